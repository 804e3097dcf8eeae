#!/usr/bin/env python
"""Owner readings on a GPU, in one command (about 4 minutes on an H100):

    python bench/owners_gpu_check.py OUTDIR

1. runs tests/gpu/test_owners_gpu.py (real allocator snapshots: every block one owner, views, the
   cuBLAS workspace, copies vs temporaries with memory history, kept exception, by-design scores,
   OOM post-mortem, memory-viz export; snapshot cost at 1k/10k/50k blocks printed);
2. records the owner-evidence GPU accuracy cases (tests/accuracy/make_gpu_accuracy_fixtures.py --only ...)
   into OUTDIR/fixtures and checks each against its target (clean: nothing >= low; planted: its
   detector >= 0.5 naming the owner), printing a table;
3. measures what the owner readings and memory history cost (interleaved pairs, tiny llama 16x64):
   per-request wall time with owners on/off, decode throughput with memory_history on/off.

Writes OUTDIR/summary.json and OUTDIR/*.log. To commit the fixtures: copy OUTDIR/fixtures/*.kvt.h5
into tests/data/accuracy/ and merge OUTDIR/fixtures/manifest.json into tests/data/accuracy/manifest.json
(the script prints the command).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "accuracy"))


def run(cmd: list[str], log: Path, timeout: int) -> int:
    t = time.time()
    with open(log, "w") as fh:
        try:
            code = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT,
                                  env={**os.environ, "PYTHONWARNINGS": "ignore"}).returncode
        except subprocess.TimeoutExpired:
            code = 124  # what finished is in the log; the rest of the check still runs
    print(f"  {' '.join(cmd[1:4])} ... exit {code} in {time.time() - t:.0f} s (log {log})", flush=True)
    return code


def check_fixtures(fixdir: Path) -> list[dict]:
    import kvtrace
    from kvtrace.analyzer.base import Severity

    manifest = json.loads((fixdir / "manifest.json").read_text())
    rows = []
    for name, info in sorted(manifest.items()):
        r = kvtrace.analyze(fixdir / info["file"])
        ok, why = True, ""
        if info.get("detector"):
            hits = [f for f in r.result(info["detector"]).findings if f.kind in info["kinds"]]
            top = max(hits, key=lambda f: f.score) if hits else None
            ok = top is not None and top.score >= 0.5 and info.get("owner", "") in top.message
            if info.get("pathology") == "non_kv_growth":
                ok = ok and not [f for f in r.result("growth_curve").findings if f.kind == "duplication" and f.score > 0.1]
            why = f"{top.kind} {top.score:.2f}: {top.message[:300]}" if top else "not named"
        else:
            low = [f for f in r.findings if f.severity >= Severity.LOW]
            ok = not low
            why = "; ".join(f"{f.detector}/{f.kind} {f.score:.2f}: {f.message[:200]}" for f in low) or "clean"
        rows.append({"case": name, "ok": ok, "bytes": info["bytes"], "seconds": info["seconds"], "why": why})
        print(f"  {'PASS' if ok else 'FAIL'} {name:32s} {info['bytes'] / 1024:7.1f} KiB  {why[:160]}", flush=True)
    return rows


def costs() -> dict:
    import gc
    import warnings

    import torch

    import kvtrace
    from tests.helpers.models import tiny_model, tiny_prompt

    warnings.simplefilter("ignore")
    m = tiny_model("llama", dtype=torch.float16, num_key_value_heads=16, num_attention_heads=16,
                   head_dim=64, num_hidden_layers=8, hidden_size=1024, intermediate_size=2816).to("cuda")
    prompt = tiny_prompt(128).to("cuda")

    def session(path: Path, n: int, new: int, **opts) -> tuple[float, float]:
        with kvtrace.record(m, path, **opts):
            t0 = time.perf_counter()
            for _ in range(n):
                m.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
        return (t1 - t0) / n, n * new / (t1 - t0)

    tmp = Path("/tmp/kvtrace_owner_costs")
    tmp.mkdir(exist_ok=True)
    session(tmp / "warm.kvt.h5", 2, 8)
    out: dict = {"owners_per_request_s": {"on": [], "off": []}, "decode_tokens_per_s": {"history": [], "plain": []}}
    for i in range(3):  # interleaved pairs
        for flag in ("on", "off"):
            per_req, _ = session(tmp / f"o{i}{flag}.kvt.h5", 8, 32, owners=flag == "on")
            out["owners_per_request_s"][flag].append(round(per_req, 4))
        for flag in ("history", "plain"):
            _, tps = session(tmp / f"h{i}{flag}.kvt.h5", 2, 128, memory_history=flag == "history")
            out["decode_tokens_per_s"][flag].append(round(tps, 1))
        gc.collect()
    on, off = (statistics.median(out["owners_per_request_s"][k]) for k in ("on", "off"))
    hist, plain = (statistics.median(out["decode_tokens_per_s"][k]) for k in ("history", "plain"))
    out["owners_overhead_ratio"] = round(on / off, 4)
    out["memory_history_slowdown"] = round(plain / hist, 4)
    out["device"] = torch.cuda.get_device_name(0)
    out["torch"] = torch.__version__
    print(f"  owners on/off per request: {on * 1e3:.1f} / {off * 1e3:.1f} ms ({on / off:.3f}x); "
          f"memory_history decode: {hist:.0f} vs {plain:.0f} tokens/s ({plain / hist:.2f}x slower)", flush=True)
    return out


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__)
        return 64
    out = Path(sys.argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {}
    print("1. tests/gpu/test_owners_gpu.py", flush=True)
    summary["gpu_tests_exit"] = run([sys.executable, "-m", "pytest", "tests/gpu/test_owners_gpu.py", "-m", "gpu",
                                     "-q", "-s", "-p", "no:cacheprovider"], out / "gpu_tests.log", 210)
    print("2. owner-evidence GPU accuracy cases", flush=True)
    import make_gpu_accuracy_fixtures as mk

    fixdir = out / "fixtures"
    summary["fixtures_exit"] = run([sys.executable, "tests/accuracy/make_gpu_accuracy_fixtures.py", str(fixdir),
                                    "--only", *mk.OWNER_CASES], out / "fixtures.log", 250)
    if (fixdir / "manifest.json").exists():
        summary["fixtures"] = check_fixtures(fixdir)
    print("3. costs", flush=True)
    try:
        summary["costs"] = costs()
    except Exception as exc:  # noqa: BLE001 - the rest of the summary still counts
        summary["costs"] = {"error": f"{type(exc).__name__}: {exc}"}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    failed = [r["case"] for r in summary.get("fixtures", []) if not r["ok"]]
    print(f"\nsummary: gpu tests exit {summary['gpu_tests_exit']}, fixtures {len(summary.get('fixtures', []))} "
          f"recorded, {len(failed)} off target {failed}; {out / 'summary.json'}")
    print(f"commit the fixtures: cp {fixdir}/*.kvt.h5 tests/data/accuracy/ && python -c \"import json;"
          f"a=json.load(open('tests/data/accuracy/manifest.json'));a.update(json.load(open('{fixdir}/manifest.json')));"
          f"json.dump(a,open('tests/data/accuracy/manifest.json','w'),indent=2,sort_keys=True)\"")
    return 0 if summary["gpu_tests_exit"] == 0 and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
