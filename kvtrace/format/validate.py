"""Check a trace against the spec and list every problem found (not just the first).

Validation works in bounded memory whatever the file declares: tables are read in blocks of rows,
payload chunks are decoded one at a time and dropped, and anything over the reader's decode limit
is reported instead of read (spec §9).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import h5py
import numpy as np

from kvtrace.format import schema
from kvtrace.format.codec import check_chunk
from kvtrace.format.errors import H5_READ_ERRORS, CorruptChunk, TraceError
from kvtrace.format.owner_rules import owner_block_problems
from kvtrace.format.reader import MAX_TEXT_BYTES, Trace
from kvtrace.format.serving_rules import cb_request_problems, serving_problems
from kvtrace.format.state_rules import state_block_problems
from kvtrace.format.trace_rules import (
    ENUM_COLUMNS,
    INDEX_BLOCK,
    MAX_LISTED,
    IndexScan,
    counter_problems,
    structure_problems,
    unknown_codes,
    unknown_mask,
)

TEXT_REFS = schema.TEXT_REFS  # (offset, length) column pairs into /text, per table
ROW_BLOCK = 1 << 16  # rows per read: a few MiB for the widest table


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
    with Trace(path, check=False) as trace:
        report = validate_open(trace, check_payloads=check_payloads)
    report.path = str(path)  # as the caller spelt it
    return report


def validate_open(trace: Trace, *, check_payloads: bool = True) -> ValidationReport:
    """:func:`validate` of a trace the caller already holds open (one open per command)."""
    report = ValidationReport(str(trace.path))
    report.version = trace.version
    problems, present = structure_problems(trace)
    report.problems.extend(problems)
    if "payloads/index" in present and not problems:
        _guard(_check_skipped_payloads, trace, report)
    _guard(_check_status, trace, report)
    if present:
        _guard(_check_rows, trace, report, present)
        _guard(_check_serving, trace, report, present)
    _guard(_check_privacy, trace, report)
    if "layers" in present and not problems:
        _guard(_check_config, trace, report)
    if check_payloads and "payloads/index" in present:
        _guard(_check_payloads, trace, report)
    return report


def _guard(check: Callable[..., None], trace: Trace, report: ValidationReport, *args: object) -> None:
    try:
        check(trace, report, *args)
    except (TraceError, *H5_READ_ERRORS) as exc:
        report.problems.append(f"unreadable structure in {check.__name__[7:]} ({_short(exc)})")


def _short(exc: BaseException) -> str:
    """The message without the leading path (the CLI prefixes every line with it)."""
    return str(exc).split(": ", 1)[-1] if isinstance(exc, TraceError) else str(exc)


def _check_skipped_payloads(trace: Trace, report: ValidationReport) -> None:
    """Payload index rows of codes a newer minor added (kind, dtype): skipped by this kvtrace."""
    skipped = int(np.count_nonzero(trace.index_scan.skipped))
    if skipped:
        report.warnings.append(f"/payloads/index has {skipped:,} row(s) of kinds or dtypes added after format "
                               f"{schema.FORMAT_VERSION} (written by format {trace.version}): this kvtrace skips them")


def _check_status(trace: Trace, report: ValidationReport) -> None:
    if "status" not in trace._file:
        return  # structure_problems reported it
    if not trace.complete:
        from kvtrace.format.summary import stopped  # /stop, spec §8.1

        stop = stopped(trace)
        report.warnings.append(
            f"incomplete: the writer stopped early after a storage failure ({stop['reason']}): "
            "it holds everything up to its last flush" if stop else
            "writer did not close the trace (killed, crashed, or still recording): "
            "it holds everything up to its last flush"
        )


def _blocks(trace: Trace, name: str) -> Iterator[np.ndarray]:
    """A table in blocks of rows. The whole table must fit the decode limit (a table that declares
    more rows than its file could hold is refused with LimitExceeded, not read)."""
    ds = trace._file[name]
    n = int(ds.shape[0])
    trace._refuse_over_limit(f"/{name}", n * ds.dtype.itemsize)
    for start in range(0, n, ROW_BLOCK):
        yield trace.table(name, rows=slice(start, min(n, start + ROW_BLOCK)), check_codes=False)


def _check_rows(trace: Trace, report: ValidationReport, present: set[str]) -> None:
    text = trace._file.get("text")
    text_len = int(text.shape[0]) if isinstance(text, h5py.Dataset) and text.ndim == 1 else 0
    request_ids = np.empty(0, dtype=np.uint32)
    referenced: dict[str, np.ndarray] = {}
    running = 0
    for name in schema.TABLES:
        if name not in present:
            continue
        seen: set[str] = set()
        unknown: dict[str, tuple[int, set[int]]] = {}
        try:
            for rows in _blocks(trace, name):
                _check_block(name, rows, text_len, seen, unknown)
                if name == "requests":
                    request_ids = np.concatenate([request_ids, rows["request"]])
                    running += int(np.sum(rows["outcome"] == schema.Outcome.RUNNING))
                if name in ("kv", "steps", "payloads/index", "state") and rows.size:  # /blocks: serving_rules
                    referenced[name] = np.union1d(referenced.get(name, request_ids[:0]), rows["request"])
                if name == "owners" and rows.size:  # -1: a reading tied to no request
                    named = rows["request"][rows["request"] >= 0].astype(np.uint32)
                    referenced[name] = np.union1d(referenced.get(name, request_ids[:0]), named)
        except TraceError as exc:
            seen.add(_short(exc))
        except H5_READ_ERRORS as exc:
            seen.add(f"/{name} rows unreadable ({exc})")
        report.problems.extend(sorted(seen))
        _report_codes(trace, report, name, unknown)
    if "requests" in present:
        if np.unique(request_ids).size != request_ids.size:
            report.problems.append("/requests has duplicate request ids")
        if running and trace.complete:
            report.problems.append(f"{running} request(s) still RUNNING in a closed trace")
        elif running:
            report.warnings.append(f"{running} request(s) were in progress when the writer stopped")
        for table, ids in referenced.items():
            orphans = np.setdiff1d(ids, request_ids)
            if orphans.size:
                report.problems.append(f"/{table} names requests absent from /requests: {orphans.tolist()[:8]}")
    if "kv" in present and "steps" in present:
        report.problems.extend(_kv_beyond_steps(trace))
    for table in ("telemetry/nvml", "telemetry/allocator", "telemetry/process"):
        if table in present and _goes_backwards(trace, table):
            report.warnings.append(f"/{table} timestamps go backwards (multi-device interleave?)")


def _kv_beyond_steps(trace: Trace) -> list[str]:
    """A decoder layer cannot have processed more tokens than the sequence holds: a /kv row's
    tokens_seen is at most the /steps tokens_seen of its (request, step) (cross-attention layers
    count the encoder's tokens instead). The analysers locate sampled positions from it."""
    keys, seen = [], []
    for rows in _blocks(trace, "steps"):
        keys.append(rows["request"].astype(np.int64) << 32 | rows["step"].astype(np.int64))
        seen.append(rows["tokens_seen"])
    if not keys:
        return []
    k = np.concatenate(keys)
    order = np.argsort(k, kind="stable")
    k, s = k[order], np.concatenate(seen)[order]
    cross = int(schema.LayerType.CROSS_ATTENTION)
    for rows in _blocks(trace, "kv"):
        rk = rows["request"].astype(np.int64) << 32 | rows["step"].astype(np.int64)
        at = np.minimum(np.searchsorted(k, rk), k.size - 1)
        over = (k[at] == rk) & (rows["layer_type"] != cross) & (rows["tokens_seen"] > s[at])
        if over.any():
            i = int(np.flatnonzero(over)[0])
            return [f"/kv holds layers that processed more tokens than their step's sequence (/steps tokens_seen): "
                    f"request {int(rows['request'][i])} step {int(rows['step'][i])} layer {int(rows['layer'][i])} "
                    f"{int(rows['tokens_seen'][i]):,} > {int(s[at[i]]):,}"]
    return []


def _report_codes(trace: Trace, report: ValidationReport, name: str, unknown: dict[str, tuple[int, set[int]]]) -> None:
    """Codes this kvtrace does not know (spec §2): a problem in a file of its own minor or older; in a
    newer minor's file a warning (readers of this kvtrace skip those rows and say so)."""
    for column, (rows, codes) in unknown.items():
        listed = sorted(codes)[:8]
        if not trace.newer_minor:
            report.problems.append(f"/{name} {column} has unknown codes {listed}")
        else:
            report.warnings.append(
                f"/{name} {column} has codes added after format {schema.FORMAT_VERSION} {listed} in {rows:,} "
                f"row(s) (written by format {trace.version}): this kvtrace skips those rows")


def _check_block(name: str, rows: np.ndarray, text_len: int, seen: set[str],
                 unknown: dict[str, tuple[int, set[int]]]) -> None:
    """Row rules of one block; each distinct problem is reported once per table. Unknown codes are
    counted into ``unknown`` (column -> (rows, codes)): whether they are a problem depends on the minor."""
    for column, enum_type in ENUM_COLUMNS.get(name, ()):
        if name != "payloads/index" and rows.size:
            mask = unknown_mask(rows[column], enum_type)
            if mask.any():
                count, codes = unknown.get(column, (0, set()))
                unknown[column] = (count + int(np.count_nonzero(mask)), codes | set(unknown_codes(rows[column], enum_type)))
    for off, length in TEXT_REFS.get(name, ()):
        if rows.size and np.any(rows[length] > 0):
            ends = rows[off].astype(np.uint64) + rows[length].astype(np.uint64)
            if np.any(ends > text_len) or np.any(ends < rows[off].astype(np.uint64)):
                seen.add(f"/{name} {off} points past the end of /text")
            if np.any(rows[length] > MAX_TEXT_BYTES):
                seen.add(f"/{name} {length} exceeds the {MAX_TEXT_BYTES}-byte string limit")
    seen.update(counter_problems(name, rows))  # beyond what any recording holds (spec §7)
    if name == "kv" and rows.size:
        if np.any(rows["tokens_kept"] > rows["tokens_seen"]):
            seen.add("/kv has rows keeping more tokens than seen")
        if np.any(rows["bytes_valid"] > rows["bytes_allocated"]):
            seen.add("/kv has rows with more valid than allocated bytes")
    if name == "state":
        seen.update(state_block_problems(rows))  # spec §7 (1.5)
    if name == "owners":
        seen.update(owner_block_problems(rows))  # spec §7 (1.5)


def _check_serving(trace: Trace, report: ValidationReport, present: set[str]) -> None:
    """The continuous-batching tables and serving events (1.4): the rules the reader enforces when a
    command reads them (kvtrace.format.serving_rules)."""
    report.problems.extend(serving_problems(trace, present, codes=False))  # codes: _check_block
    if "requests" in present:
        report.problems.extend(cb_request_problems(trace))


def _goes_backwards(trace: Trace, table: str) -> bool:
    last = None
    for rows in _blocks(trace, table):
        t = rows["t_ns"].astype(np.int64)
        if t.size and ((last is not None and t[0] < last) or np.any(np.diff(t) < 0)):
            return True
        if t.size:
            last = t[-1]
    return False


def _check_privacy(trace: Trace, report: ValidationReport) -> None:
    """The /meta privacy flags must not deny what the file holds (spec §3): tools that gate on them
    (export zenodo, info, report) decide from the contents, and validate reports a flag that lies."""
    if "meta" in trace._file and "requests" in trace._file:
        report.problems.extend(trace.privacy_mismatches())


def _check_config(trace: Trace, report: ValidationReport) -> None:
    """The stored model config sizes what the analysers build (lists of layers, head pairings,
    float arithmetic): its sizing values within their ceilings and the /layers rows' KV heads within
    its attention heads (kvtrace.geometry.bounds)."""
    from kvtrace.geometry.bounds import config_problems, recorded_problems

    config = trace.meta.model_config
    found = config_problems(config) or recorded_problems(config, trace.table("layers", check_codes=False))
    report.problems.extend(f"/meta model_config_json: {p}" for p in found)


def _index_rows(trace: Trace, scan: IndexScan) -> Iterator[tuple[int, np.void]]:
    """(row number, row) of every readable index row, a block at a time (bad rows were listed by
    structure_problems)."""
    for start in range(0, scan.rows, INDEX_BLOCK):
        block = trace.table("payloads/index", rows=slice(start, min(scan.rows, start + INDEX_BLOCK)),
                            check_codes=False)
        for j in np.flatnonzero(~(scan.bad | scan.skipped)[start : start + len(block)]):
            yield start + int(j), block[j]


def _check_payloads(trace: Trace, report: ValidationReport) -> None:
    """Decode every chunk of every payload once, one chunk in memory at a time."""
    scan = trace.index_scan
    if scan.whole:
        return  # listed by structure_problems; over the limit or shared chunks: decoding is refused
    extent = {}  # elements of each carrier that structure_problems found sound
    for itemsize in schema.PAYLOAD_ITEMSIZES:
        ds = trace._file.get(schema.payload_dataset_name(itemsize))
        if isinstance(ds, h5py.Dataset) and ds.ndim == 1 and ds.chunks == (schema.payload_chunk_elements(itemsize),):
            extent[itemsize] = int(ds.shape[0])
    bad = 0
    for i, row in _index_rows(trace, scan):
        itemsize = int(row["itemsize"])
        chunk_bytes = schema.PAYLOAD_CHUNK_BYTES
        if itemsize not in extent:
            continue  # its carrier is missing or mistyped: listed by structure_problems
        try:
            if int(row["first_chunk"] + row["n_chunks"]) * schema.payload_chunk_elements(itemsize) > extent[itemsize]:
                raise CorruptChunk(f"{trace.path}: chunks [{int(row['first_chunk'])}, "
                                   f"+{int(row['n_chunks'])}) out of range")
            for mask, stored in trace.stored_chunks(itemsize, int(row["first_chunk"]), int(row["n_chunks"])):
                check_chunk(mask, stored, chunk_bytes)
        except (TraceError, *H5_READ_ERRORS) as exc:
            bad += 1
            if bad <= MAX_LISTED:
                report.problems.append(f"payload {i}: {_short(exc)}")
    if bad > MAX_LISTED:
        report.problems.append(f"... and {bad - MAX_LISTED} more payload(s) that do not decode")
