"""Compare two analyses (traces or saved JSON reports): per-request and per-layer deltas in KV
bytes, peak and retained memory, fragmentation, and findings that appeared, disappeared or
changed severity. For a transformers upgrade, a config change or a patch.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtrace.analyzer.base import severity_for
from kvtrace.analyzer.report import SCHEMA_NAME, SCHEMA_VERSION
from kvtrace.format.errors import InvalidTrace, NotATrace
from kvtrace.jsonable import read_json_document, refuse_schema

DIFF_SCHEMA_NAME = "kvtrace-analysis-diff"
DIFF_SCHEMA_VERSION = "1.0"

_REQ_FIELDS = (
    "final_tokens", "peak_kv_bytes", "final_kv_bytes", "peak_allocated_bytes", "retained_allocated_bytes",
    "kv_alive_after_request_bytes", "duration_ns",
)
_MEM_FIELDS = ("max_allocated_bytes", "max_reserved_bytes", "max_gap_bytes", "max_inactive_split_bytes")


def load_report(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A report dict from a trace (analysed now) or from `kvtrace analyze --json` output
    (its first report)."""
    p = Path(path)
    if p.is_file():
        with open(p, "rb") as fh:
            head = fh.read(8)
        if head.lstrip()[:1] == b"{":
            doc = read_json_document(p, "JSON report")
            if not isinstance(doc, dict) or doc.get("schema") != SCHEMA_NAME or not doc.get("reports"):
                raise NotATrace(f"{p}: JSON but not a kvtrace analysis report")
            major = str(doc.get("schema_version", "0")).split(".")[0]
            if major != SCHEMA_VERSION.split(".")[0]:
                refuse_schema(p, "analysis", doc.get("schema_version"), SCHEMA_VERSION)  # newer: exit 4
            _check_report(doc["reports"][0], p)
            return doc["reports"][0]
    from kvtrace.analyzer import analyze

    return analyze(p).to_dict()


def _number(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return abs(v) < 2**63 and (isinstance(v, int) or math.isfinite(v))  # NaN fails the comparison


def _report_problem(r: Any) -> str | None:
    """What a saved report lacks of what diff reads and prints (None when it has all of it): a file
    someone else wrote is checked like a trace, not trusted."""
    if not isinstance(r, dict):
        return "is not an object"
    for key, kind in (("trace", dict), ("model", dict), ("software", dict), ("devices", list), ("requests", list),
                      ("findings", list), ("detectors", list)):
        if not isinstance(r.get(key), kind):
            return f"{key} is not {'an object' if kind is dict else 'a list'}"
    if not isinstance(r["trace"].get("path"), str) or not all(isinstance(r["model"].get(k), str) for k in ("id", "type")):
        return "trace.path, model.id or model.type is not a string"
    for req in r["requests"]:
        if not isinstance(req, dict) or not isinstance(req.get("request"), int) or not all(
                _number(req.get(f)) for f in ("prompt_tokens", "new_tokens")) or not all(
                req.get(f) is None or _number(req.get(f)) for f in _REQ_FIELDS) or not isinstance(req.get("layers", []), list):
            return "a request's id, token counts or sizes are not numbers"
        for lay in req.get("layers", []):
            if not isinstance(lay, dict) or not isinstance(lay.get("layer"), int) or not all(
                    lay.get(f) is None or _number(lay.get(f)) for f in ("bytes_valid", "bytes_allocated", "tokens_kept")):
                return "a layer's number or sizes are not numbers"
    mem = r.get("memory", {})
    if not isinstance(mem, dict) or not all(str(k).lstrip("-").isdigit() and len(str(k)) < 12 and isinstance(v, dict)
                                            and all(v.get(f) is None or _number(v.get(f)) for f in _MEM_FIELDS)
                                            for k, v in mem.items()):
        return "memory is not sizes per device number"
    for f in r["findings"]:
        if not isinstance(f, dict) or not all(isinstance(f.get(k), str) for k in ("detector", "kind", "severity", "message")) \
                or not _number(f.get("score")) or not 0 <= f["score"] <= 1:
            return "a finding's detector, kind, severity, message or score (0-1) is not what the analyser writes"
    if not all(isinstance(d, dict) and isinstance(d.get("name"), str) and isinstance(d.get("status"), str)
               for d in r["detectors"]):
        return "a detector's name or status is not a string"
    return None


def _check_report(r: Any, path: Path) -> None:
    problem = _report_problem(r)
    if problem is not None:
        raise InvalidTrace(f"{path}: a kvtrace analysis report whose first report {problem} "
                           "(spec/analysis-json.md)")


def _delta(a: Any, b: Any) -> dict[str, Any]:
    d = b - a if isinstance(a, (int, float)) and isinstance(b, (int, float)) else None
    return {"a": a, "b": b, "delta": d}


@dataclass
class ReportDiff:
    a: dict[str, Any]
    b: dict[str, Any]
    requests: list[dict[str, Any]] = field(default_factory=list)
    layers: list[dict[str, Any]] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)
    appeared: list[dict[str, Any]] = field(default_factory=list)
    disappeared: list[dict[str, Any]] = field(default_factory=list)
    changed: list[dict[str, Any]] = field(default_factory=list)
    unchanged: int = 0
    not_compared: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": DIFF_SCHEMA_NAME,
            "schema_version": DIFF_SCHEMA_VERSION,
            "a": self.a,
            "b": self.b,
            "notes": self.notes,
            "requests": self.requests,
            "layers": self.layers,
            "memory": self.memory,
            "findings": {"appeared": self.appeared, "disappeared": self.disappeared,
                         "changed": self.changed, "unchanged": self.unchanged,
                         "not_compared": self.not_compared},
        }


def _ident(r: dict[str, Any]) -> dict[str, Any]:
    return {"trace": r["trace"]["path"], "model": r["model"], "devices": r["devices"], "software": r["software"]}


def _finding_key(f: dict[str, Any]) -> tuple[str, str]:
    return f["detector"], f["kind"]


def _worst_by_key(findings: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for f in findings:
        k = _finding_key(f)
        if k not in out or f["score"] > out[k]["score"]:
            out[k] = f
    return out


def diff_reports(a: dict[str, Any], b: dict[str, Any]) -> ReportDiff:
    d = ReportDiff(_ident(a), _ident(b))
    if a["model"]["type"] != b["model"]["type"]:
        d.notes.append(f"different model types: {a['model']['type']} vs {b['model']['type']}")
    ra = {r["request"]: r for r in a["requests"]}
    rb = {r["request"]: r for r in b["requests"]}
    only_a, only_b = sorted(set(ra) - set(rb)), sorted(set(rb) - set(ra))
    if only_a or only_b:
        d.notes.append(f"requests only in A: {only_a[:8]}, only in B: {only_b[:8]} (matched by request id)")
    for rid in sorted(set(ra) & set(rb)):
        x, y = ra[rid], rb[rid]
        entry = {"request": rid, **{f: _delta(x.get(f), y.get(f)) for f in _REQ_FIELDS}}
        if (x["prompt_tokens"], x["new_tokens"]) != (y["prompt_tokens"], y["new_tokens"]):
            entry["note"] = (f"different shape: {x['prompt_tokens']}+{x['new_tokens']} vs "
                             f"{y['prompt_tokens']}+{y['new_tokens']} tokens")
        d.requests.append(entry)
        la = {lay["layer"]: lay for lay in x.get("layers", [])}
        lb = {lay["layer"]: lay for lay in y.get("layers", [])}
        for layer in sorted(set(la) | set(lb)):
            p, q = la.get(layer, {}), lb.get(layer, {})
            d.layers.append({
                "request": rid, "layer": layer,
                "kind": {"a": p.get("kind"), "b": q.get("kind")},
                "bytes_valid": _delta(p.get("bytes_valid"), q.get("bytes_valid")),
                "bytes_allocated": _delta(p.get("bytes_allocated"), q.get("bytes_allocated")),
                "tokens_kept": _delta(p.get("tokens_kept"), q.get("tokens_kept")),
            })
    ma, mb = a.get("memory", {}), b.get("memory", {})
    for dev in sorted(set(ma) | set(mb)):
        p, q = ma.get(dev, {}), mb.get(dev, {})
        d.memory.append({"device": int(dev), **{f: _delta(p.get(f), q.get(f)) for f in _MEM_FIELDS}})
    fa, fb = _worst_by_key(a["findings"]), _worst_by_key(b["findings"])
    ran_a = {r["name"] for r in a["detectors"] if r["status"] == "ran"}
    ran_b = {r["name"] for r in b["detectors"] if r["status"] == "ran"}
    for k in sorted(set(fa) | set(fb)):
        x, y = fa.get(k), fb.get(k)
        if k[0] not in ran_a or k[0] not in ran_b:
            # A detector that could not run on one side (e.g. no allocator on a CPU trace) says
            # nothing about appearing or disappearing.
            side = "A" if k[0] not in ran_a else "B"
            d.not_compared.append({"detector": k[0], "kind": k[1], "reason": f"{k[0]} did not run on {side}"})
            continue
        if x is None:
            d.appeared.append(y)  # type: ignore[arg-type]
        elif y is None:
            d.disappeared.append(x)
        elif severity_for(x["score"]) != severity_for(y["score"]):
            d.changed.append({"detector": k[0], "kind": k[1], "a": {"score": x["score"], "severity": x["severity"]},
                              "b": {"score": y["score"], "severity": y["severity"]}, "message_b": y["message"]})
        else:
            d.unchanged += 1
    return d


def diff(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> ReportDiff:
    """Diff two traces or saved JSON reports (any mix)."""
    return diff_reports(load_report(a), load_report(b))
