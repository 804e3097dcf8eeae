"""serving_capacity: how full the paged KV pool and the GPU got while serving.

Pool usage is block-level, (pool - free - cached) / pool per scheduler step (what vLLM exports as
kv_cache_usage_perc: unreferenced cached prefix blocks are evicted on demand, so they count as
free room there and here); the token-level usage (valid KV bytes / pool) is quoted beside it, since
block-level usage overstates occupancy by the unfilled block tails. The score follows the issue's
memory alerts (the seed method's "leave headroom for bursts"): 0.1 at 70% where a trend starts to
matter, high (warning) at 80%, critical at 90%, 1.0 at 100% where admissions stop; reached at two
steps at least (one step is one instant: at most low).

GPU usage comes from the NVML samples taken while the scheduler ran (without NVML: the caching
allocator's reserved bytes, this process only, against the device size). transformers (like vLLM)
allocates the pool up front from free memory x max_memory_percent (0.9 by default in 5.23), so
raw device usage sits near 90% on every healthy host; the score uses the device memory in use
less the pool's free bytes and evictable cached blocks at that moment (one GPU; with several, the
pool's device is unknown and the raw figure is used).
"""

from __future__ import annotations

import numpy as np

from kvtrace.analyzer.base import Finding, ev, register
from kvtrace.analyzer.detectors._common import plural
from kvtrace.analyzer.detectors._serving import (
    USAGE_ALERT,
    ServingDetector,
    alert,
    cached_bytes,
    held,
    in_use,
    known_pool,
    managers,
    outside_pool,
    phase_at,
    pool_room,
    room_at,
    token_usage,
)
from kvtrace.analyzer.replay import ReplayContext
from kvtrace.labels import device_where
from kvtrace.units import format_bytes


@register
class ServingCapacity(ServingDetector):
    name = "serving_capacity"
    summary = "paged KV pool usage per scheduler step (80%/90% alerts) and GPU usage while serving"

    def run(self, ctx: ReplayContext) -> list[Finding]:
        out: list[Finding] = []
        for manager, rows in managers(ctx).items():
            f = self._pool(ctx, manager, known_pool(rows))
            if f is not None:
                out.append(f)
        gpu = self._gpu(ctx)
        if gpu is not None:
            out.append(gpu)
        return out

    def _pool(self, ctx: ReplayContext, manager: int, rows: np.ndarray) -> Finding | None:
        if not rows.size:
            return None
        cached = cached_bytes(ctx, manager, rows)
        usage, tokens = in_use(ctx, manager, rows), token_usage(rows)
        level = held(usage)
        i = int(np.argmax(usage))
        above = int(np.sum(usage >= 0.8))
        score = alert(level, *USAGE_ALERT)
        if rows.size < 2:
            score = min(score, 0.29)  # one step is one instant: worth a look at most
        pool = int(rows["pool_bytes"][i])
        tok = float(tokens[i])
        msg = (f"Manager {manager}: the paged KV pool ({format_bytes(pool)}) reached {usage[i]:.0%} block usage "
               f"at step {int(rows['step'][i])}{phase_at(ctx, int(rows['t_ns'][i]))} "
               f"({format_bytes(pool - int(rows['free_bytes'][i]) - int(cached[i]))} in blocks"
               + (f", {format_bytes(int(cached[i]))} more in cached prefix blocks, evictable" if cached[i] else "")
               + (f", {tok:.0%} holding valid tokens" if tok >= 0 else "") + f"); {above:,} of {rows.size:,} steps "
               f"at >= 80%" + (f", with {plural(int(rows['waiting'][i]), 'request')} waiting" if rows["waiting"][i] else "")
               + ".")
        return self.finding(
            "pool_usage", score, msg,
            evidence={
                "pool_bytes": ev(pool, "bytes"),
                "peak_block_usage": ev(round(float(usage[i]), 4), "ratio"),
                "held_block_usage": ev(round(level, 4), "ratio"),
                "token_usage_at_peak": ev(round(tok, 4) if tok >= 0 else None, "ratio"),
                "cached_prefix_bytes_at_peak": ev(int(cached[i]), "bytes"),
                "steps_at_or_above_80pct": ev(above, "count"),
                "steps": ev(int(rows.size), "count"),
                "peak_step": ev(int(rows["step"][i]), "step"),
            },
            steps=[int(rows["step"][i])],
        )

    def _gpu(self, ctx: ReplayContext) -> Finding | None:
        sched = ctx.trace.sched[:]
        rows, source = _device_samples(ctx, int(sched["t_ns"].min()), int(sched["t_ns"].max()))
        if rows is None:
            return None
        devices = sorted({int(d) for d in rows["device"]})
        pool_t, room = pool_room(sched, ctx.trace.sched_groups[:])  # free + evictable cached blocks, per row
        best: tuple[float, int, np.ndarray, np.ndarray] | None = None
        for dev in devices:
            mine = rows[rows["device"] == dev]
            used = mine["used"].astype(np.float64)
            if len(devices) == 1 and pool_t.size:
                used = outside_pool(used, room_at(pool_t, room, mine["t_ns"]))
            level = held(used / mine["total"])
            if best is None or level > best[0]:
                best = (level, dev, mine, used)
        assert best is not None
        level, dev, mine, used = best
        i = int(np.argmax(used))
        total = int(mine["total"][i])
        raw = int(mine["used"][i])
        subtracted = len(devices) == 1 and pool_t.size > 0
        msg = (f"While serving, {device_where(dev)} ({format_bytes(total)}) had {format_bytes(raw)} in use "
               f"({raw / total:.0%}, {source})" + (f"; {format_bytes(int(used[i]))} ({used[i] / total:.0%}) without the "
                                                  "KV pool's free and evictable cached blocks, which are reserved up "
                                                  "front by design"
                                                  if subtracted else "")
               + f": {level:.0%} held over two samples at least.")
        return self.finding(
            "gpu_usage", alert(level, *USAGE_ALERT), msg, device=dev,
            evidence={
                "device_memory_bytes": ev(total, "bytes"),
                "used_bytes": ev(raw, "bytes"),
                "used_without_free_pool_bytes": ev(int(used[i]) if subtracted else None, "bytes"),
                "held_usage": ev(round(level, 4), "ratio"),
                "samples": ev(int(mine.size), "count"),
            },
        )


SAMPLES = np.dtype([("t_ns", "<u8"), ("device", "<i2"), ("used", "<i8"), ("total", "<i8")])


def _device_samples(ctx: ReplayContext, t0: int, t1: int) -> tuple[np.ndarray | None, str]:
    """Device memory in use while the scheduler ran: NVML `used` (all processes), else the caching
    allocator's reserved bytes (this process; the pool is allocated through it) against the device size."""
    nvml = ctx.window(ctx.nvml, t0, t1)
    nvml = nvml[(nvml["total_bytes"] > 0) & (nvml["used_bytes"] >= 0)]
    if nvml.size:
        out = np.zeros(nvml.size, dtype=SAMPLES)
        out["t_ns"], out["device"], out["used"], out["total"] = (nvml["t_ns"], nvml["device"], nvml["used_bytes"],
                                                               nvml["total_bytes"])
        return out, "NVML"
    alloc = ctx.window(ctx.allocator, t0, t1)
    alloc = alloc[alloc["reserved_bytes"] >= 0]
    totals = np.array([ctx.device_total(int(d)) or 0 for d in alloc["device"]], dtype=np.int64)
    keep = totals > 0
    if not keep.any():
        return None, ""
    out = np.zeros(int(keep.sum()), dtype=SAMPLES)
    out["t_ns"], out["device"], out["used"], out["total"] = (alloc["t_ns"][keep], alloc["device"][keep],
                                                           alloc["reserved_bytes"][keep], totals[keep])
    return out, "allocator reserved"
