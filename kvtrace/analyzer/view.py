"""TraceView: the one read side of a trace, lazy and indexed by request (h5py-style).

Every consumer of a recorded trace (the analyser, the HTML report, Perfetto, Prometheus replay, the
Zenodo data card, ``calc --trace``) reads through one TraceView over one open Trace: small tables
are read once and kept, and the /kv table, which can hold millions of rows, is never read whole.
Its request index is built by one bounded scan (``SCAN_ROWS`` rows at a time) that keeps only the
row runs of each request; ``kv(request)`` then reads those runs and nothing else.

numpy and kvtrace.format only: no torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cached_property
from typing import Any

import numpy as np

from kvtrace.format import schema
from kvtrace.format.reader import Trace
from kvtrace.labels import device_text

SCAN_ROWS = 1 << 18  # rows read per slice of a large table (bounds memory on long traces)
# A request whose /kv rows lie in more runs than this (continuous batching interleaves requests)
# is read as the one span covering its runs and masked: one h5py read per run costs tens of µs,
# so past a few hundred runs one larger read is cheaper than many small ones.
MAX_RUNS = 256


class TraceView:
    """One open trace, read lazily; the analyser and every renderer share it."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace

    @classmethod
    def of(cls, trace: TraceView | Trace) -> TraceView:
        """The view of an open trace (a view is returned as it is)."""
        return trace if isinstance(trace, TraceView) else cls(trace)

    # ---- identity ---------------------------------------------------------------------------------

    @property
    def path(self) -> str:
        return str(self.trace.path)

    @property
    def meta(self) -> Any:
        return self.trace.meta

    @property
    def version(self) -> str:
        return self.trace.version

    @property
    def complete(self) -> bool:
        return self.trace.complete

    def has(self, table: str) -> bool:
        return self.trace.has(table)

    def nrows(self, table: str) -> int:
        return self.trace.nrows(table)

    def text(self, offset: int, length: int) -> str:
        return self.trace.text(offset, length)

    # ---- small tables, read once ------------------------------------------------------------------

    @cached_property
    def requests(self) -> np.ndarray:
        return self.trace.requests()

    @cached_property
    def layers(self) -> np.ndarray:
        return self.trace.layers()

    @cached_property
    def devices(self) -> np.ndarray:
        return self.trace.devices()

    def device_label(self, device: int) -> str:
        """'cuda:0 NVIDIA H100 ...' for a device the trace names, else 'cuda:0' / 'cpu'."""
        for row in self.devices:
            if int(row["device"]) == device:
                return device_text(device, row["name"].decode(errors="replace"))
        return device_text(device)

    # ---- large tables, sliced -----------------------------------------------------------------------

    def iter_rows(self, table: str, rows: int = SCAN_ROWS) -> Iterator[np.ndarray]:
        """A table slice by slice, so that memory stays bounded on long traces."""
        n = self.trace.nrows(table)
        for start in range(0, n, rows):
            yield self.trace.table(table, slice(start, min(n, start + rows)))

    def kv_head(self, n: int) -> np.ndarray:
        """The first ``n`` /kv rows (what the layout detection samples)."""
        total = self.trace.nrows("kv")
        return self.trace.table("kv", slice(0, min(n, total))) if total else np.zeros(0, schema.KV)

    @cached_property
    def kv_runs(self) -> dict[int, list[tuple[int, int]]]:
        """request -> [(start, stop), ...] row runs of /kv holding that request, in file order."""
        runs: dict[int, list[tuple[int, int]]] = {}
        base = 0
        for rows in self.iter_rows("kv", SCAN_ROWS):
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

    def kv(self, request: int, step: int | None = None) -> np.ndarray:
        """The /kv rows of one request (and step), in file order, read by their runs."""
        runs = self.kv_runs.get(int(request))
        if not runs:
            return np.zeros(0, schema.KV)
        if len(runs) > MAX_RUNS:
            rows = self.trace.table("kv", slice(runs[0][0], runs[-1][1]))
            rows = rows[rows["request"] == request]
        else:
            parts = [self.trace.table("kv", slice(a, b)) for a, b in runs]
            rows = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return rows if step is None else rows[rows["step"] == step]

