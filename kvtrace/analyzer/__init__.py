"""The offline analyser: replay a trace through the detectors and report findings.

Imports numpy, h5py and kvtrace.format/geometry only; never torch (it runs where torch is absent).

    report = kvtrace.analyze("run.kvt.h5")
    for f in report.findings:
        print(f.severity.label, f.detector, f.message)
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from kvtrace.analyzer.base import (
    REGISTRY,
    SEVERITY_NAMES,
    Detector,
    DetectorResult,
    Evidence,
    Finding,
    Severity,
    detector_names,
    get_detectors,
    register,
    severity_for,
)
from kvtrace.analyzer.notes import trace_notes
from kvtrace.analyzer.replay import ReplayContext
from kvtrace.analyzer.report import SCHEMA_VERSION, AnalysisReport, document, memory_summary, request_summary
from kvtrace.format.errors import TraceError
from kvtrace.format.reader import Trace
from kvtrace.labels import device_where

__all__ = [
    "REGISTRY",
    "SCHEMA_VERSION",
    "SEVERITY_NAMES",
    "AnalysisReport",
    "Detector",
    "DetectorResult",
    "Evidence",
    "Finding",
    "ReplayContext",
    "Severity",
    "analyze",
    "detector_names",
    "document",
    "get_detectors",
    "register",
    "severity_for",
]


def analyze(
    trace: Trace | str | os.PathLike[str], detectors: Iterable[str] | None = None
) -> AnalysisReport:
    """Run the detectors (all, or those named) on a trace given as a path, an open Trace (the one a
    renderer already holds: then the file is not read twice).

    Raises kvtrace.format.TraceError subclasses for files that are not readable traces, and when a
    detector reads a part of the trace that breaks the spec (a damaged /sched, say: the trace is
    refused, not the detector); ValueError for unknown detector names. A detector that fails
    otherwise is reported with status "error" (set KVTRACE_DEBUG=1 to get the exception instead).
    """
    chosen = get_detectors(detectors)
    if isinstance(trace, Trace):
        return _analyze_open(trace, chosen)
    with Trace(trace) as t:
        return _analyze_open(t, chosen)


def _analyze_open(trace: Trace, chosen: list[Detector]) -> AnalysisReport:
    ctx = ReplayContext(trace)
    results: list[DetectorResult] = []
    for det in chosen:
        reason = det.skip_reason(ctx)
        if reason:
            results.append(DetectorResult(det.name, "skipped", reason))
            continue
        try:
            findings = det.run(ctx)
        except TraceError:  # the trace breaks the spec where it read: the trace is refused, not the detector
            raise
        except Exception as exc:  # noqa: BLE001 - one broken detector must not hide the others
            if os.environ.get("KVTRACE_DEBUG"):
                raise
            results.append(DetectorResult(det.name, "error", f"{type(exc).__name__}: {exc}"))
            continue
        results.append(DetectorResult(det.name, "ran", "", findings))
    meta = ctx.meta
    path = Path(trace.path)
    notes, notes_unlisted = trace_notes(trace)
    return AnalysisReport(
        trace={
            "path": str(path),
            "name": path.name,
            "format_version": trace.version,
            "complete": trace.complete,
            "file_bytes": path.stat().st_size if path.exists() else None,
        },
        model={"id": meta.model_id, "type": meta.model_type},
        devices=[{**d, "label": device_where(d["index"])} for d in ctx.devices],
        software={
            "kvtrace_recorder": meta.kvtrace_version, "torch": meta.torch_version,
            "transformers": meta.transformers_version, "cuda": meta.cuda_version,
            "driver": meta.driver_version, "python": meta.python_version,
        },
        expectation={"source": ctx.expectation.source, "notes": list(ctx.expectation.notes)},
        requests=[request_summary(ctx, r) for r in ctx.requests],
        results=results,
        memory=memory_summary(ctx),
        notes=notes,
        notes_unlisted=notes_unlisted,
    )
