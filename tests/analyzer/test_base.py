"""Detector interface: severities, findings, evidence units, registry."""

import json

import pytest

from kvtrace.analyzer import SEVERITY_NAMES, Finding, Severity, detector_names, get_detectors, severity_for
from kvtrace.analyzer.base import Evidence, ev


@pytest.mark.parametrize("score,label", [
    (0.0, "info"), (0.1, "info"), (0.1001, "low"), (0.29, "low"), (0.3, "medium"),
    (0.49, "medium"), (0.5, "high"), (0.79, "high"), (0.8, "critical"), (1.0, "critical"),
])
def test_severity_thresholds(score, label):
    assert severity_for(score).label == label


def test_severity_parse_and_order():
    assert [Severity.parse(n) for n in SEVERITY_NAMES] == sorted(Severity)
    with pytest.raises(ValueError, match="unknown severity"):
        Severity.parse("fatal")


def test_finding_clamps_score_and_rejects_nan():
    f = Finding("x", "k", 1.7, "m", requests=[3, 1, 3], layers=[2, 0])
    assert f.score == 1.0 and f.requests == [1, 3] and f.layers == [0, 2]
    assert Finding("x", "k", -0.2, "m").score == 0.0
    with pytest.raises(ValueError):
        Finding("x", "k", float("nan"), "m")


def test_evidence_units_are_checked_and_json_safe():
    with pytest.raises(ValueError, match="unit"):
        Evidence(3, "MB")
    f = Finding("x", "k", 0.5, "m", evidence={"a": ev(float("inf"), "ratio"), "b": ev(1024, "bytes")})
    d = json.loads(json.dumps(f.to_dict()))
    assert d["evidence"]["a"] == {"value": None, "unit": "ratio"}
    assert d["evidence"]["b"] == {"value": 1024, "unit": "bytes"}
    assert d["severity"] == "high"


def test_registry_has_the_reference_six_first_then_the_rest():
    names = detector_names()
    assert names[:6] == ["growth_curve", "post_eos", "fragmentation", "layer_anomaly", "cache_density",
                         "layer_uniformity"]
    assert set(names[6:]) == {"aliasing", "prefill_spike", "capacity", "oom",
                              # serving (continuous batching)
                              "serving_capacity", "concurrency_headroom", "block_waste", "preemption", "queueing",
                              "prefix_cache", "over_reservation", "context_spike"}
    for det in get_detectors():
        assert det.name and det.summary and isinstance(det.needs, tuple)


def test_unknown_detector_name_is_refused():
    with pytest.raises(ValueError, match="unknown detector"):
        get_detectors(["growth_curve", "no_such"])
    assert [d.name for d in get_detectors(["oom", "oom"])] == ["oom"]
