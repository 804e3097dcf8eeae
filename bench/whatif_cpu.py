"""CPU workloads of the what-if replay, shared by bench/bench_whatif.py --cpu and probes.

* :func:`make_trace`: a recorded trace of a tiny random-weight llama (2 layers, 4 query heads on 2
  KV heads, head dim 16 -- tests' geometry) over ``tokens`` tokens: a prefill of ``tokens -
  decode`` tokens, then ``decode`` generated ones, K/V and post-RoPE queries sampled every
  ``every`` steps (every prefill query sampled). Cached under ``cache_dir`` by its parameters.
* :func:`replay`: ``run_whatif`` of the whole policy set (13 policies, ratios 0.25/0.5/0.75) with
  ``--steps all``; :func:`rerun`: ``teacher_forced_logprobs`` of one policy over a text (one
  model pass, the default; or ``mode="per_token"``, the loop that defines it);
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
    from tests.helpers.models import tiny_model

    return tiny_model("llama", seed=seed, max_position_embeddings=max_positions)


def make_trace(cache_dir: Path, tokens: int = 8192, decode: int = 64, every: int = 8) -> Path:
    """The trace (recorded once, then reused from ``cache_dir``)."""
    path = Path(cache_dir) / f"whatif_cpu_{tokens}_{decode}_{every}.kvt.h5"
    if path.exists():
        return path
    import torch

    import kvtrace
    from kvtrace.recorder.sampling import SamplingSettings
    from tests.helpers.models import tiny_prompt

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


def rerun(model: Any, ids: Any, policy: str, ratio: float | None, mode: str = "auto") -> Any:
    from kvtrace.whatif import parse_policy
    from kvtrace.whatif.rerun import teacher_forced_logprobs

    got, layers = teacher_forced_logprobs(model, ids, parse_policy(policy), ratio, mode=mode)
    if mode == "auto" and layers[0].mode != "one_pass":
        raise RuntimeError(f"the rerun fell back to one token per forward: {layers[0].mode_note}")
    return got


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


# ---------------------------------------------------------------------------------- the bench


def _cpu_s(fn: Any) -> float:
    import time

    t = time.process_time()
    fn()
    return time.process_time() - t


def paired(fa: Any, fb: Any, pairs: int) -> dict[str, Any]:
    """CPU seconds of ``fa`` and ``fb`` run alternately (b first in odd pairs), after one warm-up
    of each; the ratio a/b of each pair, its median and 95% bootstrap CI."""
    from bench_overhead import bootstrap_median_ci

    fa(), fb()
    ta, tb = [], []
    for i in range(pairs):
        if i % 2:
            b = _cpu_s(fb)
            a = _cpu_s(fa)
        else:
            a = _cpu_s(fa)
            b = _cpu_s(fb)
        ta.append(a)
        tb.append(b)
    med, lo, hi = bootstrap_median_ci([x / y for x, y in zip(ta, tb, strict=True)])
    import statistics

    return {"a_cpu_s": statistics.median(ta), "b_cpu_s": statistics.median(tb), "ratio": med, "ci95": [lo, hi],
            "pairs": pairs}


def _numpy_env(on: bool) -> None:
    if on:
        os.environ["KVTRACE_WHATIF_NUMPY"] = "1"
    else:
        os.environ.pop("KVTRACE_WHATIF_NUMPY", None)


def bench_replay(cache_dir: Path, tokens: int, pairs: int, runs: int) -> dict[str, Any]:
    """The offline replay: (1) the whole policy set with --steps all on ``tokens`` tokens, CPU
    seconds of ``runs`` runs (median, CI) against the 10 s goal; (2) on a 1k-token trace, pairs of
    the fast path against numerics.py alone (KVTRACE_WHATIF_NUMPY=1, the numpy code the
    torch CPU path replaced) and an A-vs-A control (fast against fast)."""
    import statistics

    from bench_overhead import bootstrap_median_ci

    big = make_trace(cache_dir, tokens)
    small = make_trace(cache_dir, 1024)
    _numpy_env(False)
    replay(small)  # imports, torch's first calls
    times = [_cpu_s(lambda: replay(big)) for _ in range(runs)]
    med, lo, hi = bootstrap_median_ci(times)
    out: dict[str, Any] = {"tokens": tokens, "policies": list(ALL_POLICIES), "ratios": RATIOS, "steps": "all",
                           "cpu_s": times, "cpu_s_median": statistics.median(times), "ci95": [lo, hi],
                           "goal_s": 10.0, "verdict": "met" if hi < 10 else "not met" if lo >= 10 else "not resolved"}

    def fast() -> None:
        _numpy_env(False)
        replay(small)

    def slow() -> None:
        _numpy_env(True)
        replay(small)
        _numpy_env(False)

    out["numpy_over_fast_1k"] = paired(slow, fast, pairs)
    out["control_fast_over_fast_1k"] = paired(fast, fast, pairs)
    return out


REPLAY_POLICIES = ("knorm", "keydiff", "random", "streaming_llm", "snapkv", "tova", "observed_attention",
                   "expected_attention", "kivi:nbits=4")


def bench_rerun(tokens: int, pairs: int, policies: tuple[str, ...] = REPLAY_POLICIES) -> dict[str, Any]:
    """--rerun's pass of each policy at ratio 0.5 (kivi: its own setting) against the plain
    evicting loop (by key norm; streaming_llm: sinks + recent) on the same model and text,
    interleaved pairs, CPU seconds: the one-pass rerun (the default) and the per-token loop (its
    definition, the fallback), each as a ratio to a plain loop timed beside it; plus plain
    against plain (the A-vs-A control). Goal: one pass <= 2x plain (the CI's high end: met)."""
    import torch

    from tests.helpers.models import tiny_prompt

    torch.set_num_threads(1)  # one thread: the CPU seconds of the work, not of spinning workers
    model = bench_model(max(1024, tokens + 16))
    ids = tiny_prompt(tokens)
    knorm = lambda: plain_evicting_loop(model, ids, "knorm", 0.5)  # noqa: E731
    rows: dict[str, Any] = {"control_plain_over_plain": paired(knorm, knorm, pairs)}
    for p in policies:
        ratio = None if p.startswith(("kivi", "fp8", "quanto", "hqq")) else 0.5
        base = "streaming_llm" if p == "streaming_llm" else "knorm"
        plain = lambda base=base: plain_evicting_loop(model, ids, base, 0.5)  # noqa: E731
        row: dict[str, Any] = {"baseline": f"plain evicting loop ({base})"}
        for mode in ("auto", "per_token"):
            r = paired(lambda p=p, ratio=ratio, mode=mode: rerun(model, ids, p, ratio, mode), plain, pairs)
            r["verdict"] = "met" if r["ci95"][1] <= 2 else "not met" if r["ci95"][0] > 2 else "not resolved"
            row["one_pass" if mode == "auto" else "per_token"] = r
        rows[p] = row
        a, b = row["one_pass"], row["per_token"]
        print(f"rerun {p}: one pass {a['ratio']:.2f}x plain ({a['ci95'][0]:.2f}-{a['ci95'][1]:.2f}) {a['verdict']}; "
              f"per token {b['ratio']:.2f}x", flush=True)
    return {"tokens": tokens, "model": "tiny llama (2 layers, 4 q / 2 KV heads, dim 16), fp32", "threads": 1,
            "rows": rows}


def main_cpu(args: Any) -> int:
    import json
    import platform
    import time

    import torch

    cache = Path(args.cache_dir)
    doc: dict[str, Any] = {"bench": "bench_whatif --cpu", "cpu": platform.processor() or platform.machine(),
                           "cores": os.cpu_count(), "torch": torch.__version__, "started": time.time()}
    try:
        import subprocess

        doc["commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                       capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    def save() -> None:
        if args.json_out:
            Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json_out).write_text(json.dumps(doc, indent=2))

    if args.cpu in ("replay", "all"):
        doc["replay"] = bench_replay(cache, args.tokens, args.pairs, args.runs)
        save()
        r = doc["replay"]
        print(f"replay {r['tokens']} tokens, 13 policies, --steps all: {r['cpu_s_median']:.1f} s CPU "
              f"({r['ci95'][0]:.1f}-{r['ci95'][1]:.1f}) {r['verdict']}; 1k: numpy/fast "
              f"{r['numpy_over_fast_1k']['ratio']:.1f}x, control {r['control_fast_over_fast_1k']['ratio']:.2f}x",
              flush=True)
    if args.cpu in ("rerun", "all"):
        doc["rerun"] = bench_rerun(args.rerun_tokens, args.pairs)
    save()
    return 0
