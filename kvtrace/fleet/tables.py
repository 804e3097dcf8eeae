"""One trace (a :class:`~kvtrace.fleet.source.TraceData`) as Arrow tables, each row keyed by trace_id.

Enumerated codes become their lower-case names (unknown codes their number as text), fixed-size
byte strings become UTF-8 text, shapes become lists, and text-heap references are dropped (event
text is resolved; prompts never leave the trace). spec/fleet.md is the schema these functions
implement; change both together.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa

from kvtrace.fleet.source import TABLES, TraceData
from kvtrace.format import frames, schema

# 1.1: per-trace aggregates in `traces` (the summary reads that one table). A directory written
# under another version is exported again in full (export.plan).
FLEET_SCHEMA_VERSION = "1.1"


def schema_key(version: str) -> tuple[int, ...] | None:
    """A fleet schema version as numbers ("1.1" -> (1, 1)); None when it is not one."""
    try:
        return tuple(int(x) for x in version.split(".")) if isinstance(version, str) and version else None
    except ValueError:
        return None


def newer_major(version: str | None) -> bool:
    """Whether a directory's fleet schema has a major version above this kvtrace's: its tables may
    mean something else, so it is neither read nor re-exported over (exit 4, "upgrade kvtrace")."""
    key = schema_key(version) if version is not None else None
    return key is not None and key[0] > int(FLEET_SCHEMA_VERSION.split(".")[0])

SEVERITY_RANK = {"info": 0, "low": 1, "medium": 2, "high": 3, "critical": 4}

# Per-request numbers the analyser derives (spec/analysis-json.md "requests"), joined onto requests.
REQUEST_ANALYSIS = ("duration_ns", "final_tokens", "peak_kv_bytes", "final_kv_bytes", "baseline_allocated_bytes",
                    "peak_allocated_bytes", "retained_allocated_bytes", "kv_alive_after_request_bytes",
                    "state_bytes")  # the last: hybrid models' conv/recurrent state (null otherwise)

TELEMETRY_SCHEMA = pa.schema([
    ("trace_id", pa.string()), ("source", pa.string()), ("t_ns", pa.uint64()), ("device", pa.int16()),
    ("nvml_used_bytes", pa.int64()), ("nvml_free_bytes", pa.int64()), ("nvml_reserved_bytes", pa.int64()),
    ("nvml_total_bytes", pa.int64()), ("nvml_process_used_bytes", pa.int64()),
    ("allocated_bytes", pa.int64()), ("reserved_bytes", pa.int64()), ("active_bytes", pa.int64()),
    ("inactive_split_bytes", pa.int64()), ("num_alloc_retries", pa.int64()), ("num_ooms", pa.int64()),
    ("rss_bytes", pa.int64()),
])

FINDINGS_SCHEMA = pa.schema([
    ("trace_id", pa.string()), ("detector", pa.string()), ("kind", pa.string()), ("score", pa.float64()),
    ("severity", pa.string()), ("severity_rank", pa.int8()), ("message", pa.string()),
    ("requests", pa.list_(pa.int64())), ("steps", pa.list_(pa.int64())), ("layers", pa.list_(pa.int64())),
    ("device", pa.int64()), ("evidence_json", pa.string()),
])

TRACES_SCHEMA = pa.schema([
    ("trace_id", pa.string()), ("path", pa.string()), ("file_bytes", pa.int64()), ("mtime_ns", pa.int64()),
    ("sha256_edges", pa.string()), ("format_version", pa.string()), ("complete", pa.bool_()),
    ("kvtrace_version", pa.string()), ("torch_version", pa.string()), ("transformers_version", pa.string()),
    ("cuda_version", pa.string()), ("driver_version", pa.string()), ("python_version", pa.string()),
    ("model_id", pa.string()), ("model_type", pa.string()), ("host", pa.string()),
    ("device", pa.string()), ("device_count", pa.int32()), ("device_total_memory_bytes", pa.int64()),
    ("recorded_at_ns", pa.int64()), ("contains_prompt_text", pa.bool_()),
    ("contains_tensor_payloads", pa.bool_()), ("payload_tokens", pa.string()),
    ("requests", pa.int64()), ("steps", pa.int64()), ("kv_rows", pa.int64()), ("payloads", pa.int64()),
    ("analysed", pa.bool_()), ("analysis_error", pa.string()), ("findings", pa.int64()),
    ("max_severity", pa.string()), ("max_score", pa.float64()),
    # Per-trace aggregates of the other tables, so the default summary reads only `traces`.
    ("max_severity_rank", pa.int8()), ("findings_low", pa.int64()), ("tokens", pa.int64()),
    ("retained_allocated_bytes", pa.int64()), ("max_peak_allocated_bytes", pa.int64()),
    ("kv_bytes_valid", pa.int64()), ("kv_tokens", pa.int64()),
    ("findings_by", pa.list_(pa.struct([("detector", pa.string()), ("severity", pa.string()),
                                        ("severity_rank", pa.int8()), ("findings", pa.int64())]))),
    ("kv_layer_types", pa.list_(pa.struct([("layer_type", pa.string()), ("min_bytes_per_token", pa.float64()),
                                           ("max_bytes_per_token", pa.float64())]))),
])

# The one file holding the traces table (the other tables: one file per trace in DIR/<table>/).
TRACES_FILE = "traces.parquet"
MANIFEST = "_manifest.json"  # which input became which trace id; its fleet_schema_version

# Every table of the fleet directory, in the order views are created.
TABLE_NAMES: tuple[str, ...] = ("traces", "requests", "layers", "steps", "kv", "state", "events", "readings",
                                "retention", "telemetry", "payloads", "findings")


def structured(name: str, rows: np.ndarray, trace_id: str, drop: tuple[str, ...] = ()) -> pa.Table:
    """A format table as Arrow: trace_id first, enums as names, text references dropped
    (kvtrace.format.frames: the columns Trace.to_pandas / to_arrow give for one trace)."""
    cols: dict[str, pa.Array] = {"trace_id": pa.array([trace_id] * len(rows), pa.string())}
    cols.update(frames.arrow_columns(TABLES.get(name, name), rows, drop))
    return pa.table(cols)


def _requests(data: TraceData, trace_id: str) -> pa.Table:
    table = structured("requests", data.tables["requests"], trace_id)
    by_request = {int(r["request"]): r for r in (data.analysis or {}).get("requests", [])}
    for key in REQUEST_ANALYSIS:
        values = [by_request.get(int(r), {}).get(key) for r in data.tables["requests"]["request"]]
        table = table.append_column(key, pa.array(values, pa.int64()))
    return table


def _kv(data: TraceData, trace_id: str) -> pa.Table:
    rows = data.tables["kv"]
    table = structured("kv", rows, trace_id)
    return table.append_column("bytes_per_token", pa.array(frames.kv_bytes_per_token(rows), pa.float64(),
                                                           from_pandas=True))


def _events(data: TraceData, trace_id: str) -> pa.Table:
    table = structured("events", data.tables["events"], trace_id)
    return table.append_column("text", pa.array(data.event_text, pa.string()))


def _telemetry(data: TraceData, trace_id: str) -> pa.Table:
    parts = []
    renames = {"nvml": {"used_bytes": "nvml_used_bytes", "free_bytes": "nvml_free_bytes",
                        "reserved_bytes": "nvml_reserved_bytes", "total_bytes": "nvml_total_bytes",
                        "process_used_bytes": "nvml_process_used_bytes"}}
    for source in ("nvml", "allocator", "process"):
        rows = data.tables[source]
        names = renames.get(source, {})
        cols = {"trace_id": [trace_id] * len(rows), "source": [source] * len(rows)}
        for field in rows.dtype.names or ():
            cols[names.get(field, field)] = rows[field]
        arrays = [pa.array(cols[f.name], f.type) if f.name in cols else pa.nulls(len(rows), f.type)
                  for f in TELEMETRY_SCHEMA]
        parts.append(pa.Table.from_arrays(arrays, schema=TELEMETRY_SCHEMA))
    return pa.concat_tables(parts)


def _findings(data: TraceData, trace_id: str) -> pa.Table:
    found = (data.analysis or {}).get("findings", [])
    rows = [{"trace_id": trace_id, "detector": f["detector"], "kind": f["kind"], "score": f["score"],
             "severity": f["severity"], "severity_rank": SEVERITY_RANK.get(f["severity"], -1),
             "message": f["message"], "requests": f["requests"], "steps": f["steps"], "layers": f["layers"],
             "device": f["device"], "evidence_json": json.dumps(f["evidence"], sort_keys=True)} for f in found]
    return pa.Table.from_pylist(rows, schema=FINDINGS_SCHEMA)


def _aggregates(requests: pa.Table, kv: pa.Table, findings: pa.Table) -> dict[str, Any]:
    """The `traces` columns that summarise the trace's other tables (spec/fleet.md)."""
    req = {c: requests.column(c).to_numpy(zero_copy_only=False) for c in
           ("batch_size", "prompt_tokens", "new_tokens")}
    tokens = int((req["batch_size"].astype(np.int64) * (req["prompt_tokens"].astype(np.int64)
                                                          + req["new_tokens"])).sum())
    retained = [v for v in requests.column("retained_allocated_bytes").to_pylist() if v is not None]
    peaks = [v for v in requests.column("peak_allocated_bytes").to_pylist() if v is not None]
    by: dict[tuple[str, str, int], int] = {}
    ranks = findings.column("severity_rank").to_pylist()
    for det, sev, rank in zip(findings.column("detector").to_pylist(), findings.column("severity").to_pylist(),
                              ranks, strict=True):
        by[(det, sev, rank)] = by.get((det, sev, rank), 0) + 1
    layer_types: dict[str, list[float]] = {}
    for lt, v in zip(kv.column("layer_type").to_pylist(), kv.column("bytes_per_token").to_pylist(), strict=True):
        if v is not None and v == v:  # NaN: no kept tokens
            layer_types.setdefault(lt, []).append(v)
    kv_tokens = 0
    if kv.num_rows:
        batch = np.array([s[0] if s else 1 for s in kv.column("k_shape").to_pylist()], np.int64)
        kv_tokens = int((kv.column("tokens_kept").to_numpy().astype(np.int64) * np.maximum(batch, 1)).sum())
    return {
        "max_severity_rank": max(ranks, default=None), "findings_low": sum(1 for r in ranks if r >= 1),
        "tokens": tokens, "retained_allocated_bytes": sum(retained) if retained else None,
        "max_peak_allocated_bytes": max(peaks, default=None),
        "kv_bytes_valid": int(kv.column("bytes_valid").to_numpy().astype(np.int64).sum()) if kv.num_rows else None,
        "kv_tokens": kv_tokens if kv.num_rows else None,
        "findings_by": [{"detector": d, "severity": s, "severity_rank": r, "findings": n}
                        for (d, s, r), n in sorted(by.items(), key=lambda kv_: (-kv_[0][2], kv_[0][0]))],
        "kv_layer_types": [{"layer_type": lt, "min_bytes_per_token": min(v), "max_bytes_per_token": max(v)}
                           for lt, v in sorted(layer_types.items())],
    }


def _traces(data: TraceData, trace_id: str, aggregates: dict[str, Any]) -> pa.Table:
    ident, a = data.identity, data.analysis
    gpus = [d for d in data.devices if d["device"] >= 0] or data.devices
    summary = a["summary"] if a else {}
    row: dict[str, Any] = {
        **data.meta, "trace_id": trace_id, "path": ident["path"], "file_bytes": ident["size"],
        "mtime_ns": ident["mtime_ns"], "sha256_edges": ident["sha256_edges"],
        "device": gpus[0]["name"] if gpus else "", "device_count": len(gpus),
        "device_total_memory_bytes": gpus[0]["total_memory_bytes"] if gpus else None,
        "requests": len(data.tables["requests"]), "steps": len(data.tables["steps"]),
        "kv_rows": len(data.tables["kv"]), "payloads": len(data.tables["payloads"]),
        "analysed": a is not None, "analysis_error": data.analysis_error,
        "findings": summary.get("findings"), "max_severity": summary.get("max_severity"),
        "max_score": summary.get("max_score"), **aggregates,
    }
    return pa.Table.from_pylist([row], schema=TRACES_SCHEMA)


def trace_tables(data: TraceData) -> dict[str, pa.Table]:
    """Every fleet table for one trace (tables may have zero rows)."""
    tid = data.identity["trace_id"]
    out = {"requests": _requests(data, tid), "kv": _kv(data, tid),
           "events": _events(data, tid), "telemetry": _telemetry(data, tid), "findings": _findings(data, tid)}
    for name in ("layers", "steps", "readings", "retention", "payloads", "state"):
        out[name] = structured(name, data.tables[name], tid)
    # last: export_one writes in this order, and a trace counts as exported once its traces file exists
    out["traces"] = _traces(data, tid, _aggregates(out["requests"], out["kv"], out["findings"]))
    return out


def empty_schema(name: str) -> pa.Schema:
    """The Arrow schema of a fleet table, from an empty trace (for views over no files)."""
    empty = {src: np.zeros(0, schema.TABLES[path][0]) for src, path in TABLES.items()}
    data = TraceData("", {"trace_id": "", "path": "", "size": 0, "mtime_ns": 0, "sha256_edges": ""},
                     {}, empty, [], None)
    if name == "traces":
        return TRACES_SCHEMA
    return trace_tables(data)[name].schema
