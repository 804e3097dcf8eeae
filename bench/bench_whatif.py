"""Benchmark the what-if kernels (kvtrace/kernels/whatif.py) against eager torch on one CUDA GPU.

    PYTHONPATH=. python3 bench/bench_whatif.py --json-out bench/results/whatif.json [--quick]
    PYTHONPATH=. python3 bench/bench_whatif.py --smoke      # tiny shapes; CPU + Triton interpreter if no GPU
    PYTHONPATH=. python3 bench/bench_whatif.py --quick --only keep --keys 32768 --queries 1   # a focused run
    PYTHONPATH=. python3 bench/bench_whatif.py --cpu all --json-out bench/results/whatif_cpu.json  # CPU

Rows:
  keep   mass recall + output error of 9 keep-sets (knorm, random, streaming_llm x ratios 0.25,
         0.5, 0.75) over 4k-64k keys, for 1 (a decode step's sampled query), 64 and 1024 queries
         per head; Llama-3-8B attention geometry (32 query heads, 8 KV heads, head dim 128); fp32
         inputs, as the replay feeds them. Kernel: one Triton pass over the keys for all sets.
         Eager: kernels.whatif.keep_measures_reference in fp32 -- the straightforward torch: the
         scores [B, Hq, Tq, T] materialised once, then a masked softmax, a mass sum and p @ V per
         keep-set (TF32 off). Goal: >= 10x eager at 32k keys, memory O(rows).
         The kernel time is the whole keep_measures_triton call on the fp32 inputs: the bf16-grid
         and position checks (one host sync), allocations, the key pass and the split-merge
         launch. Two more columns say where it goes: "prep" = the same call on inputs already
         converted by as_bf16_if_exact (what the replay's per-unit cache passes), "launch" = the
         two kernels alone on buffers allocated beforehand, "device" = the GPU time of the whole call
         (summed kernel durations from the torch profiler: the rest of "kernel ms" is host time the
         GPU waited for).
  quant  MSE + cosine per head of a quantise-dequantise round trip of one layer's K or V
         [1, 8, T, 128] (KIVI 2-bit keys per channel / values per token, quanto int4 groups of
         64, fp8 e4m3). Kernel: fused, float64 rounding and sums, nothing dequantised in memory.
         Eager: kernels.whatif.quant_error_reference (the same float64 numbers, materialised).
Timings: between CUDA events after one warm-up call (which compiles and autotunes). Keep rows:
kernel and eager timed alternately, 15 of each (3 in --smoke); kernel/eager ms are the medians, the
speed-up the median of the pairs' ratios with a 95% bootstrap CI, and the goal's verdict per row
"met" (CI low >= 10), "not met" (CI high < 10) or "not resolved". Other columns and quant rows:
median of repeated runs fitting a ~2 s budget per measurement (3 to 20). Peak memory: max_memory_allocated
during one call above what was allocated before it (inputs excluded). Every row also records the
largest difference between kernel and eager results; one float64 check per kind is recorded too.
A case that fails (out of memory, a kernel error) is recorded with its error and the run goes on.
The JSON file is rewritten after every case, so an interrupted run keeps what it measured.
Exits 69 (EX_UNAVAILABLE) with one line when there is no CUDA device or triton (unless --smoke),
1 when a kernel case failed, else 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

EX_UNAVAILABLE = 69
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_overhead import bootstrap_median_ci  # noqa: E402

SIZES: dict[str, dict[str, Any]] = {
    "full": {"heads": (32, 8, 128), "keys": [4096, 16384, 32768, 65536], "queries": [1, 64, 1024],
             "quant_heads": 8, "budget_ms": 2000.0, "max_reps": 20, "pairs": 15},
    "quick": {"heads": (32, 8, 128), "keys": [4096, 32768], "queries": [1, 64], "quant_heads": 8,
              "budget_ms": 500.0, "max_reps": 5, "pairs": 15},
    "smoke": {"heads": (4, 2, 16), "keys": [64, 96], "queries": [1, 16], "quant_heads": 2,
              "budget_ms": 1.0, "max_reps": 2, "pairs": 3},
}
RATIOS = (0.25, 0.5, 0.75)
GOAL_KEYS, GOAL_SPEEDUP = 32768, 10.0


def _now_ms(torch, cuda: bool):
    if cuda:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def _elapsed(torch, cuda: bool, start, end) -> float:
    if cuda:
        end.synchronize()
        return float(start.elapsed_time(end))
    return (end - start) * 1e3


def time_ms(torch, fn, cuda: bool, budget_ms: float, max_reps: int) -> tuple[float, int]:
    """(median ms, repeats) after one warm-up call."""
    fn()
    if cuda:
        torch.cuda.synchronize()
    times: list[float] = []
    while True:
        s = _now_ms(torch, cuda)
        fn()
        e = _now_ms(torch, cuda)
        times.append(_elapsed(torch, cuda, s, e))
        if len(times) >= max_reps or (len(times) >= 3 and sum(times) >= budget_ms):
            break
        if len(times) >= 2 and max_reps <= 2:
            break
    return statistics.median(times), len(times)


def paired_ms(torch, fa, fb, cuda: bool, pairs: int) -> tuple[list[float], list[float]]:
    """Times (ms) of ``fa`` and ``fb`` taken alternately, ``pairs`` of each, after one warm-up call
    of each: a slow or fast stretch of the host or the GPU lands on both, so the ratio of a pair
    cancels it (eager's time at one query varied 5.5-8.2 ms between runs)."""
    fa(), fb()
    if cuda:
        torch.cuda.synchronize()
    ta: list[float] = []
    tb: list[float] = []
    for i in range(2 * pairs):
        f, out = (fa, ta) if i % 2 == 0 else (fb, tb)
        s = _now_ms(torch, cuda)
        f()
        e = _now_ms(torch, cuda)
        out.append(_elapsed(torch, cuda, s, e))
    return ta, tb


def verdict(ci: list[float], goal: float = GOAL_SPEEDUP) -> str:
    """met: the 95% CI of the median speed-up lies at or above the goal; not met: below it."""
    if ci[0] >= goal:
        return "met"
    if ci[1] < goal:
        return "not met"
    return "not resolved"


def peak_extra_bytes(torch, fn, cuda: bool) -> int | None:
    """Bytes allocated at the peak of one call above what was allocated before it."""
    if not cuda:
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return int(peak)


def device_ms(torch, fn, cuda: bool, calls: int = 5) -> float | None:
    """GPU time of one call: the summed durations of the kernels (and copies) it ran, from the
    torch profiler, per call -- what the call costs the device, without host time between launches."""
    if not cuda:
        return None
    prof = profiled(torch, fn, calls)
    gpu = torch.autograd.DeviceType.CUDA
    total_us = sum(ev.device_time_total for ev in prof.events() if ev.device_type == gpu)
    return total_us / 1e3 / calls


def profiled(torch, fn, calls: int):
    """The torch profiler (CUDA activity) over ``calls`` calls of ``fn`` after one warm-up call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof


def keep_sets(torch, k, ratios=RATIOS, seed: int = 0):
    """[9, B, Hk, T] bool: knorm (largest norms evicted), random, streaming_llm (4 sinks + the
    most recent) at each ratio -- the sets the replay would evaluate for 3 policies x 3 ratios."""
    B, Hk, T, _ = k.shape
    gen = torch.Generator(device=k.device).manual_seed(seed)
    score_knorm = -torch.linalg.vector_norm(k.float(), dim=-1)
    score_random = torch.rand(B, Hk, T, generator=gen, device=k.device)
    pos = torch.arange(T, device=k.device, dtype=torch.float32)
    score_stream = torch.where(pos < 4, torch.full_like(pos, float(T) * 2), pos).expand(B, Hk, T)
    sets = []
    for score in (score_knorm, score_random, score_stream):
        for r in ratios:
            n = int(T * (1 - r))
            keep = torch.zeros(B, Hk, T, dtype=torch.bool, device=k.device)
            keep.scatter_(-1, score.topk(n, dim=-1).indices, True)
            sets.append(keep)
    return torch.stack(sets)


def _max_diff(torch, a, b) -> float:
    a, b = a.double(), b.double()
    both = torch.isnan(a) & torch.isnan(b)
    d = torch.where(both, torch.zeros_like(a), (a - b).abs())
    return float(torch.nan_to_num(d, nan=float("inf")).max()) if d.numel() else 0.0


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def keep_inputs(torch, dev: str, heads: tuple[int, int, int], T: int, Tq: int, grid: str):
    """(q, k, v, keep, positions) of a keep row: random fp32 q/k/v ([1, Hq, Tq, D], [1, Hk, T, D]),
    on the bf16 grid when ``grid`` is "bf16" (a bf16 model's recorded values upcast), the 9
    ``keep_sets`` and the queries at the last Tq positions; seeded by the shape."""
    Hq, Hk, D = heads
    gen = torch.Generator(device=dev).manual_seed(T * 7 + Tq)

    def draw(*shape):
        x = torch.randn(*shape, device=dev, generator=gen)
        return x.to(torch.bfloat16).float() if grid == "bf16" else x

    q, k, v = draw(1, Hq, Tq, D), draw(1, Hk, T, D), draw(1, Hk, T, D)
    return q, k, v, keep_sets(torch, k), torch.arange(T - Tq, T, device=dev)


def bench_keep(torch, W, dev: str, sz: dict, T: int, Tq: int, grid: str = "bf16",
               kernels: dict | None = None) -> dict[str, Any]:
    """``grid`` bf16: fp32 tensors holding bf16 values (a bf16 model's recorded K/V/Q, as the
    replay reads them; the kernels then run bf16 dots exactly); fp32: full fp32 mantissas (3xTF32).
    ``kernels``: the kernel calls' ``config`` and ``fallbacks`` (kernels/whatif_config.py)."""
    cuda = dev == "cuda"
    Hq, Hk, D = sz["heads"]
    row: dict[str, Any] = {"kind": "keep", "keys": T, "queries": Tq, "q_heads": Hq, "kv_heads": Hk, "head_dim": D,
                           "sets": 3 * len(RATIOS), "dtype": "float32", "values_on": grid}
    q, k, v, keep, pos = keep_inputs(torch, dev, (Hq, Hk, D), T, Tq, grid)
    kw = dict(q_positions=pos)
    kkw = dict(kw, **(kernels or {}))

    def kern():
        return W.keep_measures_triton(q, k, v, keep, **kkw)

    def eager():
        return W.keep_measures_reference(q, k, v, keep, **kw, dtype=torch.float32)

    got = None
    try:
        got = kern()
        row["kernel_peak_bytes"] = peak_extra_bytes(torch, kern, cuda)
    except Exception as exc:
        row["kernel_error"] = _error_text(exc)
    if got is not None:  # where the time goes (not part of the speed-up)
        try:
            row["kernel_device_ms"] = device_ms(torch, kern, cuda)
        except Exception as exc:  # a profiler that does not run here: the column stays empty
            row["device_error"] = _error_text(exc)
        try:
            prepared = [W.as_bf16_if_exact(x) for x in (q, k, v)]  # what the replay's unit cache passes
            row["kernel_prepared_ms"], _ = time_ms(torch, lambda: W.keep_measures_triton(*prepared, keep, **kkw), cuda,
                                                   sz["budget_ms"], sz["max_reps"])
            del prepared
            row["kernels_only_ms"], _ = time_ms(torch, W.keep_kernels_only(q, k, v, keep, **kkw), cuda,
                                                sz["budget_ms"], sz["max_reps"])
        except Exception as exc:
            row["breakdown_error"] = _error_text(exc)
    try:
        row["eager_peak_bytes"] = peak_extra_bytes(torch, eager, cuda)
        if got is not None:
            ref = eager()
            row["max_diff_recall"] = _max_diff(torch, got[0], ref[0])
            row["max_diff_error"] = _max_diff(torch, got[1], ref[1])
            del ref
            # The speed-up: kernel and eager timed alternately, the median of the pairs' ratios
            # with a 95% bootstrap CI.
            tk, te = paired_ms(torch, kern, eager, cuda, sz["pairs"])
            row["kernel_times_ms"], row["eager_times_ms"] = tk, te
            row["kernel_ms"], row["eager_ms"] = statistics.median(tk), statistics.median(te)
            row["kernel_reps"] = row["eager_reps"] = len(tk)
            med, lo, hi = bootstrap_median_ci([e / k for k, e in zip(tk, te, strict=True)])
            row["speedup"], row["speedup_ci95"] = med, [lo, hi]
    except Exception as exc:
        row["eager_error"] = _error_text(exc)
    return row


QUANTS = [
    ("kivi2 key (per channel, groups of 32 tokens)", dict(bits=2, axis="token", group=32, residual=128)),
    ("kivi2 value (per token, groups of 32 channels)", dict(bits=2, axis="channel", group=32, residual=128)),
    ("quanto int4 (groups of 64 channels)", dict(bits=4, axis="channel", group=64, residual=128)),
    ("fp8 e4m3", dict(kind="fp8", man=3, emin=-6, top=448.0)),
]


def bench_quant(torch, W, dev: str, sz: dict, T: int, name: str, spec_kw: dict) -> dict[str, Any]:
    cuda = dev == "cuda"
    H, D = sz["quant_heads"], sz["heads"][2]
    row: dict[str, Any] = {"kind": "quant", "spec": name, "keys": T, "heads": H, "head_dim": D, "dtype": "float32"}
    x = torch.randn(1, H, T, D, device=dev, generator=torch.Generator(device=dev).manual_seed(T))
    kw = dict(spec_kw)
    if "residual" in kw:  # keep most tokens quantised at the smoke sizes too (128 at >= 1k keys)
        kw["residual"] = min(kw["residual"], T // 8)
    spec = W.QuantSpec(**kw)
    row["residual"] = spec.residual
    got = None
    try:
        row["kernel_ms"], row["kernel_reps"] = time_ms(torch, lambda: W.quant_error_triton(x, spec), cuda,
                                                       sz["budget_ms"], sz["max_reps"])
        row["kernel_peak_bytes"] = peak_extra_bytes(torch, lambda: W.quant_error_triton(x, spec), cuda)
        got = W.quant_error_triton(x, spec)
    except Exception as exc:
        row["kernel_error"] = _error_text(exc)
    try:
        row["eager_ms"], row["eager_reps"] = time_ms(torch, lambda: W.quant_error_reference(x, spec), cuda,
                                                     sz["budget_ms"], sz["max_reps"])
        row["eager_peak_bytes"] = peak_extra_bytes(torch, lambda: W.quant_error_reference(x, spec), cuda)
        if got is not None:
            ref = W.quant_error_reference(x, spec)
            row["max_rel_diff_mse"] = float(((got[0] - ref[0]).abs() / ref[0].abs().clamp(min=1e-300)).max())
            row["max_diff_cosine"] = _max_diff(torch, got[1], ref[1])
    except Exception as exc:
        row["eager_error"] = _error_text(exc)
    if "kernel_ms" in row and "eager_ms" in row:
        row["speedup"] = row["eager_ms"] / row["kernel_ms"]
        row["kernel_GBps"] = x.numel() * x.element_size() * (2 if spec.axis == "token" and spec.kind == "minmax" else 1) \
            / (row["kernel_ms"] * 1e6)
    return row


def float64_check(torch, W, dev: str, sz: dict, kernels: dict | None = None) -> dict[str, Any]:
    """Kernel against the float64 reference (the exact numbers) on the smallest case."""
    Hq, Hk, D = sz["heads"]
    T, Tq = sz["keys"][0], min(64, max(sz["queries"]))
    gen = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(1, Hq, Tq, D, device=dev, generator=gen) * 2.0  # peakier attention than randn
    k = torch.randn(1, Hk, T, D, device=dev, generator=gen)
    v = torch.randn(1, Hk, T, D, device=dev, generator=gen)
    keep = keep_sets(torch, k)
    out: dict[str, Any] = {"keys": T, "queries": Tq}
    try:
        got = W.keep_measures_triton(q, k, v, keep, q_positions=torch.arange(T - Tq, T, device=dev), **(kernels or {}))
        ref = W.keep_measures_reference(q, k, v, keep, q_positions=torch.arange(T - Tq, T, device=dev))
        out["keep_max_diff_recall"] = _max_diff(torch, got[0], ref[0])
        out["keep_max_diff_error"] = _max_diff(torch, got[1], ref[1])
        out["keep_error_range"] = [float(torch.nan_to_num(ref[1]).min()), float(torch.nan_to_num(ref[1]).max())]
    except Exception as exc:
        out["keep_error"] = _error_text(exc)
    try:
        x = k.to(torch.bfloat16).float()  # a bf16 grid: many rounding ties, as recorded K/V have
        for name, kw in QUANTS:
            spec = W.QuantSpec(**kw)
            g, r = W.quant_error_triton(x, spec), W.quant_error_reference(x, spec)
            out[f"quant {name}"] = {"max_rel_diff_mse": float(((g[0] - r[0]).abs() / r[0].abs().clamp(min=1e-300)).max()),
                                    "max_diff_cosine": _max_diff(torch, g[1], r[1])}
    except Exception as exc:
        out["quant_error"] = _error_text(exc)
    return out


def _mib(b: int | None) -> str:
    return "-" if b is None else f"{b / 2**20:,.1f}"


def _ci(ci: list[float] | None) -> str:
    return "-" if ci is None else f"{ci[0]:.1f}-{ci[1]:.1f}x"


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(doc: dict[str, Any]) -> None:
    print(f"\nwhat-if kernels on {doc['device']} (torch {doc['torch']}, triton {doc['triton']})")
    hdr = f"{'kind':<6} {'case':<48} {'keys':>6} {'q':>5} {'kernel ms':>10} {'device':>7} {'prep ms':>8} {'launch ms':>9} " \
          f"{'eager ms':>10} {'speed-up':>9} {'95% CI':>12} {'kern MiB':>9} {'eager MiB':>10} {'max|diff|':>10}"
    print(hdr)
    print("-" * len(hdr))
    for r in doc["rows"]:
        case = r.get("spec", f"9 keep-sets, {r.get('q_heads')}/{r.get('kv_heads')} heads, D {r.get('head_dim')}, "
                             f"{r.get('values_on')} values")
        diff = r.get("max_diff_error", r.get("max_diff_cosine"))
        print(f"{r['kind']:<6} {case:<48} {r['keys']:>6} {r.get('queries', '-')!s:>5} "
              f"{_fmt(r.get('kernel_ms'), '10.3f')} {_fmt(r.get('kernel_device_ms'), '7.3f'):>7} "
              f"{_fmt(r.get('kernel_prepared_ms'), '8.3f'):>8} "
              f"{_fmt(r.get('kernels_only_ms'), '9.3f'):>9} {_fmt(r.get('eager_ms'), '10.3f')} "
              f"{_fmt(r.get('speedup'), '8.1f')}x {_ci(r.get('speedup_ci95')):>12} {_mib(r.get('kernel_peak_bytes')):>9} "
              f"{_mib(r.get('eager_peak_bytes')):>10} {_fmt(diff, '10.2e')}")
        for key in ("kernel_error", "breakdown_error", "device_error", "eager_error"):
            if key in r:
                print(f"       {key}: {r[key]}")
    print("\nfloat64 check:", json.dumps(doc["float64_check"]))
    for f in doc.get("kernel_fallbacks", []):
        print("kernel fallback:", f)
    for g in doc["goal"]:
        print(f"goal >= {GOAL_SPEEDUP:g}x at {g['keys']} keys, {g['queries']} queries, {g['values_on']} values: "
              f"{_fmt(g['speedup'], '.1f')}x, 95% CI {_ci(g['ci95'])} -> {g['verdict']}")


def _release(torch, cuda: bool) -> None:
    """Return the last case's tensors to the device (they are gone once its function returned)."""
    if cuda:
        torch.cuda.empty_cache()


def _git_commit() -> str | None:
    """HEAD, or BENCH_COMMIT where the tree was copied without its repository (a GPU machine)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except Exception:
        head = ""
    return head or os.environ.get("BENCH_COMMIT") or None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json-out", type=Path, help="write the results to this JSON file (rewritten after every case)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="fewer shapes (a short GPU run)")
    mode.add_argument("--smoke", action="store_true", help="tiny shapes; runs on the CPU interpreter without a GPU")
    ap.add_argument("--only", choices=("keep", "quant"), help="measure only the keep-set or the quantisation rows")
    ap.add_argument("--keys", type=int, nargs="+", help="key counts to measure (default: the size's list)")
    ap.add_argument("--queries", type=int, nargs="+", help="queries per head for the keep rows (default: the size's)")
    ap.add_argument("--pairs", type=int, help="kernel/eager pairs per keep row (default: the size's; more pairs "
                    "narrow a CI that straddles the goal)")
    ap.add_argument("--cpu", choices=("replay", "rerun", "all"),
                    help="the CPU benchmarks instead (bench/whatif_cpu.py): the offline replay of the whole policy "
                    "set at --tokens with --steps all (CPU seconds; fast vs numpy pairs and an A-vs-A control at 1k), "
                    "and/or --rerun per policy against a plain evicting loop (interleaved pairs, 95%% CI)")
    ap.add_argument("--tokens", type=int, default=8192, help="--cpu replay: trace length (default 8192)")
    ap.add_argument("--rerun-tokens", type=int, default=160, help="--cpu rerun: text length (default 160)")
    ap.add_argument("--runs", type=int, default=5, help="--cpu replay: runs at --tokens (default 5)")
    ap.add_argument("--cache-dir", default="/tmp/kvtrace-bench", help="--cpu: where the recorded traces are kept")
    ap.add_argument("--pieces", choices=("auto", "on", "off"), default="auto",
                    help="the signature-pieces path for 16+ query rows per KV head (default auto: where it pays)")
    ap.add_argument("--no-exact-decode", action="store_true",
                    help="decode steps with fp32 K/V on the packed kernel after the grid check, not the exact kernel")
    ap.add_argument("--no-direct-launch", action="store_true", help="every launch through Triton's call path")
    args = ap.parse_args(argv)
    if args.cpu:
        from whatif_cpu import main_cpu

        if args.pairs is None:
            args.pairs = 9
        return main_cpu(args)
    try:
        import torch
    except Exception as exc:
        print(f"bench_whatif: torch is not importable ({exc})", file=sys.stderr)
        return EX_UNAVAILABLE
    cuda = torch.cuda.is_available()
    if not cuda:
        if not args.smoke:
            print("bench_whatif: no CUDA device visible; this benchmark runs on a GPU (or use --smoke)", file=sys.stderr)
            return EX_UNAVAILABLE
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    try:
        import triton
    except Exception as exc:
        print(f"bench_whatif: triton is not importable ({exc}); install kvtrace[gpu]", file=sys.stderr)
        return EX_UNAVAILABLE
    from kvtrace.kernels import whatif as W

    config = W.KernelConfig(exact_decode=not args.no_exact_decode,
                            pieces={"auto": "auto", "on": True, "off": False}[args.pieces],
                            direct_launch=not args.no_direct_launch)
    kernels = dict(config=config, fallbacks=W.KernelFallbacks())  # one record for the whole run

    torch.backends.cuda.matmul.allow_tf32 = False  # the eager reference is fp32; keep it honest
    dev = "cuda" if cuda else "cpu"
    sz = dict(SIZES["smoke" if args.smoke else "quick" if args.quick else "full"])
    sz.update({name: getattr(args, name) for name in ("keys", "queries", "pairs") if getattr(args, name)})
    t0 = time.perf_counter()
    doc: dict[str, Any] = {
        "bench": "bench_whatif", "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor()})",
        "torch": torch.__version__, "triton": triton.__version__, "commit": _git_commit(),
        "sizes": "smoke" if args.smoke else "quick" if args.quick else "full",
        "selection": {"only": args.only, "keys": args.keys, "queries": args.queries, "pairs": sz["pairs"]}, "rows": [], "float64_check": {},
        "goal": [], "kernel_config": dataclasses.asdict(config),
    }

    def save() -> None:
        doc["kernel_fallbacks"] = list(kernels["fallbacks"].notes)  # a kernel replaced by another (compiler trouble)
        if args.json_out:
            args.json_out.parent.mkdir(parents=True, exist_ok=True)
            args.json_out.write_text(json.dumps(doc, indent=2))

    goal_keys = GOAL_KEYS if not args.smoke else sz["keys"][-1]
    for T in sz["keys"] if args.only != "quant" else ():
        for Tq in sz["queries"]:
            for grid in ("bf16", "fp32") if T == goal_keys else ("bf16",):
                doc["rows"].append(bench_keep(torch, W, dev, sz, T, Tq, grid, kernels))
                _release(torch, cuda)
                r = doc["rows"][-1]
                print(f"keep T={T} Tq={Tq} {grid}: kernel {r.get('kernel_ms')} ms, eager {r.get('eager_ms')} ms "
                      f"{r.get('kernel_error', '')}{r.get('eager_error', '')}", flush=True)
                save()
    for T in sz["keys"] if args.only != "keep" else ():
        for name, kw in QUANTS:
            doc["rows"].append(bench_quant(torch, W, dev, sz, T, name, kw))
            _release(torch, cuda)
            save()
    doc["float64_check"] = float64_check(torch, W, dev, sz, kernels) if args.only is None else {"skipped": f"--only {args.only}"}
    for r in doc["rows"]:
        if r["kind"] == "keep" and r["keys"] == goal_keys:
            ci = r.get("speedup_ci95")
            doc["goal"].append({"keys": goal_keys, "queries": r["queries"], "values_on": r["values_on"],
                                "speedup": r.get("speedup"), "ci95": ci,
                                "verdict": verdict(ci) if ci else "not measured"})
    doc["total_s"] = time.perf_counter() - t0
    save()
    print_table(doc)
    print(f"\n(total {doc['total_s']:.0f} s)")
    failed = any("kernel_error" in r for r in doc["rows"]) or "keep_error" in doc["float64_check"] \
        or "quant_error" in doc["float64_check"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
