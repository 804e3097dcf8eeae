"""DuckDB views over a fleet directory and the default summary (spec/fleet.md).

``traces`` is ``DIR/traces.parquet`` read into memory; every other view reads
``DIR/<table>/*.parquet`` with ``union_by_name`` (files that different versions
of kvtrace wrote may differ in columns); a table no trace had rows in is an empty view with the
known schema, so queries never fail on a missing table.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from kvtrace.fleet import FleetError
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
    if not (d / TRACES_FILE).is_file():
        if (d / "traces").is_dir():  # fleet schema 1.0: one traces file per trace
            raise FleetError(f"{d}: exported by an older kvtrace (traces/ instead of {TRACES_FILE}); "
                             f"run 'kvtrace export parquet TRACES -o {d}' again to update it")
        raise FleetError(f"{d}: no exported traces (no {TRACES_FILE}); run 'kvtrace export parquet' first")
    con = duckdb.connect(":memory:")
    try:
        _create_views(con, d, tables)
    except duckdb.Error as exc:  # a damaged or foreign file in the directory: one line, not a traceback
        raise FleetError(f"{d}: cannot read the exported tables ({first_line(exc)})") from None
    if "traces" in tables:
        have = set(trace_columns(con))
        missing = [f.name for f in TRACES_SCHEMA if f.name not in have]
        if missing:  # the summary cannot run on it: say what is known of where it came from
            raise FleetError(_not_this_schema(d, exported_as, have, missing[0]))
    return con


def exported_schema(d: Path) -> str | None:
    """The fleet schema version ``DIR/_manifest.json`` names (None: no manifest, or not one). The
    manifest is written with sorted keys, so the version comes before the (large) per-trace entries:
    only its head is read, every query opens the directory."""
    try:
        with open(d / MANIFEST, "rb") as fh:
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


def _create_views(con: duckdb.DuckDBPyConnection, d: Path, tables: Iterable[str]) -> None:
    for name in TABLE_NAMES:
        if name not in tables:
            continue
        if name == "traces":
            # one file, read once into memory: the summary and diff query it several times
            con.execute(f"CREATE TEMP TABLE traces AS SELECT * FROM read_parquet({_sql_string(str(d / TRACES_FILE))})")
        elif any((d / name).glob("*.parquet")):
            glob = _sql_string(str(d / name / "*.parquet"))
            con.execute(f"CREATE VIEW {name} AS SELECT * FROM read_parquet({glob}, union_by_name = true)")
        else:
            empty = pa.Table.from_batches([], schema=empty_schema(name))
            con.register(f"_empty_{name}", empty)
            con.execute(f"CREATE VIEW {name} AS SELECT * FROM _empty_{name}")


@dataclass
class QueryResult:
    columns: list[str]
    rows: list[tuple[Any, ...]]

    def records(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, r, strict=True)) for r in self.rows]


def run_sql(con: duckdb.DuckDBPyConnection, sql: str) -> QueryResult:
    try:
        cur = con.execute(sql)
        rows = cur.fetchall()
    except duckdb.Error as exc:
        raise FleetError(f"query failed: {first_line(exc)}") from None
    return QueryResult([c[0] for c in cur.description or []], [tuple(r) for r in rows])


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
    k = ", ".join(f't."{key}"' for key in keys)
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
