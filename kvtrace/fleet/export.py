"""`kvtrace export parquet`: traces -> a directory of Parquet files, incrementally, in parallel.

Layout (spec/fleet.md): ``DIR/<table>/<trace_id>.parquet`` for every table a trace has rows in,
``DIR/traces.parquet`` (one row per trace, all traces in one file: the summary reads only it), and
``DIR/_manifest.json`` (which input path became which trace id, with the size, mtime and edge hash
used to skip unchanged traces on the next run). Per-trace work runs in :func:`export_one`, which
opens the trace itself: h5py objects do not pickle and h5py serialises threads, so workers get
paths (a spawn process pool, or dask.distributed workers that share the filesystem) and write
their own files; only small dicts and the one-row traces table travel back. The parent alone
writes traces.parquet and the manifest, rewriting both whole (atomically) at checkpoints.

Every file is created fresh inside DIR (:func:`kvtrace.wholefile.create_in_dir`: no symlink, hard
link or FIFO found there is written through) under a name checked by
:func:`kvtrace.wholefile.check_name`; the manifest and traces.parquet are validated
(:mod:`kvtrace.fleet.layout`) before anything in them is acted on. One export runs in a directory at
a time (an advisory lock on it); a run that fails or is stopped removes the per-trace files of the
traces it did not record, and the next run removes what a killed one left.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from kvtrace import exitcodes
from kvtrace.errors import CannotWrite
from kvtrace.fleet import FleetError
from kvtrace.fleet.layout import (
    OWN_TRACE_ID,
    PER_TRACE_TABLES,
    check_trace_ids,
    kind_of,
    load_manifest,
    lstat_or_none,
    open_regular,
    table_dir,
)
from kvtrace.fleet.source import file_identity, read_trace
from kvtrace.fleet.tables import (
    FLEET_SCHEMA_VERSION,
    MANIFEST,
    TRACES_FILE,
    newer_major,
    trace_tables,
)
from kvtrace.format.errors import TraceError, UnsupportedVersion
from kvtrace.wholefile import clean_parts, create_in_dir, failure_reason, remove_in_dir

__all__ = ["MANIFEST", "ExportResult", "export_one", "export_parquet", "load_manifest", "load_traces", "plan"]

# traces.parquet and the manifest are rewritten whole after at least this many exports AND this
# many seconds since the last rewrite (at the end of the run in any case): a crash loses at most
# that much work, and a fleet of 100k traces is not rewritten every 256 of them.
CHECKPOINT_TRACES = 256
CHECKPOINT_SECONDS = 30.0
DASK_CONNECT_TIMEOUT_S = 5  # an unreachable scheduler fails the command, it does not hang it


def _write_file(out_dir: str | os.PathLike[str], rel: tuple[str, ...], write: Callable[[Any], object]) -> None:
    """Create ``out_dir/rel...`` fresh, whole or not at all (its temporary is hidden, not matched by
    the *.parquet globs); a full disk is CannotWrite (exit 73), not pyarrow's OSError (an internal
    error)."""
    try:
        create_in_dir(out_dir, rel, write)
    except OSError as exc:
        raise CannotWrite(f"cannot write {Path(out_dir, *rel)}: {failure_reason(exc)}") from None


def _write_table(table: Any, out_dir: str | os.PathLike[str], *rel: str) -> None:
    _write_file(out_dir, rel, lambda fh: pq.write_table(table, fh, compression="zstd"))


def export_one(path: str, out_dir: str, identity: dict[str, Any] | None = None) -> dict[str, Any]:
    """Read, analyse and write one trace; returns its manifest entry (or the error). Runs in workers."""
    t0 = time.perf_counter_ns()
    try:
        data = read_trace(path)
        if identity is not None:  # the hash the parent decided on (the file may have been touched)
            data.identity = identity
        tables = trace_tables(data)
    except TraceError as exc:
        return {"path": path, "status": "failed", "error": str(exc), "code": exc.exit_code}
    tid = data.identity["trace_id"]
    traces_row = tables.pop("traces")  # the parent merges it into traces.parquet
    rows = {"traces": traces_row.num_rows}
    written: list[str] = []  # this call's new files: removed when a later table cannot be written
    try:
        for name, table in tables.items():
            if table.num_rows == 0:  # views fall back to the known schema; empty files only slow globs
                _remove(out_dir, name, tid)
                continue
            new = not os.path.lexists(Path(out_dir, name, f"{tid}.parquet"))  # else: this trace's, re-exported
            _write_table(table, out_dir, name, f"{tid}.parquet")
            if new:
                written.append(name)
            rows[name] = table.num_rows
    except BaseException:  # a trace is exported whole or not at all: no rows without its traces row
        for name in written:
            with contextlib.suppress(OSError):
                remove_in_dir(out_dir, (name, f"{tid}.parquet"))
        raise
    return {"path": path, "status": "exported", **data.identity, "rows": rows, "traces_row": traces_row,
            "analysis_error": data.analysis_error, "seconds": (time.perf_counter_ns() - t0) / 1e9}


def _remove(out_dir: str | os.PathLike[str], table: str, trace_id: str) -> None:
    try:
        remove_in_dir(out_dir, (table, f"{trace_id}.parquet"))
    except OSError as exc:
        raise CannotWrite(f"cannot remove {Path(out_dir, table, trace_id + '.parquet')}: "
                          f"{failure_reason(exc)}") from None


@dataclass
class ExportResult:
    directory: Path
    exported: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)  # unchanged or duplicate inputs
    failed: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    engine: str = "in-process"

    @property
    def exit_code(self) -> int:
        """0 when every input was exported or skipped, else the worst failure's code (4 > 1 > 2)."""
        codes = {f["code"] for f in self.failed}
        for code in (exitcodes.VERSION, exitcodes.INVALID, exitcodes.UNREADABLE):
            if code in codes:
                return code
        return exitcodes.OK

    def to_dict(self) -> dict[str, Any]:
        return {"directory": str(self.directory), "engine": self.engine, "seconds": round(self.seconds, 3),
                "exported": [{k: e[k] for k in ("path", "trace_id", "rows", "analysis_error")} for e in self.exported],
                "skipped": self.skipped, "failed": self.failed}


def _manifest_text(manifest: dict[str, Any]) -> str:
    return json.dumps(manifest, indent=1, sort_keys=True)


def _save_manifest(out_dir: Path, text: str) -> None:
    data = text.encode("utf-8")
    _write_file(out_dir, (MANIFEST,), lambda fh: fh.write(data))


def load_traces(out_dir: Path) -> pa.Table | None:
    """The traces table of an export (None when there is none yet); FleetError when it is not a
    regular Parquet file with safe trace ids (damaged: refused rather than drop its rows)."""
    path = out_dir / TRACES_FILE
    try:
        fh = open_regular(path, TRACES_FILE)
    except FileNotFoundError:
        return None
    try:
        with fh:
            table = pq.read_table(fh)
    except (OSError, pa.ArrowException) as exc:
        raise FleetError(f"{path}: not a readable Parquet file ({str(exc).splitlines()[0] if str(exc) else exc!r}); "
                         "remove it and export again, or export into a new directory") from None
    if "trace_id" not in table.column_names:
        raise FleetError(f"{path}: not a table kvtrace exported (it has no trace_id column); "
                         "remove it and export again, or export into a new directory")
    check_trace_ids(table.column("trace_id").to_pylist(), path)
    return table


def _sweep(out: Path, keep: set[str]) -> None:
    """Check the table directories and remove what a stopped export left in them: temporaries of
    dead writers, and ``<id>.parquet`` files (ids of kvtrace's own shape) of traces neither
    traces.parquet nor the manifest lists. Any other ``*.parquet`` there, a directory named like
    one, or a table directory that is a symlink is a damaged fleet (FleetError, exit 2)."""
    clean_parts(out)
    for name in PER_TRACE_TABLES:
        d = table_dir(out, name)
        if d is None:
            continue
        clean_parts(d)
        for entry in os.scandir(d):
            if entry.name.startswith(".") or not entry.name.endswith(".parquet"):
                continue
            stem = entry.name[: -len(".parquet")]
            mode = entry.stat(follow_symlinks=False).st_mode
            if stat.S_ISDIR(mode) or (stem not in keep and not OWN_TRACE_ID.fullmatch(stem)):
                why = kind_of(mode) if stat.S_ISDIR(mode) else f"not a trace of {TRACES_FILE} or {MANIFEST}"
                raise FleetError(f"{d / entry.name}: {why}, not a file kvtrace exported (a damaged fleet "
                                 "directory: remove it, or export into a new directory)")
            if stem not in keep:
                _remove(out, name, stem)


def _merge_traces(old: pa.Table | None, new_rows: list[pa.Table], drop: set[str]) -> pa.Table:
    """Old rows minus the replaced and re-exported trace ids, then the new rows."""
    parts = []
    if old is not None and old.num_columns:
        ids = old.column("trace_id").to_pylist()
        parts.append(old.filter(pa.array([i not in drop for i in ids], pa.bool_())))
    parts += new_rows
    return pa.concat_tables(parts, promote_options="default") if parts else pa.table({})


def plan(paths: Iterable[str], manifest: dict[str, Any], exported: set[str],
         force: bool = False) -> tuple[list[tuple[str, dict[str, Any]]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Split inputs into (to export with their identity, skipped, failed) without opening any trace.
    ``exported``: the trace ids traces.parquet holds."""
    known: dict[str, Any] = manifest["traces"]
    todo, skipped, failed = [], [], []
    seen: dict[str, str] = {}
    for path in paths:
        try:
            if Path(path).is_dir():
                raise IsADirectoryError(path)
            st = os.stat(path)
            resolved = str(Path(path).resolve())
            old = known.get(resolved)
            if (not force and old and old["size"] == st.st_size and old["mtime_ns"] == st.st_mtime_ns
                    and old["trace_id"] in exported):
                ident = {**old, "path": resolved}  # unchanged by size and mtime: not even hashed
            else:
                ident = file_identity(path)
        except OSError as exc:
            reason = "is a directory" if isinstance(exc, IsADirectoryError) else (exc.strerror or "cannot read")
            failed.append({"path": path, "status": "failed", "error": f"{path}: {reason}",
                           "code": exitcodes.UNREADABLE})
            continue
        tid = ident["trace_id"]
        if tid in seen:
            skipped.append({"path": path, "trace_id": tid, "reason": f"same content as {seen[tid]}"})
            continue
        seen[tid] = path
        old = known.get(resolved)
        if not force and old and old["trace_id"] == tid and tid in exported:
            skipped.append({"path": path, "trace_id": tid, "reason": "unchanged since the last export"})
            old["mtime_ns"] = ident["mtime_ns"]
            continue
        todo.append((path, ident))
    return todo, skipped, failed


def _run_pool(todo: list[tuple[str, dict[str, Any]]], out_dir: str, jobs: int) -> Iterator[dict[str, Any]]:
    if jobs <= 1 or len(todo) <= 1:  # a spawned interpreter costs more than one small trace
        for path, ident in todo:
            yield export_one(path, out_dir, ident)
        return
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"))
    try:
        futures = [pool.submit(export_one, path, out_dir, ident) for path, ident in todo]
        for fut in as_completed(futures):
            yield fut.result()
    finally:  # stopped early (a failure, Ctrl-C): queued traces never start, running ones finish
        pool.shutdown(wait=True, cancel_futures=True)


def _run_dask(todo: list[tuple[str, dict[str, Any]]], out_dir: str, address: str | None,
              workers: int) -> Iterator[dict[str, Any]]:
    from dask.distributed import Client, LocalCluster
    from dask.distributed import as_completed as dask_completed

    cluster = None
    if address is None:
        # silence_logs CRITICAL: a worker's heartbeat racing the cluster's close logs an ERROR
        # traceback on stderr; a task's own failure still raises through fut.result()
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                               dashboard_address=None, silence_logs=logging.CRITICAL)
    try:
        client = Client(cluster if cluster is not None else address, timeout=DASK_CONNECT_TIMEOUT_S)
    except (OSError, TimeoutError) as exc:
        raise ConnectionError(f"cannot reach the dask scheduler {address}: {exc}") from None
    futures: list[Any] = []
    try:
        futures = client.map(export_one, [p for p, _ in todo], [out_dir] * len(todo), [i for _, i in todo],
                             pure=False)
        for fut in dask_completed(futures):
            yield fut.result()
    finally:
        client.cancel(futures)  # queued traces never start (one running on a worker finishes)
        client.close()
        if cluster is not None:
            cluster.close()


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    """An advisory lock on the directory itself (no file made for it) for the export's duration: a
    second export into the same directory would overwrite traces.parquet with its own rows and
    remove the first one's files as leftovers. Where the file system has no flock, no lock."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system: no flock
        yield
        return
    fd = os.open(out, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CannotWrite(f"cannot write {out}: another kvtrace export parquet is writing into it") from None
        except OSError:  # no flock here (some network file systems): export unlocked
            pass
        yield
    finally:
        os.close(fd)  # releases the lock


def export_parquet(paths: Iterable[str], out_dir: str | os.PathLike[str], *, jobs: int = 1,
                   dask_address: str | None = None, dask_workers: int = 0, force: bool = False,
                   progress: Callable[[str], None] | None = None) -> ExportResult:
    """Export traces into ``out_dir``; unchanged traces already there are skipped.

    ``jobs`` > 1: a spawn process pool; ``dask_address`` or ``dask_workers`` > 0: dask.distributed
    (an existing scheduler, or a LocalCluster of that many single-threaded worker processes).
    FleetError (exit 2) when the directory is not a fleet kvtrace wrote (a forged or damaged
    manifest or traces.parquet, a symlinked or foreign entry); nothing is then written or removed."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with _locked(out):
        return _export(paths, out, jobs=jobs, dask_address=dask_address, dask_workers=dask_workers, force=force,
                       progress=progress)


def _export(paths: Iterable[str], out: Path, *, jobs: int, dask_address: str | None, dask_workers: int,
            force: bool, progress: Callable[[str], None] | None) -> ExportResult:
    t0 = time.perf_counter()
    manifest = load_manifest(out)
    if newer_major(manifest.get("fleet_schema_version")):  # re-exporting would downgrade a newer export
        raise UnsupportedVersion(f"{out}: exported by a newer kvtrace (fleet schema "
                                 f"{manifest['fleet_schema_version']}; this kvtrace writes {FLEET_SCHEMA_VERSION}); "
                                 "upgrade kvtrace, or export into a new directory")
    traces = load_traces(out)
    exported_ids = set(traces.column("trace_id").to_pylist()) if traces is not None else set()
    listed = {v["trace_id"] for v in manifest["traces"].values()}
    old_layout = table_dir(out, "traces")  # fleet schema 1.0 kept one traces file per trace
    _sweep(out, exported_ids | listed)
    # rows written under another fleet schema lack columns the views expect: export them again
    force = force or manifest.get("fleet_schema_version") != FLEET_SCHEMA_VERSION
    if old_layout is not None:
        shutil.rmtree(old_layout)
    made = {name for name in PER_TRACE_TABLES if lstat_or_none(out / name) is None}
    todo, skipped, failed = plan(paths, manifest, exported_ids, force)
    result = ExportResult(out, skipped=skipped, failed=failed)
    for entry in skipped:
        progress and progress(entry["path"])
    if dask_address is not None or dask_workers > 0:
        result.engine = f"dask {dask_address}" if dask_address else f"dask LocalCluster({dask_workers})"
        runner = _run_dask(todo, str(out), dask_address, dask_workers)
    else:
        result.engine = f"process pool ({jobs}, spawn)" if jobs > 1 and len(todo) > 1 else "in-process"
        runner = _run_pool(todo, str(out), jobs)
    by_path = {ident["path"]: ident for _, ident in todo}
    new_rows: list[pa.Table] = []
    drop: set[str] = set()
    stale: set[str] = set()  # ids of traces whose file changed: their files go once traces.parquet is written
    committed = exported_ids | listed  # the ids whose files a failure keeps
    saved = _manifest_text(manifest) if (out / MANIFEST).exists() else ""
    last = time.monotonic()

    def checkpoint() -> None:
        nonlocal traces, new_rows, drop, stale, committed, saved, last
        manifest["fleet_schema_version"] = FLEET_SCHEMA_VERSION
        text = _manifest_text(manifest)
        if not new_rows and not drop and text == saved:  # nothing new: nothing rewritten
            return
        merged = _merge_traces(traces, new_rows, drop)
        if merged.num_rows:
            _write_table(merged, out, TRACES_FILE)
        traces, new_rows, drop, last = merged, [], set(), time.monotonic()
        committed = set(merged.column("trace_id").to_pylist()) if merged.num_rows else set()
        _save_manifest(out, text)
        saved = text
        committed |= {v["trace_id"] for v in manifest["traces"].values()}
        for tid in stale - committed:
            for name in PER_TRACE_TABLES:
                _remove(out, name, tid)
        stale = set()

    try:
        try:
            for entry in runner:
                if entry["status"] == "failed":
                    result.failed.append(entry)
                else:
                    old = manifest["traces"].get(entry["path"])
                    if old and old["trace_id"] != entry["trace_id"] and not any(
                            v["trace_id"] == old["trace_id"] for k, v in manifest["traces"].items()
                            if k != entry["path"]):
                        stale.add(old["trace_id"])  # the file changed: its old rows go
                        drop.add(old["trace_id"])
                    drop.add(entry["trace_id"])
                    new_rows.append(entry.pop("traces_row"))
                    manifest["traces"][entry["path"]] = {k: by_path.get(entry["path"], entry)[k] for k in
                                                         ("size", "mtime_ns", "sha256_edges", "trace_id")}
                    result.exported.append(entry)
                    if len(new_rows) >= CHECKPOINT_TRACES and time.monotonic() - last >= CHECKPOINT_SECONDS:
                        checkpoint()
                progress and progress(entry["path"])
        finally:
            runner.close()  # no worker writes after this: queued traces cancelled, running ones done
        checkpoint()
    except CannotWrite:  # keep the traces exported whole before the failure, when there is room for them
        with contextlib.suppress(CannotWrite):
            checkpoint()
        _clean_after_failure(out, committed, made)
        raise
    except BaseException:  # Ctrl-C, SIGTERM (the CLI raises SystemExit), a bug: the last checkpoint stands
        _clean_after_failure(out, committed, made)
        raise
    result.seconds = time.perf_counter() - t0
    return result


def _clean_after_failure(out: Path, committed: set[str], made: set[str]) -> None:
    """What a failed run leaves is what its last checkpoint recorded: the files of traces it did not
    record are removed, and the table directories it made and left empty go."""
    with contextlib.suppress(FleetError, CannotWrite, OSError):
        _sweep(out, committed)
    for name in made:
        with contextlib.suppress(OSError):
            (out / name).rmdir()  # fails when it holds a file: kept
