"""Append-only trace writer (HDF5, SWMR) with bounded-interval flushing.

Crash consistency comes from SWMR: every object exists before writing starts, afterwards only
chunked datasets grow, and HDF5 orders its metadata writes so that a reader opening the file
at any instant (even after SIGKILL) sees a consistent state as of the last flush. Rows are
buffered in memory between flushes; a daemon thread flushes at least every
`flush_interval_s`, so a killed process loses at most that interval, and memory stays bounded
(a buffer past `max_buffer_rows` wakes the flusher early).

Two locks, because the recorder appends from the model's thread at every decode step: appending
takes only `_buf_lock` (held for a list operation), never the HDF5 lock that payload writes and
flushes hold for milliseconds. A flush swaps the buffers out under `_buf_lock`, then converts and
writes them under the HDF5 lock. Rows may be buffered as tuples or as :class:`RowBlock` objects
whose conversion to a numpy array is deferred to the flusher, off the model's thread.

Storage faults (disk full, EFBIG past RLIMIT_FSIZE, EIO, the file deleted or its directory
removed) never reach HDF5 as errors: the file goes through :class:`~kvtrace.format.storage.GuardedFile`
(h5py's ``fileobj`` driver), which on the first failure stops sending anything to the disk. The
writer then enters its failed state: every later append, flush and payload is a cheap no-op,
:attr:`TraceWriter.failure` says why, and ``close()`` closes HDF5 against the in-memory overlay
and stamps ``/stop`` in place. The file keeps everything up to its last completed flush (spec §8).

Why one module over 600 lines: buffering, flushing, the failed state and the fork/exit handling
share the two locks and the buffers above; split apart, each piece would reach into the others'
state.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import io
import os
import platform
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, BinaryIO

import h5py
import numpy as np

from kvtrace._version import __version__
from kvtrace.format import schema
from kvtrace.format.codec import encode_chunks
from kvtrace.format.storage import GuardedFile, StorageFault, fault_from, open_raw

LIBVER = ("v110", "v110")  # superblock v3: needed by SWMR, opens in HDF5 >= 1.10
# Rows per table chunk. A flush recompresses the partly filled last chunk of each table it
# touches: 256 rows cost ~60% of the CPU of 1024 per flush (held with the GIL) and leave less
# dead space from rewritten chunks (bench numbers in docs/benchmarks.md, "Recorder overhead").
TABLE_CHUNK_ROWS = 256
TEXT_CHUNK_BYTES = 64 * 1024
TEXT_MAX_BYTES = 1 << 20  # one string; longer ones are cut and say so


_YIELD_EVERY_NS = 500_000
_PAYLOAD_GROW_CHUNKS = 64  # 16 MiB of extent per payload dataset at least, per growth


def monotonic_ns() -> int:
    """The trace clock: monotonic nanoseconds, anchored to wall time in /meta."""
    return time.monotonic_ns()


@functools.cache  # reading package metadata costs ~2 ms a name; it cannot change in a process
def _package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unavailable"


@dataclass(frozen=True)
class DeviceInfo:
    index: int  # CUDA ordinal; -1 for the CPU
    name: str
    total_memory_bytes: int  # -1 when unknown
    uuid: str = ""


@dataclass
class EncodedPayload:
    """A sampled tensor already split into encoded chunks (done outside the writer lock): the
    schema's PAYLOAD_DESCRIPTION fields, then where its chunks go (itemsize, n_elements, frames)."""

    request: int
    step: int
    layer: int
    kind: schema.PayloadKind
    dtype: schema.CacheDType
    shape: tuple[int, ...]
    itemsize: int
    n_elements: int
    frames: list[bytes]
    head_start: int = 0
    head_stride: int = 1
    token_start: int = 0
    t_ns: int = 0


def encode_payload(
    request: int,
    step: int,
    layer: int,
    kind: schema.PayloadKind,
    dtype: schema.CacheDType,
    raw: np.ndarray,
    *,
    shape: Sequence[int] | None = None,
    head_start: int = 0,
    head_stride: int = 1,
    token_start: int = 0,
    t_ns: int | None = None,
    level: int = 3,
) -> EncodedPayload:
    """Compress a tensor's raw elements (any numpy view of the right itemsize) into chunks.

    `raw` carries the bits: bf16 as uint16, fp8 as uint8, fp32 as float32 or uint32.
    """
    itemsize = schema.DTYPE_ITEMSIZE[schema.CacheDType(dtype)]
    if raw.dtype.itemsize != itemsize:
        raise ValueError(f"raw itemsize {raw.dtype.itemsize} does not match {dtype.name}")
    shape = tuple(int(s) for s in (raw.shape if shape is None else shape))
    if len(shape) > schema.PAYLOAD_MAX_NDIM:
        raise ValueError(f"payloads have at most {schema.PAYLOAD_MAX_NDIM} dimensions")
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if n != raw.size:
        raise ValueError(f"shape {shape} does not match {raw.size} elements")
    carrier = np.ascontiguousarray(raw).view(schema.payload_carrier(itemsize)).reshape(-1)
    frames = encode_chunks(carrier, schema.payload_chunk_elements(itemsize), level=level)
    return EncodedPayload(
        request, step, layer, schema.PayloadKind(kind), schema.CacheDType(dtype), shape,
        itemsize, n, frames, head_start, head_stride, token_start,
        monotonic_ns() if t_ns is None else t_ns,
    )


class TraceWriter:
    """Writes one trace file. Thread-safe; all HDF5 calls happen under one lock.

    ``on_failure`` is called once, from whichever thread met the first storage fault, after the
    writer stopped writing; it must not raise. ``raw`` replaces the file opened at ``path`` (an
    unbuffered binary file object; tests inject faults with it)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        meta: Mapping[str, Any] | None = None,
        devices: Iterable[DeviceInfo] = (),
        *,
        flush_interval_s: float = 1.0,
        max_buffer_rows: int = 8192,
        payload_level: int = 3,
        on_failure: Callable[[StorageFault], None] | None = None,
        raw: BinaryIO | None = None,
    ) -> None:
        if not 0 < flush_interval_s <= 60:
            raise ValueError("flush_interval_s must be in (0, 60]")
        self.path = Path(path)
        self.flush_interval_s = flush_interval_s
        self.max_buffer_rows = max_buffer_rows
        self.payload_level = payload_level
        self._lock = threading.RLock()  # HDF5 calls and the file's own state (row counts, chunks)
        self._buf_lock = threading.Lock()  # in-memory buffers only: held for microseconds
        self._closed = False
        self._flushes = 0
        self._buffers: dict[str, list[tuple]] = {name: [] for name in schema.TABLES}
        self._rows_written: dict[str, int] = {name: 0 for name in schema.TABLES}
        self._text_buffer: list[bytes] = []
        self._text_size = 0
        self._text_written = 0
        self._request_rows: dict[int, int] = {}  # request id -> its row index in /requests
        self._requests_taken = 0  # /requests rows a flush has taken from the buffer (written or writing)
        self._request_updates: dict[int, dict[str, Any]] = {}  # row index -> fields, for rows taken
        self._payload_chunks = {s: 0 for s in schema.PAYLOAD_ITEMSIZES}  # chunks in use
        self._payload_extent = {s: 0 for s in schema.PAYLOAD_ITEMSIZES}  # chunks the extent spans
        # Row tables, text and status by name, opened once: a flush writes ~10 of them through
        # h5py's low-level calls (the high-level path looks each up and rebuilds its dtype).
        self._ds: _Handles = _Handles()
        self._mtypes: dict[str, Any] = {}  # HDF5 memory type per table: built once per process
        # What the writer's own work cost so far (read by bench_overhead.py): flushes, their wall
        # and CPU time (the CPU part holds the GIL: time the model's thread cannot run).
        self.flush_count = 0
        self.flush_ns = 0
        self.flush_cpu_ns = 0
        self._last_yield_ns = 0
        self._payload_unflushed = False  # payload chunks written since the last H5Fflush
        self._stop_offset: int | None = None
        self.failure: StorageFault | None = None  # set once, on the first storage fault
        self._on_failure = on_failure
        self._io = GuardedFile(open_raw(self.path) if raw is None else raw)
        try:
            # The empty layout (19 datasets with their descriptions) is built once per process
            # and copied: creating it through h5py took most of a session's open.
            self._io.seek(0)
            self._io.write(_layout_image(payload_level))
            self._file = h5py.File(self._io, "r+", libver=LIBVER)
        except BaseException:
            self._io.close_raw()
            raise
        try:
            self._open_layout(meta or {}, list(devices))
            self._file.swmr_mode = True
            self._file.flush()
        except BaseException:
            self._close_file()
            raise
        if self._io.fault is not None:  # the empty layout did not fit: fail now, nothing recorded yet
            fault = self._io.fault
            self._close_file()
            if raw is None:
                with contextlib.suppress(OSError):
                    self.path.unlink()  # what we created holds nothing a reader could use
            raise OSError(fault.errno or errno.EIO, f"cannot write trace {self.path}: {fault.describe()}")
        self._stop_offset = self._ds["stop"].id.get_offset()  # contiguous: fixed address
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by append() when a buffer passes max_buffer_rows
        self._flusher = threading.Thread(target=self._flush_loop, name="kvtrace-flush", daemon=True)
        self._flusher.start()
        _OPEN_WRITERS.add(self)

    # ---- layout -----------------------------------------------------------------------------

    def _open_layout(self, meta: Mapping[str, Any], devices: list[DeviceInfo]) -> None:
        """This trace's own part of the layout (``/meta``, ``/devices``) over the copied image,
        and the handles the writer keeps."""
        f = self._file
        g = f["meta"]
        for key, value in self._complete_meta(meta).items():
            g.attrs[key] = schema.meta_attr_value(key, value)
        self._ds.file = f  # datasets open on first use: a session touches about half of them
        self._mtypes = _memory_types()
        if devices:
            rows = [
                schema.DeviceRow(d.index, name=d.name.encode()[:64], total_memory_bytes=d.total_memory_bytes,
                                 uuid=d.uuid.encode()[:64])
                for d in devices
            ]
            self._append_array("devices", 0, np.array(rows, dtype=schema.DEVICES))
            self._rows_written["devices"] = len(rows)

    @staticmethod
    def _complete_meta(meta: Mapping[str, Any]) -> dict[str, Any]:
        """The declared defaults (schema.META), the values only this process knows, then ``meta``."""
        out: dict[str, Any] = {a.name: a.default for a in schema.META if a.default is not None}
        out.update(
            kvtrace_version=__version__,
            python_version=platform.python_version(),
            torch_version=_package_version("torch"),
            transformers_version=_package_version("transformers"),
            clock_anchor_wall_ns=time.time_ns(),
            clock_anchor_mono_ns=monotonic_ns(),
        )
        out.update(meta)
        unknown = [k for k in out if not isinstance(k, str) or not k.isidentifier()]
        if unknown:
            raise ValueError(f"meta keys must be identifiers: {unknown}")
        return out

    # ---- appending ------------------------------------------------------------------------------

    def append(self, table: str, row: tuple | Sequence[tuple] | RowBlock) -> None:
        """Buffer one row (a tuple in the table's field order), a list of rows, or a
        :class:`RowBlock` (converted later, by the flusher)."""
        if self.failure is not None:
            return
        with self._buf_lock:
            self._check_open()
            buf = self._buffers[table]
            if isinstance(row, list):
                buf.extend(row)
            else:
                buf.append(row)
            pending = len(buf)
        if pending >= self.max_buffer_rows:
            if pending >= 4 * self.max_buffer_rows:  # the flusher is not keeping up: write here
                with self._lock, self._writing():
                    self._drain_buffers(tables=(table,))
            else:
                self._wake.set()

    def add_text(self, text: str) -> tuple[int, int]:
        """Store a string in the text heap; returns (offset, length) for a row to reference."""
        data = text.encode("utf-8", errors="replace")
        if len(data) > TEXT_MAX_BYTES:
            data = data[: TEXT_MAX_BYTES - 16] + b"...[truncated]"
        if not data or self.failure is not None:
            return (0, 0)
        with self._buf_lock:
            self._check_open()
            off = self._text_size
            self._text_buffer.append(data)
            self._text_size += len(data)
            return (off, len(data))

    def begin_request(self, row: tuple) -> None:
        """Append a request row now (outcome RUNNING) so a crash still leaves it visible. Takes
        only the buffer lock: a request start never waits behind a flush or a payload write."""
        with self._buf_lock:
            self._check_open()
            if self.failure is not None:
                return
            self._request_rows[int(row[0])] = self._requests_taken + len(self._buffers["requests"])
            self._buffers["requests"].append(tuple(row))

    def update_request(self, request_id: int, **fields: Any) -> None:
        """Rewrite fields of a request row (outcome, end_ns, new_tokens, ...). Takes only the
        buffer lock: a row still buffered is edited there; one a flush already took is rewritten
        by the next flush (rows first, then these updates), never on the caller's thread."""
        unknown = set(fields) - set(schema.REQUESTS.names)
        if unknown:
            raise ValueError(f"/requests has no field(s) {', '.join(sorted(unknown))}")
        with self._buf_lock:
            self._check_open()
            if self.failure is not None:
                return
            index = self._request_rows[request_id]
            if index >= self._requests_taken:
                buf = self._buffers["requests"]
                names = schema.REQUESTS.names
                row = list(buf[index - self._requests_taken])
                for k, v in fields.items():
                    row[names.index(k)] = v
                buf[index - self._requests_taken] = tuple(row)
            else:
                self._request_updates.setdefault(index, {}).update(fields)

    def write_payload(self, payload: EncodedPayload) -> bool:
        """Store pre-encoded chunks with write_direct_chunk and index them. False (nothing
        stored) once the writer has stopped on a storage fault."""
        with self._lock:
            self._check_open()
            if self.failure is not None:
                return False
            itemsize = payload.itemsize
            ds = self._ds[schema.payload_dataset_name(itemsize)]
            chunk = schema.payload_chunk_elements(itemsize)
            first = self._payload_chunks[itemsize]
            n = len(payload.frames)
            with self._writing():
                self._reserve_chunks(itemsize, first + n)
                for i, frame in enumerate(payload.frames):
                    ds.id.write_direct_chunk(((first + i) * chunk,), frame, filter_mask=0)
                    if self._io.fault is not None:
                        break
                    self._maybe_yield_gil()
            if self.failure is not None:
                return False
            self._payload_chunks[itemsize] = first + n
            self._payload_unflushed = True
            row = schema.payload_index_row(payload, first_chunk=first, n_chunks=n)
            with self._buf_lock:
                self._buffers["payloads/index"].append(row)
            return True

    def _maybe_yield_gil(self) -> None:
        """Let a thread waiting for the GIL (the model's) in about every 0.5 ms of chunk writes:
        often enough that it never waits long, rarely enough that each hand-over (two thread
        switches) stays cheap next to the writing."""
        now = time.perf_counter_ns()
        if now - self._last_yield_ns >= _YIELD_EVERY_NS:
            _yield_gil()
            self._last_yield_ns = time.perf_counter_ns()

    def _reserve_chunks(self, itemsize: int, needed: int) -> None:
        """Grow a payload dataset's extent ahead of use, by half again at least 64 chunks: a
        resize holds the GIL for a B-tree update, and one per payload stalled the model's thread
        after every sampling step (bench/sampling_phases.py). Unwritten chunks take no space in
        the file; close() trims the extent to what is used."""
        extent = self._payload_extent[itemsize]
        if needed <= extent:
            return
        extent = max(needed, extent + extent // 2, _PAYLOAD_GROW_CHUNKS)
        self._ds[schema.payload_dataset_name(itemsize)].resize((extent * schema.payload_chunk_elements(itemsize),))
        self._payload_extent[itemsize] = extent

    def _trim_payload_extents(self) -> None:
        for itemsize in schema.PAYLOAD_ITEMSIZES:
            used = self._payload_chunks[itemsize]
            if self._payload_extent[itemsize] > used:
                self._ds[schema.payload_dataset_name(itemsize)].resize((used * schema.payload_chunk_elements(itemsize),))
                self._payload_extent[itemsize] = used

    # ---- flushing ------------------------------------------------------------------------------

    def _take_buffers(
        self, tables: Iterable[str]
    ) -> tuple[list[bytes], dict[str, list], dict[int, dict[str, Any]]]:
        """Swap out the text heap, the named tables' buffers and the pending request-row updates
        in one step (under _buf_lock), so every row taken can only reference text taken with it
        or earlier, and every update taken applies to a row already written or taken with it."""
        with self._buf_lock:
            text, self._text_buffer = self._text_buffer, []
            taken = {}
            for table in tables:
                if self._buffers[table]:
                    taken[table], self._buffers[table] = self._buffers[table], []
            self._requests_taken += len(taken.get("requests", ()))
            updates: dict[int, dict[str, Any]] = {}
            if "requests" in tables:
                updates, self._request_updates = self._request_updates, {}
        return text, taken, updates

    def _drain_buffers(self, tables: Iterable[str] = schema.TABLES) -> None:
        """Write buffered text, then rows, then request-row updates to the file. Caller holds
        ``_lock``."""
        text, taken, updates = self._take_buffers(tables)
        try:
            # What other rows refer to goes first, then one H5Fflush, then the rest: text (rows
            # point into it), request and layer rows (rows name them), and the chunk index of
            # payloads written since the last flush (/payloads/index rows point at chunks). One
            # file flush orders them; without it HDF5 may write the datasets of one flush in any
            # order, and a crash could leave a row pointing past what its target holds.
            had_text = bool(text)
            self._write_text(text)
            referenced = [t for t in _REFERENCED if t in taken]
            for table in referenced:
                self._write_rows(table, taken[table])
                del taken[table]
            if taken and (had_text or referenced or self._payload_unflushed) and self._io.fault is None:
                self._file.flush()
                self._payload_unflushed = False
            while taken:
                table = next(iter(taken))
                self._write_rows(table, taken[table])
                del taken[table]
                if self._io.fault is not None:
                    return  # the failed state drops what is left
                _yield_gil()  # between tables, let the model's thread run
            while updates:
                index, fields = updates.popitem()
                self._rewrite_request(index, fields)
                if self._io.fault is not None:
                    return
        except BaseException:
            # Not written: put it back in front of anything buffered since, for the next flush.
            with self._buf_lock:
                self._text_buffer[:0] = text
                for table, rows in taken.items():
                    self._buffers[table][:0] = rows
                self._requests_taken -= len(taken.get("requests", ()))
                for index, fields in updates.items():  # later updates win over these
                    self._request_updates[index] = {**fields, **self._request_updates.get(index, {})}
            raise

    def _rewrite_request(self, index: int, fields: dict[str, Any]) -> None:
        ds = self._ds["requests"]
        current = ds[index]
        for k, v in fields.items():
            current[k] = v
        ds[index] = current

    def _write_rows(self, table: str, buf: list) -> None:
        if not buf:
            return
        arr = _rows_array(buf, schema.TABLES[table][0])
        start = self._rows_written[table]
        self._append_array(table, start, arr)
        self._rows_written[table] = start + len(arr)

    def _append_array(self, name: str, start: int, arr: np.ndarray) -> None:
        """Grow dataset ``name`` to ``start + len(arr)`` and write ``arr`` there: what
        ``ds.resize(...); ds[start:] = arr`` does, minus h5py's per-call lookups and dtype rebuilds
        (a flush holds the GIL throughout; the model's thread waits for it)."""
        dsid = self._ds[name].id
        n = len(arr)
        dsid.set_extent((start + n,))
        fspace = dsid.get_space()
        fspace.select_hyperslab((start,), (n,))
        dsid.write(h5py.h5s.create_simple((n,)), fspace, np.ascontiguousarray(arr), mtype=self._mtypes[name])

    def _write_text(self, pieces: list[bytes]) -> None:
        if not pieces:
            return
        data = np.frombuffer(b"".join(pieces), dtype=np.uint8)
        self._append_array("text", self._text_written, data)
        self._text_written += data.size
        pieces.clear()

    def flush(self) -> None:
        """Write every buffered row and make it visible to readers (and to crash recovery)."""
        with self._lock:
            if self._closed or self.failure is not None:
                return
            t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            with self._writing():
                self._io.check_linked()
                if self._io.fault is None:
                    self._drain_buffers()
                if self._io.fault is None:
                    self._flushes += 1
                    self._write_status(0, self._flushes)
                    self._file.flush()
            self.flush_count += 1
            self.flush_ns += time.perf_counter_ns() - t0
            self.flush_cpu_ns += time.thread_time_ns() - c0

    def _write_status(self, closed_ns: int, flushes: int) -> None:
        row = np.array([schema.StatusRow(closed_ns, monotonic_ns(), flushes)], dtype=schema.STATUS)
        self._ds["status"].id.write(h5py.h5s.ALL, h5py.h5s.ALL, row)

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Around HDF5 writes (caller holds ``_lock``): a storage fault met inside, or any error
        HDF5 raises, puts the writer in its failed state and is not raised. After an error
        HDF5's caches are in an unknown state, so nothing more goes to the disk either way."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - the recorder never harms the user's run
            if self._io.fault is None:
                self._io.fail(fault_from(exc, "hdf5"))
        if self._io.fault is not None and self.failure is None:
            self._enter_failed(self._io.fault)

    def _enter_failed(self, fault: StorageFault) -> None:
        """Stop for good: drop what is buffered, stop the flusher, tell the owner once."""
        self.failure = fault
        with self._buf_lock:
            for buf in self._buffers.values():
                buf.clear()
            self._text_buffer.clear()
        self._stop.set()
        self._wake.set()
        if self._on_failure is not None:
            try:
                self._on_failure(fault)
            except Exception:  # noqa: BLE001, S110 - a callback must not undo the failed state
                pass

    def flush_soon(self) -> None:
        """Ask the flusher thread to flush now and return at once (the caller's thread writes
        nothing): rows appended before this call reach the file within milliseconds."""
        self._wake.set()

    def _flush_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return  # close() does the final flush
            try:
                self.flush()
            except Exception:  # noqa: BLE001, S110 - a failed flush must not kill the host process
                pass  # flush() turns write errors into the failed state; nothing else is expected

    def close(self) -> None:
        """Flush, mark the trace complete, close. Safe to call twice. After a storage fault the
        trace is not marked complete: ``/stop`` says why it stopped (where the disk still takes
        that in-place write) and it holds everything up to its last completed flush."""
        self._stop.set()
        self._wake.set()
        if self._flusher.is_alive() and threading.current_thread() is not self._flusher:
            self._flusher.join(timeout=5)
        with self._lock:
            if self._closed:
                return
            if self.failure is None:
                with self._writing():
                    self._trim_payload_extents()
                self.flush()
                if self.failure is None:
                    # The complete stamp goes out with HDF5's close (which flushes): after the
                    # rows it vouches for, which the flush above already wrote (spec §8).
                    with self._writing():
                        self._write_status(monotonic_ns(), self._flushes)
            self._closed = True
            self._close_file()
            if self._io.fault is not None and self.failure is None:  # HDF5's own close failed
                self._enter_failed(self._io.fault)

    def _close_file(self) -> None:
        """Close HDF5, stamp /stop after a fault, close the file under it. After a fault HDF5's
        last writes go to the overlay, never to the disk."""
        try:
            self._file.close()
        except Exception as exc:  # noqa: BLE001 - close is best effort once writing failed
            self._io.fail(fault_from(exc, "hdf5"))
        fault = self._io.fault
        if fault is not None and self._stop_offset is not None and fault.operation != _FORKED:
            # In place: these bytes already exist, so a full disk still takes them; a failing
            # device may not, and then the trace is simply incomplete.
            reason = fault.describe().encode("utf-8", errors="replace")[:128]
            row = np.array([schema.StopRow(monotonic_ns(), fault.errno, reason)], dtype=schema.STOP)
            self._io.raw_write(int(self._stop_offset), row.tobytes())
        self._io.close_raw()

    def _close_at_exit(self) -> None:
        """A writer still open at interpreter exit: flush and close it (not marked complete).
        HDF5 would otherwise close it from its own exit handler, calling the fileobj driver
        back into an interpreter that is gone (a segfault)."""
        self._stop.set()
        self._wake.set()
        with self._lock:
            if self._closed:
                return
            self.flush()
            self._closed = True
            self._close_file()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def failed(self) -> bool:
        """True once a storage fault stopped the writer (see :attr:`failure`)."""
        return self.failure is not None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("trace writer is closed")

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Tables whose rows other rows refer to (by request id, layer index): written and flushed first.
_REFERENCED = ("requests", "layers", "devices")

_OPEN_WRITERS: weakref.WeakSet[TraceWriter] = weakref.WeakSet()


_FORKED = "fork"


@atexit.register
def _close_open_writers() -> None:
    for writer in list(_OPEN_WRITERS):
        try:
            writer._close_at_exit()
        except Exception:  # noqa: BLE001, S110 - exiting anyway; the file keeps its last flush
            pass


def _detach_in_child() -> None:
    """A forked child inherits open writers (and their file); it must never write to the parent's
    trace. Each one is put in the failed state without a callback or /stop stamp, so whatever
    the child does, including its exit-time close, goes to the overlay. Fresh locks: another
    thread of the parent may have held them at the fork."""
    for writer in list(_OPEN_WRITERS):
        writer._lock = threading.RLock()
        writer._buf_lock = threading.Lock()
        fault = StorageFault(0, "inherited by a forked child process", _FORKED, -1)
        writer._io.fail(fault)
        writer.failure = fault


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_detach_in_child)


class _Handles(dict):
    """Datasets by name, opened from ``file`` on first use (opening an existing dataset is
    allowed in SWMR mode; only creating one is not)."""

    file: Any = None

    def __missing__(self, name: str) -> h5py.Dataset:
        ds = self[name] = self.file[name]
        return ds


class RowBlock:
    """Rows whose numpy conversion is deferred to the flusher (see the module docstring).
    Subclasses return a structured array of the table's dtype from :meth:`rows_array`."""

    __slots__ = ()

    def rows_array(self, dtype: np.dtype) -> np.ndarray:
        raise NotImplementedError


def _rows_array(buf: list, dtype: np.dtype) -> np.ndarray:
    """One structured array from buffered tuples and RowBlocks, in buffer order."""
    parts: list[np.ndarray] = []
    run: list[tuple] = []
    for item in buf:
        if isinstance(item, RowBlock):
            if run:
                parts.append(np.array(run, dtype=dtype))
                run = []
            parts.append(item.rows_array(dtype))
        else:
            run.append(item)
    if run:
        parts.append(np.array(run, dtype=dtype))
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


@functools.cache
def _memory_types() -> dict[str, Any]:
    """HDF5 memory types of the row tables and the text heap (transient types serve any file)."""
    types = {name: h5py.h5t.py_create(table.hdf5_dtype) for name, table in schema.TABLE_DECLS.items()}
    types["text"] = h5py.h5t.py_create(np.dtype("u1"))
    return types


@functools.cache
def _layout_image(payload_level: int) -> bytes:
    """The bytes of an empty trace: every group and dataset of the layout with its description
    attributes, /status and /stop allocated and zeroed, /meta without attributes. What SWMR
    needs (every object exists before writing starts) is all here; a writer copies it, adds
    its /meta attributes and /devices rows, and starts SWMR."""
    bio = io.BytesIO()
    with h5py.File(bio, "w", libver=LIBVER) as f:
        f.attrs["format"] = schema.FORMAT_NAME
        f.attrs["format_version"] = schema.FORMAT_VERSION
        f.attrs["format_major"] = schema.FORMAT_MAJOR
        f.attrs["format_minor"] = schema.FORMAT_MINOR
        f.create_group("meta")
        for name, table in schema.TABLE_DECLS.items():
            ds = f.create_dataset(
                name, shape=(0,), maxshape=(None,), dtype=table.hdf5_dtype, chunks=(TABLE_CHUNK_ROWS,),
                compression="gzip", compression_opts=1, shuffle=True,
            )
            _describe(ds, table.attributes())
        text = f.create_dataset(
            "text", shape=(0,), maxshape=(None,), dtype="u1", chunks=(TEXT_CHUNK_BYTES,),
            compression="gzip", compression_opts=1,
        )
        _describe(text, schema.TEXT_ATTRS)
        for itemsize in schema.PAYLOAD_ITEMSIZES:
            chunk = schema.payload_chunk_elements(itemsize)
            ds = f.create_dataset(
                schema.payload_dataset_name(itemsize), shape=(0,), maxshape=(None,),
                dtype=schema.payload_carrier(itemsize), chunks=(chunk,), shuffle=True,
                compression=schema.FILTER_ZSTD, compression_opts=(payload_level,),
                allow_unknown_filter=True,
            )
            _describe(ds, schema.PAYLOAD_CARRIER_ATTRS)
        for group, description in schema.GROUP_DESCRIPTIONS.items():
            f[group].attrs["description"] = description
        status = f.create_dataset("status", shape=(1,), dtype=schema.STATUS)
        status[0] = schema.StatusRow(closed_ns=0, last_flush_ns=0, flushes=0)
        _describe(status, schema.STATUS_TABLE.attributes())
        stop = f.create_dataset("stop", shape=(1,), dtype=schema.STOP)  # contiguous, allocated now
        stop[0] = schema.StopRow(stopped_ns=0, errno=0, reason=b"")
        _describe(stop, schema.STOP_TABLE.attributes())
    return bio.getvalue()


def _yield_gil() -> None:
    """Release the GIL between HDF5 calls so a thread waiting for it (the model's) runs now: a
    background thread that keeps running Python holds it until the 5 ms switch interval forces a
    hand-over. (h5py itself releases the GIL inside dataset reads and writes.)"""
    time.sleep(0)


def _describe(obj: h5py.HLObject, attrs: Mapping[str, Any]) -> None:
    """Self-description attributes (1.3): strings, or lists of strings (one per column)."""
    for key, value in attrs.items():
        obj.attrs.create(key, value, dtype=h5py.string_dtype())
