"""Fleet scale: export N traces to Parquet and time the default summary over them.

    python bench/bench_fleet.py [--traces 1000] [--jobs 1,2] [--dir /tmp/kvtrace-fleet-bench] [--json out.json]

The traces are copies of the real recordings under tests/data (H100/H200 runs of llama, gemma3,
gpt-oss and qwen3 geometries with planted retention, fragmentation, OOM and duplication faults),
each copy given its own /meta (transformers_version alternating 5.17.0 / 5.23.0, a host label of
8 hosts) so every copy is a distinct trace to the exporter. Copies differ in metadata, not in
measurements: the query timings are what matters here, the diff verdicts are not meaningful.
Reports export wall time per engine (fresh directory each), the incremental re-run (all skipped),
and the summary (connect + three queries) median of 5 runs, cold and warm.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import h5py

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvtrace.fleet.export import export_parquet  # noqa: E402
from kvtrace.fleet.query import connect, summary  # noqa: E402


def make_traces(n: int, out: Path) -> list[str]:
    sources = sorted(p for p in (ROOT / "tests" / "data").rglob("*.kvt.h5"))
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        dst = out / f"t{i:05d}.kvt.h5"
        if not dst.exists():
            shutil.copy(sources[i % len(sources)], dst)
            with h5py.File(dst, "r+") as f:
                f["meta"].attrs["transformers_version"] = ("5.17.0", "5.23.0")[i % 2]
                f["meta"].attrs["host_label"] = f"host-{i % 8}"
                f["meta"].attrs["bench_copy"] = i  # an unknown /meta attribute: makes each copy distinct
        paths.append(str(dst))
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=int, default=1000)
    ap.add_argument("--jobs", default="1,2", help="comma-separated process-pool sizes to time")
    ap.add_argument("--dask-workers", type=int, default=0, help="also time a dask LocalCluster of N workers")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/kvtrace-fleet-bench"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    paths = make_traces(args.traces, args.dir / "traces")
    size = sum(Path(p).stat().st_size for p in paths)
    results: dict = {"traces": len(paths), "trace_bytes": size, "export": {}}
    fleet = None
    engines = [("jobs", int(j)) for j in args.jobs.split(",") if j] + (
        [("dask", args.dask_workers)] if args.dask_workers else [])
    for kind, n in engines:
        fleet = args.dir / f"fleet-{kind}{n}"
        shutil.rmtree(fleet, ignore_errors=True)
        r = export_parquet(paths, fleet, jobs=n if kind == "jobs" else 1, dask_workers=n if kind == "dask" else 0)
        assert not r.failed and len(r.exported) == len(paths), (r.failed[:3], r.skipped[:3])
        results["export"][r.engine] = {"seconds": round(r.seconds, 2),
                                       "traces_per_s": round(len(r.exported) / r.seconds, 1)}
        print(f"export {r.engine:28s} {r.seconds:7.2f} s  {len(r.exported) / r.seconds:6.1f} traces/s", flush=True)
    assert fleet is not None
    t0 = time.perf_counter()
    again = export_parquet(paths, fleet)
    results["incremental_rerun_s"] = round(time.perf_counter() - t0, 3)
    print(f"re-run (all {len(again.skipped)} skipped)  {results['incremental_rerun_s']:.3f} s")
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        con = connect(fleet)
        s = summary(con, ["transformers_version", "model_type"])
        times.append(time.perf_counter() - t0)
        con.close()
    results["summary_s"] = {"first": round(times[0], 3), "median": round(statistics.median(times), 3)}
    print(f"summary (connect + 3 queries, grouped by 2 keys): first {times[0]:.3f} s, "
          f"median of 5 {statistics.median(times):.3f} s; {len(s['groups'].rows)} groups")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
