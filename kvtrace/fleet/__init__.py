"""Fleets of traces: export many traces to Parquet, query them with DuckDB, diff versions.

Needs the ``fleet`` extra (pyarrow, duckdb, dask[distributed]); the analyser core never imports
this package. Traces are read only through :mod:`kvtrace.fleet.source` (the one adapter onto the
public read side), so a redesign of the reader touches that module alone. spec/fleet.md documents
the Parquet layout and the SQL views.
"""

from __future__ import annotations

EXTRA_HINT = "install with: pip install 'kvtrace[fleet]'"


def missing_dependency(exc: ImportError) -> str:
    """One line naming the missing module of the fleet extra."""
    name = getattr(exc, "name", None) or str(exc)
    return f"kvtrace fleet needs {name} ({EXTRA_HINT})"
