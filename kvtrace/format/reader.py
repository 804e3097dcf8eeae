"""Lazy trace reader: opening reads only the root and /meta attributes; tables and payloads
are read when asked. Returns numpy structured arrays and plain dataclasses; never unpickles
(h5py object references and pickled attributes are never dereferenced or loaded).

The rules opening a trace enforces (identity, codes, counters, the payload index, the structure)
live in trace_rules.py, beside serving_rules.py, state_rules.py and owner_rules.py; this module
reads and refuses.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from kvtrace.format import schema
from kvtrace.format.codec import decode_chunk_into
from kvtrace.format.errors import (
    H5_READ_ERRORS,
    CorruptChunk,
    CorruptTrace,
    InvalidTrace,
    LimitExceeded,
    NotATrace,
    TraceError,
)
from kvtrace.format.joins import TraceJoins
from kvtrace.format.numeric import to_float32
from kvtrace.format.serving_rules import TABLES as SERVING_TABLES
from kvtrace.format.serving_rules import serving_problems
from kvtrace.format.skipped import Skipped, notify_skipped, skipped_note
from kvtrace.format.tables import Table
from kvtrace.format.trace_rules import (
    ENUM_COLUMNS,
    IndexScan,
    counter_problems,
    identity_version,
    payload_row_problem,
    scan_payload_index,
    structure_problems,
    unknown_codes,
    unknown_mask,
)
from kvtrace.units import format_bytes

# One /meta JSON attribute. Real ones are kilobytes (the largest Hugging Face configs, with label
# maps, are ~1 MiB); parsing turns text into Python objects of up to ~25x its size ("[{},{},...]"),
# so 4 MiB keeps a hostile attribute near 100 MiB of memory.
MAX_JSON_ATTR_BYTES = 4 * 1024 * 1024
# Decoding allowed for one operation (a table read; all payloads of the index together), relative
# to the file: real sampled K/V/Q decode to 1.3x their stored bytes (tests/data, bf16 after
# shuffle + zstd) and tables to about 1x the file, so 64x leaves ample room for zero-heavy data
# while a 1 MiB file can no longer ask for 2 GiB. The floor keeps small test traces unaffected.
DECODE_RATIO = 64
DECODE_FLOOR_BYTES = 256 * 1024**2
# The writer cuts strings at 1 MiB (spec §5); a longer text reference is damage, not data.
MAX_TEXT_BYTES = 1 << 20
# zstd's worst case for one 256 KiB chunk (ZSTD_COMPRESSBOUND) plus room; a larger stored chunk
# is refused before it is read into memory.
MAX_STORED_CHUNK_BYTES = schema.PAYLOAD_CHUNK_BYTES + schema.PAYLOAD_CHUNK_BYTES // 128 + 4096

SKIP_BLOCK = 1 << 20  # rows per read when finding skipped rows (a few bytes of each)

@dataclass(frozen=True)
class Payload:
    """One sampled tensor: raw element bits in `data` (carrier dtype) plus what they mean (the
    schema's PAYLOAD_DESCRIPTION fields of its index row)."""

    request: int
    step: int
    layer: int
    kind: schema.PayloadKind
    dtype: schema.CacheDType
    shape: tuple[int, ...]
    head_start: int
    head_stride: int
    token_start: int
    t_ns: int
    data: np.ndarray

    def to_float32(self) -> np.ndarray:
        return to_float32(self.data, self.dtype).reshape(self.shape)


@dataclass
class TraceMeta:
    """Run metadata from /meta; JSON attributes decoded, unknown attributes kept in `extra`."""

    kvtrace_version: str
    torch_version: str
    transformers_version: str
    cuda_version: str
    driver_version: str
    python_version: str
    model_id: str
    model_type: str
    model_config: dict[str, Any]
    generation_defaults: dict[str, Any]
    recorder_settings: dict[str, Any]
    sources: dict[str, Any]
    clock_anchor_wall_ns: int
    clock_anchor_mono_ns: int
    contains_prompt_text: bool
    contains_tensor_payloads: bool
    # "all" (every payload holds every token its layer kept) or "new" (incremental, format 1.1+:
    # spec §6.1); traces before 1.1 and traces without payloads say "all".
    payload_tokens: str = "all"
    extra: dict[str, Any] = field(default_factory=dict)

    def source_available(self, name: str) -> bool:
        entry = self.sources.get(name)
        if isinstance(entry, dict):
            return bool(entry.get("available"))
        return bool(entry)

    def wall_ns(self, t_ns: int) -> int:
        """Convert a trace (monotonic) timestamp to Unix nanoseconds."""
        return int(t_ns) - self.clock_anchor_mono_ns + self.clock_anchor_wall_ns


def _checked_meta(path: Path, kind: str, key: str, value: Any) -> Any:
    """A /meta value of its declared kind, or InvalidTrace naming the attribute."""
    if kind == "str" and not isinstance(value, str):
        raise InvalidTrace(f"{path}: /meta {key} must be a string")
    if kind == "bool":
        if not isinstance(value, (bool, int)) or value not in (0, 1):
            raise InvalidTrace(f"{path}: /meta {key} must be a boolean")
        return bool(value)
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        raise InvalidTrace(f"{path}: /meta {key} must be an integer")
    if kind == "json" and not isinstance(value, dict):
        raise InvalidTrace(f"{path}: /meta {key}_json must hold a JSON object")
    return value



def _open_h5(path: Path) -> tuple[h5py.File, bool]:
    """Open read-only. A file whose writer was killed (or is still running) keeps its SWMR
    'open for write' flag; SWMR read mode opens it consistently as of the last flush.
    Returns (file, closed_cleanly_flag_readable)."""
    if not path.exists():
        raise NotATrace(f"{path}: no such file")
    if path.is_dir():
        raise NotATrace(f"{path}: is a directory")
    if path.stat().st_size == 0:
        raise NotATrace(f"{path}: empty file, not an HDF5 trace")
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
    except OSError as exc:
        raise NotATrace(f"{path}: cannot read ({exc.strerror})") from None
    if head != b"\x89HDF\r\n\x1a\n":
        raise NotATrace(f"{path}: not an HDF5 file (no HDF5 signature)")
    try:
        return h5py.File(path, "r"), True
    except OSError as first:
        message = str(first)
        # Only a writer's leftover SWMR flag justifies SWMR read mode: on a truncated or
        # damaged file SWMR reads retry checksums for a long time instead of failing.
        if "already open for write" not in message and "consistency flags" not in message:
            detail = message[message.find("(") + 1 : message.rfind(")")] if "(" in message else message
            raise NotATrace(f"{path}: HDF5 cannot open it, truncated or corrupt ({detail})") from None
        try:
            return h5py.File(path, "r", swmr=True), False
        except OSError as exc:
            raise NotATrace(f"{path}: HDF5 cannot open it, truncated or corrupt ({exc})") from None


def _table(path: str, doc: str) -> property:
    return property(lambda self: self[path], doc=doc)


class Trace(TraceJoins):
    """An open trace, read on demand (h5py's model). Use as a context manager or call close().

    Each table is an attribute (``trace.kv``, ``trace.steps``, ``trace.nvml``, ...) or
    ``trace[path]``: a :class:`~kvtrace.format.tables.Table` that reads nothing until rows are
    asked for (``trace.kv[:]``, ``trace.kv[a:b]``, ``trace.kv.where(request=r, step=s)``, which
    reads only that request's rows). Payloads are decoded one at a time by their index row
    (:meth:`payload`). What several tables join to (state bytes per step, continuous-batching
    requests) is computed once per open trace (:class:`~kvtrace.format.joins.TraceJoins`).

    Opening checks the structure every reader relies on (``/meta``, every table with its fields,
    ``/text``, ``/status``, the payload carriers) and raises :class:`InvalidTrace` naming the first
    problem, so no command works on a file that breaks the spec there. ``check=False`` skips that
    (``kvtrace validate`` lists every problem itself)."""

    def __init__(self, path: str | os.PathLike[str], *, check: bool = True) -> None:
        self.path = Path(path)
        self._tables: dict[str, Table] = {}
        self.skipped: dict[str, Skipped] = {}  # table -> rows skipped for codes a newer minor added
        self._positions: dict[str, np.ndarray | None] = {}  # table -> file positions of the rows shown
        self._file, self._flags_clean = _open_h5(self.path)
        try:
            self._check_identity()
            self.file_bytes = self.path.stat().st_size
            if check:
                problems, _ = structure_problems(self)
                if problems:
                    more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
                    raise InvalidTrace(f"{self.path}: {problems[0]}{more}; 'kvtrace validate' lists them")
                self.__dict__["_payload_index_checked"] = True  # the index rules held: no second read
        except TraceError:
            self._file.close()
            raise
        except H5_READ_ERRORS as exc:
            self._file.close()
            raise InvalidTrace(f"{self.path}: unreadable HDF5 structure ({exc})") from None
        except BaseException:
            self._file.close()
            raise

    def _check_identity(self) -> None:
        attrs = self._file.attrs
        try:
            marker = attrs.get("format")
            version = attrs.get("format_version")
        except H5_READ_ERRORS:
            raise NotATrace(f"{self.path}: root attributes unreadable (corrupt or truncated)") from None
        self.version, self.major, self.minor = identity_version(
            self.path, _as_str(marker), None if version is None else _as_str(version))

    @property
    def decode_limit(self) -> int:
        """Bytes one operation may decode from this file (DECODE_RATIO x its size, at least the floor)."""
        return max(DECODE_FLOOR_BYTES, DECODE_RATIO * self.file_bytes)

    def _refuse_over_limit(self, what: str, nbytes: int) -> None:
        if nbytes > self.decode_limit:
            raise LimitExceeded(
                f"{self.path}: {what} would decode to {format_bytes(nbytes)} from a {format_bytes(self.file_bytes)} "
                f"file, over the reader's limit of {format_bytes(self.decode_limit)} "
                f"({DECODE_RATIO}x the file, at least {format_bytes(DECODE_FLOOR_BYTES)}); refused"
            )

    # ---- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Trace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- metadata -------------------------------------------------------------------------------

    @cached_property
    def meta(self) -> TraceMeta:
        try:
            if "meta" not in self._file:
                raise InvalidTrace(f"{self.path}: missing group /meta")
            raw = dict(self._file["meta"].attrs.items())
        except H5_READ_ERRORS as exc:
            raise CorruptTrace(f"{self.path}: /meta unreadable, corrupt or truncated ({exc})") from None
        values: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in raw.items():
            if key.endswith("_json"):
                text = _as_str(value)
                if len(text) > MAX_JSON_ATTR_BYTES:
                    raise InvalidTrace(f"{self.path}: /meta {key} is implausibly large")
                try:
                    decoded = json.loads(text)
                    if "\\ud" in text.lower():  # a \uD800-\uDFFF escape may decode to a lone surrogate
                        decoded = _clean_json(decoded)
                # ValueError: JSONDecodeError, and an integer of more digits than Python converts
                # (4300); RecursionError: nesting deeper than Python's stack
                except (ValueError, RecursionError):
                    raise InvalidTrace(f"{self.path}: /meta {key} is not valid JSON (or nested too deeply, "
                                       "or holds a number too long to read)") from None
                values[key[: -len("_json")]] = decoded
            else:
                values[key] = _plain(value)
        known = {f for f in TraceMeta.__dataclass_fields__ if f != "extra"}
        values["payload_tokens"] = _as_str(values.get("payload_tokens", "all"))  # optional (1.1)
        missing = [k for k in known if k not in values]
        if missing:
            raise InvalidTrace(f"{self.path}: /meta lacks {', '.join(sorted(missing))}")
        for key in list(values):
            if key not in known:
                extra[key] = values.pop(key)
        for kind in ("str", "bool", "int", "json"):  # the declared kinds (schema.META), checked in this order
            for key in (a.field for a in schema.META if a.kind == kind and a.field in known):
                values[key] = _checked_meta(self.path, kind, key, values[key])
        return TraceMeta(extra=extra, **values)

    @property
    def status(self) -> np.void | None:
        try:
            if "status" not in self._file:
                return None
            ds = self._file["status"]
            if not isinstance(ds, h5py.Dataset) or ds.shape != (1,) or ds.dtype != schema.STATUS:
                raise InvalidTrace(f"{self.path}: /status is not one row of the status type")
            return ds[0]
        except H5_READ_ERRORS as exc:
            raise CorruptTrace(f"{self.path}: /status unreadable ({exc})") from None

    @property
    def complete(self) -> bool:
        """True when the writer closed the file; False after a crash or while still recording."""
        st = self.status
        return bool(st is not None and int(st["closed_ns"]) != 0 and self._flags_clean)

    # ---- tables ---------------------------------------------------------------------------------

    def has(self, name: str) -> bool:
        try:
            return name in self._file
        except H5_READ_ERRORS as exc:
            raise CorruptTrace(f"{self.path}: /{name} unreadable ({exc})") from None

    def nrows(self, table: str, *, check_codes: bool = True) -> int:
        """Rows of a table as :meth:`table` presents them: in a newer minor's file, rows holding codes
        this reader does not know are not counted (``check_codes=False``: every row of the file)."""
        if not self.has(table):
            return 0
        ds = self._dataset(table)
        if ds.ndim != 1:
            raise InvalidTrace(f"{self.path}: /{table} is not a 1-D table")
        known = self._known_positions(table) if check_codes else None
        return int(ds.shape[0]) if known is None else int(known.size)

    def table(self, name: str, rows: slice | None = None, *, check_codes: bool = True) -> np.ndarray:
        """Read a table (or a slice of rows) as a structured array, known fields only: the primitive
        every :class:`~kvtrace.format.tables.Table` reads through (consumers use ``trace.kv[a:b]``,
        ``trace[path][:]``, ``trace.kv.where(request=r)``).

        Fields a newer minor version added are dropped; the array has this reader's dtype
        where the file has every field, else the file's fields that this reader knows. Enumerated
        columns (``check_codes``, spec §2): a code this reader does not know raises InvalidTrace in a
        file of its minor or older; in a newer minor's file the rows holding one are skipped, and
        ``rows`` and :meth:`nrows` number the rows that remain (so slices and positions agree).
        """
        if check_codes and name in SERVING_TABLES and self._serving_problems:  # 1.4 row rules (spec §7)
            problems = self._serving_problems
            more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
            raise InvalidTrace(f"{self.path}: {problems[0]}{more}; 'kvtrace validate' lists them")
        ds = self._dataset(name)
        selection = rows if rows is not None else slice(None)
        known = self._known_positions(name) if check_codes and ds.ndim == 1 else None
        picked = None
        if known is not None:  # the file's rows [first, last] that hold the rows asked for
            picked = known[selection]
            selection = slice(int(picked[0]), int(picked[-1]) + 1) if picked.size else slice(0, 0)
        if ds.ndim == 1:
            self._refuse_over_limit(f"/{name}", len(range(*selection.indices(ds.shape[0]))) * ds.dtype.itemsize)
        try:
            data = ds[selection]
        except H5_READ_ERRORS as exc:
            raise CorruptTrace(f"{self.path}: /{name} unreadable, corrupt or truncated ({exc})") from None
        if picked is not None and picked.size:
            data = data[picked - picked[0]]
        expected = schema.TABLES[name][0] if name in schema.TABLES else None
        if expected is None or data.dtype.names is None:
            return data
        if check_codes and not self.newer_minor:
            self._refuse_unknown_codes(name, data)
        if check_codes:
            over = counter_problems(name, data)
            if over:
                raise InvalidTrace(f"{self.path}: {over[0]}; 'kvtrace validate' lists every problem")
        keep = [n for n in expected.names if n in data.dtype.names]
        if len(keep) == len(data.dtype.names) == len(expected.names):
            return data
        return np.array(data[keep], dtype=[(n, data.dtype[n]) for n in keep])

    @property
    def newer_minor(self) -> bool:
        """The file is of a newer minor of this reader's major (spec §2: it may hold codes added since)."""
        return self.major == schema.FORMAT_MAJOR and self.minor > schema.FORMAT_MINOR

    def _refuse_unknown_codes(self, name: str, data: np.ndarray) -> None:
        """A code this reader does not know, in a file of its own minor or older, is damage (spec §2)."""
        for column, enum_type in ENUM_COLUMNS.get(name, ()):
            if column in data.dtype.names:
                bad = unknown_codes(data[column], enum_type)
                if bad:
                    raise InvalidTrace(f"{self.path}: /{name} {column} has unknown codes {bad}")

    def _known_positions(self, name: str) -> np.ndarray | None:
        """File positions of the rows a consumer of a newer minor's table sees: those whose enumerated
        columns hold codes this reader knows (None: every row, as in any file of an older minor). Found
        once per table, reading only its enumerated columns in blocks; the rows left out are counted
        in :attr:`skipped` and the trace is announced to :func:`collect_skipped`."""
        if not self.newer_minor or name not in ENUM_COLUMNS or not self.has(name):
            return None
        if name in self._positions:
            return self._positions[name]
        ds = self._dataset(name)
        columns = [(c, e) for c, e in ENUM_COLUMNS[name] if ds.dtype.names and c in ds.dtype.names]
        n = int(ds.shape[0]) if ds.ndim == 1 else 0
        if columns:
            self._refuse_over_limit(f"/{name}", n * ds.dtype.itemsize)
        unknown = np.zeros(n if columns else 0, dtype=bool)
        codes: dict[str, set[int]] = {}
        for start in range(0, unknown.size, SKIP_BLOCK):
            try:
                block = ds.fields([c for c, _ in columns])[start : min(n, start + SKIP_BLOCK)]
            except H5_READ_ERRORS as exc:
                raise CorruptTrace(f"{self.path}: /{name} unreadable, corrupt or truncated ({exc})") from None
            for column, enum_type in columns:
                values = block[column] if block.dtype.names else block  # one field: h5py may return it bare
                mask = unknown_mask(values, enum_type)
                unknown[start : start + mask.size] |= mask
                if mask.any():
                    codes.setdefault(column, set()).update(int(c) for c in np.unique(values[mask])[:8])
        positions = np.flatnonzero(~unknown) if unknown.any() else None
        self._positions[name] = positions
        if positions is not None:
            self.skipped[name] = Skipped(int(unknown.sum()), {c: sorted(v)[:8] for c, v in codes.items()})
            notify_skipped(self)
        return positions

    def skipped_note(self) -> str | None:
        """One line saying which rows of a newer minor this reader skipped (None when none were)."""
        return skipped_note(self.skipped, self.version)

    @cached_property
    def _serving_problems(self) -> list[str]:
        """The rules of the continuous-batching tables and serving events this trace breaks, checked
        once, when a consumer first reads one of them (every read after that refuses the same way)."""
        return serving_problems(self, codes=not self.newer_minor)  # a newer minor's codes: skipped rows

    def _dataset(self, name: str) -> h5py.Dataset:
        try:
            obj = self._file[name]
        except KeyError:
            raise InvalidTrace(f"{self.path}: missing dataset /{name}") from None
        except H5_READ_ERRORS as exc:
            raise CorruptTrace(f"{self.path}: /{name} unreadable, corrupt or truncated ({exc})") from None
        if not isinstance(obj, h5py.Dataset):
            raise InvalidTrace(f"{self.path}: /{name} is not a dataset")
        return obj

    def __getitem__(self, path: str) -> Table:
        """The table at ``path`` ("kv", "telemetry/nvml", "payloads/index", ...), read on demand
        (:class:`~kvtrace.format.tables.Table`); KeyError for a name the format does not define."""
        table = self._tables.get(path)
        if table is None:
            table = self._tables[path] = Table(self, path)
        return table

    requests = _table("requests", "/requests: one row per request")
    layers = _table("layers", "/layers: one row per layer")
    devices = _table("devices", "/devices: one row per device the run used")
    kv = _table("kv", "/kv: one row per layer and recorded step (``kv.where(request=r)`` reads only r's rows)")
    steps = _table("steps", "/steps: one row per recorded step")
    events = _table("events", "/events: events in time order")
    readings = _table("readings", "/readings: labelled memory readings")
    retention = _table("retention", "/retention: what outlived each request")
    nvml = _table("telemetry/nvml", "/telemetry/nvml: NVML samples")
    allocator = _table("telemetry/allocator", "/telemetry/allocator: allocator samples")
    process = _table("telemetry/process", "/telemetry/process: process RSS samples")
    payload_index = _table("payloads/index", "/payloads/index: one row per sampled tensor (see :meth:`payload`)")
    sched = _table("sched", "/sched: one row per continuous-batching scheduler step (1.4; empty before)")
    sched_groups = _table("sched_groups", "/sched_groups: per step and cache group (1.4; empty before)")
    blocks = _table("blocks", "/blocks: per step, running request and cache group (1.4; empty before)")
    state = _table("state", "/state: hybrid caches' conv/recurrent state (1.5; empty before; "
                            ":attr:`state_rows` refuses rows that break the spec)")
    owners = _table("owners", "/owners: memory by owner (1.5; empty before; "
                              "owner_rules.checked_owners refuses rows that break the spec)")

    def to_pandas(self, table: str, request: int | None = None) -> Any:
        """One table as a pandas DataFrame, with the Parquet export's column names and values:
        enumerations as lower-case names (``ok``, ``sliding``), shapes as lists, byte strings as
        text, text references dropped (events get their ``text``, kv its ``bytes_per_token``).

        ``table``: requests, layers, devices, kv, steps, events, readings, retention, nvml,
        allocator, process, payloads (the index), sched, sched_groups, blocks. ``request`` keeps
        one request's rows. Needs pandas. See :mod:`kvtrace.format.frames`."""
        from kvtrace.format.frames import to_pandas

        return to_pandas(self, table, request)

    def to_arrow(self, table: str, request: int | None = None) -> Any:
        """One table as a pyarrow Table, typed as the Parquet export types it (see
        :meth:`to_pandas`). Needs pyarrow (the ``fleet`` extra)."""
        from kvtrace.format.frames import to_arrow

        return to_arrow(self, table, request)

    def text(self, offset: int, length: int) -> str:
        """A string from the text heap ('' for length 0)."""
        if length == 0:
            return ""
        if length > MAX_TEXT_BYTES:
            raise InvalidTrace(f"{self.path}: text reference of {length} bytes (strings are at most "
                               f"{MAX_TEXT_BYTES} bytes)")
        ds = self._dataset("text")
        end = int(offset) + int(length)
        if end > ds.shape[0]:
            raise InvalidTrace(f"{self.path}: text reference [{offset}, {end}) past end of /text")
        try:
            data = ds[int(offset) : end]
        except H5_READ_ERRORS as exc:
            raise CorruptTrace(f"{self.path}: /text unreadable, corrupt or truncated ({exc})") from None
        return data.tobytes().decode("utf-8", errors="replace")

    def stored_contents(self) -> dict[str, str]:
        """Privacy-relevant content the file actually holds, in words ('' when none), whatever
        /meta claims: payload index rows or stored payload chunks, and requests that reference
        prompt text. Reads storage sizes and one column of /requests."""
        out = {"tensor_payloads": "", "prompt_text": ""}
        rows = self.nrows("payloads/index", check_codes=False)  # what the file holds, skipped rows too
        stored = self.payload_stored_bytes()
        if rows or stored:
            out["tensor_payloads"] = f"{rows} sampled tensors, {format_bytes(stored)} of payload chunks"
        n = self.nrows("requests", check_codes=False)
        if n:
            self._refuse_over_limit("/requests", n * self._dataset("requests").dtype.itemsize)
            try:
                lengths = self._dataset("requests").fields("prompt_text_len")[:]
            except H5_READ_ERRORS as exc:
                raise CorruptTrace(f"{self.path}: /requests unreadable ({exc})") from None
            with_text = int(np.count_nonzero(lengths))
            if with_text:
                out["prompt_text"] = f"prompt text of {with_text} request(s)"
        return out

    def payload_stored_bytes(self) -> int:
        """Bytes the payload carriers occupy in the file (compressed chunks)."""
        stored = 0
        try:
            for itemsize in schema.PAYLOAD_ITEMSIZES:
                ds = self._file.get(schema.payload_dataset_name(itemsize))
                if isinstance(ds, h5py.Dataset):
                    stored += int(ds.id.get_storage_size())
        except H5_READ_ERRORS as exc:
            raise CorruptTrace(f"{self.path}: payload carriers unreadable ({exc})") from None
        return stored

    def privacy_mismatches(self) -> list[str]:
        """Where a /meta privacy flag denies content the file holds (spec §3): one line each."""
        held = self.stored_contents()
        out = []
        if held["tensor_payloads"] and not self.meta.contains_tensor_payloads:
            out.append(f"/meta contains_tensor_payloads is false but the trace holds {held['tensor_payloads']}")
        if held["prompt_text"] and not self.meta.contains_prompt_text:
            out.append(f"/meta contains_prompt_text is false but the trace holds {held['prompt_text']}")
        return out

    # ---- payloads -------------------------------------------------------------------------------

    def payload(self, index_row: int | np.void) -> Payload:
        self._payload_index_checked  # noqa: B018 - the whole-index limits, once per trace
        row = self._payload_row(int(index_row)) if isinstance(index_row, (int, np.integer)) else index_row
        problem = payload_row_problem(row)
        if problem:
            raise InvalidTrace(f"{self.path}: {problem}")
        data = self._read_carrier(int(row["itemsize"]), int(row["first_chunk"]), int(row["n_chunks"]),
                                  int(row["n_elements"]))
        return Payload(**schema.payload_description(row), data=data)

    @cached_property
    def index_scan(self) -> IndexScan:
        """The payload index checked once per trace (:func:`scan_payload_index`)."""
        return scan_payload_index(self)

    @cached_property
    def _payload_index_checked(self) -> bool:
        """Whole-index rules, checked before the first payload is decoded: the payloads together
        decode within the reader's limit, and no two payloads share a chunk (so decoding every
        payload decodes each stored chunk at most once: work is bounded by what the file stores)."""
        if self.index_scan.whole:
            raise self.index_scan.whole[0]
        return True

    def _payload_row(self, i: int) -> np.void:
        """One index row, read alone: callers looping over payloads by number must not re-read
        the whole index each time."""
        n = self.nrows("payloads/index")  # numbered as payload_index() numbers them (spec §2: rows skipped)
        if not -n <= i < n:
            raise IndexError(f"payload {i} out of range ({n} payloads)")
        i %= n
        return self.table("payloads/index", rows=slice(i, i + 1))[0]

    def payload_filters(self, itemsize: int) -> list[int]:
        """Filter ids of a payload dataset's pipeline, in order."""
        ds = self._dataset(schema.payload_dataset_name(itemsize))
        plist = ds.id.get_create_plist()
        return [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]

    def _read_carrier(self, itemsize: int, first_chunk: int, n_chunks: int, n: int) -> np.ndarray:
        ds = self._dataset(schema.payload_dataset_name(itemsize))
        chunk = schema.payload_chunk_elements(itemsize)
        if ds.chunks != (chunk,):
            raise InvalidTrace(f"{self.path}: {ds.name} has chunks {ds.chunks}, expected ({chunk},)")
        if n_chunks * chunk < n or (first_chunk + n_chunks) * chunk > ds.shape[0]:
            raise InvalidTrace(f"{self.path}: payload chunks [{first_chunk}, +{n_chunks}) out of range")
        filters = self.payload_filters(itemsize)
        if filters != [schema.FILTER_SHUFFLE, schema.FILTER_ZSTD]:
            raise InvalidTrace(f"{self.path}: {ds.name} filter pipeline {filters} is not [2, 32015]")
        chunk_bytes = chunk * itemsize
        out = np.empty(n_chunks * chunk_bytes, dtype=np.uint8)
        for i, (mask, stored) in enumerate(self.stored_chunks(itemsize, first_chunk, n_chunks)):
            try:
                decode_chunk_into(out[i * chunk_bytes : (i + 1) * chunk_bytes], mask, stored, itemsize)
            except CorruptChunk as exc:
                raise CorruptChunk(f"{self.path}: chunk {first_chunk + i} of {ds.name}: {exc}") from None
        return out[: n * itemsize].view(schema.payload_carrier(itemsize))

    def stored_chunks(self, itemsize: int, first_chunk: int, n_chunks: int) -> Iterator[tuple[int, bytes]]:
        """(filter_mask, stored bytes) of consecutive chunks of a carrier, one at a time; a chunk that
        was never written or whose stored size no zstd frame of one chunk can have is refused before
        it is read into memory."""
        ds = self._dataset(schema.payload_dataset_name(itemsize))
        chunk = schema.payload_chunk_elements(itemsize)
        for c in range(first_chunk, first_chunk + n_chunks):
            try:
                info = ds.id.get_chunk_info_by_coord((c * chunk,))
                if info.byte_offset is None or info.size == 0:
                    raise CorruptChunk(f"{self.path}: chunk {c} of {ds.name} was never written")
                if info.size > MAX_STORED_CHUNK_BYTES:
                    raise CorruptChunk(f"{self.path}: chunk {c} of {ds.name} stores {info.size} bytes, "
                                       f"more than one compressed chunk can; refused")
                yield ds.id.read_direct_chunk((c * chunk,))
            except (OSError, KeyError, ValueError, RuntimeError) as exc:
                raise CorruptChunk(f"{self.path}: chunk {c} of {ds.name} unreadable ({exc})") from None



def open_trace(path: str | os.PathLike[str]) -> Trace:
    """Open a trace lazily. Raises NotATrace / UnsupportedVersion / InvalidTrace."""
    return Trace(path)


def _clean(text: str) -> str:
    """h5py decodes attribute strings with surrogateescape, and JSON may escape lone surrogates
    ("\\ud83d"): either way a string no UTF-8 writer accepts. Undecodable bytes become U+FFFD,
    other lone surrogates '?'."""
    if text.isascii():
        return text
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


def _clean_json(obj: Any) -> Any:
    """:func:`_clean` every string of a decoded JSON document (keys too), without recursion."""
    root = [obj]
    stack: list[tuple[Any, Any]] = [(root, 0)]
    while stack:
        container, key = stack.pop()
        value = container[key]
        if isinstance(value, str):
            container[key] = _clean(value)
        elif isinstance(value, list):
            stack.extend((value, i) for i in range(len(value)))
        elif isinstance(value, dict):
            cleaned = {_clean(k): v for k, v in value.items()}
            value.clear()
            value.update(cleaned)
            stack.extend((value, k) for k in value)
    return root[0]


def _as_str(value: Any) -> str:
    if isinstance(value, str):
        return _clean(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, np.ndarray) and value.shape == ():
        return _as_str(value.item())
    return str(value) if value is not None else ""


def _plain(value: Any) -> Any:
    if isinstance(value, str):
        return _clean(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value
