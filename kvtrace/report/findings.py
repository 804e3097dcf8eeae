"""Findings of the analyser, flattened for the report table and the Perfetto instants.

The analyser (kvtrace.analyzer) is optional here: without it the report says so instead of
showing an empty table that would read as "no problems found".
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


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


def _get(obj: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        if isinstance(obj, Mapping) and name in obj:
            return obj[name]
        if hasattr(obj, name):
            return getattr(obj, name)
    return default


def _int_or_none(value: Any) -> int | None:
    try:
        return None if value is None or int(value) < 0 else int(value)
    except (TypeError, ValueError):
        return None


def _plain(value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item):
        try:
            return value.item()
        except (ValueError, TypeError):
            pass
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        return {k: _plain(getattr(value, k)) for k in value.__dataclass_fields__}
    return value


def flatten(analysis: Any) -> list[FindingRow]:
    """Rows from an analyser report (object with .findings, a dict, or a list of findings)."""
    findings = _get(analysis, "findings", default=analysis)
    rows = []
    for f in findings or []:
        severity = _get(f, "severity", default="info")
        severity = getattr(severity, "name", severity)
        score = _get(f, "score")
        evidence = _plain(_get(f, "evidence", default={}) or {})
        if not isinstance(evidence, dict):
            evidence = {"value": evidence}
        rows.append(FindingRow(
            detector=str(_get(f, "detector", "name", default="?")),
            severity=str(severity).lower(),
            score=None if score is None else float(score),
            message=str(_get(f, "message", "summary", default="")),
            request=_int_or_none(_get(f, "request")),
            layer=_int_or_none(_get(f, "layer")),
            t_ns=_int_or_none(_get(f, "t_ns", "time_ns")),
            evidence=evidence,
        ))
    return rows


def run_analysis(trace_path: str | os.PathLike[str]) -> tuple[list[FindingRow] | None, str]:
    """(rows, note). rows is None when the analyser is missing or failed; note says why."""
    try:
        from kvtrace.analyzer import analyze
    except ImportError as exc:
        return None, f"the analyser is not available in this installation ({exc})"
    try:
        analysis = analyze(str(trace_path))
    except Exception as exc:  # noqa: BLE001 - the report still shows the measurements
        return None, f"the analyser failed on this trace: {type(exc).__name__}: {exc}"
    return flatten(analysis), "findings of kvtrace.analyze"
