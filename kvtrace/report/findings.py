"""Findings of the analyser, flattened for the report table and the Perfetto instants.

Reads kvtrace.analyzer's AnalysisReport (findings with severity, score, message, evidence of
value + unit, requests/steps/layers) by attribute name, so a dict or another object of the same
shape works too. Without the analyser the report says so instead of showing an empty table that
would read as "no problems found".
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

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
    t_ns: int | None = None  # trace clock, when the finding points at an instant
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


def _get(obj: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        if isinstance(obj, Mapping) and name in obj:
            return obj[name]
        if not isinstance(obj, Mapping) and hasattr(obj, name):
            return getattr(obj, name)
    return default


def _int_or_none(value: Any) -> int | None:
    try:
        return None if value is None or int(value) < 0 else int(value)
    except (TypeError, ValueError):
        return None


def _ints(value: Any) -> list[int]:
    try:
        return [int(v) for v in (value or [])]
    except (TypeError, ValueError):
        return []


def _severity(f: Any) -> str:
    sev = _get(f, "severity", default="info")
    sev = getattr(sev, "label", None) or getattr(sev, "name", None) or sev
    return str(sev).lower()


def flatten(analysis: Any) -> list[FindingRow]:
    """Rows from an analyser report (object with .findings, a dict, or a list of findings)."""
    findings = _get(analysis, "findings", default=analysis)
    rows = []
    for f in findings or []:
        score = _get(f, "score")
        evidence = plain(_get(f, "evidence", default={}) or {})
        if not isinstance(evidence, dict):
            evidence = {"value": evidence}
        requests = _ints(_get(f, "requests"))
        layers = _ints(_get(f, "layers"))
        request = _int_or_none(_get(f, "request"))
        layer = _int_or_none(_get(f, "layer"))
        rows.append(FindingRow(
            detector=str(_get(f, "detector", "name", default="?")),
            severity=_severity(f),
            score=None if score is None else float(score),
            message=str(_get(f, "message", "summary", default="")),
            request=request if request is not None else (requests[0] if requests else None),
            layer=layer if layer is not None else (layers[0] if len(layers) == 1 else None),
            t_ns=_int_or_none(_get(f, "t_ns", "time_ns")),
            evidence=evidence,
            kind=str(_get(f, "kind", default="")),
            requests=requests or ([request] if request is not None else []),
            steps=_ints(_get(f, "steps")),
            layers=layers or ([layer] if layer is not None else []),
        ))
    rows.sort(key=lambda r: (SEVERITY_ORDER.get(r.severity, 5), -(r.score or 0.0), r.detector))
    return rows


def detector_statuses(analysis: Any) -> list[DetectorStatus]:
    """What each detector did (ran / skipped with why / failed), when the report says."""
    out = []
    for r in _get(analysis, "results", default=None) or []:
        out.append(DetectorStatus(str(_get(r, "name", default="?")), str(_get(r, "status", default="?")),
                                  str(_get(r, "reason", default="") or ""),
                                  len(_get(r, "findings", default=[]) or [])))
    return out


def run_analysis(trace_path: str | os.PathLike[str]) -> tuple[Any, str]:
    """(analysis report or None, note). None when the analyser is missing or failed; note says why."""
    try:
        from kvtrace.analyzer import analyze
    except ImportError as exc:
        return None, f"the analyser is not available in this installation ({exc})"
    try:
        analysis = analyze(str(trace_path))
    except Exception as exc:  # noqa: BLE001 - the report still shows the measurements
        if os.environ.get("KVTRACE_DEBUG"):
            raise
        return None, f"the analyser failed on this trace: {type(exc).__name__}: {exc}"
    return analysis, "findings of kvtrace.analyze"
