"""The accuracy suite's GPU cases, from traces recorded on an H100
(tests/accuracy/make_gpu_accuracy_fixtures.py; how each was made: tests/data/accuracy/README.md).
The analyser needs no GPU: clean controls have no finding of severity low or above, planted cases
are named by their own detector with score >= 0.5."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvtrace
from kvtrace.analyzer.base import Severity

DIR = Path(__file__).resolve().parents[1] / "data" / "accuracy"
MANIFEST = json.loads((DIR / "manifest.json").read_text()) if (DIR / "manifest.json").exists() else {}
CASES = sorted(MANIFEST.items())
KiB = 1 << 10
pytestmark = pytest.mark.skipif(not CASES, reason="tests/data/accuracy has no manifest.json")


def _report(name: str):
    return kvtrace.analyze(DIR / MANIFEST[name]["file"])


def test_fixtures_stay_small_and_documented():
    readme = (DIR / "README.md").read_text()
    for name, info in CASES:
        size = (DIR / info["file"]).stat().st_size
        assert size < 768 * KiB, (name, size)
        assert info["note"] and name in readme


@pytest.mark.parametrize("name,info", CASES, ids=[c[0] for c in CASES])
def test_gpu_case_meets_its_target(name, info):
    r = _report(name)
    assert all(x.status != "error" for x in r.results), [(x.name, x.reason) for x in r.results]
    assert r.result("fragmentation").status == "ran"
    if info.get("detector"):
        hits = [f for f in r.result(info["detector"]).findings if f.kind in info["kinds"]]
        assert hits and max(f.score for f in hits) >= 0.5, [(f.detector, f.kind, f.score) for f in r.findings]
        if info.get("owner"):  # the naming finding names the owner or holder
            top = max(hits, key=lambda f: f.score)
            assert info["owner"] in top.message, top.message
        if info.get("pathology") == "non_kv_growth":  # never called copies of the cache
            assert not [f for f in r.result("growth_curve").findings if f.kind == "duplication" and f.score > 0.1]
    elif info.get("only"):  # a twin: only its pathology's detector must stay at info
        assert r.score(info["only"]) <= 0.1, [f.message for f in r.result(info["only"]).findings]
    else:
        low = [(f.detector, f.kind, round(f.score, 3), f.message) for f in r.findings if f.severity >= Severity.LOW]
        assert not low, low
        if info.get("outcomes"):
            assert [q["outcome"] for q in r.requests] == info["outcomes"]


def test_first_use_workspace_and_transient_prefill_are_info_with_their_cause():
    fresh = [f for f in _report("gpu_clean_fresh_single").result("post_eos").findings]
    assert fresh and fresh[0].kind == "first_use_allocation" and fresh[0].score <= 0.1
    assert fresh[0].evidence["retained_bytes"].value >= 8 << 20  # the cuBLAS workspace really is there
    (frag,) = _report("gpu_clean_gptoss_long_eager").result("fragmentation").findings
    assert frag.kind == "transient_split" and "eager attention" in frag.message
    assert frag.evidence["max_inactive_split_bytes"].value > 1 << 30  # the 1.8 GiB transient
    (spike,) = _report("gpu_clean_gptoss_long_eager").result("prefill_spike").findings
    assert spike.kind == "eager_attention_spike" and spike.score <= 0.1


def test_retention_names_holders_and_oom_names_the_cap():
    for name in ("gpu_retention_hook", "gpu_retention_global_list"):
        fs = [f for f in _report(name).result("post_eos").findings if f.severity == Severity.CRITICAL]
        assert len(fs) == 2 and all("list" in f.message and f.evidence["kv_alive_bytes"].value > 0 for f in fs)
    (cap,) = _report("gpu_oom_cap").result("oom").findings
    assert cap.kind == "oom_memory_cap" and "fraction 0.05" in cap.message
    assert cap.evidence["limit_bytes"].value < cap.evidence["device_memory_bytes"].value / 10
    (real,) = _report("gpu_oom_real").result("oom").findings
    assert real.evidence["cap_hit"].value == 0 and "larger than the device" in real.message


def test_fragmentation_follows_the_allocator_setting():
    on = _report("gpu_frag_user_decode").result("fragmentation").findings[0]
    off = _report("gpu_frag_user_decode_expandable").result("fragmentation").findings[0]
    assert on.score >= 0.5 and on.evidence["decode_split_growth_bytes"].value > 0
    assert off.score <= 0.1  # the same user pattern with expandable segments leaves no split blocks


def test_duplication_outside_the_cache_on_allocator_bytes():
    (f,) = [f for f in _report("gpu_dup_cat_subclass").result("growth_curve").findings if f.kind == "duplication"]
    assert f.evidence["signature"].value == 2 and 0.8 <= f.evidence["fitted_multiple"].value <= 1.25
