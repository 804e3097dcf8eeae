"""The file under the trace writer: a file object for h5py's ``fileobj`` driver that turns the
first failed write into a "stopped" state instead of an HDF5 error.

Why: when a write fails under HDF5's own (sec2) driver, HDF5 sees the error half-way through a
metadata flush, keeps going with partly-updated caches, rewrites the superblock with an end of
file that was never written, and later crashes (seen: SIGSEGV after ~200 "Exception ignored"
tracebacks, files that cannot be opened). Here HDF5 never sees an I/O error. On the first failed
write, truncate or flush :class:`GuardedFile` records the fault and from then on sends nothing
to the disk: later writes land in an in-memory overlay (so HDF5 reads back what it believes it
wrote, and its close finishes normally) and are discarded at close. The file on disk is then
exactly what it was at the instant of the fault, which is what a SIGKILL at that instant leaves:
SWMR write ordering keeps that consistent as of the last completed flush (spec §8).
"""

from __future__ import annotations

import errno
import io
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

# Writes HDF5 makes after a fault (the rest of the failing call, then close) are metadata and
# cached chunks: a few MiB. Past this the overlay stops keeping them (reads of those bytes then
# see the disk's old bytes; the file on disk is unaffected either way).
OVERLAY_MAX_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class StorageFault:
    """The first failed operation on a trace file."""

    errno: int  # 0 when the failure carried no errno
    strerror: str
    operation: str  # "write", "truncate", "flush", "read", "unlinked"
    offset: int  # file offset of a failed write or read; the size for truncate; -1 otherwise

    @property
    def errno_name(self) -> str:
        return errno.errorcode.get(self.errno, f"errno {self.errno}") if self.errno else "error"

    def describe(self) -> str:
        if not self.errno:  # not an OS error: HDF5 or the writer itself failed
            return f"{self.strerror} during {self.operation}"
        where = f" at offset {self.offset}" if self.operation in ("write", "read") and self.offset >= 0 else ""
        return f"{self.errno_name} ({self.strerror}) on {self.operation}{where}"


def fault_from(exc: BaseException, operation: str, offset: int = -1) -> StorageFault:
    code = getattr(exc, "errno", None) or 0
    text = getattr(exc, "strerror", None) if code else f"{type(exc).__name__}: {exc}"
    return StorageFault(int(code), str(text or exc), operation, offset)


class GuardedFile:
    """What h5py's ``fileobj`` driver calls (seek, tell, readinto, write, truncate, flush),
    over a raw binary file. Not thread-safe on its own: h5py serialises every call into HDF5
    (and the writer holds its lock around them)."""

    def __init__(self, raw: BinaryIO, *, on_fault: Callable[[StorageFault], None] | None = None) -> None:
        self._raw = raw
        self._pos = 0
        self._size = raw.seek(0, io.SEEK_END)
        self.fault: StorageFault | None = None
        self._on_fault = on_fault
        self._overlay: list[tuple[int, bytes]] = []
        self._overlay_bytes = 0

    # ---- what the driver calls ------------------------------------------------------------------

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            self._pos = pos
        elif whence == io.SEEK_CUR:
            self._pos += pos
        else:
            self._pos = self._size + pos
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, size: int = -1) -> bytes:
        n = max(0, self._size - self._pos) if size < 0 else size
        buf = bytearray(n)
        self.readinto(buf)
        return bytes(buf)

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        n, pos = view.nbytes, self._pos
        got = 0
        try:
            self._raw.seek(pos)
            while got < n:
                k = self._raw.readinto(view[got:])
                if not k:
                    break  # past the end: HDF5 expects zeros there, as sec2 gives
                got += k
        except OSError as exc:
            if self.fault is None:
                self.fail(fault_from(exc, "read", pos))
        view[got:] = bytes(n - got)
        for off, data in self._overlay:  # writes since the fault, in order
            lo, hi = max(off, pos), min(off + len(data), pos + n)
            if lo < hi:
                view[lo - pos : hi - pos] = data[lo - off : hi - off]
        self._pos = pos + n
        return n

    def write(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        n, pos = view.nbytes, self._pos
        if pos == 0:
            view = _mark_open_for_write(view)
        if self.fault is None:
            try:
                self._write_all(view, pos)
            except OSError as exc:
                self.fail(fault_from(exc, "write", pos))
        if self.fault is not None and self._overlay_bytes + n <= OVERLAY_MAX_BYTES:
            self._overlay.append((pos, bytes(view)))
            self._overlay_bytes += n
        self._pos = pos + n
        self._size = max(self._size, self._pos)
        return n

    def truncate(self, size: int | None = None) -> int:
        size = self._pos if size is None else size
        if self.fault is None:
            try:
                self._raw.truncate(size)
            except OSError as exc:
                self.fail(fault_from(exc, "truncate", size))
        self._size = size
        return size

    def flush(self) -> None:
        if self.fault is None:
            try:
                self._raw.flush()
            except OSError as exc:
                self.fail(fault_from(exc, "flush"))

    # h5py only checks for these to choose the driver; the rest of io's interface is not used.
    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    # ---- the writer's side -------------------------------------------------------------------------

    def check_linked(self) -> None:
        """Stop if the file was deleted (or its directory removed) while open: writes to an
        unlinked file succeed and are lost at close, so carrying on only fills the disk."""
        if self.fault is not None:
            return
        try:
            links = os.fstat(self._raw.fileno()).st_nlink
        except (OSError, AttributeError, io.UnsupportedOperation):
            return  # not a real file (tests) or fstat unavailable: nothing to check
        if links == 0:
            self.fail(StorageFault(errno.ENOENT, "the trace file was deleted or its directory removed",
                                    "unlinked", -1))

    def raw_write(self, offset: int, data: bytes) -> bool:
        """One deliberate in-place write after a fault (the /status stop stamp): overwrites bytes
        that already exist, so it needs no new space. False if it failed."""
        try:
            self._raw.seek(offset)
            self._write_all(memoryview(data), offset)
            self._raw.flush()
            return True
        except OSError:
            return False

    def close_raw(self) -> None:
        """Close the underlying file (after h5py closed; the overlay is dropped)."""
        self._overlay.clear()
        try:
            self._raw.close()
        except OSError as exc:  # e.g. EIO reported at close on NFS
            if self.fault is None:
                self.fail(fault_from(exc, "close"))

    def _write_all(self, view: memoryview, pos: int) -> None:
        self._raw.seek(pos)
        done = 0
        while done < view.nbytes:
            k = self._raw.write(view[done:])
            if not k:  # None (would block) or 0: no progress is a failure, not a retry loop
                raise OSError(errno.EIO, "write made no progress")
            done += k

    def fail(self, fault: StorageFault) -> None:
        """Enter the stopped state (the first fault wins; nothing reaches the disk after it)."""
        if self.fault is not None:
            return
        self.fault = fault
        if self._on_fault is not None:
            self._on_fault(fault)


# ---- superblock flags ----------------------------------------------------------------------------

_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_WRITE_ACCESS, _SWMR_WRITE_ACCESS = 0x01, 0x04  # superblock v2/v3 file consistency flags


def _mark_open_for_write(view: memoryview) -> memoryview:
    """HDF5 marks a file "open for write" (flag 0x01) only through drivers that can lock files,
    which the fileobj driver cannot: a SWMR writer through it leaves 0x04 alone, a state neither
    plain nor SWMR readers accept after a crash. Set 0x01 beside 0x04 in a v2/v3 superblock
    (recomputing its checksum), as HDF5's default driver has it; a clean close writes 0."""
    if view.nbytes < 12 or bytes(view[:8]) != _HDF5_SIGNATURE or view[8] not in (2, 3):
        return view
    flags, end = view[11], 12 + 4 * view[9]  # signature..flags, 4 addresses; then the checksum
    if not flags & _SWMR_WRITE_ACCESS or flags & _WRITE_ACCESS or view.nbytes < end + 4:
        return view
    patched = bytearray(view)
    patched[11] = flags | _WRITE_ACCESS
    patched[end : end + 4] = lookup3(bytes(patched[:end])).to_bytes(4, "little")
    return memoryview(patched)


def lookup3(data: bytes, initval: int = 0) -> int:
    """Bob Jenkins' lookup3 hash (hashlittle), HDF5's metadata checksum."""
    m = 0xFFFFFFFF

    def rot(x: int, k: int) -> int:
        return ((x << k) | (x >> (32 - k))) & m

    def words(block: bytes) -> None:
        for j in range(3):
            v[j] = (v[j] + int.from_bytes(block[4 * j : 4 * j + 4], "little")) & m

    n = len(data)
    v = [(0xDEADBEEF + n + initval) & m] * 3  # a, b, c
    i = 0
    while n - i > 12:
        words(data[i : i + 12])
        for x, y, z, k in _MIX:  # x -= y; x ^= rot(y, k); y += z
            v[x] = (v[x] - v[y]) & m ^ rot(v[y], k)
            v[y] = (v[y] + v[z]) & m
        i += 12
    if n == i:
        return v[2]
    words(data[i:] + bytes(12 - (n - i)))  # the missing bytes add nothing
    for x, y, k in _FINAL:  # x ^= y; x -= rot(y, k)
        v[x] = ((v[x] ^ v[y]) - rot(v[y], k)) & m
    return v[2]


_MIX = ((0, 2, 1, 4), (1, 0, 2, 6), (2, 1, 0, 8), (0, 2, 1, 16), (1, 0, 2, 19), (2, 1, 0, 4))
_FINAL = ((2, 1, 14), (0, 2, 11), (1, 0, 25), (2, 1, 16), (0, 2, 4), (1, 0, 14), (2, 1, 24))


def open_raw(path: str | os.PathLike[str]) -> BinaryIO:
    """The trace file, created or truncated, unbuffered (every write reaches the OS at once)."""
    return open(path, "w+b", buffering=0)  # noqa: SIM115 - closed by GuardedFile.close_raw


# ---- SIGXFSZ ------------------------------------------------------------------------------------

_sigxfsz_lock = threading.Lock()
_sigxfsz_users = 0
_sigxfsz_saved: Any = None


def hold_sigxfsz() -> bool:
    """While recording, a write past RLIMIT_FSIZE must fail with EFBIG, not kill the process with
    SIGXFSZ. CPython already ignores SIGXFSZ at start-up; an embedding application that kept the
    default action gets it ignored here until :func:`release_sigxfsz`. A handler the user
    installed is left alone (it decides), and so is everything outside the main thread (where
    signal.signal cannot be called). Returns whether this call changed the disposition."""
    global _sigxfsz_users, _sigxfsz_saved
    sig = getattr(signal, "SIGXFSZ", None)
    if sig is None or threading.current_thread() is not threading.main_thread():
        return False
    with _sigxfsz_lock:
        if _sigxfsz_users == 0:
            current = signal.getsignal(sig)
            if current != signal.SIG_DFL:
                return False
            signal.signal(sig, signal.SIG_IGN)
            _sigxfsz_saved = current
        _sigxfsz_users += 1
        return True


def release_sigxfsz() -> None:
    """Undo one successful :func:`hold_sigxfsz`; the last one restores the default action."""
    global _sigxfsz_users, _sigxfsz_saved
    sig = getattr(signal, "SIGXFSZ", None)
    if sig is None or threading.current_thread() is not threading.main_thread():
        return
    with _sigxfsz_lock:
        if _sigxfsz_users == 0:
            return
        _sigxfsz_users -= 1
        if _sigxfsz_users == 0 and _sigxfsz_saved is not None:
            if signal.getsignal(sig) == signal.SIG_IGN:  # nobody replaced ours meanwhile
                signal.signal(sig, _sigxfsz_saved)
            _sigxfsz_saved = None
