"""Fleet scale: export N traces to Parquet and time the default summary over them.

    python bench/bench_fleet.py [--traces 1000] [--jobs 1,2] [--dask-workers 1,2] [--rounds 1]
                                [--summary-runs 7] [--profile 54] [--dir /tmp/kvtrace-fleet-bench]
                                [--json out.json]

The traces are copies of the real recordings under tests/data (H100/H200 runs of llama, gemma3,
gpt-oss and qwen3 geometries with planted retention, fragmentation, OOM and duplication faults),
each copy given its own /meta (transformers_version alternating 5.17.0 / 5.23.0, a host label of
8 hosts) so every copy is a distinct trace to the exporter. Copies differ in metadata, not in
measurements: the query timings are what matters here, the diff verdicts are not meaningful.

Reports, with the 1-minute load average at each step (the machine may be shared: a busy machine
slows everything, and 2 workers on 2 busy cores cannot show a speed-up):
* export wall time per engine (fresh directory each): in-process, spawn process pools and dask
  LocalClusters of the sizes given, so 1 vs 2 workers can be compared per engine; with --rounds R
  the list runs R times in turn and the medians are reported (interleaving is what makes 1 vs 2
  workers comparable on a machine whose load drifts);
* the incremental re-run (all skipped);
* the default summary (connect + three queries) over the exported directory, every run timed,
  with the median; one `fleet diff` and one `fleet report` (with the diff);
* where one trace's export time goes (--profile N traces, in-process): opening the trace and
  reading its tables (HDF5 decode), the analysis (detectors, reading tables again), building the
  Arrow tables (kvtrace's own Python), writing the Parquet files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import h5py

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kvtrace  # noqa: E402
from kvtrace.fleet.export import _write_atomic, export_parquet  # noqa: E402
from kvtrace.fleet.query import SUMMARY_TABLES, connect, summary  # noqa: E402
from kvtrace.fleet.source import read_trace  # noqa: E402
from kvtrace.fleet.tables import trace_tables  # noqa: E402


def load() -> float:
    return round(os.getloadavg()[0], 2)


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


def profile_export(paths: list[str]) -> dict[str, float]:
    """Milliseconds per trace in each part of export_one, measured part by part in-process."""
    parts = dict.fromkeys(("open_and_read_tables", "analyze", "arrow_tables", "write_parquet"), 0.0)
    out = Path(tempfile.mkdtemp(prefix="kvtrace-fleet-profile-"))
    for p in paths:
        t0 = time.perf_counter()
        data = read_trace(p, analyze=False)
        t1 = time.perf_counter()
        with kvtrace.open(p) as t:
            t2 = time.perf_counter()
            data.analysis = kvtrace.analyze(t).to_dict()
        t3 = time.perf_counter()
        tables = trace_tables(data)
        t4 = time.perf_counter()
        for name, table in tables.items():
            if table.num_rows:
                (out / name).mkdir(exist_ok=True)
                _write_atomic(table, out / name / f"{data.identity['trace_id']}.parquet")
        t5 = time.perf_counter()
        for key, dt in zip(parts, (t1 - t0 + t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
            parts[key] += dt
    shutil.rmtree(out, ignore_errors=True)
    return {k: round(v / len(paths) * 1000, 2) for k, v in parts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=int, default=1000)
    ap.add_argument("--jobs", default="1,2", help="comma-separated process-pool sizes to time (1 = in-process)")
    ap.add_argument("--dask-workers", default="", help="comma-separated dask LocalCluster sizes to time, e.g. 1,2")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat the engine list this many times, in turn, so that 1 and 2 workers meet the "
                         "same load (a shared machine's load drifts within minutes); medians per engine")
    ap.add_argument("--summary-runs", type=int, default=7)
    ap.add_argument("--profile", type=int, default=54, help="traces to profile export_one on (0: skip)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/kvtrace-fleet-bench"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    paths = make_traces(args.traces, args.dir / "traces")
    size = sum(Path(p).stat().st_size for p in paths)
    results: dict = {"traces": len(paths), "trace_bytes": size, "cpus": os.cpu_count(),
                     "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "export": []}
    fleet = None
    engines = [("jobs", int(j)) for j in args.jobs.split(",") if j] + [
        ("dask", int(n)) for n in args.dask_workers.split(",") if n]
    for kind, n in [e for _ in range(args.rounds) for e in engines]:
        fleet = args.dir / f"fleet-{kind}{n}"
        shutil.rmtree(fleet, ignore_errors=True)
        before = load()
        r = export_parquet(paths, fleet, jobs=n if kind == "jobs" else 1, dask_workers=n if kind == "dask" else 0)
        assert not r.failed and len(r.exported) == len(paths), (r.failed[:3], r.skipped[:3])
        results["export"].append({"engine": r.engine, "workers": n, "seconds": round(r.seconds, 2),
                                  "traces_per_s": round(len(r.exported) / r.seconds, 1),
                                  "load_before": before, "load_after": load()})
        print(f"export {r.engine:28s} {r.seconds:7.2f} s  {len(r.exported) / r.seconds:6.1f} traces/s  "
              f"(load {before} -> {load()})", flush=True)
    assert fleet is not None
    by_engine: dict[str, list[float]] = {}
    for e in results["export"]:
        by_engine.setdefault(e["engine"], []).append(e["seconds"])
    results["export_median_s"] = {k: statistics.median(v) for k, v in by_engine.items()}
    if args.rounds > 1:
        print("export medians:", results["export_median_s"])
    t0 = time.perf_counter()
    again = export_parquet(paths, fleet)
    results["incremental_rerun_s"] = round(time.perf_counter() - t0, 3)
    print(f"re-run (all {len(again.skipped)} skipped)  {results['incremental_rerun_s']:.3f} s")
    times, loads = [], []
    for _ in range(args.summary_runs):
        loads.append(load())
        t0 = time.perf_counter()
        con = connect(fleet, SUMMARY_TABLES)
        s = summary(con, ["transformers_version", "model_type"])
        times.append(time.perf_counter() - t0)
        con.close()
    results["summary"] = {"runs_s": [round(t, 3) for t in times], "median_s": round(statistics.median(times), 3),
                          "load": loads, "groups": len(s["groups"].rows)}
    print(f"summary (connect + 3 queries, grouped by 2 keys): runs {results['summary']['runs_s']} s, "
          f"median {results['summary']['median_s']:.3f} s; load {loads}; {len(s['groups'].rows)} groups")
    # one run each: the diff (5.17.0 vs 5.23.0 copies; its verdicts mean nothing here) and the report
    from kvtrace.fleet.compare import DIFF_TABLES, Selector, fleet_diff
    from kvtrace.fleet.report import REPORT_TABLES, build_fleet_report

    sel = Selector("transformers_version", "5.17.0"), Selector("transformers_version", "5.23.0")
    t0, before = time.perf_counter(), load()
    fleet_diff(connect(fleet, DIFF_TABLES), *sel)
    results["diff_s"] = {"seconds": round(time.perf_counter() - t0, 2), "load": before}
    t0, before = time.perf_counter(), load()
    page = Path(tempfile.mkdtemp(prefix="kvtrace-fleet-report-")) / "fleet.html"
    build_fleet_report(connect(fleet, REPORT_TABLES + DIFF_TABLES), page, keys=["model_type", "transformers_version"],
                       baseline=sel[0], candidate=sel[1], directory=str(fleet))
    results["report_s"] = {"seconds": round(time.perf_counter() - t0, 2), "load": before,
                           "html_bytes": page.stat().st_size}
    print(f"fleet diff {results['diff_s']['seconds']} s, fleet report (with the diff) "
          f"{results['report_s']['seconds']} s ({page.stat().st_size / 1024:.0f} KiB)", flush=True)
    if args.profile:
        before = load()
        results["export_profile_ms_per_trace"] = prof = profile_export(paths[: args.profile])
        results["export_profile_load"] = [before, load()]
        print("one trace's export, ms:", prof, f"(load {before} -> {load()})")
    results["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
