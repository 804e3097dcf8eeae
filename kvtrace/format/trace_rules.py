"""The rules opening a trace enforces and ``kvtrace validate`` lists: the file's identity (format
marker and version), enumerated codes, counter ceilings, payload index rows and the whole index,
and the structure every reader relies on (spec §2, §7). The row rules of the continuous-batching,
state and owner tables live beside them in serving_rules.py, state_rules.py and owner_rules.py.

Every function here reads through an open :class:`~kvtrace.format.reader.Trace` (or takes rows
already read) and returns problems as text; the reader decides what refuses a trace.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import h5py
import numpy as np

from kvtrace.format import schema
from kvtrace.format.errors import (
    H5_READ_ERRORS,
    InvalidTrace,
    LimitExceeded,
    NotATrace,
    TraceError,
    UnsupportedVersion,
)
from kvtrace.format.parallel_meta import parallel_problems

if TYPE_CHECKING:  # pragma: no cover
    from pathlib import Path

    from kvtrace.format.reader import Trace

MAX_LISTED = 8  # distinct problems of one kind listed; the rest are counted
MAX_PAYLOAD_BYTES = 8 * 1024**3  # one payload decoded into memory; larger is refused
# Enumerated columns per table (declared in schema): a code the reader does not know is refused in
# a file of its own minor or older, and its row skipped in a newer minor's file (spec §2).
ENUM_COLUMNS = schema.ENUM_COLUMNS
# Counters every consumer does int64 arithmetic with (spec §7): no cache holds 2^40 tokens and no
# device 2^62 bytes, so a row beyond them is damage (a /kv tokens_seen of 2^64 - 1 made report and
# whatif end in 70), refused where a command reads it as an unknown code is.
MAX_TOKENS = 1 << 40
MAX_BYTES = 1 << 62
COUNTER_CEILINGS: dict[str, tuple[tuple[str, int], ...]] = {
    "requests": (("prompt_tokens", MAX_TOKENS), ("new_tokens", MAX_TOKENS)),
    "kv": (("tokens_seen", MAX_TOKENS), ("tokens_kept", MAX_TOKENS), ("bytes_allocated", MAX_BYTES),
           ("bytes_valid", MAX_BYTES), ("bytes_unique", MAX_BYTES), ("k_storage_bytes", MAX_BYTES),
           ("v_storage_bytes", MAX_BYTES), ("expanded_bytes", MAX_BYTES)),
    "steps": (("tokens_seen", MAX_TOKENS), ("kv_bytes_naive", MAX_BYTES), ("kv_bytes_unique", MAX_BYTES),
              ("kv_bytes_valid", MAX_BYTES)),
    "retention": (("nbytes", MAX_BYTES),),
    "state": (("bytes_allocated", MAX_BYTES), ("bytes_valid", MAX_BYTES), ("bytes_unique", MAX_BYTES)),
    "owners": (("bytes", MAX_BYTES), ("largest_bytes", MAX_BYTES), ("blocks", MAX_BYTES)),
}



def parse_version(text: str) -> tuple[int, int]:
    try:
        major, minor = str(text).split(".", 1)
        return int(major), int(minor)
    except ValueError:
        raise InvalidTrace(f"format_version {text!r} is not 'major.minor'") from None


def identity_version(path: Path, marker: str, version: str | None) -> tuple[str, int, int]:
    """(version, major, minor) of a file whose root says it is a kvtrace trace of a major this
    reader reads; NotATrace without the marker, UnsupportedVersion for a newer or pre-1 major."""
    if marker != schema.FORMAT_NAME or version is None:
        raise NotATrace(f"{path}: HDF5 file but not a kvtrace trace (no format marker)")
    major, minor = parse_version(version)
    if major > schema.FORMAT_MAJOR:
        raise UnsupportedVersion(
            f"{path}: trace format {version} is newer than this kvtrace reads "
            f"({schema.FORMAT_VERSION}); upgrade kvtrace"
        )
    if major < 1:
        raise UnsupportedVersion(f"{path}: trace format {version} is not supported")
    return version, major, minor


def counter_problems(name: str, rows: np.ndarray) -> list[str]:
    """The counters of ``rows`` (of table ``name``) beyond their ceiling (COUNTER_CEILINGS), one
    line per column."""
    out = []
    for column, ceiling in COUNTER_CEILINGS.get(name, ()):
        if rows.size and rows.dtype.names and column in rows.dtype.names:
            top = rows[column].max()
            if int(top) > ceiling:
                unit = "tokens" if ceiling == MAX_TOKENS else "bytes"
                out.append(f"/{name} {column} holds {int(top):,} (more {unit} than any recording holds: at most "
                           f"2^{ceiling.bit_length() - 1})")
    return out


def unknown_mask(column: np.ndarray, enum_type: type) -> np.ndarray:
    """True where ``column`` holds a code ``enum_type`` does not define."""
    return ~np.isin(column, [int(v) for v in enum_type])


def unknown_codes(column: np.ndarray, enum_type: type) -> list[int]:
    """Codes in ``column`` that ``enum_type`` does not define (at most 8, sorted)."""
    bad = np.unique(column[unknown_mask(column, enum_type)])
    return [int(b) for b in bad[:8]]


def payload_row_problem(row: np.void) -> str | None:
    """What makes one index row unreadable, or None (see :func:`payload_row_problems`)."""
    _, found = payload_row_problems(np.asarray(row).reshape(1))
    return next((message for message, _ in found.values()), None)


def payload_row_problems(rows: np.ndarray, skip: np.ndarray | None = None) -> tuple[np.ndarray, dict[str, tuple[str, int]]]:
    """Index rows that cannot be read (itemsize, codes, shape, chunk count), vectorised over a block
    (a hostile index may hold millions of rows): (mask of bad rows, broken rule -> (message about
    its first offending row, rows that break it)). ``skip``: rows left out of every rule (those of
    codes a newer minor added, which the reader skips)."""
    bad = np.zeros(len(rows), dtype=bool)
    found: dict[str, tuple[str, int]] = {}

    def flag(rule: str, mask: np.ndarray, message: Callable[[int], str]) -> None:
        hits = np.flatnonzero(mask if skip is None else mask & ~skip)
        if hits.size:
            found[rule] = (message(int(hits[0])), hits.size)
            bad[hits] = True

    itemsize = rows["itemsize"].astype(np.int64)
    ndim = rows["ndim"].astype(np.int64)
    n = rows["n_elements"].astype(np.uint64)
    flag("itemsize", ~np.isin(itemsize, schema.PAYLOAD_ITEMSIZES),
         lambda i: f"payload itemsize {itemsize[i]} is not one of {schema.PAYLOAD_ITEMSIZES}")
    dtype_size = np.zeros(256, dtype=np.int64)  # dtype is uint8: a lookup table covers every code
    for d, size in schema.DTYPE_ITEMSIZE.items():
        dtype_size[int(d)] = size
    for column, enum_type in ENUM_COLUMNS["payloads/index"]:
        codes = rows[column].astype(np.int64)
        flag(column, unknown_mask(codes, enum_type),
             lambda i, c=codes, col=column: f"payload index {col} has unknown code {c[i]}")
    fits = dtype_size[rows["dtype"].astype(np.uint8)] == itemsize
    flag("fits", ~fits, lambda i: f"payload itemsize {itemsize[i]} does not fit dtype code {int(rows['dtype'][i])}")
    flag("ndim", (ndim < 0) | (ndim > schema.PAYLOAD_MAX_NDIM),
         lambda i: f"payload ndim {ndim[i]} is not in [0, {schema.PAYLOAD_MAX_NDIM}]")
    used = np.arange(schema.PAYLOAD_MAX_NDIM)[None, :] < ndim[:, None]
    shape = rows["shape"].astype(np.int64)
    product = np.prod(np.where(used, shape, 1).astype(np.float64), axis=1)
    flag("shape", np.any(used & (shape < 0), axis=1) | (product != n.astype(np.float64)),
         lambda i: f"payload shape {tuple(int(x) for x in shape[i][: max(0, ndim[i])])} "
                   f"does not hold {n[i]} elements")
    decoded = n.astype(np.float64) * itemsize
    flag("size", decoded > MAX_PAYLOAD_BYTES,
         lambda i: f"payload of {int(decoded[i])} bytes exceeds the reader limit of {MAX_PAYLOAD_BYTES}")
    per_chunk = np.where(np.isin(itemsize, schema.PAYLOAD_ITEMSIZES),
                         schema.PAYLOAD_CHUNK_BYTES // np.maximum(itemsize, 1), 1)
    needed = np.maximum(1, -(-n.astype(np.float64) // per_chunk))
    flag("n_chunks", rows["n_chunks"].astype(np.float64) != needed,
         lambda i: f"payload of {n[i]} elements claims {int(rows['n_chunks'][i])} chunks of "
                   f"{per_chunk[i]} (it occupies {int(needed[i])})")
    return bad, found


@dataclass
class IndexScan:
    """The payload index checked block by block (never held whole in memory)."""

    rows: int
    bad: np.ndarray  # bool per row: the row cannot be read
    skipped: np.ndarray  # bool per row: a newer minor's row holding codes this reader does not know
    row_messages: list[str]  # distinct broken rules, one line each
    whole: list[InvalidTrace]  # rules over all rows: decode limit, shared chunks


INDEX_BLOCK = 1 << 16  # index rows per read (~6 MiB)
_INDEX_COLUMNS = np.dtype([("itemsize", "u1"), ("first_chunk", "<u8"), ("n_chunks", "<u4"), ("n_elements", "<u8")])


def scan_payload_index(trace: Trace) -> IndexScan:
    """Row rules of every index row and the whole-index rules (total decoded size within the
    reader's limit, no two payloads sharing a chunk), reading the index in blocks and keeping only
    the four columns the whole-index rules need (21 bytes a row)."""
    n = trace.nrows("payloads/index", check_codes=False)
    trace._refuse_over_limit(f"/payloads/index ({n} rows)", n * schema.PAYLOAD_INDEX.itemsize)
    bad, skipped, rules, cols, declared = [], [], {}, [], 0
    for start in range(0, n, INDEX_BLOCK):
        block = trace.table("payloads/index", rows=slice(start, min(n, start + INDEX_BLOCK)), check_codes=False)
        skip = np.zeros(len(block), dtype=bool)
        for column, enum_type in ENUM_COLUMNS["payloads/index"] if trace.newer_minor else ():
            skip |= unknown_mask(block[column], enum_type)
        mask, found = payload_row_problems(block, skip)
        bad.append(mask)
        skipped.append(skip)
        mask = mask | skip
        for rule, (message, count) in found.items():
            first, total = rules.get(rule, (message, 0))
            rules[rule] = (first, total + count)
        good = block[~mask]  # rows that break a row rule are refused on their own
        declared += int(np.sum(good["n_elements"].astype(np.float64) * good["itemsize"]))
        compact = np.empty(len(good), dtype=_INDEX_COLUMNS)  # a multi-field view keeps the full row size
        for name in _INDEX_COLUMNS.names:
            compact[name] = good[name]
        cols.append(compact)
    messages = [m + (f" ({count} rows)" if count > 1 else "") for m, count in rules.values()]
    none = np.zeros(0, dtype=bool)
    scan = IndexScan(n, np.concatenate(bad) if bad else none, np.concatenate(skipped) if skipped else none, messages, [])
    if not n:
        return scan
    index = np.concatenate(cols)
    try:
        trace._refuse_over_limit(f"{n} payloads", declared)
    except LimitExceeded as exc:
        scan.whole.append(exc)
    for itemsize in np.unique(index["itemsize"]):
        rows = index[index["itemsize"] == itemsize]
        first = rows["first_chunk"].astype(np.uint64)
        order = np.argsort(first, kind="stable")
        ends = first[order] + rows["n_chunks"][order].astype(np.uint64)
        if np.any(first[order][1:] < ends[:-1]):
            scan.whole.append(InvalidTrace(f"{trace.path}: payloads share chunks of "
                                           f"/{schema.payload_dataset_name(int(itemsize))}"))
    return scan


def structure_problems(trace: Trace) -> tuple[list[str], set[str]]:
    """What every reader needs (spec §7 without row contents): /meta, the tables with their fields,
    /text, /status and the payload carriers. Returns (problems, tables present and well-typed)."""
    problems: list[str] = []
    try:
        meta = trace.meta
        if meta.payload_tokens not in schema.PAYLOAD_TOKENS and trace.minor >= schema.FIELDS_MINOR:
            problems.append(f"/meta payload_tokens {meta.payload_tokens!r} is not one of "
                            f"{', '.join(schema.PAYLOAD_TOKENS)}")
        if "parallel" in meta.extra:  # 1.4 (spec §3.1): ranks and device maps every consumer trusts
            problems.extend(parallel_problems(meta.extra["parallel"], newer_minor=trace.minor > schema.FORMAT_MINOR))
    except TraceError as exc:
        problems.append(str(exc).split(": ", 1)[-1])
    present: set[str] = set()
    for name, (dtype, required) in schema.TABLES.items():
        try:
            obj = trace._file.get(name)
        except H5_READ_ERRORS as exc:
            problems.append(f"/{name} unreadable ({exc})")
            continue
        if obj is None:
            if required:
                problems.append(f"missing required dataset /{name}")
            continue
        if not isinstance(obj, h5py.Dataset) or obj.ndim != 1 or obj.dtype.names is None:
            problems.append(f"/{name} is not a 1-D table")
            continue
        bad = [n for n in dtype.names if n not in obj.dtype.names or obj.dtype[n] != dtype[n]]
        if bad and trace.minor >= schema.FIELDS_MINOR:
            problems.append(f"/{name} lacks or mistypes fields: {', '.join(bad)}")
            continue
        try:
            trace._refuse_over_limit(f"/{name} ({obj.shape[0]} rows)", obj.shape[0] * obj.dtype.itemsize)
        except LimitExceeded as exc:
            problems.append(str(exc).split(": ", 1)[-1])
            continue
        present.add(name)
    if "payloads/index" in present:
        try:
            scan = trace.index_scan
            problems.extend(scan.row_messages[:MAX_LISTED])
            if len(scan.row_messages) > MAX_LISTED:
                problems.append(f"... and {len(scan.row_messages) - MAX_LISTED} more kinds of bad payload index rows")
            problems.extend(str(exc).split(": ", 1)[-1] for exc in scan.whole)
        except TraceError as exc:
            problems.append(str(exc).split(": ", 1)[-1])
    try:
        text = trace._file.get("text")
        if not isinstance(text, h5py.Dataset) or text.dtype != np.uint8 or text.ndim != 1:
            problems.append("missing or mistyped dataset /text (1-D uint8)")
        status = trace._file.get("status")
        if not isinstance(status, h5py.Dataset) or status.shape != (1,) or status.dtype != schema.STATUS:
            problems.append("missing or mistyped dataset /status (one row)")
        for itemsize in schema.PAYLOAD_ITEMSIZES:
            name = schema.payload_dataset_name(itemsize)
            ds = trace._file.get(name)
            if not isinstance(ds, h5py.Dataset):
                problems.append(f"missing payload dataset /{name}")
                continue
            chunk = schema.payload_chunk_elements(itemsize)
            if ds.dtype != schema.payload_carrier(itemsize) or ds.chunks != (chunk,) or ds.ndim != 1:
                problems.append(f"/{name} must be {schema.payload_carrier(itemsize)} chunked ({chunk},)")
                continue
            filters = trace.payload_filters(itemsize)
            if filters != [schema.FILTER_SHUFFLE, schema.FILTER_ZSTD]:
                problems.append(f"/{name} filter pipeline {filters} is not [2, 32015]")
    except H5_READ_ERRORS as exc:
        problems.append(f"unreadable HDF5 structure ({exc})")
    return problems, present
