"""The replay context: one open trace reorganised for detectors.

Requests come in time order, each with its steps, a (step x layer) grid of /kv fields, its events,
labelled readings and retention rows; telemetry is sorted by time and can be cut per request.
Everything is read once, lazily, from the trace's tables; nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from kvtrace.analyzer.expect import Expectation, build_expectation
from kvtrace.analyzer.ranks import shard_config
from kvtrace.format import schema
from kvtrace.format.reader import Trace
from kvtrace.geometry.bounds import checked_config
from kvtrace.labels import device_text

# /kv fields the grid exposes, plus derived columns.
GRID_FIELDS = (
    "layer_type", "tokens_seen", "tokens_kept", "bytes_allocated", "bytes_valid", "bytes_unique",
    "k_storage", "v_storage", "k_storage_bytes", "v_storage_bytes", "expanded_bytes", "t_ns",
    "k_dtype", "v_dtype", "device",
)


@dataclass
class KVGrid:
    """/kv rows of one request as (step x layer) arrays; -1 where a (step, layer) has no row."""

    steps: np.ndarray  # step ids, ascending
    layers: np.ndarray  # layer ids, ascending
    fields: dict[str, np.ndarray]
    present: np.ndarray  # bool (step x layer)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.fields[name]

    @property
    def empty(self) -> bool:
        return self.steps.size == 0

    def last_row(self) -> int:
        """Index of the last step that has rows for the most layers (the request's final state)."""
        counts = self.present.sum(axis=1)
        full = np.flatnonzero(counts == counts.max())
        return int(full[-1])

    def col(self, layer: int) -> int:
        return int(np.searchsorted(self.layers, layer))


def _grid(rows: np.ndarray) -> KVGrid:
    steps = np.unique(rows["step"]).astype(np.int64)
    layers = np.unique(rows["layer"]).astype(np.int64)
    si = np.searchsorted(steps, rows["step"])
    li = np.searchsorted(layers, rows["layer"])
    shape = (steps.size, layers.size)
    present = np.zeros(shape, dtype=bool)
    present[si, li] = True
    fields: dict[str, np.ndarray] = {}
    for name in GRID_FIELDS:
        arr = np.full(shape, -1, dtype=np.int64)
        arr[si, li] = rows[name].astype(np.int64)
        fields[name] = arr
    for name, src, dim in (("batch", "k_shape", 0), ("k_heads", "k_shape", 1),
                           ("k_len", "k_shape", 2), ("k_dim", "k_shape", 3),
                           ("v_len", "v_shape", 2), ("v_dim", "v_shape", 3)):
        arr = np.full(shape, -1, dtype=np.int64)
        arr[si, li] = rows[src][:, dim].astype(np.int64)
        fields[name] = arr
    return KVGrid(steps, layers, fields, present)


@dataclass
class RequestTimeline:
    """One generate() call, replayed in time order."""

    request: int
    outcome: schema.Outcome
    batch_size: int
    prompt_tokens: int
    new_tokens: int
    eos_step: int
    start_ns: int
    end_ns: int
    steps: np.ndarray  # /steps rows sorted by step
    kv: KVGrid
    events: np.ndarray
    readings: dict[int, np.void]  # label -> last reading row with that label
    retention: np.ndarray
    # (label, device) -> last reading row: a model spread over devices has one row per device
    readings_on: dict[tuple[int, int], np.void] = field(default_factory=dict)
    # hybrid models (format 1.5 /state): conv/recurrent state bytes beside the KV, constant in tokens
    state_by_step: dict[int, int] = field(default_factory=dict)  # step -> unique state bytes
    state_layers: dict[int, int] = field(default_factory=dict)  # layer -> state bytes at its largest step

    @property
    def state_bytes(self) -> int:
        """Largest state bytes the request's cache held at one step (0: an attention-only model)."""
        return max(self.state_by_step.values(), default=0)

    def reading(self, label: schema.ReadingLabel) -> np.void | None:
        return self.readings.get(int(label))

    def reading_at(self, label: schema.ReadingLabel, device: int) -> np.void | None:
        """The reading with this label taken on ``device`` (None when there is none)."""
        return self.readings_on.get((int(label), int(device)))

    @property
    def reading_devices(self) -> list[int]:
        """Devices the request's labelled readings were taken on."""
        return sorted({d for _, d in self.readings_on})

    @property
    def end_or_last_ns(self) -> int:
        """end_ns, or the last thing the trace saw of the request when it never ended."""
        if self.end_ns:
            return self.end_ns
        ts = [self.start_ns]
        if self.steps.size:
            ts.append(int(self.steps["t_ns"].max()))
        if self.events.size:
            ts.append(int(self.events["t_ns"].max()))
        return max(ts)

    @property
    def peak_kv_unique(self) -> int:
        """Largest de-duplicated KV bytes over the request's steps (0 without rows)."""
        if self.steps.size:
            return int(self.steps["kv_bytes_unique"].max())
        if not self.kv.empty:
            return int(np.where(self.kv.present, self.kv["bytes_unique"], 0).sum(axis=1).max())
        return 0

    @property
    def final_tokens(self) -> int:
        if self.steps.size:
            return int(self.steps["tokens_seen"][-1])
        if not self.kv.empty:
            return int(self.kv["tokens_seen"][self.kv.last_row()].max())
        return 0

    def step_of_time(self, t_ns: int) -> int | None:
        """The step whose forward was running at t_ns (steps carry their end time)."""
        if not self.steps.size:
            return None
        i = int(np.searchsorted(self.steps["t_ns"], t_ns, side="left"))
        if i >= self.steps.size:
            return None
        return int(self.steps["step"][i])


def _by_request(rows: np.ndarray, key: str = "request") -> dict[int, np.ndarray]:
    if rows.size == 0:
        return {}
    order = np.argsort(rows[key], kind="stable")
    rows = rows[order]
    ids, starts = np.unique(rows[key], return_index=True)
    bounds = list(starts[1:]) + [rows.size]
    return {int(i): rows[s:e] for i, s, e in zip(ids, starts, bounds, strict=True)}


class ReplayContext:
    """Everything detectors read, built from an open Trace."""

    def __init__(self, source: Trace) -> None:
        trace = self.trace = source
        self.meta = trace.meta
        self.path = str(trace.path)
        self.layers_table = trace.layers[:]
        trace.kv.runs  # noqa: B018 - index /kv first: a damaged /kv is reported before the other tables
        steps = trace.steps[:]
        events = trace.events[:]
        readings = trace.readings[:]
        retention = trace.retention[:]
        self.events = events[np.argsort(events["t_ns"], kind="stable")] if events.size else events
        self.kv_rows = trace.nrows("kv")
        checked_config(trace, self.layers_table)  # sizes within bounds before they size anything (exit 1)
        self.expectation: Expectation = build_expectation(shard_config(self.meta), self.layers_table, trace.kv[:64])
        steps_by = _by_request(steps)
        ev_by = _by_request(self.events[self.events["request"] >= 0]) if events.size else {}
        rd_by = _by_request(readings[readings["request"] >= 0]) if readings.size else {}
        ret_by = _by_request(retention)
        state = _state_by_request(trace)  # hybrid models' /state (format 1.5)
        self.requests: list[RequestTimeline] = []
        for r in trace.requests[:]:
            rid = int(r["request"])
            krows = trace.kv.where(request=rid)  # this request's runs of /kv, not the table read whole and masked
            krows = krows[np.lexsort((krows["layer"], krows["step"]))]
            srows = steps_by.get(rid, steps[:0])
            srows = srows[np.argsort(srows["step"], kind="stable")]
            rd: dict[int, np.void] = {}
            rd_on: dict[tuple[int, int], np.void] = {}
            for row in rd_by.get(rid, readings[:0]):
                rd[int(row["label"])] = row
                rd_on[(int(row["label"]), int(row["device"]))] = row
            try:
                outcome = schema.Outcome(int(r["outcome"]))
            except ValueError:
                outcome = schema.Outcome.ERROR
            self.requests.append(RequestTimeline(
                rid, outcome, int(r["batch_size"]), int(r["prompt_tokens"]), int(r["new_tokens"]),
                int(r["eos_step"]), int(r["start_ns"]), int(r["end_ns"]), srows,
                _grid(krows),
                ev_by.get(rid, events[:0]), rd, ret_by.get(rid, retention[:0]), rd_on,
                *state.get(rid, ({}, {})),
            ))
        self.requests.sort(key=lambda t: (t.start_ns, t.request))
        self.unattributed_readings = readings[readings["request"] < 0] if readings.size else readings

    # ---- telemetry ------------------------------------------------------------------------------

    @cached_property
    def allocator(self) -> np.ndarray:
        return _sorted(self.trace.allocator[:])

    @cached_property
    def nvml(self) -> np.ndarray:
        return _sorted(self.trace.nvml[:])

    @cached_property
    def process(self) -> np.ndarray:
        return _sorted(self.trace.process[:])

    @cached_property
    def devices(self) -> list[dict[str, Any]]:
        return [
            {"index": int(d["device"]), "name": d["name"].decode(errors="replace"),
             "total_memory_bytes": int(d["total_memory_bytes"])}
            for d in self.trace.devices[:]
        ]

    def device_total(self, device: int) -> int | None:
        for d in self.devices:
            if d["index"] == device and d["total_memory_bytes"] > 0:
                return d["total_memory_bytes"]
        return None

    @property
    def gpu_devices(self) -> list[int]:
        return [d["index"] for d in self.devices if d["index"] >= 0]

    @staticmethod
    def window(rows: np.ndarray, t0: int, t1: int) -> np.ndarray:
        """Rows of a time-sorted table with t0 <= t_ns <= t1."""
        if rows.size == 0:
            return rows
        lo = int(np.searchsorted(rows["t_ns"], t0, side="left"))
        hi = int(np.searchsorted(rows["t_ns"], t1, side="right"))
        return rows[lo:hi]

    def request_at(self, t_ns: int) -> RequestTimeline | None:
        for req in self.requests:
            if req.start_ns <= t_ns <= req.end_or_last_ns:
                return req
        return None

    # ---- availability ---------------------------------------------------------------------------

    def source_reason(self, name: str) -> str:
        entry = self.meta.sources.get(name)
        if isinstance(entry, dict) and entry.get("reason"):
            return str(entry["reason"])
        return "not recorded"

    def has_allocator(self) -> bool:
        if self.allocator.size:
            return True
        # RECORDER_OWN rows carry the recorder's own bytes (0 on a CPU): not an allocator reading
        own = int(schema.ReadingLabel.RECORDER_OWN)
        return any(int(r["allocated_bytes"]) >= 0 and int(r["device"]) >= 0 and int(r["label"]) != own
                   for t in self.requests for r in t.readings.values())

    def has_nvml(self) -> bool:
        if self.nvml.size:
            return True
        return any(int(r["nvml_used_bytes"]) >= 0 for t in self.requests for r in t.readings.values())

    def has_retention_tracking(self) -> bool:
        """Whether the recorder looked for surviving KV storages after each request (an empty
        /retention table then means nothing survived, not that nobody looked)."""
        setting = self.meta.recorder_settings.get("retention")
        if setting is not None:
            return bool(setting)
        return self.trace.nrows("retention") > 0

    def missing(self, need: str) -> str | None:
        """None when the trace holds `need`, else a one-line reason it does not."""
        if need == "kv":
            return None if self.kv_rows else "the trace holds no per-layer KV rows (/kv is empty)"
        if need == "steps":
            return None if self.trace.nrows("steps") else "the trace holds no per-step rows (/steps is empty)"
        if need == "requests":
            return None if self.requests else "the trace holds no requests"
        if need == "config":
            if self.expectation.source == "config":
                return None
            return "; ".join(self.expectation.notes) or "no usable model config"
        if need == "allocator":
            if self.has_allocator():
                return None
            return f"no torch allocator data in this trace ({self.source_reason('allocator')})"
        if need == "nvml":
            if self.has_nvml():
                return None
            return f"no NVML data in this trace ({self.source_reason('nvml')})"
        if need == "readings":
            return None if self.trace.nrows("readings") else "the trace holds no labelled memory readings"
        if need == "device_memory":
            if any(self.device_total(d) for d in self.gpu_devices):
                return None
            return "the trace names no GPU with a known memory size"
        raise ValueError(f"unknown need {need!r}")

    # ---- identity -------------------------------------------------------------------------------

    @property
    def device_label(self) -> str:
        if not self.devices:
            return "unknown device"
        return ", ".join(device_text(d["index"], d["name"]) for d in self.devices)


def _state_by_request(trace: Trace) -> dict[int, tuple[dict[int, int], dict[int, int]]]:
    """request -> (step -> state bytes, layer -> state bytes at the request's largest step), from
    the /state rows read once (empty for attention-only traces)."""
    by_step: dict[int, dict[int, int]] = {}
    for (rid, step), (unique, _) in trace.state_steps.items():
        by_step.setdefault(rid, {})[step] = unique
    out: dict[int, tuple[dict[int, int], dict[int, int]]] = {}
    rows = trace.state_rows
    for rid, steps in by_step.items():
        top = max(steps, key=lambda k: (steps[k], k))
        at = rows[(rows["request"] == rid) & (rows["step"] == top)]
        layers: dict[int, int] = {}
        for layer, nbytes in zip(at["layer"].tolist(), at["bytes_unique"].tolist(), strict=True):
            layers[int(layer)] = layers.get(int(layer), 0) + int(nbytes)
        out[rid] = (steps, layers)
    return out


def _sorted(rows: np.ndarray) -> np.ndarray:
    if rows.size < 2:
        return rows
    return rows[np.argsort(rows["t_ns"], kind="stable")]

