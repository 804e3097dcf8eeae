"""What consumers join from several tables of one open trace, computed once per trace: the
hybrid caches' state bytes per step, the continuous-batching requests and load-test phases, and
device labels. :class:`~kvtrace.format.reader.Trace` carries these, so the analyser and every
renderer that share one open trace share them too. numpy only.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from kvtrace.format import schema
from kvtrace.format.errors import InvalidTrace
from kvtrace.format.serving_rules import cb_args
from kvtrace.format.state_rules import checked_state
from kvtrace.labels import device_text

if TYPE_CHECKING:  # pragma: no cover
    from kvtrace.format.tables import Table

U64_MAX = (1 << 64) - 1

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


class TraceJoins:
    """The joins of :class:`~kvtrace.format.reader.Trace` (a base of it, not used alone)."""

    path: object
    requests: Table
    devices: Table
    events: Table
    text: Callable[[int, int], str]

    def device_label(self, device: int) -> str:
        """'cuda:0 NVIDIA H100 ...' for a device the trace names, else 'cuda:0' / 'cpu'."""
        for row in self.devices[:]:
            if int(row["device"]) == device:
                return device_text(device, row["name"].decode(errors="replace"))
        return device_text(device)

    # ---- hybrid caches (format 1.5 /state; empty for older traces and attention-only models) ---------

    @cached_property
    def state_rows(self) -> np.ndarray:
        """/state rows, refused (exit 1) when a row breaks the spec's §7 rules; read once."""
        return checked_state(self)

    @cached_property
    def state_steps(self) -> dict[tuple[int, int], tuple[int, int]]:
        """(request, step) -> (unique, valid) state bytes of that step: what the cache held beside its
        KV, each storage once (Σ /state bytes_unique; valid: the states' own bytes)."""
        rows = self.state_rows
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
        rows = self.state_rows
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
    def serving_events(self) -> np.ndarray:
        """The /events rows of continuous batching: request start/end, EOS and the 1.4 kinds."""
        events = self.events[:]
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
        reqs = self.requests[:]
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
