"""Check a trace against the spec and list every problem found (not just the first)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import h5py
import numpy as np

from kvtrace.format import schema
from kvtrace.format.errors import H5_READ_ERRORS, CorruptChunk, InvalidTrace, TraceError
from kvtrace.format.reader import Trace

TEXT_REFS = {
    "requests": [("prompt_text_off", "prompt_text_len"), ("gen_args_off", "gen_args_len"),
                 ("error_off", "error_len")],
    "layers": [("module_off", "module_len")],
    "events": [("text_off", "text_len")],
    "retention": [("referrers_off", "referrers_len")],
}
ENUM_FIELDS = {
    ("requests", "outcome"): schema.Outcome,
    ("layers", "layer_type"): schema.LayerType,
    ("kv", "layer_type"): schema.LayerType,
    ("kv", "k_dtype"): schema.CacheDType,
    ("kv", "v_dtype"): schema.CacheDType,
    ("steps", "phase"): schema.Phase,
    ("events", "kind"): schema.EventKind,
    ("readings", "label"): schema.ReadingLabel,
    ("payloads/index", "kind"): schema.PayloadKind,
    ("payloads/index", "dtype"): schema.CacheDType,
}


@dataclass
class ValidationReport:
    path: str
    version: str = ""
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.problems


def validate(path: str | os.PathLike[str], *, check_payloads: bool = True) -> ValidationReport:
    """Raises NotATrace / UnsupportedVersion for files that cannot be read as traces at all."""
    report = ValidationReport(str(path))
    with Trace(path) as trace:
        report.version = trace.version
        checks = [_check_meta, _check_tables, _check_status]
        present: set[str] = set()
        for check in checks:
            try:
                result = check(trace, report)
            except (TraceError, *H5_READ_ERRORS) as exc:
                report.problems.append(f"unreadable structure in {check.__name__[7:]} ({exc})")
                continue
            if check is _check_tables:
                present = result
        if present:
            _guard(_check_rows, trace, report, present)
        if check_payloads and "payloads/index" in present:
            _guard(_check_payloads, trace, report)
    return report


def _guard(check, trace: Trace, report: ValidationReport, *args) -> None:
    try:
        check(trace, report, *args)
    except (TraceError, *H5_READ_ERRORS) as exc:
        report.problems.append(f"unreadable structure in {check.__name__[7:]} ({exc})")


def _check_meta(trace: Trace, report: ValidationReport) -> None:
    try:
        meta = trace.meta
    except InvalidTrace as exc:
        report.problems.append(str(exc).split(": ", 1)[-1])
        return
    except H5_READ_ERRORS as exc:
        report.problems.append(f"/meta unreadable ({exc})")
        return
    if meta.payload_tokens not in schema.PAYLOAD_TOKENS and trace.minor >= schema.FORMAT_MINOR:
        report.problems.append(f"/meta payload_tokens {meta.payload_tokens!r} is not one of "
                               f"{', '.join(schema.PAYLOAD_TOKENS)}")


def _check_tables(trace: Trace, report: ValidationReport) -> set[str]:
    present: set[str] = set()
    for name, (dtype, required) in schema.TABLES.items():
        try:
            obj = trace._file.get(name)
        except H5_READ_ERRORS as exc:
            report.problems.append(f"/{name} unreadable ({exc})")
            continue
        if obj is None:
            if required:
                report.problems.append(f"missing required dataset /{name}")
            continue
        if not isinstance(obj, h5py.Dataset) or obj.ndim != 1 or obj.dtype.names is None:
            report.problems.append(f"/{name} is not a 1-D table")
            continue
        bad = [
            n for n in dtype.names
            if n not in obj.dtype.names or obj.dtype[n] != dtype[n]
        ]
        if bad and trace.minor >= schema.FORMAT_MINOR:
            report.problems.append(f"/{name} lacks or mistypes fields: {', '.join(bad)}")
            continue
        present.add(name)
    text = trace._file.get("text")
    if not isinstance(text, h5py.Dataset) or text.dtype != np.uint8 or text.ndim != 1:
        report.problems.append("missing or mistyped dataset /text (1-D uint8)")
    for itemsize in schema.PAYLOAD_ITEMSIZES:
        name = schema.payload_dataset_name(itemsize)
        ds = trace._file.get(name)
        if not isinstance(ds, h5py.Dataset):
            report.problems.append(f"missing payload dataset /{name}")
            continue
        chunk = schema.payload_chunk_elements(itemsize)
        if ds.dtype != schema.payload_carrier(itemsize) or ds.chunks != (chunk,):
            report.problems.append(f"/{name} must be {schema.payload_carrier(itemsize)} chunked ({chunk},)")
        try:
            filters = trace.payload_filters(itemsize)
        except (InvalidTrace, OSError) as exc:
            report.problems.append(f"/{name} filter pipeline unreadable ({exc})")
            continue
        if filters != [schema.FILTER_SHUFFLE, schema.FILTER_ZSTD]:
            report.problems.append(f"/{name} filter pipeline {filters} is not [2, 32015]")
    return present


def _check_status(trace: Trace, report: ValidationReport) -> None:
    try:
        status = trace.status
    except (OSError, ValueError, KeyError) as exc:
        report.problems.append(f"/status unreadable ({exc})")
        return
    if status is None:
        report.problems.append("missing required dataset /status")
    elif not trace.complete:
        report.warnings.append(
            "writer did not close the trace (killed, crashed, or still recording): "
            "it holds everything up to its last flush"
        )


def _read(trace: Trace, name: str, report: ValidationReport) -> np.ndarray | None:
    try:
        return trace.table(name)
    except (OSError, ValueError, KeyError, TraceError) as exc:
        report.problems.append(f"/{name} rows unreadable ({exc})")
        return None


def _check_rows(trace: Trace, report: ValidationReport, present: set[str]) -> None:
    tables = {name: _read(trace, name, report) for name in present}
    text_len = trace._file["text"].shape[0] if "text" in trace._file else 0
    for (table, column), enum_type in ENUM_FIELDS.items():
        rows = tables.get(table)
        if rows is None or rows.size == 0:
            continue
        allowed = np.array([int(v) for v in enum_type])
        bad = np.unique(rows[column][~np.isin(rows[column], allowed)])
        if bad.size:
            report.problems.append(f"/{table} {column} has unknown codes {bad.tolist()[:8]}")
    for table, refs in TEXT_REFS.items():
        rows = tables.get(table)
        if rows is None or rows.size == 0:
            continue
        for off, length in refs:
            end = rows[off].astype(np.uint64) + rows[length].astype(np.uint64)
            if np.any(end > text_len):
                report.problems.append(f"/{table} {off} points past the end of /text")
    requests = tables.get("requests")
    if requests is not None:
        ids = requests["request"]
        if np.unique(ids).size != ids.size:
            report.problems.append("/requests has duplicate request ids")
        running = int(np.sum(requests["outcome"] == schema.Outcome.RUNNING))
        if running and trace.complete:
            report.problems.append(f"{running} request(s) still RUNNING in a closed trace")
        elif running:
            report.warnings.append(f"{running} request(s) were in progress when the writer stopped")
        for table in ("kv", "steps", "payloads/index"):
            rows = tables.get(table)
            if rows is not None and rows.size:
                orphans = np.setdiff1d(np.unique(rows["request"]), ids)
                if orphans.size:
                    report.problems.append(f"/{table} names requests absent from /requests: {orphans.tolist()[:8]}")
    kv = tables.get("kv")
    if kv is not None and kv.size:
        if np.any(kv["tokens_kept"] > kv["tokens_seen"]):
            report.problems.append("/kv has rows keeping more tokens than seen")
        if np.any(kv["bytes_valid"] > kv["bytes_allocated"]):
            report.problems.append("/kv has rows with more valid than allocated bytes")
    for table in ("telemetry/nvml", "telemetry/allocator", "telemetry/process"):
        rows = tables.get(table)
        if rows is not None and rows.size > 1 and np.any(np.diff(rows["t_ns"].astype(np.int64)) < 0):
            report.warnings.append(f"/{table} timestamps go backwards (multi-device interleave?)")


def _check_payloads(trace: Trace, report: ValidationReport) -> None:
    try:
        index = trace.payload_index()
    except (OSError, TraceError) as exc:
        report.problems.append(f"/payloads/index unreadable ({exc})")
        return
    for i in range(index.shape[0]):
        try:
            trace.payload(index[i])
        except CorruptChunk as exc:
            report.problems.append(f"payload {i}: {str(exc).split(': ', 1)[-1]}")
        except (TraceError, *H5_READ_ERRORS) as exc:
            report.problems.append(f"payload {i}: {str(exc).split(': ', 1)[-1]}")
