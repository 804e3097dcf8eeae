"""Where a recording session's fixed cost goes: cProfile of ``record()`` opening and closing.

    python bench/profile_open_close.py [--device cuda] [--sessions 8] [--top 25]

Opening (``kvtrace.record(...).__enter__``) and closing (``__exit__``) are paid once per
session, on the caller's thread, so with one request per session they are part of the call
(bench_overhead.py's open/close columns). This script opens and closes ``--sessions`` sessions
around a short generate on Pythia-1.4B (bf16 on a GPU; a tiny shrink on a CPU), prints each
session's open/close milliseconds and the functions that took the time in the later half
(the first sessions pay one-time imports and caches).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path


def nvml_costs(n: int = 200) -> None:
    """Wall time of the telemetry thread's NVML and allocator calls, one after another (GPU idle)."""
    import torch

    from kvtrace.recorder import allocator
    from kvtrace.recorder.telemetry import _open_nvml

    nvml = _open_nvml()
    handle = nvml.handle_by_uuid(str(torch.cuda.get_device_properties(0).uuid)) if nvml.available else None
    calls = {"allocator.read": lambda: allocator.read(0)}
    if handle is not None:
        calls["nvml.memory"] = lambda: nvml.memory(handle)
        calls["nvml.process_used"] = lambda: nvml.process_used(handle)
    for name, fn in calls.items():
        fn()
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        print(f"{name}: {(time.perf_counter_ns() - t0) / n / 1e3:.1f} us per call")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)

    import torch

    import kvtrace
    from kvtrace import presets

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("profile_open_close: no CUDA device (use --device cpu)", file=sys.stderr)
        return 69
    gpu = args.device.startswith("cuda")
    model = presets.preset_model("pythia-1.4b", dtype=torch.bfloat16 if gpu else torch.float32,
                                 device=args.device, shrink=not gpu)
    ids = torch.randint(3, int(model.config.vocab_size), (1, 32)).to(args.device)

    def gen() -> None:
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        if gpu:
            torch.cuda.synchronize()

    gen()
    opens, closes = cProfile.Profile(), cProfile.Profile()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.sessions):
            late = i >= args.sessions // 2
            t0 = time.perf_counter()
            if late:
                opens.enable()
            rec = kvtrace.record(model, Path(tmp) / f"s{i}.kvt.h5")
            rec.__enter__()
            if late:
                opens.disable()
            t1 = time.perf_counter()
            gen()
            t2 = time.perf_counter()
            if late:
                closes.enable()
            rec.__exit__(None, None, None)
            if late:
                closes.disable()
            t3 = time.perf_counter()
            print(f"session {i}: open {(t1 - t0) * 1e3:.1f} ms, close {(t3 - t2) * 1e3:.1f} ms"
                  + (" (profiled)" if late else ""))
    if gpu:
        nvml_costs()
    for name, prof in (("open", opens), ("close", closes)):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(args.top)
        print(f"\n==== {name}: cumulative, sessions {args.sessions // 2}..{args.sessions - 1} ====")
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
