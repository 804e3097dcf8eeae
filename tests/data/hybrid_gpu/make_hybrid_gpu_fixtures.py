"""Record the GPU hybrid-cache fixtures of tests/data/hybrid_gpu (format 1.5 /state) on a CUDA device.

Real per-layer geometry of two presets (kvtrace.presets: qwen3-next-80b-a3b, falcon-h1-7b), cut to a
few layers (the layer pattern kept: gated delta-net or Mamba layers beside attention) and with the
MoE experts cut to 16 (experts size weights, not the cache; at least the 10 routed per token), bf16 random weights, nothing downloaded.
Recorded with structure_every=1: request 0 one sequence (prompt 64, 32 new tokens), request 1 a batch
of 2 (prompt 48, 32 new). Before saving, each trace's last /state rows are checked against the live
cache tensors of a plain generate of the same request (bytes per layer), so a fixture that reached
the repo was exact on the GPU it came from. Run on the GPU machine from the repo root:
``python3 tests/data/hybrid_gpu/make_hybrid_gpu_fixtures.py OUTDIR``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import kvtrace  # noqa: E402
from kvtrace import presets  # noqa: E402
from tests.helpers.hfcache import output_cache  # noqa: E402

CUTS = {"qwen3-next-80b-a3b": dict(num_hidden_layers=4, num_experts=16),  # >= its 10 experts per token
        "falcon-h1-7b": dict(num_hidden_layers=4)}
NEW = 32


def build(name: str):
    from transformers import AutoModelForCausalLM

    cfg = presets.preset_config(name)
    for key, value in CUTS[name].items():
        setattr(cfg, key, value)
    # a stored pattern is cut to the layers kept; Falcon-H1 derives its pattern from the layer count
    # (in 5.24 assigning it reaches a read-only property)
    if getattr(cfg, "layer_types", None) and len(cfg.layer_types) != cfg.num_hidden_layers:
        try:
            cfg.layer_types = list(cfg.layer_types)[: cfg.num_hidden_layers]
        except AttributeError:
            pass
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


def live_state_bytes(cache) -> int:
    total, seen = 0, set()
    for layer in cache.layers:
        for attr in ("conv_states", "recurrent_states"):
            for t in (getattr(layer, attr, None) or {}).values():
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    total += t.untyped_storage().nbytes()
    return total


def record(name: str, out: Path) -> Path:
    model = build(name)
    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    requests = [torch.randint(3, vocab, (b, p), generator=gen).cuda() for p, b in ((64, 1), (48, 2))]
    path = out / f"{name.split('-')[0]}_{name.split('-')[1]}.kvt.h5"
    path.unlink(missing_ok=True)
    with kvtrace.record(model, path, structure_every=1, model_id=f"gpu/{name}-cut"):
        for ids in requests:
            model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    ref = output_cache(model.generate(requests[-1], max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                      return_dict_in_generate=True))
    with kvtrace.open(path) as t:
        rows = t.table("state")
        last = rows[(rows["request"] == 1) & (rows["step"] == rows[rows["request"] == 1]["step"].max())]
        recorded = int(np.sum(last["bytes_unique"]))
    expect = live_state_bytes(ref)
    print(f"{path.name}: state recorded {recorded} B, live {expect} B, {torch.cuda.get_device_name(0)}")
    if recorded != expect:
        raise SystemExit(f"{name}: recorded state {recorded} != live {expect}")
    return path


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    outdir = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
    for preset in CUTS:
        record(preset, outdir)
