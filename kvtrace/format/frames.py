"""A trace table as plain columns that data-frame libraries take (pandas, pyarrow, polars, DuckDB),
named and typed as the Parquet export names and types them (spec/fleet.md).

The reader's tables are numpy structured arrays: enumerated columns hold integer codes, shapes are
fixed-size sub-arrays and text lives in the /text heap behind (offset, length) pairs. A data frame
wants one scalar per cell. So, per column:

* enumerated codes become their lower-case names (``ok``, ``sliding``, ``decode``); an unknown
  code (a newer writer's) becomes its number as text;
* fixed-size byte strings (device names, uuids) become ``str``;
* shapes (``k_shape`` [B, H, T, D], a payload's ``shape``) become one Python list per row;
* text-heap references (``*_off``/``*_len``) are dropped; the events table gets its ``text``
  resolved, the kv table its ``bytes_per_token`` (valid bytes / (kept tokens x batch), NaN where
  nothing is kept). Prompt text never leaves the trace here, as in the Parquet export.

Only numpy here: pandas and pyarrow are imported by the functions that return their objects
(:func:`to_pandas`, :func:`to_arrow`), so the reader keeps working without either.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtrace.format import schema

if TYPE_CHECKING:  # pragma: no cover
    from kvtrace.format.reader import Trace

# Short names accepted for the tables under a group (the Parquet export's telemetry and payloads).
ALIASES = {"nvml": "telemetry/nvml", "allocator": "telemetry/allocator", "process": "telemetry/process",
           "payloads": "payloads/index"}
# Tables that take a ``request`` filter (they have a request column).
BY_REQUEST = ("requests", "kv", "steps", "events", "readings", "retention", "payloads/index", "blocks")


def table_path(name: str) -> str:
    """The trace path of a table name ("kv", "nvml", "telemetry/nvml", "payloads"...); KeyError
    naming the tables there are for any other name."""
    path = ALIASES.get(name, name)
    if path not in schema.TABLES:
        names = sorted(set(schema.TABLES) - {"state"} | set(ALIASES))
        raise KeyError(f"no table {name!r}; tables: {', '.join(names)}")
    return path


def enum_names(values: np.ndarray, enum_type: type[enum.IntEnum]) -> list[str]:
    """Codes as lower-case member names; a code the enumeration lacks as its number."""
    names = {int(e): e.name.lower() for e in enum_type}
    return [names.get(int(v), str(int(v))) for v in values]


def kv_bytes_per_token(rows: np.ndarray) -> np.ndarray:
    """Valid KV bytes per kept token and sequence of each /kv row (NaN where nothing is kept)."""
    batch = rows["k_shape"][:, 0].astype(np.float64) if rows.size else np.zeros(0)
    denom = rows["tokens_kept"].astype(np.float64) * np.maximum(batch, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(denom > 0, rows["bytes_valid"].astype(np.float64) / denom, np.nan)


def columns(path: str, rows: np.ndarray, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """``rows`` of table ``path`` as {column: values}: numpy arrays for numbers, lists of str for
    enumerations and byte strings, lists of lists for shapes; text references dropped."""
    enums = dict(schema.ENUM_COLUMNS.get(path, ()))
    out: dict[str, Any] = {}
    for field in rows.dtype.names or ():
        if field.endswith(("_off", "_len")) or field in drop:
            continue
        values = rows[field]
        if field in enums:
            out[field] = enum_names(values, enums[field])
        elif values.ndim > 1:
            out[field] = values.astype(np.int64).tolist()
        elif values.dtype.kind == "S":
            out[field] = [v.rstrip(b"\0").decode("utf-8", errors="replace") for v in values.tolist()]
        else:
            out[field] = values
    return out


def arrow_type(values: Any, rows: np.ndarray, field: str) -> Any:
    """The Arrow type of one column of :func:`columns` (explicit, so an empty table keeps it)."""
    import pyarrow as pa

    if isinstance(values, np.ndarray):
        return pa.from_numpy_dtype(values.dtype)
    if field in rows.dtype.names and rows[field].ndim > 1:
        return pa.list_(pa.int64())
    return pa.string()


def arrow_columns(path: str, rows: np.ndarray, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """:func:`columns` as pyarrow arrays (the Parquet export's types)."""
    import pyarrow as pa

    return {name: pa.array(values, arrow_type(values, rows, name))
            for name, values in columns(path, rows, drop).items()}


def trace_columns(trace: Trace, name: str, request: int | None = None) -> tuple[str, np.ndarray, dict[str, Any]]:
    """(path, rows, columns) of one table of an open trace, with the extra columns the Parquet
    export adds (events ``text``, kv ``bytes_per_token``); ``request`` keeps one request's rows."""
    path = table_path(name)
    if request is not None and path not in BY_REQUEST:
        raise ValueError(f"table {name!r} has no request column: call it without request=")
    rows = trace[path][:] if request is None else trace[path].where(request=request)
    cols = columns(path, rows)
    if path == "kv":
        cols["bytes_per_token"] = kv_bytes_per_token(rows)
    elif path == "events":
        cols["text"] = [trace.text(int(r["text_off"]), int(r["text_len"])) for r in rows]
    return path, rows, cols


def to_pandas(trace: Trace, name: str, request: int | None = None) -> Any:
    """One table as a pandas DataFrame (needs pandas)."""
    try:
        import pandas as pd
    except ImportError:
        raise ImportError("Trace.to_pandas needs pandas: pip install pandas") from None
    _, _, cols = trace_columns(trace, name, request)
    return pd.DataFrame(cols, columns=list(cols))


def to_arrow(trace: Trace, name: str, request: int | None = None) -> Any:
    """One table as a pyarrow Table with the Parquet export's types (needs pyarrow: the fleet extra)."""
    try:
        import pyarrow as pa
    except ImportError:
        raise ImportError("Trace.to_arrow needs pyarrow: pip install 'kvtrace[fleet]' (or pyarrow)") from None
    _, rows, cols = trace_columns(trace, name, request)
    return pa.table({k: pa.array(v, arrow_type(v, rows, k)) for k, v in cols.items()})
