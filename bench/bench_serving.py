"""What the serving recorder costs continuous batching: output tokens/s with and without it.

    python bench/bench_serving.py --json bench/results/serving_h100.json          # on a GPU
    python bench/bench_serving.py --smoke                                         # tiny, CPU, seconds

Method (issue 16, "Cost"):

* It drives ``model.generate_batch`` directly (transformers' continuous batching, paged cache,
  its own scheduler thread), not the HTTP server: the same scheduler and cache work, without
  the HTTP, tokenizer and event-loop noise that would hide a 1% effect.
* **Shapes:** 16 and 64 requests submitted at once (``--concurrency``), each a distinct random
  prompt of ``--prompt`` tokens generating exactly ``--new`` tokens (EOS disabled).
* **ABBA pairs, interleaved:** each pair is one run without the recorder ("base") and one inside
  ``with kvtrace.record(model, path):``; consecutive pairs swap the order, and the two shapes take
  turns, so drift (clocks, thermals) falls on both sides alike. One warm-up run of each side and
  shape comes first, untimed.
* **Throughput** of a run: output tokens / wall time of the ``generate_batch`` call (manager and
  paged-cache set-up included, as a user sees it); the recorder's start and close are timed apart.
  A pair's ratio is recorder tokens/s / base tokens/s; the table gives the median ratio with its
  95% percentile-bootstrap CI (4,000 resamples, bench_overhead.bootstrap_median_ci). Goal: loss
  (1 - ratio) <= 1%.
* **Trace growth per 1,000 requests:** the trace's size on disk after close, per shape; the slope
  between the two shapes (bytes per extra request x 1,000) removes the fixed part (metadata,
  tables' first chunks).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_overhead import bootstrap_median_ci  # noqa: E402


def build(args: argparse.Namespace) -> Any:
    import torch

    if args.smoke:
        from kvtrace.testing_models import tiny_model

        return tiny_model("llama", max_position_embeddings=1024)
    from kvtrace.loading import load_model

    loaded = load_model(f"preset:{args.preset}", device=args.device, dtype=args.dtype, layers=args.layers,
                        width=args.width, vocab=args.vocab, seed=0)
    model = loaded.model
    model.eval()
    torch.manual_seed(0)
    return model


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def batch_kwargs(model: Any, new: int, smoke: bool) -> dict[str, Any]:
    """generate_batch's arguments, for the installed transformers (5.17 has no
    continuous_batching_config; 5.23 does)."""
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    kw: dict[str, Any] = {"generation_config": gc}
    params = inspect.signature(model.generate_batch).parameters
    if "progress_bar" in params:
        kw["progress_bar"] = False
    if smoke and "continuous_batching_config" in params:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        kw["continuous_batching_config"] = ContinuousBatchingConfig(page_size=16, num_blocks=256,
                                                                    max_batch_tokens=512)
    if smoke and "warmup" in params:
        kw["warmup"] = False
    return kw


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def one_run(model: Any, inputs: list[list[int]], kw: dict[str, Any], recorded: bool, trace: Path) -> dict[str, Any]:
    import kvtrace

    out: dict[str, Any] = {"recorded": recorded}
    rec = None
    if recorded:
        t = time.perf_counter()
        rec = kvtrace.record(model, trace)
        rec.start()
        out["open_s"] = time.perf_counter() - t
    try:
        _sync()
        t = time.perf_counter()
        results = model.generate_batch(inputs=inputs, **kw)
        _sync()
        out["generate_s"] = time.perf_counter() - t
    finally:
        if rec is not None:
            t = time.perf_counter()
            rec.close()
            out["close_s"] = time.perf_counter() - t
            out["requests_recorded"] = rec.requests
            out["recorder_errors"] = rec.recorder_errors
    out["output_tokens"] = sum(len(r.generated_tokens) for r in results.values())
    out["tokens_per_s"] = out["output_tokens"] / out["generate_s"]
    if recorded:
        out["trace_bytes"] = os.path.getsize(trace)
        trace.unlink()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-3.1-8b", help="kvtrace preset (random weights, real geometry)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--width", type=float, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", default="16,64", help="requests submitted at once, per shape")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per request")
    ap.add_argument("--new", type=int, default=256, help="output tokens per request (exactly)")
    ap.add_argument("--pairs", type=int, default=8, help="ABBA pairs per shape")
    ap.add_argument("--smoke", action="store_true", help="tiny llama on CPU, 2 pairs, a few tokens")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.concurrency, args.prompt, args.new, args.pairs = "4,8", 16, 8, 2
    shapes = [int(x) for x in args.concurrency.split(",")]
    model = build(args)
    vocab = int(model.config.vocab_size)
    kw = batch_kwargs(model, args.new, args.smoke)
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in shapes}
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "serving.kvt.h5"
        for n in shapes:  # warm-up, untimed: kernels, allocator, CUDA graphs
            for recorded in (False, True):
                one_run(model, prompts(n, args.prompt, vocab, seed=-1), kw, recorded, trace)
        for i in range(args.pairs):
            for n in shapes:
                inputs = prompts(n, args.prompt, vocab, seed=i)
                order = (False, True) if i % 2 == 0 else (True, False)
                pair = {r: one_run(model, inputs, kw, r, trace) for r in order}
                runs[n].append({"base": pair[False], "recorder": pair[True], "order": "BA" if i % 2 == 0 else "AB"})
                print(f"pair {i} x{n}: base {pair[False]['tokens_per_s']:.1f} tok/s, recorder "
                      f"{pair[True]['tokens_per_s']:.1f} tok/s", file=sys.stderr)
    summary = {}
    for n in shapes:
        ratios = [p["recorder"]["tokens_per_s"] / p["base"]["tokens_per_s"] for p in runs[n]]
        med, lo, hi = bootstrap_median_ci(ratios)
        rec_runs = [p["recorder"] for p in runs[n]]
        summary[n] = {
            "base_tokens_per_s": statistics.median(p["base"]["tokens_per_s"] for p in runs[n]),
            "recorder_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rec_runs),
            "ratio_median": med, "ratio_ci95": [lo, hi],
            "open_s_median": statistics.median(r["open_s"] for r in rec_runs),
            "close_s_median": statistics.median(r["close_s"] for r in rec_runs),
            "trace_bytes_median": statistics.median(r["trace_bytes"] for r in rec_runs),
            "requests_recorded": rec_runs[0]["requests_recorded"], "recorder_errors": sum(r["recorder_errors"] for r in rec_runs),
        }
    growth = None
    if len(shapes) >= 2:
        a, b = min(shapes), max(shapes)
        growth = (summary[b]["trace_bytes_median"] - summary[a]["trace_bytes_median"]) / (b - a) * 1000
    import torch
    import transformers

    doc = {"method": "bench/bench_serving.py docstring", "preset": "tiny llama (smoke)" if args.smoke else args.preset,
           "layers": args.layers, "width": args.width, "dtype": args.dtype, "prompt": args.prompt, "new": args.new,
           "pairs": args.pairs, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "transformers": transformers.__version__,
           "summary": {str(k): v for k, v in summary.items()}, "trace_bytes_per_1000_requests": growth,
           "runs": {str(k): v for k, v in runs.items()}}
    print(f"{'requests':>8}  {'base tok/s':>10}  {'recorder tok/s':>14}  ratio median [95% CI]   loss    "
          f"trace/run   open/close")
    for n, s in summary.items():
        lo, hi = s["ratio_ci95"]
        print(f"{n:>8}  {s['base_tokens_per_s']:>10.1f}  {s['recorder_tokens_per_s']:>14.1f}  {s['ratio_median']:.4f} "
              f"[{lo:.4f}, {hi:.4f}]  {1 - s['ratio_median']:+.2%}  {s['trace_bytes_median'] / 1024:.0f} KiB   "
              f"{s['open_s_median'] * 1000:.0f}/{s['close_s_median'] * 1000:.0f} ms")
    if growth is not None:
        print(f"trace growth: {growth / 1024**2:.2f} MiB per 1,000 requests ({args.prompt} prompt + {args.new} "
              f"output tokens each; slope between {min(shapes)} and {max(shapes)} requests)")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
