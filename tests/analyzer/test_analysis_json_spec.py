"""spec/analysis-json.md and AnalysisReport.to_dict agree: every field the spec lists is emitted and
every field emitted is listed (REPORT, REQUEST, DETECTOR, FINDING), and the versions match."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtrace.analyzer import SCHEMA_VERSION, analyze, document

ROOT = Path(__file__).resolve().parents[2]
SPEC = (ROOT / "spec" / "analysis-json.md").read_text(encoding="utf-8")
TRACE = ROOT / "tests" / "data" / "gpu" / "gpu_duplication.kvt.h5"


def spec_fields(section: str) -> set[str]:
    """Backticked names in the first column of the field table under '### SECTION'."""
    body = SPEC.split(f"### {section}\n", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    names: set[str] = set()
    for line in body.splitlines():
        cells = line.split("|")
        if len(cells) > 2 and "`" in cells[1]:
            names.update(re.findall(r"`([a-z_]+)`", cells[1]))
    return names


@pytest.fixture(scope="module")
def doc():
    return document([analyze(TRACE)])


def test_versions_match(doc):
    assert doc["schema_version"] == SCHEMA_VERSION
    assert f'"schema_version": "{SCHEMA_VERSION}"' in SPEC
    assert SPEC.splitlines()[0].endswith(f"schema {SCHEMA_VERSION}")


def test_report_fields(doc):
    report = doc["reports"][0]
    # contents: specified, emitted only when asked for (--contents); notes: only when the trace
    # has notes (this fixture has none; tests/analyzer notes tests cover the field)
    assert spec_fields("REPORT") - {"contents", "notes"} == set(report)
    assert "notes" in spec_fields("REPORT")


def test_request_detector_finding_fields(doc):
    report = doc["reports"][0]
    assert report["requests"] and report["findings"], "the fixture must give requests and findings"
    # state_*: hybrid models only (format 1.5 /state), emitted for them (test below)
    assert spec_fields("REQUEST") - HYBRID_ONLY == set(report["requests"][0])
    assert spec_fields("DETECTOR") == set(report["detectors"][0])
    assert spec_fields("FINDING") == set(report["findings"][0])


HYBRID_ONLY = {"state_bytes", "state_layers"}


def test_hybrid_requests_carry_every_request_field():
    report = document([analyze(ROOT / "tests" / "data" / "hybrid_cpu" / "qwen3_next.kvt.h5")])["reports"][0]
    assert spec_fields("REQUEST") == set(report["requests"][0])


def test_the_parser_sees_a_missing_field():
    # Control: a field the spec does not list must show up as a difference.
    assert "no_such_field" not in spec_fields("FINDING")
    assert {"detector", "kind", "score", "evidence"} <= spec_fields("FINDING")
