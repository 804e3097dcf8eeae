"""Output files written whole or not at all, for every writer of kvtrace (JSON documents, HTML
pages, Perfetto JSON, Parquet tables, manifests).

A regular file is written to a temporary beside it (``.NAME.PID.part``: hidden, and not matched by
a ``*.parquet`` glob) and renamed over the target only once the write finished: a full disk or a
file size limit mid-write leaves neither a truncated file nor the temporary behind, and an earlier
file at that path is kept. A symlink, a FIFO or a device (``/dev/stdout``) is written in place, as
renaming would replace the link or the device node itself. A leaf module (standard library only):
the format, the renderers and the commands all use it; the caller turns the ``OSError`` into its
own one-line error.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["part_path", "failure_reason", "write_text_whole", "write_whole"]


def failure_reason(exc: OSError) -> str:
    """Why a write failed, in the system's words ("No space left on device"): pyarrow's OSError
    carries the errno under a strerror of its own ("Error writing bytes to file. Detail: ...")."""
    return os.strerror(exc.errno) if exc.errno else str(exc.strerror or exc)


def part_path(path: Path) -> Path:
    """The temporary a whole write of ``path`` goes through."""
    return path.with_name(f".{path.name}.{os.getpid()}.part")


def write_whole(path: str | os.PathLike[str], write: Callable[[Path], object]) -> Path:
    """Call ``write(p)`` on a temporary beside ``path`` and rename it over ``path`` when it returns;
    when it raises (``OSError`` on a full disk, or anything else) the temporary is removed and the
    exception propagates. Returns ``path`` as a Path."""
    p = Path(path)
    if p.is_symlink() or (p.exists() and not p.is_file()):
        write(p)
        return p
    part = part_path(p)
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
