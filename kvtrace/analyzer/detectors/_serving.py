"""What the serving detectors share: the continuous-batching tables (format 1.4, /sched,
/sched_groups, /blocks) per manager, pool usage per step, and the alert ramps.

Every serving detector is skipped on a trace without /sched rows (a plain generate() recording):
it has nothing to say there, and says so in one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from kvtrace.analyzer.base import Detector, Finding
from kvtrace.analyzer.replay import ReplayContext
from kvtrace.format import schema

NO_SCHED = "the trace holds no continuous-batching scheduler steps (/sched is empty: not a serving recording)"
FULL = int(schema.LayerType.FULL)
# The memory alerts: warning (high) at 80% use, critical at 90%; 70% is where a trend starts to
# matter and 100% is a pool that refuses admissions. One ramp for pool usage, GPU usage, concurrency.
USAGE_ALERT = ((0.7, 0.8, 0.9, 1.0), (0.1, 0.5, 0.8, 1.0))
USAGE_WARNING, USAGE_CRITICAL = USAGE_ALERT[0][1], USAGE_ALERT[0][2]  # the same knees as thresholds (kvtrace loadtest)


def alert(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise-linear score through (xs, ys); below xs[0] it falls linearly to 0 (so a value
    under the first knee scores at most ys[0], info when ys[0] <= 0.1)."""
    if not np.isfinite(x):
        return float(ys[-1]) if x > 0 else 0.0
    if x < xs[0]:
        return float(ys[0]) * max(x, 0.0) / xs[0] if xs[0] > 0 else 0.0
    return float(np.interp(x, xs, ys))


def held(values: np.ndarray) -> float:
    """The level reached at two steps at least (persistence before score): the second-highest value;
    the only one when a single step was recorded."""
    v = np.sort(np.asarray(values, dtype=np.float64))
    return float(v[-2]) if v.size >= 2 else (float(v[0]) if v.size else 0.0)


class ServingDetector(Detector):
    """A detector of serving traces: skipped with one line when /sched is empty."""

    needs: ClassVar[tuple[str, ...]] = ()

    def skip_reason(self, ctx: ReplayContext) -> str | None:
        return None if len(ctx.trace.sched) else NO_SCHED

    def run(self, ctx: ReplayContext) -> list[Finding]:
        """One finding at most per continuous-batching manager (per_manager)."""
        found = (self.per_manager(ctx, m, rows) for m, rows in managers(ctx).items())
        return [f for f in found if f is not None]

    def per_manager(self, ctx: ReplayContext, manager: int, rows: np.ndarray) -> Finding | None:
        raise NotImplementedError  # pragma: no cover - detectors that judge per manager override it


def admitted(ctx: ReplayContext) -> np.ndarray:
    """The continuous-batching requests (Trace.cb_requests) that were admitted at least once."""
    cb = ctx.trace.cb_requests
    return cb[cb["admitted_ns"] > 0]


def managers(ctx: ReplayContext) -> dict[int, np.ndarray]:
    """/sched rows by manager, in step order."""
    rows = ctx.trace.sched[:]
    out: dict[int, np.ndarray] = {}
    for m in np.unique(rows["manager"]):
        mine = rows[rows["manager"] == m]
        out[int(m)] = mine[np.argsort(mine["step"], kind="stable")]
    return out


def known_pool(rows: np.ndarray) -> np.ndarray:
    """Rows whose pool and free bytes the cache reported (a version without them writes -1)."""
    return rows[(rows["pool_bytes"] > 0) & (rows["free_bytes"] >= 0)]


def pool_usage(pool: np.ndarray, free: np.ndarray, cached: np.ndarray | float = 0.0) -> np.ndarray:
    """Block-level usage, (pool - free - cached) / pool: vLLM's kv_cache_usage_perc. `cached` (bytes of
    the unreferenced blocks kept for prefix reuse) is free room: the cache evicts them on demand, as
    vLLM counts them (its free-block queue holds them); transformers' own free count leaves them out.
    Shared by the detectors and kvtrace loadtest's verdict (kvtrace.serving.verdict)."""
    pool = np.asarray(pool, dtype=np.float64)
    used = pool - np.asarray(free, dtype=np.float64) - cached
    return np.maximum(used, 0) / pool


def block_usage(rows: np.ndarray, cached: np.ndarray | None = None) -> np.ndarray:
    """pool_usage of /sched rows (pool_bytes, free_bytes); `cached`: cached_bytes per row."""
    return pool_usage(rows["pool_bytes"], rows["free_bytes"], 0.0 if cached is None else cached)


def outside_pool(used: np.ndarray, room: np.ndarray) -> np.ndarray:
    """Device memory in use less the KV pool's room (its free bytes and evictable cached blocks) at
    that moment: what could still run out. transformers (like vLLM) reserves the pool up front
    (free memory x max_memory_percent), so raw device usage sits near 90% on every healthy host."""
    return np.maximum(np.asarray(used, dtype=np.float64) - room, 0)


def pool_room(sched: np.ndarray, sched_groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(t_ns, room bytes) per known-pool /sched row in time order, room = free + evictable cached
    blocks (all managers' rows interleaved: each row is its manager's pool at that step)."""
    rows = known_pool(np.sort(sched, order="t_ns"))
    room = rows["free_bytes"].astype(np.float64)
    for m in np.unique(rows["manager"]):
        mine = rows["manager"] == m
        room[mine] += cached_bytes_of(sched_groups[sched_groups["manager"] == m], rows[mine])
    return rows["t_ns"].astype(np.int64), room


def room_at(pool_t: np.ndarray, room: np.ndarray, t_ns: np.ndarray) -> np.ndarray:
    """The pool's room at each of `t_ns`: that of the last /sched row at or before it (the first
    row's for a time before every row)."""
    j = np.clip(np.searchsorted(pool_t, t_ns, side="right") - 1, 0, pool_t.size - 1)
    return room[j]


def cached_bytes(ctx: ReplayContext, manager: int, rows: np.ndarray) -> np.ndarray:
    """cached_bytes_of one manager's rows, with its /sched_groups rows."""
    return cached_bytes_of(groups(ctx, manager), rows)


def cached_bytes_of(g: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Per /sched row: the bytes of the evictable cached prefix blocks, Σ over the step's groups `g`
    (one manager's /sched_groups rows) of blocks_cached x bytes_per_block (0 where unknown)."""
    out = np.zeros(rows.size, dtype=np.float64)
    if not g.size or not rows.size:
        return out
    nbytes = np.clip(g["blocks_cached"].astype(np.int64), 0, None) * np.clip(g["bytes_per_block"].astype(np.int64), 0, None)
    steps, inv = np.unique(g["step"].astype(np.int64), return_inverse=True)
    per_step = np.bincount(inv, weights=nbytes.astype(np.float64), minlength=steps.size)
    j = np.clip(np.searchsorted(steps, rows["step"].astype(np.int64)), 0, steps.size - 1)
    return np.where(steps[j] == rows["step"], per_step[j], 0.0)


def in_use(ctx: ReplayContext, manager: int, rows: np.ndarray) -> np.ndarray:
    """block_usage of one manager's known-pool rows, cached prefix blocks counted as free."""
    return block_usage(rows, cached_bytes(ctx, manager, rows))


def token_usage(rows: np.ndarray) -> np.ndarray:
    """Token-level usage per row, valid / pool (-1 where valid bytes are unknown)."""
    return np.where(rows["valid_bytes"] >= 0, rows["valid_bytes"] / rows["pool_bytes"].astype(np.float64), -1.0)


def groups(ctx: ReplayContext, manager: int) -> np.ndarray:
    """/sched_groups rows of one manager."""
    g = ctx.trace.sched_groups[:]
    return g[g["manager"] == manager]


def block_rows(ctx: ReplayContext, manager: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One manager's /blocks rows with, per row, its group's tokens per block and bytes per token
    (0 where the group row is missing)."""
    b = ctx.trace.blocks.where(manager=manager)
    g = groups(ctx, manager)
    tpb = np.zeros(b.shape[0], dtype=np.int64)
    bpt = np.zeros(b.shape[0], dtype=np.float64)
    if b.size and g.size:  # join on (step, group), vectorised: /blocks has a row per step x request x group
        gkey = g["step"].astype(np.int64) * 256 + g["group"]
        order = np.argsort(gkey, kind="stable")
        gkey = gkey[order]
        bkey = b["step"].astype(np.int64) * 256 + b["group"]
        j = np.clip(np.searchsorted(gkey, bkey), 0, gkey.size - 1)
        found = gkey[j] == bkey
        per_block = g["tokens_per_block"][order][j]
        tpb = np.where(found, per_block, 0).astype(np.int64)
        nbytes = g["bytes_per_block"][order][j].astype(np.float64)
        bpt = np.where(found & (tpb > 0), nbytes / np.maximum(tpb, 1), 0.0)
    return b, tpb, bpt


def request_peak_bytes(ctx: ReplayContext, manager: int) -> dict[int, int]:
    """Per request: the most pool bytes its block tables referenced at one step (all groups; a
    block shared with another request is counted for each)."""
    b, tpb, bpt = block_rows(ctx, manager)
    if not b.size:
        return {}
    nbytes = b["blocks"].astype(np.float64) * tpb * bpt
    keys = b["request"].astype(np.int64) * (1 << 32) + b["step"].astype(np.int64)
    uniq, inv = np.unique(keys, return_inverse=True)
    per_step = np.bincount(inv, weights=nbytes)
    req = (uniq >> 32).astype(np.int64)
    out: dict[int, int] = {}
    for r, v in zip(req.tolist(), per_step.tolist(), strict=True):
        out[r] = max(out.get(r, 0), int(v))
    return out


def phase_window(ctx: ReplayContext, t_ns: int) -> tuple[str, int, int] | None:
    """(name, start, end) of the load-test phase marker in force at `t_ns` (kvtrace loadtest,
    Recorder.mark_phase): from its marker to the next one (the load test's closing "end" marker), or
    to the end of time for the last; None when the trace has no marker before `t_ns`."""
    phases = ctx.trace.phases
    i = int(np.searchsorted(phases["t_ns"], t_ns, side="right")) - 1 if phases.size else -1
    if i < 0:
        return None
    end = int(phases["t_ns"][i + 1]) if i + 1 < phases.size else int(np.iinfo(np.int64).max)
    return str(phases["name"][i]), int(phases["t_ns"][i]), end


def phase_at(ctx: ReplayContext, t_ns: int) -> str:
    """' (phase NAME)' for the load-test phase marker in force at `t_ns`, '' when the trace has none
    before it: messages name the phase of the four-phase protocol."""
    window = phase_window(ctx, t_ns)
    return f" (phase {window[0]!r})" if window is not None else ""


def device_outside(t_ns: np.ndarray, used: np.ndarray, total: np.ndarray, room: tuple[np.ndarray, np.ndarray] | None,
                   devices: int) -> tuple[np.ndarray, np.ndarray | None, str]:
    """Per NVML reading: device memory in use outside the KV pool's room over the device's total
    (outside_pool at room_at; pool_room gives `room`); the room subtracted at each reading (None when
    not subtracted: then the share is raw use) and why not ('' when subtracted). Not subtracted
    without a recorded pool, with several GPUs in the readings (the pool's device is unknown) or
    when no reading comes after the pool's first step; a reading before that step has no pool yet.
    Shared by kvtrace loadtest's per-phase device check and the context_spike probe rule."""
    t = np.asarray(t_ns, dtype=np.int64)
    used = np.asarray(used, dtype=np.float64)
    why = ""
    if room is None or not room[0].size:
        why = "no paged-cache pool recorded"
    elif devices > 1:
        why = f"{devices} GPUs in the NVML readings: the pool's device is unknown"
    elif not bool((t >= room[0][0]).any()):
        why = "no reading after the pool's first recorded step"
    if why:
        return used / np.asarray(total, dtype=np.float64), None, why
    assert room is not None
    here = np.where(t >= room[0][0], room_at(room[0], room[1], t), 0.0)
    return outside_pool(used, here) / np.asarray(total, dtype=np.float64), here, ""
