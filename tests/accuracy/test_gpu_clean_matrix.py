"""The clean matrix recorded on a GPU (tests/accuracy/make_gpu_clean_matrix.py; every architecture x
scenario of the CPU suite, with real NVML and allocator rows): no finding of severity low or above.
The analyser needs no GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvtrace
from kvtrace.analyzer.base import Severity

DIR = Path(__file__).resolve().parents[1] / "data" / "accuracy_matrix"
MANIFEST = json.loads((DIR / "manifest.json").read_text()) if (DIR / "manifest.json").exists() else {}
RECORDED = sorted((k, v) for k, v in MANIFEST.items() if "file" in v)
pytestmark = pytest.mark.skipif(not RECORDED, reason="tests/data/accuracy_matrix has no recorded manifest")


def test_matrix_covers_ten_architectures_and_every_scenario_on_a_gpu():
    archs = {v["arch"] for _, v in RECORDED}
    scenarios = {v["scenario"] for _, v in RECORDED}
    assert len(archs) >= 10 and scenarios == {"short", "long_eager", "batch4", "sampling", "multi", "fresh"}
    assert all("NVIDIA" in v["device"] for _, v in RECORDED)


@pytest.mark.parametrize("key,info", RECORDED, ids=[k for k, _ in RECORDED])
def test_clean_gpu_control_has_no_finding_low_or_above(key, info):
    r = kvtrace.analyze(DIR / info["file"])
    assert all(x.status != "error" for x in r.results), [(x.name, x.reason) for x in r.results]
    assert r.result("fragmentation").status == "ran"  # real allocator rows were judged, not skipped
    low = [(f.detector, f.kind, round(f.score, 3), f.message) for f in r.findings if f.severity >= Severity.LOW]
    assert not low, low
