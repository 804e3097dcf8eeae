"""One table of an open trace, read on demand (h5py's Dataset model, with the reader's checks).

``trace.kv`` (or ``trace["kv"]``) is a :class:`Table`: nothing is read until rows are asked for.

* ``len(table)``: rows, as the reader presents them (a newer minor's rows of unknown codes skipped);
* ``table[a:b]``: rows by position; ``table[:]`` every row (the small tables keep it once read);
* ``table.where(request=r, step=s, ...)``: rows whose columns equal the values given. By request,
  only that request's row runs are read: an index of runs is built by one bounded scan of the
  table (``SCAN_ROWS`` rows at a time) the first time a request is asked for, so a /kv of
  millions of rows is never read whole to find one request;
* ``table.slices()``: the table slice by slice, so that memory stays bounded on long traces.

An optional table the trace predates (the 1.4 continuous-batching tables, 1.5 /state and /owners)
reads as empty with this reader's dtype; a required one that is missing is refused, as every
read of it always was. numpy only.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtrace.format import schema

if TYPE_CHECKING:  # pragma: no cover
    from kvtrace.format.reader import Trace

SCAN_ROWS = 1 << 18  # rows read per slice of a large table (bounds memory on long traces)
# A request whose rows lie in more runs than this (continuous batching interleaves requests) is
# read as the one span covering its runs and masked: one h5py read per run costs tens of µs, so
# past a few hundred runs one larger read is cheaper than many small ones.
MAX_RUNS = 256
# Tables small enough to keep once read whole (one row per request, layer, device or scheduler
# step): every consumer of an open trace shares that one read.
KEPT = frozenset({"requests", "layers", "devices", "sched", "sched_groups", "blocks"})


class Table:
    """One table of an open :class:`~kvtrace.format.reader.Trace`, read when rows are asked for."""

    def __init__(self, trace: Trace, path: str) -> None:
        if path not in schema.TABLES:
            raise KeyError(f"no table {path!r}; tables: {', '.join(schema.TABLES)}")
        self.trace = trace
        self.path = path
        self.dtype, self.required = schema.TABLES[path]

    def __repr__(self) -> str:
        return f"<kvtrace table /{self.path} of {self.trace.path}>"

    @property
    def exists(self) -> bool:
        """The file holds this table (an optional one may be absent from older traces)."""
        return self.trace.has(self.path)

    def __len__(self) -> int:
        return self.trace.nrows(self.path)

    def __getitem__(self, rows: slice) -> np.ndarray:
        if not isinstance(rows, slice):
            raise TypeError(f"/{self.path} is read by row slices (table[a:b], table[:]); "
                            "one request's rows: table.where(request=r)")
        if rows == slice(None):
            return self._whole if self.path in KEPT else self._read(None)
        return self._read(rows)

    def _read(self, rows: slice | None) -> np.ndarray:
        if not self.required and not self.exists:
            return np.zeros(0, self.dtype)
        return self.trace.table(self.path, rows)

    @cached_property
    def _whole(self) -> np.ndarray:
        rows = self._read(None)
        rows.flags.writeable = False  # shared by every consumer of the open trace
        return rows

    def slices(self, rows: int = SCAN_ROWS) -> Iterator[np.ndarray]:
        """The table slice by slice (``rows`` at a time)."""
        n = len(self)
        for start in range(0, n, rows):
            yield self._read(slice(start, min(n, start + rows)))

    @cached_property
    def runs(self) -> dict[int, list[tuple[int, int]]]:
        """request -> [(start, stop), ...] row runs holding that request, in file order (one
        bounded scan of the table, kept for the life of the open trace)."""
        if "request" not in (self.dtype.names or ()):
            raise TypeError(f"/{self.path} has no request column")
        runs: dict[int, list[tuple[int, int]]] = {}
        base = 0
        for rows in self.slices():
            req = rows["request"].astype(np.int64)
            cuts = np.flatnonzero(np.diff(req)) + 1
            starts = np.concatenate(([0], cuts))
            stops = np.concatenate((cuts, [req.size]))
            for a, b in zip(starts.tolist(), stops.tolist(), strict=True):
                mine = runs.setdefault(int(req[a]), [])
                if mine and mine[-1][1] == base + a:  # a run that crosses a slice boundary
                    mine[-1] = (mine[-1][0], base + b)
                else:
                    mine.append((base + a, base + b))
            base += req.size
        return runs

    def where(self, request: int | None = None, **equal: Any) -> np.ndarray:
        """Rows whose columns equal the values given (None: any), in file order.

        ``request``: only that request's row runs are read (see :attr:`runs`); a kept small table
        is masked in memory. Without ``request`` the table is read whole and masked."""
        if request is not None and self.path not in KEPT:
            rows = self._request_rows(int(request))
        else:
            rows = self[:]
            if request is not None:
                equal = {"request": request, **equal}
        mask = np.ones(rows.shape[0], dtype=bool)
        for column, value in equal.items():
            if value is not None:
                mask &= rows[column] == value
        return rows if mask.all() else rows[mask]

    def _request_rows(self, request: int) -> np.ndarray:
        runs = self.runs.get(request)
        if not runs:
            return np.zeros(0, self.dtype)
        if len(runs) > MAX_RUNS:
            rows = self._read(slice(runs[0][0], runs[-1][1]))
            return rows[rows["request"] == request]
        parts = [self._read(slice(a, b)) for a, b in runs]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)
