"""DuckDB views over a fleet directory and the default summary (spec/fleet.md).

``traces`` is ``DIR/traces.parquet`` read into memory; every other view reads the files
``DIR/<table>/<trace_id>.parquet`` of the traces ``traces`` lists, by column name (files that
different versions of kvtrace wrote may differ in columns); a table no trace had rows in is an
empty view with the known schema, so queries never fail on a missing table.

The connection cannot touch the file system: the files are checked (:mod:`kvtrace.fleet.layout`:
regular files, no symlink, no foreign file) and handed to DuckDB as Arrow datasets, then
``enable_external_access`` is turned off and the configuration locked. A query (``--sql``) can
read the views and nothing else: no COPY/EXPORT/ATTACH writes, no read_csv/read_text/glob of
another path, no extension, no SET that undoes it.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import math
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.dataset as pa_dataset
import pyarrow.parquet as pq

from kvtrace.fleet import FleetError
from kvtrace.fleet.layout import check_trace_ids, lstat_or_none, open_regular, table_files
from kvtrace.fleet.tables import (
    FLEET_SCHEMA_VERSION,
    MANIFEST,
    TABLE_NAMES,
    TRACES_FILE,
    TRACES_SCHEMA,
    empty_schema,
    newer_major,
    schema_key,
)
from kvtrace.format.errors import UnsupportedVersion

# Non-informational findings (severity >= low) of these detectors mark a trace as retaining or
# fragmenting; the detectors' own calibration (docs/detectors.md) decides what reaches "low".
RETENTION_DETECTORS = ("post_eos",)
FRAGMENTATION_DETECTORS = ("fragmentation",)


# What a query over damaged files raises (commands map it to exit 2 with one line).
DatabaseError = duckdb.Error


def _sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def sql_ident(name: str) -> str:
    """A column name quoted for SQL (a forged traces.parquet may name a column ``x" OR 1``)."""
    return '"' + name.replace('"', '""') + '"'


def tables_named(sql: str) -> tuple[str, ...]:
    """The fleet tables whose names appear as words in ``sql``: the views a query can reference.
    Binding a view reads the footer of every file it globs, so views nobody queries are not made."""
    words = set(re.findall(r"[A-Za-z_]\w*", sql.lower()))
    return tuple(n for n in TABLE_NAMES if n in words)


def connect(directory: str | Path, tables: Iterable[str] = TABLE_NAMES) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with one view per fleet table in ``tables`` (default: all)."""
    d = Path(directory)
    if not d.is_dir():
        raise FleetError(f"{d}: not a directory (export traces with 'kvtrace export parquet TRACES -o {d}')")
    exported_as = exported_schema(d)
    if newer_major(exported_as):
        raise UnsupportedVersion(f"{d}: exported by a newer kvtrace (fleet schema {exported_as}; this kvtrace "
                                 f"reads {FLEET_SCHEMA_VERSION}); upgrade kvtrace")
    st = lstat_or_none(d / TRACES_FILE)
    if st is None:
        if (d / "traces").is_dir():  # fleet schema 1.0: one traces file per trace
            raise FleetError(f"{d}: exported by an older kvtrace (traces/ instead of {TRACES_FILE}); "
                             f"run 'kvtrace export parquet TRACES -o {d}' again to update it")
        raise FleetError(f"{d}: no exported traces (no {TRACES_FILE}); run 'kvtrace export parquet' first")
    con = duckdb.connect(":memory:")
    try:
        _create_views(con, d, tables)
        _lock_down(con)
    except duckdb.Error as exc:  # a damaged or foreign file in the directory: one line, not a traceback
        con.close()
        raise FleetError(f"{d}: cannot read the exported tables ({first_line(exc)})") from None
    except BaseException:
        con.close()
        raise
    if "traces" in tables:
        have = set(trace_columns(con))
        missing = [f.name for f in TRACES_SCHEMA if f.name not in have]
        if missing:  # the summary cannot run on it: say what is known of where it came from
            raise FleetError(_not_this_schema(d, exported_as, have, missing[0]))
    return con


def _lock_down(con: duckdb.DuckDBPyConnection) -> None:
    """After the views exist: no file system access (COPY, EXPORT, ATTACH, read_csv of any path,
    glob, extensions), no Python objects by name, and no SET that would undo it. Times with a
    zone are shown in UTC, the same on every machine."""
    for setting in ("TimeZone = 'UTC'", "autoinstall_known_extensions = false", "autoload_known_extensions = false",
                    "python_enable_replacements = false", "enable_external_access = false",
                    "lock_configuration = true"):
        con.execute(f"SET {setting}")


def exported_schema(d: Path) -> str | None:
    """The fleet schema version ``DIR/_manifest.json`` names (None: no manifest, or not one). The
    manifest is written with sorted keys, so the version comes before the (large) per-trace entries:
    only its head is read, every query opens the directory."""
    try:
        with open_regular(d / MANIFEST, MANIFEST) as fh:  # never a FIFO (a read would wait forever)
            head = fh.read(4096).decode("utf-8", errors="replace")
    except OSError:
        return None
    found = re.search(r'"fleet_schema_version"\s*:\s*"([0-9]{1,6}(?:\.[0-9]{1,6})*)"', head)
    return found.group(1) if found else None


def _not_this_schema(d: Path, exported_as: str | None, columns: set[str], missing: str) -> str:
    """Why a traces table without a column of this fleet schema cannot be read, saying only what is
    known of where it came from (it said "exported by an older kvtrace" of any table)."""
    again = f"run 'kvtrace export parquet TRACES -o {d}' again to update it"
    if "trace_id" not in columns:
        named = f", though {MANIFEST} names fleet schema {exported_as}" if exported_as else ""
        return f"{d}: {TRACES_FILE} is not a table kvtrace exported (it has no trace_id column){named}"
    if exported_as is None:
        return (f"{d}: {TRACES_FILE} lacks {missing} and no {MANIFEST} says which kvtrace exported it "
                f"(an older one, or a damaged export); {again}")
    if exported_as == FLEET_SCHEMA_VERSION:
        return f"{d}: {TRACES_FILE} lacks {missing}, though {MANIFEST} names this fleet schema ({exported_as}); {again}"
    which = "an older" if (schema_key(exported_as) or ()) < (schema_key(FLEET_SCHEMA_VERSION) or ()) else "a newer"
    return f"{d}: exported by {which} kvtrace (fleet schema {exported_as}: {TRACES_FILE} lacks {missing}); {again}"


def first_line(exc: BaseException) -> str:
    """The first line of a DuckDB error (its later lines repeat the SQL)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _read_traces(d: Path, columns: list[str] | None) -> pa.Table:
    """DIR/traces.parquet (only ``columns`` of it, when given, and of those only the ones it has),
    opened without following a link or waiting on a FIFO."""
    path = d / TRACES_FILE
    try:
        with open_regular(path, TRACES_FILE) as fh:
            if columns is None:
                return pq.read_table(fh)
            have = set(pq.read_schema(fh).names)
            fh.seek(0)
            return pq.read_table(fh, columns=[c for c in columns if c in have])
    except FileNotFoundError:
        raise FleetError(f"{d}: no exported traces (no {TRACES_FILE}); run 'kvtrace export parquet' first") from None
    except (OSError, pa.ArrowException) as exc:
        raise FleetError(f"{d}: cannot read the exported tables ({TRACES_FILE} is not a readable Parquet "
                         f"file: {first_line(exc)})") from None


def _table_dataset(d: Path, name: str, trace_ids: set[str]) -> pa_dataset.Dataset | pa.Table:
    """The files of table ``name`` as one Arrow dataset, columns matched by name and types promoted
    as DuckDB's union_by_name does; an empty table of the known schema when there are none."""
    files = table_files(d, name, trace_ids)
    if not files:
        return pa.Table.from_batches([], schema=empty_schema(name))
    schemas = []
    for f in files:
        try:
            schemas.append(pq.read_schema(f))
        except (OSError, pa.ArrowException) as exc:
            raise FleetError(f"{d}: cannot read the exported tables ({f.relative_to(d)} is not a readable "
                             f"Parquet file: {first_line(exc)})") from None
    try:
        schema = pa.unify_schemas(schemas, promote_options="permissive")
    except (pa.ArrowException, TypeError) as exc:
        raise FleetError(f"{d}: cannot read the exported tables (the files of {name}/ do not agree on "
                         f"column types: {first_line(exc)})") from None
    return pa_dataset.dataset([str(f) for f in files], schema=schema, format="parquet")


def _create_views(con: duckdb.DuckDBPyConnection, d: Path, tables: Iterable[str]) -> None:
    tables = tuple(tables)
    per_trace = any(n != "traces" for n in tables)
    # the whole table for the traces view; its ids alone to check the other tables' files; else
    # only that it is a Parquet file (a query that names no table still runs on a damaged fleet: 2)
    traces = _read_traces(d, None if "traces" in tables else ["trace_id"] if per_trace else [])
    if "trace_id" in traces.column_names:
        trace_ids = check_trace_ids(traces.column("trace_id").to_pylist(), d / TRACES_FILE)
    elif per_trace:
        raise FleetError(f"{d}: {TRACES_FILE} is not a table kvtrace exported (it has no trace_id column)")
    else:
        trace_ids = set()
    for name in TABLE_NAMES:
        if name not in tables:
            continue
        if name == "traces":
            # one file, read once into memory: the summary and diff query it several times
            con.register("_traces_file", traces)
            con.execute("CREATE TEMP TABLE traces AS SELECT * FROM _traces_file")
            con.unregister("_traces_file")
        else:
            con.register(name, _table_dataset(d, name, trace_ids))  # a (temporary) view of that name


@dataclass
class QueryResult:
    columns: list[str]
    rows: list[tuple[Any, ...]]
    types: list[Any] | None = None  # the DuckDB type of each column, when known

    def records(self) -> list[dict[str, Any]]:
        """The rows as JSON-ready objects (:func:`json_value` of every cell). A result column name
        repeated (``SELECT 1 AS a, 2 AS a``) gets a suffix rather than lose a value."""
        names = _unique(self.columns)
        kinds = self.types or [None] * len(names)
        return [dict(zip(names, (json_value(v, k) for v, k in zip(r, kinds, strict=True)), strict=True))
                for r in self.rows]


def _unique(columns: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for c in columns:
        n = seen.get(c, 0)
        seen[c] = n + 1
        out.append(c if n == 0 else f"{c}_{n + 1}")
    return out


def json_value(v: Any, kind: Any = None) -> Any:
    """One DuckDB value as JSON (spec/fleet.md "--json"): numbers stay numbers (DECIMAL with a scale
    as a float, DECIMAL(p, 0), HUGEINT and UBIGINT as exact integers), NaN and infinity become null
    (JSON has neither), DATE, TIME, TIMESTAMP[TZ] ISO 8601 text, INTERVAL seconds, UUID text, BLOB
    base64 text, LIST/ARRAY a list, STRUCT an object, MAP an object when its keys are text, else a
    list of {key, value}; anything else its text. ``kind``: the column's DuckDB type (a cursor's
    description), which tells a MAP with list or struct keys from a STRUCT. Nesting deeper than
    Python's recursion allows is a FleetError."""
    try:
        return _json_value(v, kind)
    except RecursionError:
        raise FleetError("query failed: a result value is nested too deeply to convert to JSON") from None


_UNHASHABLE = ("list", "array", "struct", "map", "union")


def _typed(v: Any, kind: Any) -> Any:
    """The nested types, converted with their children's types; None when ``kind`` says nothing."""
    tid = getattr(kind, "id", None)
    if tid == "map":
        (_, kt), (_, vt) = kind.children[:2]
        if getattr(kt, "id", None) in _UNHASHABLE and set(v) == {"key", "value"}:
            pairs = zip(v["key"], v["value"], strict=True)  # how the Python client gives unhashable keys
        else:
            pairs = v.items()
        items = [(_json_value(k, kt), _json_value(x, vt)) for k, x in pairs]
        if all(isinstance(k, str) for k, _ in items):
            return {k: x for k, x in items}
        return [{"key": k, "value": x} for k, x in items]
    if tid in ("list", "array") and isinstance(v, (list, tuple)):
        child = kind.children[0][1]
        return [_json_value(x, child) for x in v]
    if tid == "struct" and isinstance(v, dict):
        fields = dict(kind.children)
        return {k: _json_value(x, fields.get(k)) for k, x in v.items()}
    return None


def _json_value(v: Any, kind: Any = None) -> Any:
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, decimal.Decimal):  # DECIMAL(p, 0) exactly, as an integer; with a scale, a float
        if not v.is_finite():
            return None
        return int(v) if v.as_tuple().exponent >= 0 else float(v)
    if isinstance(v, (datetime.datetime, datetime.date, datetime.time)):
        return v.isoformat()
    if isinstance(v, datetime.timedelta):
        return v.total_seconds()
    if isinstance(v, uuid.UUID):
        return str(v)
    if isinstance(v, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(v)).decode("ascii")
    if isinstance(v, (list, tuple, dict)) and kind is not None:
        typed = _typed(v, kind)
        if typed is not None:
            return typed
    if isinstance(v, (list, tuple)):
        return [_json_value(x) for x in v]
    if isinstance(v, dict):
        if all(isinstance(k, str) for k in v):
            return {k: _json_value(x) for k, x in v.items()}
        return [{"key": _json_value(k), "value": _json_value(x)} for k, x in v.items()]
    return str(v)


def run_sql(con: duckdb.DuckDBPyConnection, sql: str) -> QueryResult:
    try:
        cur = con.execute(sql)
        rows = cur.fetchall()
    except duckdb.Error as exc:
        raise FleetError(f"query failed: {first_line(exc)}") from None
    desc = cur.description or []
    return QueryResult([c[0] for c in desc], [tuple(r) for r in rows], [c[1] for c in desc])


def trace_columns(con: duckdb.DuckDBPyConnection) -> list[str]:
    return [r[0] for r in con.execute("DESCRIBE traces").fetchall()]


def check_keys(con: duckdb.DuckDBPyConnection, keys: list[str]) -> None:
    cols = trace_columns(con)
    bad = [k for k in keys if k not in cols]
    if bad:
        raise FleetError(f"unknown group key(s) {', '.join(bad)}; columns of traces: {', '.join(cols)}")


def _in(names: tuple[str, ...]) -> str:
    return "(" + ", ".join(_sql_string(n) for n in names) + ")"


# The tables the default summary reads: only `traces`, whose per-trace aggregates (spec/fleet.md)
# summarise the others, so a summary over N traces opens N small files, not 4 N.
SUMMARY_TABLES = ("traces",)


def summary(con: duckdb.DuckDBPyConnection, keys: list[str]) -> dict[str, QueryResult]:
    """The default summary, one row per combination of ``keys`` (columns of traces)."""
    check_keys(con, keys)
    k = ", ".join(f"t.{sql_ident(key)}" for key in keys)
    sel = f"{k}, " if keys else ""
    by = f"{k}, " if keys else ""
    group = f"GROUP BY {k}" if keys else ""
    order = f"ORDER BY {k}" if keys else ""

    def flagged(detectors: tuple[str, ...]) -> str:
        # a list comprehension, not a lambda: the lambda syntax changed between DuckDB 1.x and 2.0
        return (f"avg(CASE WHEN len([f FOR f IN t.findings_by IF f.severity_rank >= 1 "
                f"AND f.detector IN {_in(detectors)}]) > 0 THEN 1.0 ELSE 0.0 END)")

    groups = run_sql(con, f"""
        SELECT {sel}count(*) AS traces,
               coalesce(sum(t.requests), 0)::BIGINT AS requests,
               coalesce(sum(t.tokens), 0)::BIGINT AS tokens,
               coalesce(sum(t.findings_low), 0)::BIGINT AS findings,
               {flagged(RETENTION_DETECTORS)} AS retention_rate,
               {flagged(FRAGMENTATION_DETECTORS)} AS fragmentation_rate,
               sum(t.retained_allocated_bytes)::BIGINT AS retained_bytes,
               max(t.max_peak_allocated_bytes)::BIGINT AS max_peak_allocated_bytes,
               sum(t.kv_bytes_valid)::DOUBLE / nullif(sum(t.kv_tokens), 0) AS kv_bytes_per_token_layer
        FROM traces t {group} {order}""")
    findings = run_sql(con, f"""
        SELECT {sel}f.detector, f.severity, sum(f.findings)::BIGINT AS findings, count(*) AS traces
        FROM traces t, unnest(t.findings_by) AS u(f)
        GROUP BY {by}f.detector, f.severity, f.severity_rank
        ORDER BY {by}f.severity_rank DESC, f.detector""")
    per_token = run_sql(con, f"""
        SELECT {sel}l.layer_type, min(l.min_bytes_per_token) AS min_bytes_per_token,
               max(l.max_bytes_per_token) AS max_bytes_per_token, count(*) AS traces
        FROM traces t, unnest(t.kv_layer_types) AS u(l)
        GROUP BY {by}l.layer_type ORDER BY {by}l.layer_type""")
    return {"groups": groups, "findings": findings, "kv_bytes_per_token": per_token}
