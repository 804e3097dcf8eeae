"""What the report and the exports plot, pulled out of a trace with numpy only.

No matplotlib and no torch here: the Perfetto and Zenodo exporters reuse these extractors, and
they must work in the analyser's environment. Bytes stay integers; times are seconds (float)
from the trace's time zero (:func:`time_zero_ns`). A source the trace lacks yields no series:
callers say it is absent instead of drawing zeros.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvtrace.format import schema
from kvtrace.format.reader import Trace
from kvtrace.labels import device_text, layer_type_name  # noqa: F401 - re-exported for renderers
from kvtrace.params import split_list
from kvtrace.report.kvcheck import Unpredictable, predictor

# Events drawn as phase markers on the memory timeline.
MARKER_KINDS = (
    schema.EventKind.PREFILL_START,
    schema.EventKind.PREFILL_END,
    schema.EventKind.EOS,
    schema.EventKind.GC,
    schema.EventKind.EMPTY_CACHE,
    schema.EventKind.OOM,
)


@dataclass
class Series:
    """One memory series of one device: `t_ns` (trace clock) and `values` (bytes)."""

    name: str
    t_ns: np.ndarray
    values: np.ndarray
    source: str  # the table it came from


@dataclass
class Marker:
    t_ns: int
    kind: str  # EventKind name, lower case
    request: int
    device: int  # -1: every device


@dataclass
class DeviceTimeline:
    device: int
    label: str
    series: list[Series] = field(default_factory=list)


def time_zero_ns(trace: Trace) -> int:
    """The instant every plotted time is measured from: the writer's clock anchor, or an
    earlier row if a recorder stamped one before it (clocks of other threads)."""
    candidates = [trace.meta.clock_anchor_mono_ns]
    for table, col in (("requests", "start_ns"), ("telemetry/nvml", "t_ns"),
                       ("telemetry/allocator", "t_ns"), ("events", "t_ns"), ("steps", "t_ns")):
        if trace.has(table) and trace.nrows(table):
            first = trace[table][0:1][col]
            if first.size and int(first[0]) > 0:
                candidates.append(int(first[0]))
    return min(candidates)


def device_label(trace: Trace, device: int) -> str:
    for row in trace.devices[:]:
        if int(row["device"]) == device:
            return device_text(device, row["name"].decode(errors="replace"))
    return device_text(device)


def _valid(values: np.ndarray) -> np.ndarray:
    """Mask of real readings: the format writes -1 (NA_I64) where a value was not measured."""
    return values >= 0


def memory_timelines(trace: Trace) -> list[DeviceTimeline]:
    """Every memory series of every device, sorted by time, NA readings dropped."""
    by_device: dict[int, DeviceTimeline] = {}

    def add(device: int, name: str, t: np.ndarray, v: np.ndarray, source: str) -> None:
        keep = _valid(v)
        if not np.any(keep):
            return
        order = np.argsort(t[keep], kind="stable")
        tl = by_device.setdefault(device, DeviceTimeline(device, device_label(trace, device)))
        tl.series.append(Series(name, t[keep][order].astype(np.int64),
                                v[keep][order].astype(np.int64), source))

    nvml = trace.nvml[:]
    for dev in np.unique(nvml["device"]):
        rows = nvml[nvml["device"] == dev]
        add(int(dev), "nvml_used", rows["t_ns"], rows["used_bytes"], "telemetry/nvml")
        add(int(dev), "nvml_process_used", rows["t_ns"], rows["process_used_bytes"], "telemetry/nvml")
    alloc = trace.allocator[:]
    for dev in np.unique(alloc["device"]):
        rows = alloc[alloc["device"] == dev]
        add(int(dev), "allocator_reserved", rows["t_ns"], rows["reserved_bytes"], "telemetry/allocator")
        add(int(dev), "allocator_allocated", rows["t_ns"], rows["allocated_bytes"], "telemetry/allocator")
        add(int(dev), "allocator_inactive_split", rows["t_ns"], rows["inactive_split_bytes"],
            "telemetry/allocator")
    # Process RSS is host memory, so it belongs to the CPU timeline (device -1): on a CPU trace
    # it is the only device-level memory signal there is.
    proc = trace.process[:]
    add(-1, "process_rss", proc["t_ns"], proc["rss_bytes"], "telemetry/process")
    totals = kv_totals_by_device(trace)
    for dev, (t, v) in totals.items():
        add(dev, "kv_bytes", t, v, "kv")
    events = trace.events[:]
    last_event = int(events["t_ns"].max()) if events.size else 0
    for dev, (t, v) in retained_by_device(trace).items():
        if dev in totals:  # drawn to the trace's last event (the check at close): alive as far as it knows
            last = max(int(totals[dev][0][-1]), int(t[-1]), last_event)
            add(dev, "kv_retained", np.append(t, last), np.append(v, v[-1]), "retention")
    return [by_device[d] for d in sorted(by_device)]


@dataclass
class Retained:
    """KV storages of one request still alive after it, on one device (the /retention proof)."""

    request: int
    device: int
    nbytes: int  # unique storage bytes
    layers: list[int]
    holders: list[str]  # type names of the objects still referring to them, first seen first


def retained_kv(trace: Trace) -> list[Retained]:
    """Every (request, device) with KV storage alive after the request, storages counted once."""
    rows = trace.retention[:]
    out: dict[tuple[int, int], Retained] = {}
    seen: set[tuple[int, int, int]] = set()
    for r in rows:
        key = (int(r["request"]), int(r["device"]))
        item = out.setdefault(key, Retained(key[0], key[1], 0, [], []))
        if (key[0], key[1], int(r["storage"])) not in seen:
            seen.add((key[0], key[1], int(r["storage"])))
            item.nbytes += int(r["nbytes"])
        if int(r["layer"]) >= 0 and int(r["layer"]) not in item.layers:
            item.layers.append(int(r["layer"]))
        for name in split_list(trace.text(int(r["referrers_off"]), int(r["referrers_len"]))):
            if name not in item.holders:
                item.holders.append(name)
    return [out[k] for k in sorted(out)]


def retention_checked(trace: Trace) -> set[int]:
    """Requests the recorder ran its retention check for (its NOTE "retention checked at ...")."""
    notes = trace.events.where(kind=schema.EventKind.NOTE)
    return {int(e["request"]) for e in notes
            if trace.text(int(e["text_off"]), int(e["text_len"])).startswith("retention checked")}


def retained_by_device(trace: Trace) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per device, the KV proved alive after finished requests, summed: a step up at each such
    request's end by what it left alive. The recorder proves the storages alive at its retention
    check and records no release after it, so what a request left stays drawn to the trace's end."""
    ends = {int(r["request"]): int(r["end_ns"]) for r in trace.requests[:] if int(r["end_ns"]) > 0}
    steps: dict[int, list[tuple[int, int]]] = {}
    for item in retained_kv(trace):
        if item.request in ends and item.nbytes > 0:
            steps.setdefault(item.device, []).append((ends[item.request], item.nbytes))
    out = {}
    for dev, items in steps.items():
        items.sort()
        out[dev] = (np.array([t for t, _ in items], dtype=np.int64),
                    np.cumsum([b for _, b in items]).astype(np.int64))
    return out


def _retained_at(retained: tuple[np.ndarray, np.ndarray] | None, t: np.ndarray) -> np.ndarray:
    """The retained total (:func:`retained_by_device`) in effect at each time of ``t``."""
    if retained is None:
        return np.zeros(t.size, dtype=np.int64)
    at = np.searchsorted(retained[0], t, side="right")
    return np.where(at > 0, retained[1][np.maximum(at - 1, 0)], 0).astype(np.int64)


def kv_totals_by_device(trace: Trace) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Total unique KV bytes alive per (request, step), split by the device holding each layer.

    One point per step, stamped with the last layer's time of that step, plus one at each finished
    request's end. At a request's end the series falls to what is still alive: 0 when the request's
    cache was freed, or the KV the retention check found alive after it (/retention), which stays
    counted in every later point (:func:`retained_by_device`): a retention bug reads as the steps
    it is, never as a cache that was released."""
    sums: dict[tuple[int, int, int], list[int]] = {}
    for rows in trace.kv.slices():  # memory stays bounded on long traces
        if not rows.size:
            continue
        keys = np.stack([rows["device"].astype(np.int64), rows["request"].astype(np.int64),
                         rows["step"].astype(np.int64)], axis=1)
        uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        b = np.bincount(inverse, weights=rows["bytes_unique"].astype(np.float64), minlength=len(uniq))
        t = np.zeros(len(uniq), dtype=np.uint64)
        np.maximum.at(t, inverse, rows["t_ns"])
        for k, total, tmax in zip(uniq, b, t, strict=True):
            key = (int(k[0]), int(k[1]), int(k[2]))
            acc = sums.setdefault(key, [0, 0])
            acc[0] += int(round(total))
            acc[1] = max(acc[1], int(tmax))
    ends = {int(r["request"]): int(r["end_ns"]) for r in trace.requests[:] if int(r["end_ns"]) > 0}
    retained = retained_by_device(trace) if sums else {}
    out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for dev in sorted({k[0] for k in sums}):
        items = sorted((v[1], v[0]) for k, v in sums.items() if k[0] == dev)
        for rid in sorted({k[1] for k in sums if k[0] == dev and k[1] in ends}):
            items.append((ends[rid], 0))
        items.sort()
        t = np.array([i[0] for i in items], dtype=np.int64)
        v = np.array([i[1] for i in items], dtype=np.int64)
        out[dev] = (t, v + _retained_at(retained.get(dev), t))
    return out


def phase_markers(trace: Trace) -> list[Marker]:
    events = trace.events[:]
    wanted = np.isin(events["kind"], [int(k) for k in MARKER_KINDS])
    return [
        Marker(int(e["t_ns"]), schema.EventKind(int(e["kind"])).name.lower(), int(e["request"]),
               int(e["device"]))
        for e in events[wanted]
    ]


def decimate(t: np.ndarray, v: np.ndarray, max_points: int = 4000) -> tuple[np.ndarray, np.ndarray]:
    """Thin a series for drawing while keeping every bucket's minimum and maximum (peaks
    stay visible; a plain stride would drop them)."""
    n = t.size
    if n <= max_points:
        return t, v
    buckets = max_points // 2
    edges = np.linspace(0, n, buckets + 1).astype(np.int64)
    idx: list[int] = []
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        if b <= a:
            continue
        seg = v[a:b]
        lo, hi = a + int(np.argmin(seg)), a + int(np.argmax(seg))
        idx.extend(sorted({lo, hi}))
    sel = np.array(idx, dtype=np.int64)
    return t[sel], v[sel]


# ---- per-layer footprint ------------------------------------------------------------------------


@dataclass
class LayerFootprint:
    """KV bytes of every layer at one step (the step where the trace's KV total peaked)."""

    request: int
    step: int
    tokens_seen: int
    layers: np.ndarray  # layer index
    layer_types: np.ndarray  # LayerType codes
    bytes_allocated: np.ndarray
    bytes_valid: np.ndarray
    bytes_unique: np.ndarray
    # hybrid models (format 1.5 /state): conv/recurrent state per layer at the same step
    state_layers: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    state_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


def peak_step(trace: Trace) -> tuple[int, int] | None:
    """(request, step) with the largest unique KV total, from /steps (no kv scan needed)."""
    steps = trace.steps[:]
    if not steps.size:
        return None
    i = int(np.argmax(steps["kv_bytes_unique"]))
    return int(steps["request"][i]), int(steps["step"][i])


def layer_footprint(trace: Trace) -> LayerFootprint | None:
    where = peak_step(trace)
    if where is None:
        # No /steps: fall back to the last kv row's (request, step).
        n = trace.nrows("kv")
        if n == 0:
            return None
        last = trace.kv[n - 1 : n][0]
        where = (int(last["request"]), int(last["step"]))
    rows = trace.kv.where(request=where[0], step=where[1])  # only that request's runs
    if not rows.size:
        return None
    rows = rows[np.argsort(rows["layer"], kind="stable")]
    state = trace.state_rows
    state = state[(state["request"] == where[0]) & (state["step"] == where[1]) & (state["layer"] >= 0)]
    state_layers, inverse = np.unique(state["layer"].astype(np.int64), return_inverse=True)
    state_bytes = np.bincount(inverse, weights=state["bytes_allocated"].astype(np.float64)).astype(np.int64) \
        if state.size else np.zeros(0, np.int64)
    return LayerFootprint(
        where[0], where[1], int(rows["tokens_seen"].max()), rows["layer"].astype(np.int64),
        rows["layer_type"].astype(np.int64), rows["bytes_allocated"].astype(np.int64),
        rows["bytes_valid"].astype(np.int64), rows["bytes_unique"].astype(np.int64), state_layers, state_bytes,
    )


# ---- growth curves against the analytical expectation -------------------------------------------


@dataclass
class GrowthCurves:
    """Measured valid KV bytes per layer type against step, for the longest request, with the
    bytes kvtrace.geometry predicts from the model config (None where it cannot predict)."""

    request: int
    tokens_seen: np.ndarray  # per step (max over layers)
    measured: dict[str, np.ndarray]  # layer type -> bytes per step; "total" included
    expected: dict[str, np.ndarray] | None
    expectation_note: str
    all_requests: dict[int, tuple[np.ndarray, np.ndarray]]  # request -> (tokens, valid bytes)


def growth_curves(trace: Trace) -> GrowthCurves | None:
    steps = trace.steps[:]
    if not steps.size:
        return None
    all_requests: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for r in np.unique(steps["request"]):
        s = steps[steps["request"] == r]
        s = s[np.argsort(s["step"], kind="stable")]
        all_requests[int(r)] = (s["tokens_seen"].astype(np.int64), s["kv_bytes_valid"].astype(np.int64))
    longest = max(all_requests, key=lambda r: int(all_requests[r][0].max(initial=0)))
    rows = trace.kv.where(request=longest)  # only the longest request's runs
    if not rows.size:
        return GrowthCurves(longest, all_requests[longest][0], {"total": all_requests[longest][1]},
                            None, "the kv table has no rows for this request", all_requests)
    step_ids = np.unique(rows["step"])
    pos = np.searchsorted(step_ids, rows["step"])
    tokens = np.zeros(step_ids.size, dtype=np.int64)
    np.maximum.at(tokens, pos, rows["tokens_seen"].astype(np.int64))
    measured: dict[str, np.ndarray] = {}
    for code in np.unique(rows["layer_type"]):
        sel = rows["layer_type"] == code
        measured[layer_type_name(code)] = np.bincount(
            pos[sel], weights=rows["bytes_valid"][sel].astype(np.float64), minlength=step_ids.size
        ).round().astype(np.int64)
    measured["total"] = np.sum(list(measured.values()), axis=0).astype(np.int64)
    expected, note = _expected_valid(trace, rows, pos, step_ids.size)
    return GrowthCurves(longest, tokens, measured, expected, note, all_requests)


def _expected_valid(
    trace: Trace, rows: np.ndarray, pos: np.ndarray, n_steps: int
) -> tuple[dict[str, np.ndarray] | None, str]:
    """Valid bytes kvtrace.geometry predicts for every kv row, grouped like the measurement."""
    try:
        predict = predictor(trace)
        per_row = np.array([predict(row, 1)[1] for row in rows], dtype=np.int64)
    except ImportError:
        return None, "kvtrace.geometry is not available"
    except Unpredictable as exc:
        return None, str(exc)
    expected: dict[str, np.ndarray] = {}
    for code in np.unique(rows["layer_type"]):
        sel = rows["layer_type"] == code
        expected[layer_type_name(code)] = np.bincount(
            pos[sel], weights=per_row[sel].astype(np.float64), minlength=n_steps
        ).round().astype(np.int64)
    expected["total"] = np.sum(list(expected.values()), axis=0).astype(np.int64)
    return expected, "expected: kvtrace.geometry from the trace's model config"


# ---- post-EOS and allocator state per request ---------------------------------------------------


@dataclass
class RequestMemory:
    """Labelled readings of one request on one device (None: not measured)."""

    request: int
    device: int
    baseline_allocated: int | None
    peak_allocated: int | None
    after_return_allocated: int | None
    after_gc_allocated: int | None
    after_empty_cache_allocated: int | None
    baseline_nvml: int | None
    after_empty_cache_nvml: int | None
    peak_kv: int | None  # largest unique KV total over the request's steps
    end_reserved: int | None  # at generate return
    end_allocated: int | None
    end_inactive_split: int | None
    baseline_rss: int | None = None  # process RSS (host memory) before the request
    after_rss: int | None = None  # the latest of after empty_cache / after gc / after return
    kv_alive_after: int | None = None  # KV storage proved alive after the request (/retention)
    holders: list[str] = field(default_factory=list)  # what refers to that storage (type names)

    @property
    def residual_rss(self) -> int | None:
        """Host RSS above the pre-request baseline once the request is over. RSS also counts
        memory the C allocator keeps after frees: a hint, never proof of retention."""
        if self.after_rss is None or self.baseline_rss is None:
            return None
        return self.after_rss - self.baseline_rss

    @property
    def residual_allocated(self) -> int | None:
        """Allocator bytes still held after gc + empty_cache, above the pre-request baseline."""
        last = self.after_empty_cache_allocated
        if last is None:
            last = self.after_gc_allocated
        if last is None or self.baseline_allocated is None:
            return None
        return last - self.baseline_allocated

    @property
    def residual_nvml(self) -> int | None:
        if self.after_empty_cache_nvml is None or self.baseline_nvml is None:
            return None
        return self.after_empty_cache_nvml - self.baseline_nvml

    @property
    def end_gap(self) -> int | None:
        """reserved - allocated at the end of generation (memory the allocator holds unused)."""
        if self.end_reserved is None or self.end_allocated is None:
            return None
        return self.end_reserved - self.end_allocated


def _opt(value: int) -> int | None:
    return None if value < 0 else int(value)


def request_memory(trace: Trace) -> list[RequestMemory]:
    readings = trace.readings[:]
    steps = trace.steps[:]
    alloc = trace.allocator[:]
    ends = {int(r["request"]): int(r["end_ns"]) for r in trace.requests[:]}
    out: list[RequestMemory] = []
    requests = sorted({int(r) for r in trace.requests[:]["request"]} |
                      {int(r) for r in readings["request"] if r >= 0})
    # None where no retention check ran for the request (nothing can be said), 0 where one ran and
    # nothing survived
    checked = retention_checked(trace)
    retained: dict[tuple[int, int], Retained] = {(x.request, x.device): x for x in retained_kv(trace)}
    for r in requests:
        mine = readings[readings["request"] == r]
        s = steps[steps["request"] == r]
        peak_kv = int(s["kv_bytes_unique"].max()) if s.size else None
        devices = sorted({int(d) for d in mine["device"]}) or [-2]
        for dev in devices:
            rd = mine[mine["device"] == dev]

            def get(label: schema.ReadingLabel, col: str, rd: np.ndarray = rd) -> int | None:
                hit = rd[rd["label"] == int(label)]
                return _opt(int(hit[-1][col])) if hit.size else None

            end = _end_state(rd, alloc, dev, ends.get(r, 0))
            after_rss = next((v for v in (get(label, "rss_bytes") for label in (
                schema.ReadingLabel.AFTER_EMPTY_CACHE, schema.ReadingLabel.AFTER_GC,
                schema.ReadingLabel.AFTER_RETURN)) if v is not None), None)
            out.append(RequestMemory(
                r, dev,
                get(schema.ReadingLabel.BASELINE, "allocated_bytes"),
                get(schema.ReadingLabel.PEAK, "allocated_bytes"),
                get(schema.ReadingLabel.AFTER_RETURN, "allocated_bytes"),
                get(schema.ReadingLabel.AFTER_GC, "allocated_bytes"),
                get(schema.ReadingLabel.AFTER_EMPTY_CACHE, "allocated_bytes"),
                get(schema.ReadingLabel.BASELINE, "nvml_used_bytes"),
                get(schema.ReadingLabel.AFTER_EMPTY_CACHE, "nvml_used_bytes"),
                peak_kv, *end, get(schema.ReadingLabel.BASELINE, "rss_bytes"), after_rss,
                *_alive(retained, r, dev, r in checked),
            ))
    return [m for m in out if m.device != -2 or m.peak_kv is not None]


def _alive(retained: dict[tuple[int, int], Retained], request: int, device: int, tracked: bool
           ) -> tuple[int | None, list[str]]:
    """(KV bytes alive after ``request`` on ``device``, their holders); every device's for -2 (no
    readings); (None, []) when the recording did not track retention."""
    mine = [x for (r, d), x in retained.items() if r == request and device in (d, -2)]
    if not mine:
        return (0 if tracked else None), []
    return sum(x.nbytes for x in mine), list(dict.fromkeys(h for x in mine for h in x.holders))


def _end_state(rd: np.ndarray, alloc: np.ndarray, device: int, end_ns: int
               ) -> tuple[int | None, int | None, int | None]:
    """Allocator (reserved, allocated, inactive_split) when generate returned: the AFTER_RETURN
    reading, else the last allocator sample of the device before the request's end."""
    hit = rd[rd["label"] == int(schema.ReadingLabel.AFTER_RETURN)]
    if hit.size:
        h = hit[-1]
        return _opt(int(h["reserved_bytes"])), _opt(int(h["allocated_bytes"])), \
            _opt(int(h["inactive_split_bytes"]))
    if end_ns == 0:
        return None, None, None
    mine = alloc[(alloc["device"] == device) & (alloc["t_ns"] <= end_ns)]
    if not mine.size:
        return None, None, None
    last = mine[np.argmax(mine["t_ns"])]
    return _opt(int(last["reserved_bytes"])), _opt(int(last["allocated_bytes"])), \
        _opt(int(last["inactive_split_bytes"]))
