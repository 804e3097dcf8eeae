"""Fleets of traces: export many traces to Parquet, query them with DuckDB, diff versions.

Needs the ``fleet`` extra (pyarrow, duckdb, dask[distributed]); the analyser core never imports
this package. Traces are read only through :mod:`kvtrace.fleet.source` (the one adapter onto the
public read side), so a redesign of the reader touches that module alone. spec/fleet.md documents
the Parquet layout and the SQL views.
"""

from __future__ import annotations

from typing import Any, ClassVar

from kvtrace import exitcodes
from kvtrace.errors import KvtraceError
from kvtrace.units import format_bytes

EXTRA_HINT = "install with: pip install 'kvtrace[fleet]'"


class FleetError(KvtraceError):
    """A fleet directory or query that cannot be used (the message is one line). Exit 2, a damaged
    or foreign fleet directory (spec/cli.md); the commands answer 64 where the user's own query or
    selector is at fault."""

    exit_code: ClassVar[int] = exitcodes.UNREADABLE


def missing_dependency(exc: ImportError) -> str:
    """One line naming the missing module of the fleet extra."""
    name = getattr(exc, "name", None) or str(exc)
    return f"kvtrace fleet needs {name} ({EXTRA_HINT})"


def format_cell(column: str, value: Any) -> str:
    """A summary cell as text: rates as percentages, byte columns in binary units, '-' for null."""
    if value is None:
        return "-"
    if isinstance(value, float) and column.endswith("rate"):
        return f"{value:.1%}"
    if isinstance(value, (int, float)) and "bytes" in column:
        return format_bytes(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
