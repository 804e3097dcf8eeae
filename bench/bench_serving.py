"""What the serving recorder costs continuous batching: output tokens/s with and without it.

    python bench/bench_serving.py --json bench/results/serving_h200.json --budget-s 480     # on a GPU
    python bench/bench_serving.py --json bench/results/serving_h200.json --resume ...        # add pairs
    python bench/bench_serving.py --smoke                                                   # tiny, CPU, seconds

Method (what recording costs a served model):

* It drives ``model.generate_batch`` directly (transformers' continuous batching, paged cache,
  its own scheduler thread), not the HTTP server: the same scheduler and cache work, without
  the HTTP, tokenizer and event-loop noise that would hide a 1% effect.
* **Shapes:** 16 and 64 requests submitted at once (``--concurrency``), each a distinct random
  prompt of ``--prompt`` tokens generating exactly ``--new`` tokens (EOS disabled).
* **ABBA pairs, interleaved:** each pair is one run without the recorder ("base") and one inside
  ``kvtrace.record(model, path)``; consecutive pairs swap the order, and the shapes take turns, so
  drift (clocks, thermals) falls on both sides alike. One warm-up run of each side and shape comes
  first in every process, untimed. Before every timed run, both sides alike: ``gc.collect()``,
  ``torch.cuda.synchronize()`` and ``empty_cache()`` (each run's paged pool is sized from free
  memory, so every run starts from the same allocator state).
* **Throughput** of a run: output tokens / wall time of the ``generate_batch`` call (manager, paged
  cache and CUDA-graph set-up included, as a user sees it): ``tokens_per_s``. Also the
  **steady** rate: output tokens / time from the first scheduler step that found work to the
  call's return (a one-line probe on ``prepare_next_batch``, installed for both sides), which leaves
  out the set-up that the recorder does not touch. The recorder's start and close are timed apart.
  A pair's ratio is recorder tokens/s / base tokens/s; the table gives the median ratio with its
  95% percentile-bootstrap CI (4,000 resamples, bench_overhead.bootstrap_median_ci). Goal: loss
  (1 - ratio) <= 1%.
* **Never loses results:** the JSON is rewritten after every pair (a temporary file renamed over
  it), with the summary of the pairs so far. ``--resume`` continues a result file written with the
  same settings (it refuses another model, shape, dtype or transformers version), so several calls
  of a few minutes add pairs to one result; ``--budget-s`` stops before a round of pairs that
  would not finish in time (estimated from the slowest round so far).
* **Trace growth per 1,000 requests:** every recorded run keeps its trace's size on disk after
  close and the requests it recorded; the least-squares slope of size against requests over all
  recorded runs (runs of different request counts: the shapes) x 1,000, which removes the fixed
  part (metadata, tables' first chunks). A request here is ``--prompt`` + ``--new`` tokens.
* **The recorder's own time** (``--self-time N``, after the pairs): N more recorded runs per shape
  in which every hook method of the serving recorder is timed minus the transformers method it
  wraps, per thread (``RecorderClock``). Its share of the run's wall time on the continuous-batching
  loop's thread estimates the loss directly, without the run-to-run noise of A/B pairs.
* **transformers 5.23 options:** ``--cuda-graphs on|off`` and ``--async-batching on|off`` set
  ``ContinuousBatchingConfig(use_cuda_graph=..., use_async_batching=...)``; ``default`` leaves
  transformers' choice (graphs only where attention needs no mask, i.e. flash attention).
"""

from __future__ import annotations

import argparse
import gc
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

# settings that must match for --resume to add pairs to a result file
SAME = ("preset", "layers", "width", "vocab", "dtype", "prompt", "new", "shapes", "cuda_graphs", "async_batching",
        "device", "transformers", "torch")


def build(args: argparse.Namespace) -> Any:
    import torch

    if args.smoke:
        from tests.helpers.models import tiny_model

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


def _switch(value: str) -> bool | None:
    return {"on": True, "off": False}.get(value)


def batch_kwargs(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    """generate_batch's arguments, for the installed transformers (5.17 has no
    continuous_batching_config; 5.23 does)."""
    from transformers import GenerationConfig

    new = args.new
    gc_ = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    kw: dict[str, Any] = {"generation_config": gc_}
    params = inspect.signature(model.generate_batch).parameters
    if "progress_bar" in params:
        kw["progress_bar"] = False
    cb: dict[str, Any] = {}
    if args.smoke and "continuous_batching_config" in params:
        cb.update(page_size=16, num_blocks=256, max_batch_tokens=512)
    if _switch(args.cuda_graphs) is not None:
        cb["use_cuda_graph"] = _switch(args.cuda_graphs)
    if _switch(args.async_batching) is not None:
        cb["use_async_batching"] = _switch(args.async_batching)
    if cb:
        if "continuous_batching_config" not in params:
            raise SystemExit(f"--cuda-graphs/--async-batching need transformers' ContinuousBatchingConfig (5.23); "
                             f"this one has no continuous_batching_config: {sorted(cb)}")
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        kw["continuous_batching_config"] = ContinuousBatchingConfig(**cb)
    if args.smoke and "warmup" in params:
        kw["warmup"] = False
    return kw


class StepProbe:
    """The time of the first scheduler step that found work in the current run: a wrapper on
    ``ContinuousBatchProcessor.prepare_next_batch`` installed for the whole benchmark (both sides pay
    its one call per step alike; the recorder wraps on top of it)."""

    def __init__(self) -> None:
        from transformers.generation.continuous_batching import continuous_api

        self.first: float | None = None
        proc = continuous_api.ContinuousBatchProcessor
        original = proc.__dict__["prepare_next_batch"]
        probe = self

        def prepare(processor: Any, *a: Any, **k: Any) -> Any:
            found = original(processor, *a, **k)
            if found and probe.first is None:
                probe.first = time.perf_counter()
            return found

        proc.prepare_next_batch = prepare


class RecorderClock:
    """The serving recorder's own time on the threads it runs on: each hook method of
    ``ServingRecorder`` timed whole, minus the transformers method it wraps (its ``orig``), summed per
    thread. On the continuous-batching loop's thread (transformers' default path: its Python work and
    the GPU's forward take turns) that time adds to the run's wall time, so its share of the run is a
    direct estimate of the throughput loss that needs no A/B pair. The recorder's background threads
    (telemetry sampler, flusher) are not in it: they cost the loop only the GIL they hold."""

    METHODS = ("_add_request", "_create", "_loop", "_prepare", "_update", "_finish", "_cancelled", "_failed",
               "_offload", "_prefix", "_evict")

    def __init__(self) -> None:
        import threading

        from kvtrace.recorder import serving

        self.ns: dict[str, int] = {}  # thread name -> ns
        self.calls = 0
        self._threading = threading
        cls = serving.ServingRecorder
        for name in self.METHODS:
            setattr(cls, name, self._timed(cls.__dict__[name]))

    def reset(self) -> None:
        self.ns = {}
        self.calls = 0

    def _timed(self, method: Any) -> Any:
        clock = self
        perf = time.perf_counter_ns

        def hook(rec: Any, orig: Any, obj: Any, a: tuple, k: dict) -> Any:
            inner = [0]

            def timed_orig(*aa: Any, **kk: Any) -> Any:
                t = perf()
                try:
                    return orig(*aa, **kk)
                finally:
                    inner[0] += perf() - t

            t = perf()
            try:
                return method(rec, timed_orig, obj, a, k)
            finally:
                name = clock._threading.current_thread().name
                clock.ns[name] = clock.ns.get(name, 0) + perf() - t - inner[0]
                clock.calls += 1

        return hook


def self_time_run(model: Any, inputs: list[list[int]], kw: dict[str, Any], trace: Path, probe: StepProbe,
                  clock: RecorderClock) -> dict[str, Any]:
    """One recorded run with the recorder's own time measured (RecorderClock)."""
    clock.reset()
    out = one_run(model, inputs, kw, True, trace, probe)
    main = __import__("threading").main_thread().name
    loop_ns = sum(v for k, v in clock.ns.items() if k != main)
    out.update(recorder_ns_by_thread=dict(clock.ns), recorder_hook_calls=clock.calls, recorder_loop_ns=loop_ns,
               recorder_main_ns=clock.ns.get(main, 0), loop_share=loop_ns / 1e9 / out["generate_s"])
    return out


def _settle() -> None:
    """The same starting state for every run, both sides: garbage collected, the device idle, the
    allocator's cached blocks returned (the paged pool is sized from free memory)."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def one_run(model: Any, inputs: list[list[int]], kw: dict[str, Any], recorded: bool, trace: Path,
            probe: StepProbe) -> dict[str, Any]:
    import kvtrace

    _settle()
    out: dict[str, Any] = {"recorded": recorded, "requests": len(inputs)}
    rec = None
    if recorded:
        t = time.perf_counter()
        rec = kvtrace.record(model, trace)
        rec.start()
        out["open_s"] = time.perf_counter() - t
    try:
        _sync()
        probe.first = None
        t = time.perf_counter()
        results = model.generate_batch(inputs=inputs, **kw)
        _sync()
        end = time.perf_counter()
        out["generate_s"] = end - t
        out["steady_s"] = end - probe.first if probe.first is not None else None
    finally:
        if rec is not None:
            t = time.perf_counter()
            rec.close()
            out["close_s"] = time.perf_counter() - t
            out["requests_recorded"] = rec.requests
            out["recorder_errors"] = rec.recorder_errors
    out["output_tokens"] = sum(len(r.generated_tokens) for r in results.values())
    out["tokens_per_s"] = out["output_tokens"] / out["generate_s"]
    out["steady_tokens_per_s"] = out["output_tokens"] / out["steady_s"] if out["steady_s"] else None
    if recorded:
        out["trace_bytes"] = os.path.getsize(trace)
        trace.unlink()
    return out


def growth_per_1000(points: list[tuple[int, int]]) -> float | None:
    """Least-squares slope of trace bytes against requests recorded, x 1,000; None unless the runs
    have at least two different request counts."""
    xs = [float(x) for x, _ in points]
    if len(set(xs)) < 2:
        return None
    mx = statistics.fmean(xs)
    my = statistics.fmean(float(y) for _, y in points)
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, (_, y) in zip(xs, points, strict=True))
    return sxy / sxx * 1000


def _ratio_stats(pairs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    ratios = [p["recorder"][key] / p["base"][key] for p in pairs if p["recorder"].get(key) and p["base"].get(key)]
    med, lo, hi = bootstrap_median_ci(ratios)
    return {"median": med, "ci95": [lo, hi], "min": min(ratios, default=None), "max": max(ratios, default=None),
            "n": len(ratios)}


def summarize(runs: dict[str, list[dict[str, Any]]]) -> tuple[dict[str, Any], float | None]:
    summary: dict[str, Any] = {}
    points: list[tuple[int, int]] = []
    for n, pairs in runs.items():
        if not pairs:
            continue
        rec_runs = [p["recorder"] for p in pairs]
        points += [(r["requests_recorded"], r["trace_bytes"]) for r in rec_runs]
        whole, steady = _ratio_stats(pairs, "tokens_per_s"), _ratio_stats(pairs, "steady_tokens_per_s")
        summary[n] = {
            "pairs": len(pairs),
            "base_tokens_per_s": statistics.median(p["base"]["tokens_per_s"] for p in pairs),
            "recorder_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rec_runs),
            "ratio_median": whole["median"], "ratio_ci95": whole["ci95"], "ratio_min": whole["min"],
            "ratio_max": whole["max"], "steady_ratio_median": steady["median"], "steady_ratio_ci95": steady["ci95"],
            "open_s_median": statistics.median(r["open_s"] for r in rec_runs),
            "close_s_median": statistics.median(r["close_s"] for r in rec_runs),
            "trace_bytes_median": statistics.median(r["trace_bytes"] for r in rec_runs),
            "requests_recorded": sorted({r["requests_recorded"] for r in rec_runs}),
            "recorder_errors": sum(r["recorder_errors"] for r in rec_runs),
        }
    return summary, growth_per_1000(points)


def write_atomic(path: Path, doc: dict[str, Any]) -> None:
    """Write the whole JSON to a temporary file beside ``path`` and rename it over: a kill at any
    moment leaves the previous complete file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    os.replace(tmp, path)


def settings(args: argparse.Namespace, shapes: list[int]) -> dict[str, Any]:
    import torch
    import transformers

    return {"preset": "tiny llama (smoke)" if args.smoke else args.preset, "layers": args.layers,
            "width": args.width, "vocab": args.vocab, "dtype": args.dtype, "prompt": args.prompt, "new": args.new,
            "shapes": shapes, "cuda_graphs": args.cuda_graphs, "async_batching": args.async_batching,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__}


def load_previous(path: Path, now: dict[str, Any]) -> dict[str, Any]:
    """The result file to continue; SystemExit(2) when it was written with other settings."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"bench_serving: cannot resume from {path}: {exc}") from None
    differ = [f"{k}: {doc.get('settings', {}).get(k)!r} there, {now[k]!r} here" for k in SAME
              if doc.get("settings", {}).get(k) != now[k]]
    if differ:
        print(f"bench_serving: {path} was written with other settings ({'; '.join(differ)}); "
              "not resumed", file=sys.stderr)
        raise SystemExit(2)
    return doc


def print_table(doc: dict[str, Any]) -> None:
    print(f"{'requests':>8}  {'pairs':>5}  {'base tok/s':>10}  {'recorder tok/s':>14}  ratio median [95% CI]      "
          f"loss     steady ratio [95% CI]      trace/run  open/close")
    for n, s in doc["summary"].items():
        lo, hi = s["ratio_ci95"]
        slo, shi = s["steady_ratio_ci95"]
        print(f"{n:>8}  {s['pairs']:>5}  {s['base_tokens_per_s']:>10.1f}  {s['recorder_tokens_per_s']:>14.1f}  "
              f"{s['ratio_median']:.4f} [{lo:.4f}, {hi:.4f}]  {1 - s['ratio_median']:+.2%}  "
              f"{s['steady_ratio_median']:.4f} [{slo:.4f}, {shi:.4f}]  "
              f"{s['trace_bytes_median'] / 1024:>7.0f} KiB  {s['open_s_median'] * 1000:.0f}/"
              f"{s['close_s_median'] * 1000:.0f} ms")
    growth = doc["trace_bytes_per_1000_requests"]
    if growth is not None:
        st = doc["settings"]
        print(f"trace growth: {growth / 1024**2:.2f} MiB per 1,000 requests ({st['prompt']} prompt + {st['new']} "
              f"output tokens each; least-squares slope over the recorded runs' sizes)")


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
    ap.add_argument("--pairs", type=int, default=None,
                    help="ABBA pairs per shape in all, with --resume the total (default 8; --smoke 2)")
    ap.add_argument("--cuda-graphs", choices=("default", "on", "off"), default="default")
    ap.add_argument("--async-batching", choices=("default", "on", "off"), default="default")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no round of pairs that would end after this many seconds from the start")
    ap.add_argument("--self-time", type=int, default=0, metavar="N",
                    help="after the pairs, N recorded runs per shape timing the recorder's own hook work")
    ap.add_argument("--smoke", action="store_true", help="tiny llama on CPU, 2 pairs, a few tokens")
    ap.add_argument("--json", default=None, help="write the results here (after every pair)")
    ap.add_argument("--resume", action="store_true", help="add pairs to the --json file (same settings)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if args.smoke:
        args.concurrency, args.prompt, args.new = "4,8", 16, 8
    if args.pairs is None:
        args.pairs = 2 if args.smoke else 8
    if args.resume and not args.json:
        ap.error("--resume needs --json FILE")
    shapes = [int(x) for x in args.concurrency.split(",")]
    out_path = Path(args.json) if args.json else None
    model = build(args)
    now = settings(args, shapes)
    doc: dict[str, Any] = {"method": "bench/bench_serving.py docstring", "settings": now, "calls": [],
                           "summary": {}, "trace_bytes_per_1000_requests": None, "runs": {str(n): [] for n in shapes}}
    if args.resume and out_path is not None and out_path.exists():
        doc = load_previous(out_path, now)
    runs: dict[str, list[dict[str, Any]]] = doc["runs"]
    doc["calls"].append({"started_unix": time.time(), "pairs_before": {n: len(v) for n, v in runs.items()},
                         "argv": sys.argv[1:] if argv is None else list(argv)})
    vocab = int(model.config.vocab_size)
    kw = batch_kwargs(model, args)
    probe = StepProbe()
    slowest = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "serving.kvt.h5"
        t = time.perf_counter()
        for n in shapes:  # warm-up, untimed: kernels, allocator, CUDA graphs
            for recorded in (False, True):
                one_run(model, prompts(n, args.prompt, vocab, seed=-1), kw, recorded, trace, probe)
        slowest = time.perf_counter() - t
        print(f"warm-up round (each side and shape once): {slowest:.1f} s", file=sys.stderr, flush=True)
        i = min(len(runs[str(n)]) for n in shapes)
        while i < args.pairs:
            if args.budget_s is not None and time.perf_counter() - t_start + slowest > args.budget_s:
                print(f"bench_serving: stopping after {i} pairs: the next round (~{slowest:.0f} s) would pass "
                      f"--budget-s {args.budget_s:.0f}", file=sys.stderr)
                break
            t = time.perf_counter()
            for n in shapes:
                if len(runs[str(n)]) > i:
                    continue
                inputs = prompts(n, args.prompt, vocab, seed=i)
                order = (False, True) if i % 2 == 0 else (True, False)
                pair = {r: one_run(model, inputs, kw, r, trace, probe) for r in order}
                runs[str(n)].append({"index": i, "base": pair[False], "recorder": pair[True],
                                     "order": "base first" if i % 2 == 0 else "recorder first"})
                print(f"pair {i} x{n}: base {pair[False]['tokens_per_s']:.1f} tok/s, recorder "
                      f"{pair[True]['tokens_per_s']:.1f} tok/s, ratio "
                      f"{pair[True]['tokens_per_s'] / pair[False]['tokens_per_s']:.4f}; trace "
                      f"{pair[True]['trace_bytes'] / 1024:.0f} KiB", file=sys.stderr, flush=True)
                doc["summary"], doc["trace_bytes_per_1000_requests"] = summarize(runs)
                if out_path is not None:
                    write_atomic(out_path, doc)
            slowest = max(slowest, time.perf_counter() - t)
            i += 1
        if args.self_time:
            clock = RecorderClock()
            timed = doc.setdefault("self_time", {})
            for j in range(args.self_time):
                for n in shapes:
                    r = self_time_run(model, prompts(n, args.prompt, vocab, seed=1000 + j), kw, trace, probe, clock)
                    timed.setdefault(str(n), []).append(r)
                    print(f"self-time x{n}: recorder {r['recorder_loop_ns'] / 1e6:.1f} ms on the loop thread "
                          f"({r['loop_share']:.3%} of {r['generate_s']:.2f} s), {r['recorder_main_ns'] / 1e6:.1f} ms "
                          f"on the caller's; {r['recorder_hook_calls']} hook calls", file=sys.stderr, flush=True)
                    if out_path is not None:
                        write_atomic(out_path, doc)
    doc["summary"], doc["trace_bytes_per_1000_requests"] = summarize(runs)
    if out_path is not None:
        write_atomic(out_path, doc)
    if doc["summary"]:
        print_table(doc)
    for n, timed_runs in doc.get("self_time", {}).items():
        shares = [r["loop_share"] for r in timed_runs]
        print(f"recorder's own time on the CB loop thread, x{n}: median {statistics.median(shares):.3%} of the "
              f"run (min {min(shares):.3%}, max {max(shares):.3%}, {len(shares)} runs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
