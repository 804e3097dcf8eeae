"""Record a tensor-parallel generate, one trace per rank: run under torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/parallel/tp_record.py \
        --out DIR [--backend gloo|nccl] [--model DIR] [--keep-output-rank R]

Without ``--model`` rank 0 saves a tiny random llama (4 KV heads, so that 2 or 4 ranks split them
evenly) to ``DIR/model`` and every rank loads it with ``tp_plan="auto"``. Each rank writes
``DIR/run.rank{rank}.kvt.h5`` (the recorder templates the path). ``--keep-output-rank R`` plants a
retention on rank R: that rank keeps generate's output (and with it the KV cache) past the request.
Used by tests/parallel (CPU, gloo) and, with ``--backend nccl``, on a machine with several GPUs.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
            intermediate_size=128, max_position_embeddings=256, vocab_size=256, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=6)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--keep-output-rank", type=int, default=-1)
    args = ap.parse_args()
    out = Path(args.out)
    rank = int(os.environ["RANK"])
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(args.backend)
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = args.model or str(out / "model")
    if args.model is None:
        if rank == 0:
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY)).save_pretrained(model_dir)
        dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **_tp_auto())
    model.eval()
    import kvtrace

    kept = []
    prompt = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11]], device=model.device)
    with kvtrace.record(model, out / "run.kvt.h5", telemetry_hz=20):
        for _ in range(args.requests):
            result = model.generate(prompt, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                                    return_dict_in_generate=True)
            if rank == args.keep_output_rank:
                kept.append(result)  # planted: the output keeps its cache alive
            del result
    dist.barrier()
    dist.destroy_process_group()


def _tp_auto() -> dict:
    """tp_plan="auto" as this transformers takes it (kvtrace record --tp-plan uses the same rule)."""
    from kvtrace.loading import tp_kwargs

    return tp_kwargs("auto")


if __name__ == "__main__":
    main()
