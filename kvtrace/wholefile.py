"""Output files written whole or not at all, and never through a link, for every writer of kvtrace
(JSON documents, HTML pages, Perfetto JSON, Parquet tables, manifests, figures).

Two kinds of output, two rules:

* **A path the user named** (``-o FILE``, ``--json-out FILE``): :func:`write_whole`. A regular
  file is written to a temporary beside it and renamed over it once the write finished (a full
  disk leaves neither a truncated file nor the temporary; an earlier file is kept). A symlink, a
  FIFO or a device (``/dev/stdout``, ``>(cmd)``) is written in place: the user named it, and
  renaming would replace ``/dev/stdout`` itself.
* **A file inside an output directory** (a fleet's tables and manifest, ``--figures`` files): the
  name comes from kvtrace or from data, never from the user, so :func:`create_in_dir` creates it
  fresh. Every directory on the way is opened without following symlinks (``O_NOFOLLOW``) and
  relative to its parent's descriptor, the temporary is created exclusively (``O_EXCL |
  O_NOFOLLOW``) in the final directory, and renamed over the final name: a symlink, a hard link, a
  FIFO or a device found there is replaced, never written through or opened; a symlinked
  directory on the way is refused (``ELOOP``/``ENOTDIR``). Names are checked by
  :func:`check_name` (a fixed alphabet, no leading dot, bounded length), so a name read from data
  cannot leave the directory. :func:`remove_in_dir` deletes the same way.

Temporaries are hidden (``.NAME.HOST.PID.RANDOM.part``: not matched by a ``*.parquet`` glob), never
predictable (a planted symlink cannot catch them), and removed on any exception; those a killed
process left are removed by :func:`clean_parts` (the fleet export runs it before each export). A
leaf module (standard library only): the format, the renderers and the commands all use it; the
caller turns the ``OSError`` into its own one-line error.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import socket
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

__all__ = ["UnsafeName", "check_name", "clean_parts", "create_in_dir", "failure_reason", "part_path",
           "remove_in_dir", "write_text_whole", "write_whole"]

# A name kvtrace may give a file or directory inside an output directory: ASCII letters, digits,
# '.', '_' and '-', not starting with a dot (no '.', '..', hidden files or temporaries), at most 128.
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
MAX_NAME_CHARS = 128
# A temporary of another host (dask workers on a shared file system) is removed only this old.
STALE_PART_SECONDS = 3600.0

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_PART = re.compile(r"\.(?P<name>.+)\.(?P<host>[0-9a-f]{8})\.(?P<pid>[0-9]{1,10})\.[0-9a-f]{8}\.part")


class UnsafeName(ValueError):
    """A name that may not name a file inside an output directory (see :func:`check_name`)."""


def check_name(name: object, what: str = "name") -> str:
    """``name`` when it may name a file inside an output directory, else :class:`UnsafeName` saying
    why. ``what`` names it in the message ("trace_id")."""
    if not isinstance(name, str):
        raise UnsafeName(f"{what} is not a string ({type(name).__name__})")
    if not NAME_PATTERN.fullmatch(name):
        shown = name if len(name) <= 40 else name[:40] + "..."
        raise UnsafeName(f"{what} {shown!r} is not a safe file name (1-{MAX_NAME_CHARS} of A-Z a-z 0-9 . _ -, "
                         "not starting with a dot)")
    return name


def failure_reason(exc: OSError) -> str:
    """Why a write failed, in the system's words ("No space left on device"): pyarrow's OSError
    carries the errno under a strerror of its own ("Error writing bytes to file. Detail: ...")."""
    return os.strerror(exc.errno) if exc.errno else str(exc.strerror or exc)


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode("utf-8", "replace")).hexdigest()[:8]


def _part_name(name: str) -> str:
    return f".{name}.{_host_tag()}.{os.getpid()}.{secrets.token_hex(4)}.part"


def part_path(path: Path) -> Path:
    """A fresh, unpredictable temporary name beside ``path`` (hidden, ends in ``.part``)."""
    return path.with_name(_part_name(path.name))


def _create_exclusive(name: str, dir_fd: int | None = None) -> int:
    """A new regular file, opened for writing: never an existing file, never through a symlink."""
    return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o666, dir_fd=dir_fd)


def write_whole(path: str | os.PathLike[str], write: Callable[[Path], object]) -> Path:
    """A path the user named: call ``write(p)`` on a temporary beside ``path`` and rename it over
    ``path`` when it returns; when it raises (``OSError`` on a full disk, or anything else) the
    temporary is removed and the exception propagates. A symlink, FIFO or device is written in
    place (see the module docstring). Returns ``path`` as a Path."""
    p = Path(path)
    if p.is_symlink() or (p.exists() and not p.is_file()):
        write(p)
        return p
    part = part_path(p)
    os.close(_create_exclusive(str(part)))  # ours, empty: the writer opens a file we just made
    try:
        write(part)
        os.replace(part, p)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return p


def write_text_whole(path: str | os.PathLike[str], text: str) -> Path:
    """:func:`write_whole` of a UTF-8 text."""

    def write(p: Path) -> None:
        with open(p, "w", encoding="utf-8") as fh:
            fh.write(text)

    return write_whole(path, write)


@contextlib.contextmanager
def _open_dirs(root: str | os.PathLike[str], parts: Sequence[str], *, create: bool) -> Iterator[int | None]:
    """A descriptor of ``root/parts...``, every part opened relative to its parent without following
    a symlink; missing parts are made when ``create`` (else None is yielded). ``root`` itself is the
    user's (it may be a symlink to a directory)."""
    fds = [os.open(root, os.O_RDONLY | _DIRECTORY | _CLOEXEC)]
    try:
        for part in parts:
            check_name(part, "directory name")
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o777, dir_fd=fds[-1])
            try:
                fds.append(os.open(part, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=fds[-1]))
            except FileNotFoundError:
                if create:
                    raise
                yield None
                return
        yield fds[-1]
    finally:
        for fd in fds:
            os.close(fd)


def create_in_dir(root: str | os.PathLike[str], rel: Sequence[str], write: Callable[[BinaryIO], object]) -> Path:
    """Create ``root/rel[0]/.../rel[-1]`` fresh: ``write(fh)`` fills a new temporary (a binary file
    object) in the final directory, which is then renamed over the final name (see the module
    docstring). Missing directories are made. Raises :class:`UnsafeName` for a bad name, OSError
    when it cannot be written (the temporary is removed); a directory at the final name is
    ``IsADirectoryError``."""
    *dirs, name = rel
    check_name(name, "file name")
    with _open_dirs(root, dirs, create=True) as dfd:
        part = _part_name(name)
        fd = _create_exclusive(part, dfd)
        try:
            with os.fdopen(fd, "wb") as fh:
                write(fh)
            os.replace(part, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(part, dir_fd=dfd)
            raise
    return Path(root, *rel)


def remove_in_dir(root: str | os.PathLike[str], rel: Sequence[str]) -> bool:
    """Remove ``root/rel...`` (the name itself: a symlink there is removed, not its target); a
    symlinked directory on the way is refused (OSError). True when something was removed."""
    *dirs, name = rel
    check_name(name, "file name")
    with _open_dirs(root, dirs, create=False) as dfd:
        if dfd is None:
            return False
        try:
            os.unlink(name, dir_fd=dfd)  # a directory there: IsADirectoryError (or EPERM), not removed
        except FileNotFoundError:
            return False
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process, or not a pid at all
        return True
    return True


def clean_parts(directory: str | os.PathLike[str]) -> list[str]:
    """Remove the temporaries (``.NAME.HOST.PID.RANDOM.part``) that a killed writer left directly
    in ``directory``: those of this host whose process is gone, and those of another host older
    than STALE_PART_SECONDS. A symlink or anything else is left alone. Returns the names removed."""
    removed: list[str] = []
    try:
        fd = os.open(directory, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC)
    except OSError:
        return removed
    try:
        here, now = _host_tag(), time.time()
        for name in os.listdir(fd):
            m = _PART.fullmatch(name)
            if not m:
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            mine = m["host"] == here
            if (mine and not _alive(int(m["pid"]))) or (not mine and now - st.st_mtime > STALE_PART_SECONDS):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=fd)
                    removed.append(name)
    finally:
        os.close(fd)
    return removed
