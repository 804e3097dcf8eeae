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
from kvtrace.format.errors import InvalidTrace
from kvtrace.format.reader import Trace
from kvtrace.format.serving_rules import cb_args
from kvtrace.labels import device_text

U64_MAX = (1 << 64) - 1
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


    # ---- hybrid caches (format 1.5 /state; empty for older traces and attention-only models) ---------

    @cached_property
    def state(self) -> np.ndarray:
        """/state rows, refused (exit 1) when a row breaks the spec's §7 rules."""
        from kvtrace.format.state_rules import checked_state

        return checked_state(self.trace)

    @cached_property
    def state_steps(self) -> dict[tuple[int, int], tuple[int, int]]:
        """(request, step) -> (unique, valid) state bytes of that step: what the cache held beside its
        KV, each storage once (Σ /state bytes_unique; valid: the states' own bytes)."""
        rows = self.state
        if not rows.size:
            return {}
        key = rows["request"].astype(np.int64) << 32 | rows["step"].astype(np.int64)
        keys, inverse = np.unique(key, return_inverse=True)
        unique = np.bincount(inverse, weights=rows["bytes_unique"].astype(np.float64))
        valid = np.bincount(inverse, weights=rows["bytes_valid"].astype(np.float64))
        return {(int(k >> 32), int(k & 0xFFFFFFFF)): (int(u), int(v))
                for k, u, v in zip(keys.tolist(), unique.tolist(), valid.tolist(), strict=True)}

    def state_bytes(self, request: int, step: int) -> int:
        """State bytes the cache held at (request, step) beside its KV; 0 when none was recorded."""
        return self.state_steps.get((int(request), int(step)), (0, 0))[0]

    def state_layers(self) -> dict[int, int]:
        """layer -> its largest per-step state bytes over the trace (layers with state only)."""
        rows = self.state
        out: dict[int, int] = {}
        if not rows.size:
            return out
        key = rows["request"].astype(np.int64) << 32 | rows["step"].astype(np.int64)
        for layer in np.unique(rows["layer"]).tolist():
            mine = rows["layer"] == layer
            keys, inverse = np.unique(key[mine], return_inverse=True)
            sums = np.bincount(inverse, weights=rows["bytes_unique"][mine].astype(np.float64))
            out[int(layer)] = int(sums.max()) if sums.size else 0
        return out

    # ---- continuous batching (format 1.4; empty arrays for older traces) ------------------------

    @cached_property
    def sched(self) -> np.ndarray:
        """/sched: one row per scheduler step (schema.SCHED)."""
        return self.trace.sched()

    @cached_property
    def sched_groups(self) -> np.ndarray:
        """/sched_groups: per step and cache group (schema.SCHED_GROUPS)."""
        return self.trace.sched_groups()

    @cached_property
    def _blocks(self) -> np.ndarray:
        return self.trace.blocks()

    def blocks(self, request: int | None = None, step: int | None = None, manager: int | None = None) -> np.ndarray:
        """/blocks rows (schema.BLOCKS), optionally of one request, step and manager."""
        rows = self._blocks
        mask = np.ones(rows.shape[0], dtype=bool)
        for column, value in (("request", request), ("step", step), ("manager", manager)):
            if value is not None:
                mask &= rows[column] == value
        return rows if mask.all() else rows[mask]

    @cached_property
    def serving_events(self) -> np.ndarray:
        """The /events rows of continuous batching: request start/end, EOS and the 1.4 kinds."""
        events = self.trace.events()
        return events[np.isin(events["kind"], SERVING_EVENT_KINDS)]

    @cached_property
    def phases(self) -> np.ndarray:
        """Load-test phase markers (PHASE events) in time order: index, name, t_ns (PHASES dtype)."""
        rows = self.serving_events
        rows = rows[rows["kind"] == int(schema.EventKind.PHASE)]
        out = np.zeros(rows.shape[0], dtype=PHASES)
        for i, e in enumerate(np.sort(rows, order="t_ns")):
            out[i] = (int(e["value"]), self.text(int(e["text_off"]), int(e["text_len"])), int(e["t_ns"]))
        return out

    @cached_property
    def cb_requests(self) -> np.ndarray:
        """One row per continuous-batching request (CB_REQUESTS dtype): arrival (queued), first admission,
        first token, end, outcome and what happened in between, joined from /requests and /events.
        Times are monotonic ns; 0 where it did not happen (never admitted, no token)."""
        reqs = self.requests
        ev = self.serving_events
        out = []
        for r in reqs:
            try:
                args = cb_args(self.text(int(r["gen_args_off"]), int(r["gen_args_len"])))
            except ValueError as exc:  # damage where it is read: the trace is refused (spec §9.1)
                raise InvalidTrace(f"{self.path}: /requests request {int(r['request'])}'s gen_args {exc}; "
                                   "'kvtrace validate' lists it") from None
            if args is None:
                continue
            mine = ev[ev["request"] == int(r["request"])]

            def first(kind: schema.EventKind, rows: np.ndarray = mine) -> int:
                t = rows["t_ns"][rows["kind"] == int(kind)]
                return int(t.min()) if t.size else 0

            def total(kind: schema.EventKind, rows: np.ndarray = mine) -> int:
                # Python ints: an int64 sum of values near 2^63 wraps negative (a uint64 field refuses it)
                return min(sum(int(v) for v in rows["value"][rows["kind"] == int(kind)]), U64_MAX)

            out.append((int(r["request"]), int(args.get("manager", 0)), int(r["outcome"]), int(r["prompt_tokens"]),
                        int(r["new_tokens"]), int(r["start_ns"]), first(schema.EventKind.SCHEDULED),
                        first(schema.EventKind.FIRST_TOKEN), int(r["end_ns"]),
                        int(np.sum(mine["kind"] == int(schema.EventKind.PREEMPTED))),
                        total(schema.EventKind.PREEMPTED), total(schema.EventKind.PREFIX_HIT)))
        return np.array(out, dtype=CB_REQUESTS)


SERVING_EVENT_KINDS = [int(k) for k in (
    schema.EventKind.REQUEST_START, schema.EventKind.REQUEST_END, schema.EventKind.EOS,
    schema.EventKind.SCHEDULED, schema.EventKind.FIRST_TOKEN, schema.EventKind.PREEMPTED,
    schema.EventKind.PREFIX_HIT, schema.EventKind.BLOCK_EVICTED, schema.EventKind.OFFLOADED,
    schema.EventKind.PHASE)]
PHASES = np.dtype([("index", "<i8"), ("name", "U128"), ("t_ns", "<u8")])
CB_REQUESTS = np.dtype([
    ("request", "<u4"), ("manager", "<u2"), ("outcome", "u1"), ("prompt_tokens", "<u4"), ("new_tokens", "<u4"),
    ("arrival_ns", "<u8"), ("admitted_ns", "<u8"), ("first_token_ns", "<u8"), ("end_ns", "<u8"),
    ("preemptions", "<u4"), ("preempted_tokens", "<u8"), ("prefix_hit_tokens", "<u8"),
])

