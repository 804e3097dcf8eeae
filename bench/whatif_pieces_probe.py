"""Probe: the what-if keep-set measures for many queries, signature pieces vs the shared-max kernel
vs eager torch, on one CUDA GPU (the shapes of bench_whatif.py's keep rows).

    PYTHONPATH=. python3 bench/whatif_pieces_probe.py --json-out bench/results/whatif_pieces_probe.json

Per case: the three calls timed in rotation (``--rounds`` of each, after a warm-up that compiles and
autotunes), medians, and the median of per-round ratios against eager with a 95% bootstrap CI;
the GPU time of one pieces call by kernel (torch profiler); its extra peak memory; the plan's
chunks and pieces; the largest differences from fp32 eager. Exit 69 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_overhead import bootstrap_median_ci  # noqa: E402
from bench_whatif import _max_diff, keep_inputs, peak_extra_bytes, profiled  # noqa: E402

CASES = [(32768, 64, "bf16"), (32768, 64, "fp32"), (4096, 64, "bf16"), (32768, 16, "bf16"), (65536, 64, "bf16"),
         (32768, 256, "bf16")]


def _event_ms(torch, fn) -> float:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    e.synchronize()
    return float(s.elapsed_time(e))


def _kernels(torch, fn, calls: int = 3) -> dict[str, float]:
    """GPU ms per call by kernel name (the torch profiler)."""
    out: dict[str, float] = {}
    for ev in profiled(torch, fn, calls).key_averages():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            out[ev.key[:60]] = round(ev.device_time_total / 1e3 / calls, 4)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _host_profile(torch, fn, calls: int = 20) -> list[str]:
    """The Python functions where one call spends its host time (cProfile, top 12 by own time)."""
    import cProfile
    import io
    import pstats

    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
    return [line for line in out.getvalue().splitlines() if line.strip()][-14:]


def probe(torch, W, P, T: int, Tq: int, grid: str, rounds: int) -> dict:
    q, k, v, keep, pos = keep_inputs(torch, "cuda", (32, 8, 128), T, Tq, grid)
    Hk = k.shape[1]
    kw = dict(q_positions=pos)
    row: dict = {"keys": T, "queries": Tq, "values_on": grid, "sets": int(keep.shape[0])}

    on, off = W.KernelConfig(pieces=True), W.KernelConfig(pieces=False)

    def pieces():
        return W.keep_measures_triton(q, k, v, keep, **kw, config=on)

    def shared():
        return W.keep_measures_triton(q, k, v, keep, **kw, config=off)

    def eager():
        return W.keep_measures_reference(q, k, v, keep, **kw, dtype=torch.float32)

    fns = {"pieces": pieces, "shared": shared, "eager": eager}
    outs = {name: fn() for name, fn in fns.items()}  # warm-up: compiles and autotunes
    torch.cuda.synchronize()
    for name in ("pieces", "shared"):
        row[f"{name}_max_diff"] = [_max_diff(torch, outs[name][i], outs["eager"][i]) for i in (0, 1)]
    del outs
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(_event_ms(torch, fn))
    for name, ts in times.items():
        row[f"{name}_ms"] = statistics.median(ts)
        row[f"{name}_times"] = ts
    for name in ("pieces", "shared"):
        med, lo, hi = bootstrap_median_ci([e / x for x, e in zip(times[name], times["eager"], strict=True)])
        row[f"{name}_speedup"], row[f"{name}_ci95"] = med, [lo, hi]
    row["pieces_gpu_ms_by_kernel"] = _kernels(torch, pieces)
    row["pieces_host_profile"] = _host_profile(torch, pieces)
    row["pieces_peak_bytes"] = peak_extra_bytes(torch, pieces, True)
    row["shared_peak_bytes"] = peak_extra_bytes(torch, shared, True)
    g = W._geometry(q, k, v, kw["q_positions"], 0, None, None, True)
    from kvtrace.kernels import _triton_whatif_pieces as tp

    pk = P.piece_keys_for(T, Hk, g.group * Tq, W._sms(q.device), tp.unit(), None)
    plan, _ = P.plan(W._keep_arg(keep), g, q.device, piece_keys=pk, unit=tp.unit())
    row["chunks"] = plan.chunks
    row["pieces"] = int(plan.work.shape[0])
    row["piece_keys"] = pk
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--cases", default="all", help="comma-separated indices into CASES, or all")
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("whatif_pieces_probe: no CUDA device", file=sys.stderr)
        return 69
    from kvtrace.kernels import whatif as W
    from kvtrace.kernels import whatif_pieces as P

    picked = CASES if a.cases == "all" else [CASES[int(i)] for i in a.cases.split(",")]
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for T, Tq, grid in picked:
        try:
            row = probe(torch, W, P, T, Tq, grid, a.rounds)
        except Exception as exc:  # recorded, the run goes on
            row = {"keys": T, "queries": Tq, "values_on": grid, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        doc["rows"].append(row)
        brief = {x: row.get(x) for x in ("keys", "queries", "values_on", "pieces_ms", "shared_ms", "eager_ms",
                                         "pieces_speedup", "pieces_ci95", "shared_speedup", "pieces_max_diff",
                                         "chunks", "pieces", "pieces_peak_bytes", "error")}
        brief["gpu_top"] = dict(list(row.get("pieces_gpu_ms_by_kernel", {}).items())[:4])
        print(json.dumps(brief), flush=True)
        print("\n".join(row.get("pieces_host_profile", [])), flush=True)
        if a.json_out:
            a.json_out.write_text(json.dumps(doc, indent=1))
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
