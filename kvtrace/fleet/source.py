"""The one adapter between fleet code and kvtrace's read side.

Everything the fleet exports is read here, through the public entry points only: ``kvtrace.open``
(a :class:`kvtrace.format.Trace`, whose tables are read whole: the fleet exports every row) and
``kvtrace.analyze`` on that same open trace, with its stable JSON form (spec/analysis-json.md). It
returns plain numpy structured arrays and dicts, nothing that holds an open HDF5 file, so its
result can be built inside any worker process.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import kvtrace
from kvtrace.format import schema
from kvtrace.format.errors import TraceError

# Format tables the fleet exports (Parquet table name -> trace table). Payloads: the index only.
TABLES: dict[str, str] = {
    "requests": "requests",
    "layers": "layers",
    "steps": "steps",
    "kv": "kv",
    "events": "events",
    "readings": "readings",
    "retention": "retention",
    "nvml": "telemetry/nvml",
    "allocator": "telemetry/allocator",
    "process": "telemetry/process",
    "payloads": "payloads/index",
    "state": "state",  # format 1.5: hybrid models' conv/recurrent state (absent from older traces)
}

# How many bytes of each end of the file the identity hash reads (see file_identity).
IDENTITY_EDGE_BYTES = 1 << 20


@dataclass
class TraceData:
    """What one trace contributes to a fleet: /meta fields, raw tables, and the analysis."""

    path: str
    identity: dict[str, Any]
    meta: dict[str, Any]
    tables: dict[str, np.ndarray]
    event_text: list[str]
    analysis: dict[str, Any] | None  # one report of kvtrace.analyze's JSON document
    analysis_error: str = ""
    devices: list[dict[str, Any]] = field(default_factory=list)


def file_identity(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Size, mtime and a content hash of the file's first and last MiB (plus its size).

    Cheap on multi-GiB traces, and it changes whenever the file does: an append changes the size
    and the tail, a rewrite of a closed trace changes /status and the superblock at the head. The
    hash is also the trace id, so the same recording copied to two paths is one trace."""
    p = Path(path)
    st = p.stat()
    h = hashlib.sha256(str(st.st_size).encode())
    with open(p, "rb") as fh:
        h.update(fh.read(IDENTITY_EDGE_BYTES))
        if st.st_size > IDENTITY_EDGE_BYTES:
            fh.seek(max(IDENTITY_EDGE_BYTES, st.st_size - IDENTITY_EDGE_BYTES))
            h.update(fh.read(IDENTITY_EDGE_BYTES))
    digest = h.hexdigest()
    return {"path": str(p.resolve()), "size": int(st.st_size), "mtime_ns": int(st.st_mtime_ns),
            "sha256_edges": digest, "trace_id": digest[:16]}


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.rstrip(b"\0").decode("utf-8", errors="replace")
    return str(value)


def read_trace(path: str | os.PathLike[str], *, analyze: bool = True) -> TraceData:
    """Read everything the fleet tables need from one trace (raises kvtrace TraceError subclasses)."""
    identity = file_identity(path)
    with kvtrace.open(str(path)) as t:
        m = t.meta
        extra = {k: v for k, v in m.extra.items() if isinstance(v, (str, int, float, bool))}
        meta = {
            "format_version": t.version,
            "complete": bool(t.complete),
            "kvtrace_version": m.kvtrace_version,
            "torch_version": m.torch_version,
            "transformers_version": m.transformers_version,
            "cuda_version": m.cuda_version,
            "driver_version": m.driver_version,
            "python_version": m.python_version,
            "model_id": m.model_id,
            "model_type": m.model_type,
            "host": _text(extra.get("host_label", extra.get("hostname_sha256", ""))),
            "recorded_at_ns": int(m.clock_anchor_wall_ns),
            "contains_prompt_text": m.contains_prompt_text,
            "contains_tensor_payloads": m.contains_tensor_payloads,
            "payload_tokens": m.payload_tokens,
        }
        tables = {name: t[src][:] if t.has(src) else np.zeros(0, schema.TABLES[src][0])
                  for name, src in TABLES.items()}
        ev = tables["events"]
        event_text = [t.text(int(o), int(n)) for o, n in zip(ev["text_off"], ev["text_len"], strict=True)]
        devices = [{"device": int(d["device"]), "name": _text(d["name"]),
                    "total_memory_bytes": int(d["total_memory_bytes"])} for d in t.devices[:]]
        analysis, error = None, ""
        if analyze:
            # Damage the analyser reads (a TraceError) fails the trace as it fails analyze and report
            # (spec §9.1); an analyser bug keeps the tables and says so in analysis_error.
            try:
                analysis = kvtrace.analyze(t).to_dict()
            except TraceError:
                raise
            except Exception as exc:  # noqa: BLE001 - the tables read, the analysis did not
                if os.environ.get("KVTRACE_DEBUG"):
                    raise
                error = f"{type(exc).__name__}: {exc}"
    return TraceData(str(path), identity, meta, tables, event_text, analysis, error, devices)
