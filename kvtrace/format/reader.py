"""Lazy trace reader: opening reads only the root and /meta attributes; tables and payloads
are read when asked. Returns numpy structured arrays and plain dataclasses; never unpickles
(h5py object references and pickled attributes are never dereferenced or loaded).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from kvtrace.format import schema
from kvtrace.format.codec import decode_chunk
from kvtrace.format.errors import (
    H5_READ_ERRORS,
    CorruptChunk,
    CorruptTrace,
    InvalidTrace,
    NotATrace,
    TraceError,
    UnsupportedVersion,
)
from kvtrace.format.numeric import to_float32

MAX_JSON_ATTR_BYTES = 64 * 1024 * 1024
MAX_PAYLOAD_BYTES = 8 * 1024**3  # one payload decoded into memory; larger is refused


@dataclass(frozen=True)
class Payload:
    """One sampled tensor: raw element bits in `data` (carrier dtype) plus what they mean."""

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


def parse_version(text: str) -> tuple[int, int]:
    try:
        major, minor = str(text).split(".", 1)
        return int(major), int(minor)
    except ValueError:
        raise InvalidTrace(f"format_version {text!r} is not 'major.minor'") from None


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


class Trace:
    """An open trace. Use as a context manager or call close()."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._file, self._flags_clean = _open_h5(self.path)
        try:
            self._check_identity()
        except TraceError:
            self._file.close()
            raise
        except H5_READ_ERRORS as exc:
            self._file.close()
            raise NotATrace(f"{self.path}: unreadable HDF5 structure ({exc})") from None
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
        if _as_str(marker) != schema.FORMAT_NAME or version is None:
            raise NotATrace(f"{self.path}: HDF5 file but not a kvtrace trace (no format marker)")
        self.version = _as_str(version)
        self.major, self.minor = parse_version(self.version)
        if self.major > schema.FORMAT_MAJOR:
            raise UnsupportedVersion(
                f"{self.path}: trace format {self.version} is newer than this kvtrace reads "
                f"({schema.FORMAT_VERSION}); upgrade kvtrace"
            )
        if self.major < 1:
            raise UnsupportedVersion(f"{self.path}: trace format {self.version} is not supported")

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
                except json.JSONDecodeError:
                    raise InvalidTrace(f"{self.path}: /meta {key} is not valid JSON") from None
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
        values["contains_prompt_text"] = bool(values["contains_prompt_text"])
        values["contains_tensor_payloads"] = bool(values["contains_tensor_payloads"])
        for key in ("clock_anchor_wall_ns", "clock_anchor_mono_ns"):
            values[key] = int(values[key])
        for key in ("model_config", "generation_defaults", "recorder_settings", "sources"):
            if not isinstance(values[key], dict):
                raise InvalidTrace(f"{self.path}: /meta {key}_json must hold a JSON object")
        return TraceMeta(extra=extra, **values)

    @property
    def status(self) -> np.void | None:
        try:
            if "status" not in self._file:
                return None
            return self._file["status"][0]
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

    def nrows(self, table: str) -> int:
        return int(self._dataset(table).shape[0]) if self.has(table) else 0

    def table(self, name: str, rows: slice | None = None) -> np.ndarray:
        """Read a table (or a slice of rows) as a structured array, known fields only.

        Fields a newer minor version added are dropped; the array has this reader's dtype
        where the file has every field, else the file's fields that this reader knows.
        """
        ds = self._dataset(name)
        try:
            data = ds[rows if rows is not None else slice(None)]
        except H5_READ_ERRORS as exc:
            raise CorruptTrace(f"{self.path}: /{name} unreadable, corrupt or truncated ({exc})") from None
        expected = schema.TABLES[name][0] if name in schema.TABLES else None
        if expected is None or data.dtype.names is None:
            return data
        keep = [n for n in expected.names if n in data.dtype.names]
        if len(keep) == len(data.dtype.names) == len(expected.names):
            return data
        return np.array(data[keep], dtype=[(n, data.dtype[n]) for n in keep])

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

    def requests(self) -> np.ndarray:
        return self.table("requests")

    def layers(self) -> np.ndarray:
        return self.table("layers")

    def devices(self) -> np.ndarray:
        return self.table("devices")

    def kv(self, request: int | None = None) -> np.ndarray:
        rows = self.table("kv")
        return rows if request is None else rows[rows["request"] == request]

    def steps(self, request: int | None = None) -> np.ndarray:
        rows = self.table("steps")
        return rows if request is None else rows[rows["request"] == request]

    def events(self, kind: schema.EventKind | None = None) -> np.ndarray:
        rows = self.table("events")
        return rows if kind is None else rows[rows["kind"] == int(kind)]

    def readings(self, request: int | None = None) -> np.ndarray:
        rows = self.table("readings")
        return rows if request is None else rows[rows["request"] == request]

    def retention(self, request: int | None = None) -> np.ndarray:
        rows = self.table("retention")
        return rows if request is None else rows[rows["request"] == request]

    def nvml(self) -> np.ndarray:
        return self.table("telemetry/nvml")

    def allocator(self) -> np.ndarray:
        return self.table("telemetry/allocator")

    def process(self) -> np.ndarray:
        return self.table("telemetry/process")

    def text(self, offset: int, length: int) -> str:
        """A string from the text heap ('' for length 0)."""
        if length == 0:
            return ""
        ds = self._dataset("text")
        end = int(offset) + int(length)
        if end > ds.shape[0]:
            raise InvalidTrace(f"{self.path}: text reference [{offset}, {end}) past end of /text")
        return ds[int(offset) : end].tobytes().decode("utf-8", errors="replace")

    # ---- payloads -------------------------------------------------------------------------------

    def payload_index(self) -> np.ndarray:
        return self.table("payloads/index")

    def payload(self, index_row: int | np.void) -> Payload:
        row = self._payload_row(int(index_row)) if isinstance(index_row, (int, np.integer)) else index_row
        try:
            itemsize = int(row["itemsize"])
            dtype = schema.CacheDType(int(row["dtype"]))
            kind = schema.PayloadKind(int(row["kind"]))
        except ValueError as exc:
            raise InvalidTrace(f"{self.path}: payload index row has unknown code ({exc})") from None
        if itemsize not in schema.PAYLOAD_ITEMSIZES or schema.DTYPE_ITEMSIZE[dtype] != itemsize:
            raise InvalidTrace(f"{self.path}: payload itemsize {itemsize} does not fit {dtype.name}")
        ndim = int(row["ndim"])
        shape = tuple(int(s) for s in row["shape"][:ndim])
        n = int(row["n_elements"])
        if any(s < 0 for s in shape) or int(np.prod(shape, dtype=np.int64)) != n:
            raise InvalidTrace(f"{self.path}: payload shape {shape} does not hold {n} elements")
        if n * itemsize > MAX_PAYLOAD_BYTES:
            raise InvalidTrace(f"{self.path}: payload of {n * itemsize} bytes exceeds the reader limit")
        data = self._read_carrier(itemsize, int(row["first_chunk"]), int(row["n_chunks"]), n)
        return Payload(
            int(row["request"]), int(row["step"]), int(row["layer"]), kind, dtype, shape,
            int(row["head_start"]), int(row["head_stride"]), int(row["token_start"]),
            int(row["t_ns"]), data,
        )

    def _payload_row(self, i: int) -> np.void:
        """One index row, read alone: callers looping over payloads by number must not re-read
        the whole index each time."""
        n = self.nrows("payloads/index")
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
        out = bytearray()
        for c in range(first_chunk, first_chunk + n_chunks):
            try:
                mask, stored = ds.id.read_direct_chunk((c * chunk,))
            except (OSError, KeyError, ValueError) as exc:
                raise CorruptChunk(f"{self.path}: chunk {c} of {ds.name} unreadable ({exc})") from None
            try:
                out += decode_chunk(mask, stored, chunk_bytes, itemsize)
            except CorruptChunk as exc:
                raise CorruptChunk(f"{self.path}: chunk {c} of {ds.name}: {exc}") from None
        return np.frombuffer(bytes(out[: n * itemsize]), dtype=schema.payload_carrier(itemsize)).copy()


def open_trace(path: str | os.PathLike[str]) -> Trace:
    """Open a trace lazily. Raises NotATrace / UnsupportedVersion / InvalidTrace."""
    return Trace(path)


def _as_str(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, np.ndarray) and value.shape == ():
        return _as_str(value.item())
    return str(value) if value is not None else ""


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value
