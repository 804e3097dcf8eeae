"""report/findings reads the analyser's typed report field by field (no duck typing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtrace.analyzer import AnalysisReport, analyze
from kvtrace.report.findings import detector_statuses, flatten

DATA = Path(__file__).resolve().parents[1] / "data" / "gpu"


@pytest.fixture(scope="module")
def duplication() -> AnalysisReport:
    return analyze(DATA / "gpu_duplication.kvt.h5")


def test_rows_are_the_reports_findings(duplication):
    rows = flatten(duplication)
    assert rows, "the duplication fixture must give findings, else this test checks nothing"
    by_key = {(f.detector, f.message): f for f in duplication.findings}
    assert len(rows) == len(duplication.findings)
    for r in rows:
        f = by_key[(r.detector, r.message)]
        assert r.severity == f.severity.label and r.score == f.score and r.kind == f.kind
        assert r.requests == f.requests and r.steps == f.steps and r.layers == f.layers
        assert r.request == (f.requests[0] if f.requests else None)
        assert r.evidence == {k: v.to_dict() for k, v in f.evidence.items()}


def test_statuses_are_the_reports_results(duplication):
    statuses = detector_statuses(duplication)
    assert [(s.name, s.status, s.reason, s.findings) for s in statuses] == [
        (r.name, r.status, r.reason, len(r.findings)) for r in duplication.results]
    assert any(s.findings for s in statuses)
