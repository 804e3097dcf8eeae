"""Output paths of the CLI: one JSON convention and checks that no output clobbers an input.

Convention (every command): ``--json`` is a flag that prints JSON to stdout; ``--json-out FILE``
writes the same document to FILE. No option takes a FILE that could be mistaken for an input.

Before any work, every output path is checked:

* an output that is one of the command's inputs (same file: ``os.path.samefile``, so symlinks and
  hard links count) is refused -> exit 64 (usage: the command line names one file twice);
* an output that is an existing HDF5 file (a trace, or any HDF5 data) is refused -> exit 64;
  ``record`` refuses any existing file unless ``--force`` (which still never replaces an input);
* an output file that names a directory -> exit 64 (as click's own path checks);
* an output that cannot be created (directory missing, not writable, a read-only file system) -> exit 73.

A JSON document is written whole or not at all (:func:`kvtrace.wholefile.write_text_whole`, which
every other output of kvtrace goes through too): a full disk or a file size limit is exit 73 and
leaves neither a truncated file nor a temporary behind.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import click

from kvtrace.commands.common import json_dump
from kvtrace.errors import CannotWrite
from kvtrace.wholefile import write_text_whole

F = TypeVar("F", bound=Callable[..., Any])

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def is_hdf5(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a regular file starting with the HDF5 signature (how traces start).
    Nothing else is opened: reading ``/dev/stdout`` when it is a pipe would wait forever."""
    if not os.path.isfile(path):
        return False
    try:
        with open(path, "rb") as fh:
            return fh.read(len(HDF5_SIGNATURE)) == HDF5_SIGNATURE
    except OSError:
        return False


def _same(a: Path, b: str | os.PathLike[str]) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist: not the same file
        return False


def check_output(path: str | os.PathLike[str], *, option: str, inputs: Iterable[str | os.PathLike[str]] = (),
                 others: Iterable[tuple[str, str | os.PathLike[str] | None]] = (),
                 refuse_existing: bool = False, force: bool = False, what: str | None = None) -> Path:
    """Refuse an output file that would clobber an input or an existing trace; fail early (73)
    when it cannot be created. ``others``: (option, path) of the command's other outputs, which
    must differ from this one. ``refuse_existing``: any existing file is refused unless ``force``.
    ``what``: how the 73 messages name the output (default: the option and the path)."""
    p = Path(path)
    what = what or f"{option} {path}"
    for inp in inputs:
        if _same(p, inp):
            raise click.UsageError(f"{option} {path} is also an input ({inp}): refusing to overwrite it")
    for other_option, other in others:
        if other is not None and other != "-" and (
                _same(p, other) or os.path.abspath(p) == os.path.abspath(other)):
            raise click.UsageError(f"{option} and {other_option} name the same file ({path})")
    if p.is_dir():  # as click's own dir_okay=False check: a usage error
        raise click.UsageError(f"{option} {path} is a directory, not a file")
    if p.exists() and not force:
        if refuse_existing:
            raise click.UsageError(f"{option} {path} already exists; pass --force to replace it")
        if is_hdf5(p):
            raise click.UsageError(f"{option} {path} is an existing trace (HDF5 file): refusing to overwrite it")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise CannotWrite(f"cannot write {what}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise CannotWrite(f"cannot write {what}: {'read-only file system' if _read_only(parent) else 'permission denied'}")
    return p


def _read_only(directory: Path) -> bool:
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # no statvfs (Windows): say "permission denied"
        return False


def check_json_out(json_out: str | None, inputs: Iterable[str | os.PathLike[str]],
                   others: Iterable[tuple[str, str | os.PathLike[str] | None]] = ()) -> None:
    """:func:`check_output` for ``--json-out`` when it is given."""
    if json_out is not None:
        check_output(json_out, option="--json-out", inputs=inputs, others=others)


def check_output_dir(path: str | os.PathLike[str], *, option: str,
                     inputs: Iterable[str | os.PathLike[str]] = ()) -> Path:
    """An output directory must not be an input, nor a file (exit 64); inputs may live in it (the
    files written there are checked one by one by :func:`check_output` where names are known)."""
    p = Path(path)
    for inp in inputs:
        if _same(p, inp):
            raise click.UsageError(f"{option} {path} is also an input: refusing to write into it")
    if p.exists() and not p.is_dir():
        what = "an existing trace (HDF5 file)" if is_hdf5(p) else "an existing file"
        raise click.UsageError(f"{option} {path} is {what}, not a directory: refusing to overwrite it")
    return p


def remove_empty_dirs(path: Path) -> None:
    """Remove ``path`` and the directories under it when no file is left there: what a command that
    created an output directory leaves after a failure (a full disk) is nothing, not empty folders."""
    if not path.is_dir() or path.is_symlink():
        return
    for sub in sorted((p for p in path.rglob("*") if p.is_dir() and not p.is_symlink()),
                      key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            sub.rmdir()  # fails when it holds a file: kept
    with contextlib.suppress(OSError):
        path.rmdir()


def json_options(fn: F) -> F:
    """``--json`` (flag: print JSON to stdout) and ``--json-out FILE`` (write it to FILE)."""
    fn = click.option("--json-out", "json_out", type=click.Path(dir_okay=False), default=None, metavar="FILE",
                      help="Also write the JSON document to FILE (never an input, never an existing trace).")(fn)
    return click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")(fn)


def write_json(doc: Any, json_out: str | None, *, as_json: bool) -> None:
    """Print ``doc`` as JSON when ``as_json``; write it to ``json_out`` when given (checked before the
    work by :func:`check_output`)."""
    if not as_json and json_out is None:
        return
    text = json_dump(doc)
    if as_json:
        click.echo(text)
    if json_out is not None:
        try:
            write_text_whole(json_out, text + "\n")
        except OSError as exc:
            raise CannotWrite(f"cannot write --json-out {json_out}: {exc.strerror}") from None
