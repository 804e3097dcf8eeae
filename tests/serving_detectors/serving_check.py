"""Record every serving scenario (serving_scenarios.py) with the installed transformers on a device
and check the serving detectors on the traces: clean controls stay at info, each planted fault is
named by its detector (score >= 0.5). On CUDA it also records transformers' default pool sizing
(free memory x max_memory_percent) and checks the GPU judgements: the pool's free blocks are not
counted as used (gpu_usage at most low) and the pool is reported over-reserved (high).

Standalone, so that it runs where another transformers is installed (5.17 on the GPU machines):

    python tests/serving_detectors/serving_check.py                 # CPU
    python tests/serving_detectors/serving_check.py --device cuda   # GPU machine

and here through tests/serving_detectors/test_serving_v517_detectors.py with PYTHONPATH=/tmp/tf517.
Prints one line per scenario; exits 0, or 1 listing what failed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

CLEAN = ("clean_llama", "clean_gemma3", "clean_prefix_shared", "clean_budget_queue", "clean_qwen3", "clean_mistral",
         "clean_gpt_oss", "clean_phi3", "clean_bursty", "clean_long_tail", "clean_cancel", "clean_prefix_hits",
         "clean_hybrid_repeats", "clean_eos_sampled", "clean_well_used", "clean_many_short", "clean_sized_pool")
PLANTED = {"plant_pool_too_small": ("serving_capacity", "concurrency_headroom", "queueing"),
           "plant_large_pages": ("block_waste",), "plant_preemption": ("preemption",),
           "plant_sharing_off": ("prefix_cache",), "plant_context_spike": ("context_spike",),
           "plant_memory_percent": ("serving_capacity", "preemption"),
           "plant_burst_queue": ("concurrency_headroom", "queueing"), "plant_budget_starved": ("queueing",),
           "plant_default_pages": ("block_waste",), "plant_prefix_evicted": ("prefix_cache",),
           "plant_long_generation": ("context_spike",)}
CPU_ONLY = {"plant_memory_percent", "clean_sized_pool"}  # sized from host memory (psutil), as transformers sizes a CPU pool
# 5.17's cache evicts the newest cached blocks first: the first prompt survives and its repeat hits
NOT_517 = {"plant_prefix_evicted"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    import serving_scenarios as S
    import torch
    import transformers

    import kvtrace
    from kvtrace.analyzer.base import Severity

    torch.set_num_threads(1)
    S.DEVICE = args.device
    failures: list[str] = []
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, device {args.device}")
    with tempfile.TemporaryDirectory() as tmp:
        def analyse(name: str):
            path = getattr(S, name)(Path(tmp) / f"{name}.kvt.h5")
            return kvtrace.analyze(path)

        for name in CLEAN:
            if name in CPU_ONLY and args.device != "cpu":
                continue
            r = analyse(name)
            loud = [(f.detector, f.kind, round(f.score, 2)) for f in r.findings if f.severity >= Severity.LOW]
            print(f"{name}: {'ok' if not loud else 'FAIL ' + str(loud)}")
            if loud:
                failures.append(f"{name}: {loud}")
        for name, detectors in PLANTED.items():
            if (name in CPU_ONLY and args.device != "cpu") or (name in NOT_517 and transformers.__version__ < "5.18"):
                continue
            r = analyse(name)
            scores = {d: r.result(d).score for d in detectors}
            bad = {d: round(s, 2) for d, s in scores.items() if s < 0.5}
            print(f"{name}: {'ok' if not bad else 'FAIL'} {({d: round(s, 2) for d, s in scores.items()})}")
            if bad:
                failures.append(f"{name}: {bad}")
        if args.device.startswith("cuda"):
            r = analyse("default_pool")
            gpu = [f for f in r.result("serving_capacity").findings if f.kind == "gpu_usage"]
            over = r.result("over_reservation").findings
            line = {"gpu_usage": [(round(f.score, 2), f.message) for f in gpu],
                    "over_reservation": [(round(f.score, 2), f.message) for f in over]}
            print(f"default_pool: {line}")
            if not gpu or gpu[0].severity > Severity.LOW:
                failures.append(f"default_pool gpu_usage: {line['gpu_usage']}")
            if not over or over[0].severity != Severity.HIGH:
                failures.append(f"default_pool over_reservation: {line['over_reservation']}")
    for f in failures:
        print("FAILED", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
