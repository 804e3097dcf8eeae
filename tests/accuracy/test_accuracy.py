"""The labelled accuracy suite on the CPU (cases in cases.py): every clean control has no finding of
severity low or above, and every planted pathology is named by its own detector with score >= 0.5.

Each case is recorded once per test session (fresh-process cases in one forked helper) and its
analysis shared by every test that asks for it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvtrace  # noqa: E402
from kvtrace.analyzer.base import Severity  # noqa: E402
from tests.helpers import cases  # noqa: E402

CLEAN = cases.clean_cases()
PLANTED = cases.PLANTED
# every request outcome and growth the user asked for
OTHER_CLEAN = cases.OUTCOME_CLEAN + cases.BY_DESIGN_CLEAN


@pytest.fixture(scope="module")
def analysed(tmp_path_factory):
    """name -> Report, recording each case on first use."""
    import torch

    outdir = tmp_path_factory.mktemp("accuracy")
    reports: dict[str, object] = {}
    failed: dict[str, str] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add contention on shared CI cores
    known = cases.by_name()

    def get(name: str):
        if name not in reports and name not in failed:
            case = known[name]
            if case.fresh:  # record every fresh-process case at once: one helper start-up
                todo = [c.name for c in known.values() if c.fresh and c.name not in reports]
                failed.update(cases.record_fresh(outdir, todo))
                for n in todo:
                    if n not in failed:
                        reports[n] = kvtrace.analyze(cases.trace_path(outdir, n))
            else:
                path = cases.trace_path(outdir, name)
                case.record(path)
                reports[name] = kvtrace.analyze(path)
        if name in failed:
            pytest.fail(f"recording {name} failed: {failed[name]}")
        return reports[name]

    yield get
    torch.set_num_threads(threads)


def _above_info(report) -> dict:
    return {(f.detector, f.kind): (round(f.score, 3), f.message) for f in report.findings
            if f.severity >= Severity.LOW}


@pytest.mark.slow
@pytest.mark.parametrize("case", CLEAN, ids=[c.name for c in CLEAN])
def test_clean_control_has_nothing_above_info(analysed, case):
    r = analysed(case.name)
    errors = [(x.name, x.reason) for x in r.results if x.status == "error"]
    assert not errors, errors
    assert not _above_info(r)
    assert r.requests and all(q["outcome"] == "ok" for q in r.requests)
    ran = {x.name for x in r.results if x.status == "ran"}
    assert {"growth_curve", "post_eos", "layer_uniformity", "aliasing"} <= ran, ran


@pytest.mark.parametrize("case", OTHER_CLEAN, ids=[c.name for c in OTHER_CLEAN])
def test_clean_outcome_and_by_design_control_has_nothing_above_info(analysed, case):
    """Failed requests are checked too (a dropped exception leaves nothing), and growth the call asked
    for (output_scores/output_logits rows, hidden states, attentions, beams) is named at most information."""
    r = analysed(case.name)
    errors = [(x.name, x.reason) for x in r.results if x.status == "error"]
    assert not errors, errors
    assert not _above_info(r)
    assert [q["outcome"] for q in r.requests] == list(case.outcomes)


SERVING = ("serving_capacity", "concurrency_headroom", "block_waste", "preemption", "queueing", "prefix_cache",
           "over_reservation", "context_spike")


@pytest.mark.slow
@pytest.mark.parametrize("case", cases.SERVING_CLEAN, ids=[c.name for c in cases.SERVING_CLEAN])
def test_clean_serving_control_has_nothing_above_info(analysed, case):
    """Continuous batching (no /kv rows: the generate detectors skip) with every serving detector run."""
    r = analysed(case.name)
    errors = [(x.name, x.reason) for x in r.results if x.status == "error"]
    assert not errors, errors
    assert not _above_info(r)
    cancelled = 1 if case.scenario == "serving_cancel" else 0  # the request it cancels ends interrupted
    outcomes = [q["outcome"] for q in r.requests]
    assert outcomes and outcomes.count("interrupted") == cancelled and outcomes.count("ok") == len(outcomes) - cancelled
    ran = {x.name for x in r.results if x.status == "ran"}
    assert set(SERVING) <= ran, ran


@pytest.mark.slow
@pytest.mark.parametrize("case", PLANTED, ids=[c.name for c in PLANTED])
def test_planted_case_is_named_by_its_own_detector(analysed, case):
    r = analysed(case.name)
    hits = [f for f in r.result(case.detector).findings if f.kind in case.kinds]
    assert hits and max(f.score for f in hits) >= 0.5, [(f.detector, f.kind, round(f.score, 3), f.message)
                                                          for f in r.findings]
    top = max(hits, key=lambda f: f.score)
    assert case.owner in top.message, top.message  # the owner or holder it names
    if case.pathology == "non_kv_growth":  # named by its owner class, never as copies of the cache
        assert not [f for f in r.result("growth_curve").findings if f.kind == "duplication" and f.score > 0.1]


@pytest.mark.slow
def test_retention_names_its_holders(analysed):
    kept = max(analysed("retention:kept_output").result("post_eos").findings, key=lambda f: f.score)
    assert kept.severity == Severity.CRITICAL and "Generate" in kept.message and kept.layers == [0, 1]
    hooked = max(analysed("retention:forward_hook").result("post_eos").findings, key=lambda f: f.score)
    assert "list" in hooked.message and hooked.evidence["kv_alive_bytes"].value > 0
    glob = [f for f in analysed("retention:global_list").result("post_eos").findings if f.score >= 0.5]
    assert sorted(r for f in glob for r in f.requests) == [0, 1]  # both requests' caches are kept


def test_duplication_outside_the_cache_has_its_signature(analysed):
    (f,) = [f for f in analysed("duplication:cat_subclass").result("growth_curve").findings
            if f.kind == "duplication"]
    assert f.evidence["signature"].value == 2  # 2 = sum of earlier cache sizes (quadratic)
    assert 0.5 <= f.evidence["fitted_multiple"].value <= 2.0, f.message
    assert "sum of earlier cache sizes" in f.message


@pytest.mark.slow
def test_oom_causes_name_the_limit(analysed):
    cap = analysed("oom:rlimit_cap").result("oom").findings
    assert [f.kind for f in cap] == ["oom_memory_cap"] and "RLIMIT_AS" in cap[0].message
    host = analysed("oom:host_exhausted").result("oom").findings
    assert len(host) == 1 and "host memory" in host[0].message


def test_cli_fail_on_low_passes_clean_runs_and_fails_planted(analysed):
    """`kvtrace analyze --fail-on low` is the CI gate users wire up: 0 on clean runs, 3 on a fault."""
    import subprocess
    import sys

    clean = [analysed(n).trace["path"] for n in ("clean:llama:fresh", "clean:gemma3_text:multi", "clean:deepseek_v3:sampling")]
    planted = analysed("retention:kept_output").trace["path"]
    cmd = [sys.executable, "-m", "kvtrace.cli", "analyze", "--fail-on", "low", "-q"]
    ok = subprocess.run([*cmd, *map(str, clean)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
    bad = subprocess.run([*cmd, str(planted)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 3, bad.stdout[-2000:] + bad.stderr[-2000:]
