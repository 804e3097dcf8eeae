"""bench/bench_overhead.py runs end to end on a CPU with a tiny model (two ABBA pairs) and writes
the JSON the docs' tables are made from. Shapes only: timings are never asserted in tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_overhead.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_smoke_run_writes_pairs_and_intervals(tmp_path):
    out = tmp_path / "overhead.json"
    proc = _run("--suite", "smoke", "--device", "cpu", "--pairs", "2", "--quiet", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    (job,) = json.loads(out.read_text())["jobs"]
    assert job["code"] == "after" and job["device_name"].startswith("cpu")
    assert set(job["summary"]) == {"aa", "recorder", "m_hooks"}
    assert job["summary"]["aa"]["enter_s_median"] is None  # nothing attached: no open/close
    for variant, s in job["summary"].items():
        if variant == "aa":
            continue
        assert s["pairs"] == 2
        for key in ("total", "generate", "decode"):
            lo, hi = s[key]["ci95"]
            assert 0 < lo <= s[key]["median"] <= hi, (variant, key, s[key])
        assert s["enter_s_median"] > 0 and s["exit_s_median"] > 0
        pairs = job["pairs_raw"][variant]
        assert {p["order"] for p in pairs} == {"AB", "BA"}  # ABBA: the order alternates
        for p in pairs:
            assert p["variant"]["recorder_errors"] == 0
            assert p["total_ratio"] == p["variant"]["total_s"] / p["base"]["total_s"]
    assert "recorder" in proc.stdout and "decode/step" in proc.stdout  # the printed table


def test_serving_workload_without_cuda_says_so():
    proc = _run("--suite", "serving", "--device", "cpu")
    assert proc.returncode == 69
    assert "needs a CUDA device" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_variant_is_a_usage_error():
    proc = _run("--suite", "smoke", "--device", "cpu", "--variants", "nonesuch")
    assert proc.returncode == 64
    assert "unknown variant" in proc.stderr and "Traceback" not in proc.stderr


def test_bootstrap_interval_brackets_the_median():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from bench_overhead import bootstrap_median_ci
    finally:
        sys.path.remove(str(SCRIPT.parent))
    same = bootstrap_median_ci([1.0] * 9)
    assert same == (1.0, 1.0, 1.0)
    spread = bootstrap_median_ci([0.9, 0.95, 1.0, 1.05, 1.1, 1.0, 0.98, 1.02])
    assert spread[1] < spread[0] < spread[2]
    wide = bootstrap_median_ci([0.5, 1.5, 0.6, 1.4, 1.0, 0.7, 1.3])
    assert wide[2] - wide[1] > spread[2] - spread[1]  # more spread, wider interval
