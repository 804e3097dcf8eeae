"""DuckDB views over a fleet directory and the default summary (spec/fleet.md).

Each view reads ``DIR/<table>/*.parquet`` with ``union_by_name`` (files that different versions
of kvtrace wrote may differ in columns); a table no trace had rows in is an empty view with the
known schema, so queries never fail on a missing table.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from kvtrace.fleet.tables import TABLE_NAMES, empty_schema

# Non-informational findings (severity >= low) of these detectors mark a trace as retaining or
# fragmenting; the detectors' own calibration (docs/detectors.md) decides what reaches "low".
RETENTION_DETECTORS = ("post_eos",)
FRAGMENTATION_DETECTORS = ("fragmentation",)


class FleetError(Exception):
    """A fleet directory or query that cannot be used (the message is one line)."""


def _sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def connect(directory: str | Path) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with one view per fleet table."""
    d = Path(directory)
    if not d.is_dir():
        raise FleetError(f"{d}: not a directory (export traces with 'kvtrace export parquet TRACES -o {d}')")
    if not (d / "traces").is_dir() or not any((d / "traces").glob("*.parquet")):
        raise FleetError(f"{d}: no exported traces (no traces/*.parquet); run 'kvtrace export parquet' first")
    con = duckdb.connect(":memory:")
    for name in TABLE_NAMES:
        if any((d / name).glob("*.parquet")):
            glob = _sql_string(str(d / name / "*.parquet"))
            con.execute(f"CREATE VIEW {name} AS SELECT * FROM read_parquet({glob}, union_by_name = true)")
        else:
            empty = pa.Table.from_batches([], schema=empty_schema(name))
            con.register(f"_empty_{name}", empty)
            con.execute(f"CREATE VIEW {name} AS SELECT * FROM _empty_{name}")
    return con


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
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FleetError(f"query failed: {first}") from None
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


def summary(con: duckdb.DuckDBPyConnection, keys: list[str]) -> dict[str, QueryResult]:
    """The default summary, one row per combination of ``keys`` (columns of traces)."""
    check_keys(con, keys)
    k = ", ".join(f't."{key}"' for key in keys)
    sel = f"{k}, " if keys else ""
    group = f"GROUP BY {k}" if keys else ""
    order = f"ORDER BY {k}" if keys else ""
    groups = run_sql(con, f"""
        WITH r AS (
            SELECT trace_id, count(*) AS requests,
                   sum(batch_size::BIGINT * (prompt_tokens + new_tokens)) AS tokens,
                   sum(retained_allocated_bytes) AS retained_bytes,
                   count(retained_allocated_bytes) AS retained_measured,
                   max(peak_allocated_bytes) AS peak_allocated_bytes
            FROM requests GROUP BY trace_id),
        f AS (
            SELECT trace_id,
                   count(*) FILTER (WHERE severity_rank >= 1) AS findings,
                   count(*) FILTER (WHERE severity_rank >= 1 AND detector IN {_in(RETENTION_DETECTORS)}) AS ret,
                   count(*) FILTER (WHERE severity_rank >= 1 AND detector IN {_in(FRAGMENTATION_DETECTORS)}) AS frag
            FROM findings GROUP BY trace_id),
        kv AS (
            SELECT trace_id, sum(bytes_valid) AS kv_bytes, sum(tokens_kept * k_shape[1]) AS kv_tokens
            FROM kv GROUP BY trace_id)
        SELECT {sel}count(*) AS traces,
               coalesce(sum(r.requests), 0)::BIGINT AS requests,
               coalesce(sum(r.tokens), 0)::BIGINT AS tokens,
               coalesce(sum(f.findings), 0)::BIGINT AS findings,
               avg(CASE WHEN coalesce(f.ret, 0) > 0 THEN 1.0 ELSE 0.0 END) AS retention_rate,
               avg(CASE WHEN coalesce(f.frag, 0) > 0 THEN 1.0 ELSE 0.0 END) AS fragmentation_rate,
               sum(r.retained_bytes)::BIGINT AS retained_bytes,
               max(r.peak_allocated_bytes)::BIGINT AS max_peak_allocated_bytes,
               sum(kv.kv_bytes)::DOUBLE / nullif(sum(kv.kv_tokens), 0) AS kv_bytes_per_token_layer
        FROM traces t LEFT JOIN r USING (trace_id) LEFT JOIN f USING (trace_id) LEFT JOIN kv USING (trace_id)
        {group} {order}""")
    findings = run_sql(con, f"""
        SELECT {sel}f.detector, f.severity, count(*) AS findings, count(DISTINCT f.trace_id) AS traces
        FROM findings f JOIN traces t USING (trace_id)
        GROUP BY {k + ', ' if keys else ''}f.detector, f.severity, f.severity_rank
        ORDER BY {k + ', ' if keys else ''}f.severity_rank DESC, f.detector""")
    per_token = run_sql(con, f"""
        SELECT {sel}kv.layer_type, min(kv.bytes_per_token) AS min_bytes_per_token,
               max(kv.bytes_per_token) AS max_bytes_per_token, count(DISTINCT kv.trace_id) AS traces
        FROM kv JOIN traces t USING (trace_id) WHERE kv.bytes_per_token IS NOT NULL
        GROUP BY {k + ', ' if keys else ''}kv.layer_type ORDER BY {k + ', ' if keys else ''}kv.layer_type""")
    return {"groups": groups, "findings": findings, "kv_bytes_per_token": per_token}
