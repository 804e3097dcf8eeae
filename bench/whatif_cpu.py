"""CPU workloads of the what-if replay (issue 32), shared by bench/bench_whatif.py --cpu and probes.

* :func:`make_trace`: a recorded trace of a tiny random-weight llama (2 layers, 4 query heads on 2
  KV heads, head dim 16 -- tests' geometry) over ``tokens`` tokens: a prefill of ``tokens -
  decode`` tokens, then ``decode`` generated ones, K/V and post-RoPE queries sampled every
  ``every`` steps (every prefill query sampled). Cached under ``cache_dir`` by its parameters.
* :func:`replay`: ``run_whatif`` of the whole policy set (13 policies, ratios 0.25/0.5/0.75) with
  ``--steps all``; :func:`rerun`: ``teacher_forced_logprobs`` of one policy over a text;
  :func:`plain_evicting_loop`: the baseline the rerun is measured against -- one token per forward
  through a plain ``DynamicCache``, its full layers cut to the budget after each step by the
  policy's own scores in torch (knorm: key norms; streaming_llm: sinks + recent), no bookkeeping.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ALL_POLICIES = ("paging:page_size=16", "knorm", "keydiff", "random", "streaming_llm", "observed_attention", "tova",
                "snapkv", "expected_attention", "kivi:nbits=4", "quanto", "hqq:nbits=3", "fp8")
RATIOS = [0.25, 0.5, 0.75]


def bench_model(max_positions: int = 16384, seed: int = 0) -> Any:
    from kvtrace.testing_models import tiny_model

    return tiny_model("llama", seed=seed, max_position_embeddings=max_positions)


def make_trace(cache_dir: Path, tokens: int = 8192, decode: int = 64, every: int = 8) -> Path:
    """The trace (recorded once, then reused from ``cache_dir``)."""
    path = Path(cache_dir) / f"whatif_cpu_{tokens}_{decode}_{every}.kvt.h5"
    if path.exists():
        return path
    import torch

    import kvtrace
    from kvtrace.recorder.sampling import SamplingSettings
    from kvtrace.testing_models import tiny_prompt

    model = bench_model(max(16384, tokens + 16))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part.h5")
    with torch.no_grad(), kvtrace.record(model, tmp, sampling=SamplingSettings(every_n_steps=every, queries=True)):
        model.generate(tiny_prompt(tokens - decode), max_new_tokens=decode + 1, min_new_tokens=decode + 1,
                       do_sample=False)
    os.replace(tmp, path)
    return path


def replay(path: Path, steps: str = "all", policies: tuple[str, ...] = ALL_POLICIES) -> dict[str, Any]:
    from kvtrace.whatif import parse_policy
    from kvtrace.whatif.run import run_whatif

    return run_whatif(path, [parse_policy(p) for p in policies], list(RATIOS), steps=steps)


def rerun(model: Any, ids: Any, policy: str, ratio: float | None) -> Any:
    from kvtrace.whatif import parse_policy
    from kvtrace.whatif.rerun import teacher_forced_logprobs

    return teacher_forced_logprobs(model, ids, parse_policy(policy), ratio)[0]


def plain_evicting_loop(model: Any, ids: Any, policy: str, ratio: float) -> Any:
    """One token per forward through a plain DynamicCache; after each step every full layer keeps
    ``max(1, int(seen * (1 - ratio)))`` tokens per KV head, by key norm (knorm) or sinks + recent
    (streaming_llm); next-token log-probabilities as the rerun returns them."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    rows = []
    with torch.no_grad():
        for t in range(ids.shape[1]):
            out = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True,
                        position_ids=torch.tensor([[t]]))
            rows.append(torch.log_softmax(out.logits[0, -1].double(), dim=-1))
            n = max(1, int((t + 1) * (1 - ratio)))
            for layer in cache.layers:
                held = layer.keys.shape[-2]
                if held <= n:
                    continue
                if policy == "knorm":
                    idx = torch.sort((-layer.keys.norm(dim=-1)).topk(n, dim=-1).indices, dim=-1).values
                else:  # streaming_llm: 4 sinks + recent
                    keep = torch.cat([torch.arange(min(4, n)), torch.arange(held - max(n - 4, 0), held)])
                    idx = keep.expand(*layer.keys.shape[:2], -1)
                g = idx.unsqueeze(-1).expand(-1, -1, -1, layer.keys.shape[-1])
                layer.keys, layer.values = layer.keys.gather(2, g), layer.values.gather(2, g)
    return torch.stack(rows)
