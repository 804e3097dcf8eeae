"""AnalysisReport: what `analyze` returns, and its stable JSON form (spec/analysis-json.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtrace._version import __version__
from kvtrace.analyzer.base import DetectorResult, Finding, Severity, severity_for
from kvtrace.analyzer.replay import ReplayContext, RequestTimeline
from kvtrace.format import schema

SCHEMA_NAME = "kvtrace-analysis"
SCHEMA_VERSION = "1.1"  # 1.1: the "contents" section (kvtrace analyze --gpu / --contents)


@dataclass
class AnalysisReport:
    trace: dict[str, Any]
    model: dict[str, Any]
    devices: list[dict[str, Any]]
    software: dict[str, Any]
    expectation: dict[str, Any]
    requests: list[dict[str, Any]]
    results: list[DetectorResult]
    memory: dict[str, Any] = field(default_factory=dict)
    # Content analyses of sampled tensors (kvtrace.analyzer.contents), None when not asked for.
    contents: dict[str, Any] | None = None
    # The recorder's NOTE events, grouped (kvtrace.analyzer.notes), and distinct texts left off.
    notes: list[dict[str, Any]] = field(default_factory=list)
    notes_unlisted: int = 0

    @property
    def findings(self) -> list[Finding]:
        """Every finding, highest score first."""
        out = [f for r in self.results for f in r.findings]
        return sorted(out, key=lambda f: (-f.score, f.detector))

    @property
    def max_score(self) -> float:
        return max((f.score for f in self.findings), default=0.0)

    @property
    def max_severity(self) -> Severity | None:
        return severity_for(self.max_score) if self.findings else None

    def reaches(self, threshold: Severity) -> bool:
        """Whether any finding is at or above `threshold` (for --fail-on)."""
        return any(f.severity >= threshold for f in self.findings)

    def result(self, name: str) -> DetectorResult:
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(name)

    def score(self, name: str) -> float:
        """Highest score of one detector (0 when it found nothing or did not run)."""
        return self.result(name).score

    def to_dict(self) -> dict[str, Any]:
        sev = self.max_severity
        out = {
            "trace": self.trace,
            "model": self.model,
            "devices": self.devices,
            "software": self.software,
            "expectation": self.expectation,
            "summary": {
                "requests": len(self.requests),
                "findings": len(self.findings),
                "max_score": round(self.max_score, 4),
                "max_severity": sev.label if sev is not None else None,
                "detectors_ran": sum(r.status == "ran" for r in self.results),
                "detectors_skipped": sum(r.status == "skipped" for r in self.results),
                "detectors_failed": sum(r.status == "error" for r in self.results),
            },
            "requests": self.requests,
            "memory": self.memory,
            "detectors": [r.to_dict() for r in self.results],
            "findings": [f.to_dict() for f in self.findings],
        }
        if self.contents is not None:  # only when asked for (--gpu / --contents): 1.0 readers see 1.0
            out["contents"] = self.contents
        if self.notes or self.notes_unlisted:  # only where the trace has notes (1.1 minor addition)
            out["notes"] = self.notes
            if self.notes_unlisted:
                out["notes_unlisted"] = self.notes_unlisted
        return out


def document(reports: list[AnalysisReport]) -> dict[str, Any]:
    """The top-level JSON document for one or more traces."""
    return {
        "schema": SCHEMA_NAME,
        "schema_version": SCHEMA_VERSION,
        "generator": {"name": "kvtrace", "version": __version__},
        "units": {"bytes": "bytes", "time": "ns"},
        "reports": [r.to_dict() for r in reports],
    }


def request_summary(ctx: ReplayContext, req: RequestTimeline) -> dict[str, Any]:
    R = schema.ReadingLabel
    base, peak = req.reading(R.BASELINE), req.reading(R.PEAK)
    after = next((req.reading(x) for x in (R.AFTER_EMPTY_CACHE, R.AFTER_GC, R.AFTER_RETURN)
                  if req.reading(x) is not None), None)

    def alloc(row: Any) -> int | None:
        return int(row["allocated_bytes"]) if row is not None and int(row["allocated_bytes"]) >= 0 else None

    retained = None
    if alloc(base) is not None and alloc(after) is not None:
        retained = max(alloc(after) - alloc(base), 0)  # type: ignore[operator]
    layers: list[dict[str, Any]] = []
    g = req.kv
    if not g.empty:
        row = g.last_row()
        for li, layer in enumerate(g.layers):
            if not g.present[row, li]:
                continue
            geom = ctx.expectation.get(int(layer))
            try:
                recorded = schema.LayerType(int(g["layer_type"][row, li])).name.lower()
            except ValueError:
                recorded = "unknown"
            layers.append({
                "layer": int(layer),
                "kind": geom.kind if geom is not None and recorded != "cross_attention" else recorded,
                "recorded_type": recorded,
                "tokens_kept": int(g["tokens_kept"][row, li]),
                "bytes_valid": int(g["bytes_valid"][row, li]),
                "bytes_allocated": int(g["bytes_allocated"][row, li]),
            })
    s = req.steps
    out = {
        "request": req.request,
        "outcome": req.outcome.name.lower(),
        "batch_size": req.batch_size,
        "prompt_tokens": req.prompt_tokens,
        "new_tokens": req.new_tokens,
        "eos_step": req.eos_step if req.eos_step >= 0 else None,
        "start_ns": req.start_ns,
        "duration_ns": (req.end_ns - req.start_ns) if req.end_ns else None,
        "steps": int(s.size),
        "final_tokens": req.final_tokens,
        "peak_kv_bytes": req.peak_kv_unique,
        "peak_kv_naive_bytes": int(s["kv_bytes_naive"].max()) if s.size else None,
        "final_kv_bytes": int(s["kv_bytes_unique"][-1]) if s.size else None,
        "baseline_allocated_bytes": alloc(base),
        "peak_allocated_bytes": alloc(peak),
        "retained_allocated_bytes": retained,
        "kv_alive_after_request_bytes": int(_unique_retained(req)),
        "layers": layers,
    }
    if req.state_bytes:  # hybrid models only (format 1.5 /state): other documents keep their keys
        out["state_bytes"] = req.state_bytes
        out["state_layers"] = len(req.state_layers)
    return out


def _unique_retained(req: RequestTimeline) -> int:
    rows = req.retention
    if rows.size == 0:
        return 0
    keys = np.unique(np.stack([rows["device"].astype(np.int64), rows["storage"].astype(np.int64)], axis=1),
                     axis=0, return_index=True)[1]
    return int(rows["nbytes"][keys].sum())


def memory_summary(ctx: ReplayContext) -> dict[str, Any]:
    """Per-device allocator extremes over the whole trace (for diff and the terminal header)."""
    out: dict[str, Any] = {}
    a = ctx.allocator
    for dev in sorted({int(d) for d in a["device"]}) if a.size else []:
        rows = a[(a["device"] == dev) & (a["allocated_bytes"] >= 0)]
        if rows.size == 0:
            continue
        gap = np.maximum(rows["reserved_bytes"] - rows["allocated_bytes"], 0)
        out[str(dev)] = {
            "max_allocated_bytes": int(rows["allocated_bytes"].max()),
            "max_reserved_bytes": int(rows["reserved_bytes"].max()),
            "max_gap_bytes": int(gap.max()),
            "max_inactive_split_bytes": int(np.maximum(rows["inactive_split_bytes"], 0).max()),
            "samples": int(rows.size),
        }
    return out
