"""What a fleet directory may hold, checked before anything in it is read, written or deleted.

A fleet directory is data someone else may have made: its manifest, its ``traces.parquet`` and the
names of its files are checked here, and a directory that does not match what kvtrace writes is a
damaged fleet (:class:`~kvtrace.fleet.FleetError`, exit 2), never an instruction. In particular:

* a trace id read from the manifest or from ``traces.parquet`` names a file only after
  :func:`kvtrace.wholefile.check_name` (fixed alphabet, no leading dot, bounded length);
* the manifest and ``traces.parquet`` are opened without following a symlink and without blocking
  (a FIFO is refused, not waited on), must be regular files, and the manifest is bounded in size
  and validated whole (types of every entry; nesting that Python's parser cannot follow);
* a table directory (``DIR/kv`` ...) must be a directory, not a symlink, and hold only
  ``<trace_id>.parquet`` regular files of traces that ``traces.parquet`` lists (a foreign Parquet
  file there is refused, not merged into the views).
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

from kvtrace.fleet import FleetError
from kvtrace.fleet.tables import FLEET_SCHEMA_VERSION, MANIFEST, TABLE_NAMES, TRACES_FILE
from kvtrace.wholefile import UnsafeName, check_name

# The manifest holds ~250 bytes per trace: 256 MiB is about a million traces. Larger is refused.
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
# The trace ids kvtrace makes (the first 16 hex digits of sha256_edges): an unlisted file of this
# shape in a table directory is what an export stopped midway left, and the next export removes it.
OWN_TRACE_ID = re.compile(r"[0-9a-f]{16}")
PER_TRACE_TABLES = tuple(n for n in TABLE_NAMES if n != "traces")

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def kind_of(mode: int) -> str:
    """What a file is, in words ("a symlink", "a directory", "a FIFO", ...)."""
    for test, word in ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return word
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def lstat_or_none(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise FleetError(f"{path}: cannot read ({exc.strerror})") from None


def open_regular(path: Path, what: str) -> BinaryIO:
    """``path`` opened for reading when it is a regular file; a symlink, a FIFO, a directory or a
    device is a damaged fleet (FleetError), and nothing blocks. FileNotFoundError passes."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        st = lstat_or_none(path)
        kind = kind_of(st.st_mode) if st is not None else exc.strerror
        raise FleetError(f"{path}: {what} is {kind}, not a file kvtrace wrote (a damaged fleet directory; "
                         "export into a new directory)") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise FleetError(f"{path}: {what} is {kind_of(st.st_mode)}, not a file kvtrace wrote (a damaged fleet "
                         "directory; export into a new directory)")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _damaged_manifest(path: Path, why: str) -> FleetError:
    return FleetError(f"{path}: not a manifest kvtrace wrote ({why}); a damaged fleet directory: remove "
                      f"{MANIFEST} and export again, or export into a new directory")


def _check_entry(path: Path, key: Any, entry: Any) -> None:
    if not isinstance(key, str):
        raise _damaged_manifest(path, "a trace's key is not a path")
    if not isinstance(entry, dict):
        raise _damaged_manifest(path, f"the entry of {key[:80]!r} is not an object")
    try:
        check_name(entry.get("trace_id"), "trace_id")
    except UnsafeName as exc:
        raise _damaged_manifest(path, str(exc)) from None
    for field in ("size", "mtime_ns"):
        v = entry.get(field)
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 63:
            raise _damaged_manifest(path, f"{field} of {entry['trace_id']} is not a non-negative integer")
    if not isinstance(entry.get("sha256_edges"), str) or not re.fullmatch(r"[0-9a-f]{64}", entry["sha256_edges"]):
        raise _damaged_manifest(path, f"sha256_edges of {entry['trace_id']} is not a SHA-256 hex digest")


def load_manifest(out_dir: Path) -> dict[str, Any]:
    """The manifest of a fleet directory, every entry checked; a fresh one when there is none.
    Anything else (not a regular file, too large, not JSON, nested too deep, wrong types, an unsafe
    trace_id) is FleetError: a damaged fleet, which export parquet refuses rather than act on."""
    path = out_dir / MANIFEST
    try:
        fh = open_regular(path, MANIFEST)
    except FileNotFoundError:
        return {"fleet_schema_version": FLEET_SCHEMA_VERSION, "traces": {}}
    with fh:
        size = os.fstat(fh.fileno()).st_size
        if size > MAX_MANIFEST_BYTES:
            raise _damaged_manifest(path, f"{size} bytes, more than the {MAX_MANIFEST_BYTES} kvtrace reads")
        raw = fh.read(MAX_MANIFEST_BYTES + 1)
    try:
        doc = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise _damaged_manifest(path, "nested deeper than a manifest is") from None
    except ValueError as exc:  # JSON, UTF-8, an integer of more digits than Python converts
        raise _damaged_manifest(path, f"not JSON: {str(exc).splitlines()[0][:120]}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traces"), dict):
        raise _damaged_manifest(path, "not an object with a 'traces' object")
    version = doc.get("fleet_schema_version", FLEET_SCHEMA_VERSION)
    if not isinstance(version, str) or len(version) > 32:
        raise _damaged_manifest(path, "fleet_schema_version is not a version string")
    for key, entry in doc["traces"].items():
        _check_entry(path, key, entry)
    return doc


def check_trace_ids(ids: Iterable[Any], where: Path) -> set[str]:
    """The trace ids of ``traces.parquet`` as a set; an unsafe one (null, '../x', '/abs', a
    confusable non-ASCII letter) is FleetError."""
    out: set[str] = set()
    for tid in ids:
        try:
            out.add(check_name(tid, "trace_id"))
        except UnsafeName as exc:
            raise FleetError(f"{where}: {exc}; not a table kvtrace exported (a damaged fleet directory)") from None
    return out


def table_dir(out_dir: Path, name: str) -> Path | None:
    """``DIR/<name>`` when it is a directory; None when absent; FleetError when it is a symlink or
    anything else (its files would be read or written elsewhere)."""
    d = out_dir / name
    st = lstat_or_none(d)
    if st is None:
        return None
    if not stat.S_ISDIR(st.st_mode):
        raise FleetError(f"{d}: {kind_of(st.st_mode)}, not a table directory kvtrace wrote (a damaged fleet "
                         "directory; export into a new directory)")
    return d


def table_files(out_dir: Path, name: str, trace_ids: set[str]) -> list[Path]:
    """The Parquet files of table ``name`` (sorted), each checked: a regular file named after a
    trace of ``trace_ids``. Anything else named ``*.parquet`` there is FleetError (a foreign or
    leftover file: refused rather than merged into the view). Hidden files (temporaries) and files
    not ending in .parquet are ignored, as a ``*.parquet`` glob ignores them."""
    d = table_dir(out_dir, name)
    if d is None:
        return []
    files = []
    for entry in sorted(os.scandir(d), key=lambda e: e.name):
        if entry.name.startswith(".") or not entry.name.endswith(".parquet"):
            continue
        st = entry.stat(follow_symlinks=False)
        stem = entry.name[: -len(".parquet")]
        if not stat.S_ISREG(st.st_mode):
            raise FleetError(f"{d / entry.name}: {kind_of(st.st_mode)}, not a table file kvtrace wrote "
                             "(a damaged fleet directory; export into a new directory)")
        if stem not in trace_ids:
            raise FleetError(f"{d / entry.name}: not a trace of {TRACES_FILE} (a foreign file, or one an "
                             "export stopped midway left: run 'kvtrace export parquet' into this directory "
                             "again, or remove it)")
        files.append(d / entry.name)
    return files
