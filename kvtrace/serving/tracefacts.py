"""The recorder's numbers for each load-test phase, read from a trace (no torch).

A phase's window runs from its marker to the next marker (the load test posts a final "end"
marker) or to the trace's last row. Markers are PHASE events (format 1.4) or, from a recorder that
has no ``mark_phase``, NOTE events "phase: NAME". Paged-cache occupancy comes from the /sched and
/sched_groups tables (1.4) when the trace has rows there, else from the recorder's NOTE events
"paged cache occupancy {...}" (the first serving floor). Device memory comes from /telemetry/nvml,
fragmentation (reserved - allocated) from /telemetry/allocator. Pool and device usage follow the
serving_capacity detector's rules through its own functions (kvtrace.analyzer.detectors._serving):
evictable cached prefix blocks are free room, and device memory is judged outside the pool's room.
What a trace lacks stays None, with the reason in ``absent``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtrace.analyzer.detectors._serving import (
    cached_bytes_of,
    device_outside,
    held,
    pool_room,
    pool_usage,
)
from kvtrace.format.schema import EventKind

OCCUPANCY_PREFIX = "paged cache occupancy "
PHASE_NOTE_PREFIX = "phase: "


@dataclass
class Group:
    """One attention type's share of the pool."""

    layer_type: str
    blocks_total: int
    tokens_per_block: int
    bytes_per_block: int
    window: int = -1  # sliding window in tokens; -1 none or unknown (then the whole context counts)

    def bytes_for(self, context: int) -> int:
        """Bytes of this group's blocks one request of ``context`` tokens holds."""
        tokens = min(context, self.window) if self.window > 0 else context
        return -(-tokens // max(self.tokens_per_block, 1)) * self.bytes_per_block


def capacity(pool_bytes: int, groups: list[Group], context: int) -> int | None:
    """Requests of ``context`` tokens the pool holds at once (None without the pool's geometry)."""
    per_request = sum(g.bytes_for(context) for g in groups)
    if pool_bytes <= 0 or per_request <= 0 or any(g.tokens_per_block <= 0 or g.bytes_per_block <= 0 for g in groups):
        return None
    return pool_bytes // per_request


MAX_NUMBER = 2**62  # bytes, blocks, tokens or requests above this are not a reading
MAX_ALLOCATORS = 1024  # attention groups of one pool
_OCC_NUMBERS = ("pool_bytes", "free_bytes", "blocks_in_use", "running", "waiting", "tokens_cached")
_GROUP_NUMBERS = ("blocks_in_use", "blocks_total", "blocks_cached", "tokens_per_block", "bytes_per_block", "window")


def occupancy_problem(occ: Any) -> str | None:
    """Why ``occ`` is not the recorder's occupancy JSON (routes.live_status's ``paged_cache``, the
    occupancy NOTE events), or None when it is: an object whose numbers are integers in -1..2**62
    (-1: unknown), whose ``allocators`` is an object of at most 1,024 such objects, and whose
    ``unavailable`` is a string. Answers from a server or text from a trace are checked with it
    before any number is used, so wrong types (a list for an object, NaN, strings, 10**400) are a
    reason, never an exception."""
    if not isinstance(occ, dict):
        return f"paged_cache is a JSON {_kind(occ)}, not an object"
    if "unavailable" in occ and not isinstance(occ["unavailable"], str):
        return f"paged_cache.unavailable is a JSON {_kind(occ['unavailable'])}, not a string"
    for key in _OCC_NUMBERS:
        why = _number_problem(occ.get(key, -1))
        if why:
            return f"paged_cache.{key} {why}"
    allocators = occ.get("allocators", {})
    if not isinstance(allocators, dict):
        return f"paged_cache.allocators is a JSON {_kind(allocators)}, not an object"
    if len(allocators) > MAX_ALLOCATORS:
        return f"paged_cache.allocators holds {len(allocators)} groups (at most {MAX_ALLOCATORS})"
    for name, group in allocators.items():
        if not isinstance(group, dict):
            return f"paged_cache.allocators[{name[:40]!r}] is a JSON {_kind(group)}, not an object"
        for key in _GROUP_NUMBERS:
            why = _number_problem(group.get(key, -1))
            if why:
                return f"paged_cache.allocators[{name[:40]!r}].{key} {why}"
    return None


def _kind(x: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null", float: "number",
             int: "integer"}
    return names.get(type(x), type(x).__name__)


def _number_problem(x: Any) -> str:
    if isinstance(x, bool) or not isinstance(x, int):
        shown = repr(x) if isinstance(x, float) else f"a JSON {_kind(x)}"
        return f"is {shown}, not an integer"
    if not -1 <= x <= MAX_NUMBER:
        return f"is {'negative' if x < 0 else 'above 2**62'}, not a reading"
    return ""


def groups_from_occupancy(occ: dict[str, Any]) -> list[Group]:
    """Groups from the recorder's occupancy JSON (the NOTE event and /kvtrace/status), once
    :func:`occupancy_problem` found none."""
    return [Group(name.replace("_attention", ""), int(a.get("blocks_total", -1)), int(a.get("tokens_per_block", -1)),
                  int(a.get("bytes_per_block", -1)), int(a.get("window", -1)))
            for name, a in occ.get("allocators", {}).items()]


def sample_from_occupancy(t_ns: int, occ: dict[str, Any]) -> dict[str, Any] | None:
    """A live or NOTE sample; "cached" counts the evictable cached prefix blocks, "cached_bytes" their
    bytes (``occ`` checked by :func:`occupancy_problem`)."""
    if "pool_bytes" not in occ or "free_bytes" not in occ:
        return None
    allocators = occ.get("allocators", {}).values()
    cached = [(int(a.get("blocks_cached", -1)), int(a.get("bytes_per_block", -1))) for a in allocators]
    return {"t_ns": t_ns, "pool": int(occ["pool_bytes"]), "free": int(occ["free_bytes"]),
            "running": int(occ.get("running", 0)), "waiting": int(occ.get("waiting", 0)),
            "in_use": int(occ.get("blocks_in_use", -1)), "cached": sum(c for c, _ in cached if c > 0),
            "cached_bytes": sum(c * b for c, b in cached if c > 0 and b > 0)}


def apply_occupancy(f: PhaseFacts, window: list[dict[str, Any]], groups: list[Group], source: str) -> None:
    """Fill ``f``'s paged-cache numbers from the samples that fall in its window: block-level use with
    evictable cached prefix blocks counted as free, the serving_capacity detector's rule (pool_usage),
    held over two samples at least (held) as the detector scores it, and the peak."""
    f.occupancy_source = source
    f.groups = groups
    f.pool_bytes = max(s["pool"] for s in window)
    known = [s for s in window if s["pool"] > 0]
    if known:
        uses = pool_usage(np.array([s["pool"] for s in known]), np.array([s["free"] for s in known]),
                          np.array([s.get("cached_bytes", 0) for s in known], dtype=np.float64))
        f.pool_use_peak, f.pool_use_held = float(uses.max()), held(uses)
    f.running_peak = max(s["running"] for s in window)
    f.waiting_peak = max(s["waiting"] for s in window)
    f.in_flight_peak = max(s["running"] + s["waiting"] for s in window)


@dataclass
class DeviceFacts:
    """NVML device memory in a phase, with and without the KV pool's room (free + evictable cached
    blocks: reserved up front by design, so no OOM risk), quoted at the sample where memory outside
    that room peaked; levels are judged on ``outside_held`` (serving_capacity's gpu_usage rule)."""

    used_bytes: int
    total_bytes: int
    room_bytes: int | None  # the pool's room at that sample; None: not subtracted (``why_raw``)
    outside_peak: float  # (used - room) / total at that sample (used / total when not subtracted)
    outside_held: float  # the same, reached at two samples at least
    samples: int
    why_raw: str = ""  # why the pool's room was not subtracted


@dataclass
class PhaseFacts:
    name: str
    t_start: int
    t_end: int
    occupancy_source: str | None = None  # "/sched" or "occupancy NOTE events"
    pool_bytes: int | None = None
    pool_use_peak: float | None = None  # max (pool - free - cached) / pool over the window
    pool_use_held: float | None = None  # the same, reached at two samples at least (what is judged)
    in_flight_peak: int | None = None  # max running + waiting
    running_peak: int | None = None
    waiting_peak: int | None = None
    groups: list[Group] = field(default_factory=list)
    device: DeviceFacts | None = None  # NVML device memory, in use and outside the pool's room
    fragmentation_peak: int | None = None  # max allocator reserved - allocated, bytes
    absent: dict[str, str] = field(default_factory=dict)


def phase_markers(trace: Any) -> list[tuple[str, int]]:
    """(name, t_ns) of every phase marker, in time order."""
    out: list[tuple[str, int]] = []
    kind = getattr(EventKind, "PHASE", None)
    if kind is not None:
        for e in trace.events.where(kind=kind):
            out.append((trace.text(int(e["text_off"]), int(e["text_len"])), int(e["t_ns"])))
    for e in trace.events.where(kind=EventKind.NOTE):
        text = trace.text(int(e["text_off"]), int(e["text_len"]))
        if text.startswith(PHASE_NOTE_PREFIX):
            out.append((text[len(PHASE_NOTE_PREFIX):], int(e["t_ns"])))
    return sorted(out, key=lambda m: m[1])


def _occupancy_rows(trace: Any) -> tuple[str | None, list[dict[str, Any]], list[Group]]:
    """(source, samples with t_ns/pool/free/running/waiting, pool groups)."""
    sched = trace.sched[:] if hasattr(trace, "sched") and trace.has("sched") else None
    if sched is not None and len(sched):
        groups_rows = trace.sched_groups[:]
        groups: list[Group] = []
        if len(groups_rows):
            last = groups_rows[groups_rows["step"] == groups_rows["step"].max()]
            from kvtrace.format.schema import LayerType

            for g in last:
                groups.append(Group(LayerType(int(g["layer_type"])).name.lower(), int(g["blocks_total"]),
                                    int(g["tokens_per_block"]), int(g["bytes_per_block"]), int(g["window"])))
        cached = np.zeros(sched.size)
        all_groups = trace.sched_groups[:]
        for m in np.unique(sched["manager"]):
            mine = sched["manager"] == m
            cached[mine] = cached_bytes_of(all_groups[all_groups["manager"] == m], sched[mine])
        samples = [{"t_ns": int(r["t_ns"]), "pool": int(r["pool_bytes"]), "free": int(r["free_bytes"]),
                    "running": int(r["running"]), "waiting": int(r["waiting"]), "cached_bytes": float(c)}
                   for r, c in zip(sched, cached, strict=True)]
        return "/sched", samples, groups
    samples, groups = [], []
    for e in trace.events.where(kind=EventKind.NOTE):
        text = trace.text(int(e["text_off"]), int(e["text_len"]))
        if not text.startswith(OCCUPANCY_PREFIX):
            continue
        try:
            occ = json.loads(text[len(OCCUPANCY_PREFIX):])
        except (ValueError, RecursionError):
            continue
        if occupancy_problem(occ) is not None:  # a NOTE of another shape (a hand-made or damaged trace)
            continue
        sample = sample_from_occupancy(int(e["t_ns"]), occ)
        if sample is not None:
            samples.append(sample)
            groups = groups_from_occupancy(occ)
    return ("occupancy NOTE events" if samples else None), samples, groups


def _pool_room(trace: Any, source: str | None, samples: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray] | None:
    """(t_ns, room bytes) in time order, room = free + evictable cached blocks: the detector's
    pool_room over /sched, else from the first floor's occupancy NOTE samples; None without a pool."""
    if source == "/sched":
        t, room = pool_room(trace.sched[:], trace.sched_groups[:])
        return (t, room) if t.size else None
    known = sorted((s for s in samples if s["pool"] > 0 and s["free"] >= 0), key=lambda s: s["t_ns"])
    if not known:
        return None
    return (np.array([s["t_ns"] for s in known], dtype=np.int64),
            np.array([s["free"] + s.get("cached_bytes", 0) for s in known], dtype=np.float64))


def device_facts(rows: np.ndarray, room: tuple[np.ndarray, np.ndarray] | None, devices: int) -> DeviceFacts | None:
    """DeviceFacts of one phase's NVML rows: device memory in use less the pool's room at each
    reading (the detectors' device_outside), raw where that cannot be told."""
    if not rows.size:
        return None
    used = rows["used_bytes"].astype(np.float64)
    total = rows["total_bytes"].astype(np.float64)
    outside, here, why = device_outside(rows["t_ns"], used, total, room, devices)
    i = int(np.argmax(outside))
    return DeviceFacts(int(used[i]), int(total[i]), int(here[i]) if here is not None else None, float(outside[i]),
                       held(outside), int(rows.size), why)


def phase_facts(trace: Any) -> list[PhaseFacts]:
    """One PhaseFacts per marked phase (the "end" marker only closes the last window)."""
    from kvtrace.serving.phases import END_MARKER

    markers = phase_markers(trace)
    source, samples, groups = _occupancy_rows(trace)
    nvml = trace.nvml[:] if trace.nrows("telemetry/nvml") else None
    if nvml is not None:
        nvml = nvml[(nvml["total_bytes"] > 0) & (nvml["used_bytes"] >= 0)]
    devices = int(np.unique(nvml["device"]).size) if nvml is not None else 0
    room = _pool_room(trace, source, samples)
    alloc = trace.allocator[:] if trace.nrows("telemetry/allocator") else None
    out = []
    for i, (name, t0) in enumerate(markers):
        if name == END_MARKER:
            continue
        t1 = markers[i + 1][1] if i + 1 < len(markers) else np.iinfo(np.int64).max
        f = PhaseFacts(name, t0, t1)
        window = [s for s in samples if t0 <= s["t_ns"] < t1]
        if window:
            apply_occupancy(f, window, groups, f"trace {source}")
        else:
            f.absent["paged_cache"] = ("no continuous-batching scheduler step recorded in this phase" if samples
                                       else "the trace holds no paged-cache occupancy (not served with "
                                            "--continuous-batching, or no request reached the scheduler)")
        if nvml is None:
            f.absent["device_memory"] = "the trace holds no NVML readings (no GPU, or recorded with --no-nvml)"
        else:
            f.device = device_facts(nvml[(nvml["t_ns"] >= t0) & (nvml["t_ns"] < t1)], room, devices)
            if f.device is None:
                f.absent["device_memory"] = "no NVML reading fell inside this phase"
        if alloc is None:
            f.absent["fragmentation"] = "the trace holds no allocator readings (no CUDA allocator on this device)"
        else:
            rows = alloc[(alloc["t_ns"] >= t0) & (alloc["t_ns"] < t1)]
            if len(rows):
                f.fragmentation_peak = int((rows["reserved_bytes"] - rows["allocated_bytes"]).max())
            else:
                f.absent["fragmentation"] = "no allocator reading fell inside this phase"
        out.append(f)
    return out
