"""Findings of the analyser, flattened for the report table and the Perfetto instants.

Reads the analyser's typed result (kvtrace.analyzer.AnalysisReport: findings with score, severity,
message, evidence of value + unit, requests/steps/layers) field by field. Without the analyser the
report says so instead of showing an empty table that would read as "no problems found".
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtrace.analyzer.report import AnalysisReport
from kvtrace.format.errors import TraceError
from kvtrace.format.reader import Trace
from kvtrace.jsonable import plain
from kvtrace.units import format_bytes, format_ns

SEVERITY_ORDER = {"critical": 0, "high": 1, "error": 1, "medium": 2, "warning": 2, "low": 3, "info": 4}


@dataclass
class FindingRow:
    detector: str
    severity: str
    score: float | None
    message: str
    request: int | None = None
    layer: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    kind: str = ""
    requests: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    layers: list[int] = field(default_factory=list)

    def evidence_text(self, limit: int = 8) -> str:
        """'name=value unit' pairs, sizes in binary units."""
        parts = []
        for name, item in list(self.evidence.items())[:limit]:
            parts.append(f"{name}={format_evidence(item)}")
        return "; ".join(parts)


@dataclass
class DetectorStatus:
    name: str
    status: str  # "ran" | "skipped" | "error"
    reason: str
    findings: int


def format_evidence(item: Any) -> str:
    if isinstance(item, Mapping) and "value" in item and "unit" in item:
        value, unit = item["value"], item["unit"]
        if value is None:
            return "n/a"
        if unit == "bytes":
            return format_bytes(value)
        if unit == "ns":
            return format_ns(value)
        if unit == "ratio":
            return f"{value:.3g}" if isinstance(value, float) else str(value)
        return f"{value:g} {unit}" if isinstance(value, float) else f"{value} {unit}"
    return str(item)


def flatten(analysis: AnalysisReport) -> list[FindingRow]:
    """One row per finding of the report, worst first."""
    rows = []
    for f in analysis.findings:
        rows.append(FindingRow(
            detector=f.detector,
            severity=f.severity.label,
            score=f.score,
            message=f.message,
            request=f.requests[0] if f.requests else None,
            layer=f.layers[0] if len(f.layers) == 1 else None,
            evidence=plain(f.evidence),
            kind=f.kind,
            requests=list(f.requests),
            steps=list(f.steps),
            layers=list(f.layers),
        ))
    rows.sort(key=lambda r: (SEVERITY_ORDER.get(r.severity, 5), -(r.score or 0.0), r.detector))
    return rows


def detector_statuses(analysis: AnalysisReport) -> list[DetectorStatus]:
    """What each detector did (ran / skipped with why / failed)."""
    return [DetectorStatus(r.name, r.status, r.reason, len(r.findings)) for r in analysis.results]


def run_analysis(trace: Trace) -> tuple[AnalysisReport | None, str]:
    """(analysis report or None, note) of a trace the caller already opened (one open per command).
    None when the analyser is missing or failed (a bug); note says why. Damage the analyser reads
    raises TraceError: the report refuses the trace as analyze does (spec §9.1)."""
    try:
        from kvtrace.analyzer import analyze
    except ImportError as exc:
        return None, f"the analyser is not available in this installation ({exc})"
    try:
        analysis = analyze(trace)
    except TraceError:  # damage the analyser read (spec §9.1): the trace is refused, as by analyze itself
        raise
    except Exception as exc:  # noqa: BLE001 - the report still shows the measurements
        if os.environ.get("KVTRACE_DEBUG"):
            raise
        return None, f"the analyser failed on this trace: {type(exc).__name__}: {exc}"
    return analysis, "findings of kvtrace.analyze"
