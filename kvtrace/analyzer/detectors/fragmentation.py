"""fragmentation: reserved-but-unallocated allocator memory over time, split into the part
empty_cache() can release (whole cached segments: harmless) and inactive_split_bytes (free blocks
inside segments that are still partly in use: not releasable, the real fragmentation).

Uses the torch caching allocator's own names (allocated, reserved, inactive_split_bytes,
num_alloc_retries). Reports the largest gap and when it happened, and the trend of the split part.
"""

from __future__ import annotations

import numpy as np

from kvtrace.analyzer.base import Detector, Finding, ev, register
from kvtrace.analyzer.replay import ReplayContext
from kvtrace.analyzer.stats import linear_fit, ramp
from kvtrace.units import format_bytes, format_ns

MiB = 1 << 20
# Score: fragmented share of reserved memory AND its absolute size must both be significant.
# The byte floor was calibrated on H100 traces (tests/data/gpu): a clean run in a process whose
# earlier work left allocator state showed 227 MiB of split blocks (66% of a small reserve),
# harmless on an 80 GiB device; the planted case reached 1.45 GiB and kept growing.
SPLIT_SHARE = (0.05, 0.30)
SPLIT_BYTES = (256 * MiB, 1024 * MiB)
RETRY_BONUS = 0.2  # cudaMalloc retries: the allocator already had to flush its cache to continue


def _samples(ctx: ReplayContext, device: int) -> np.ndarray:
    """Allocator samples of one device: telemetry rows plus labelled readings, time-sorted."""
    a = ctx.allocator
    a = a[(a["device"] == device) & (a["reserved_bytes"] >= 0) & (a["allocated_bytes"] >= 0)]
    t = [a["t_ns"].astype(np.int64)]
    alloc = [a["allocated_bytes"]]
    res = [a["reserved_bytes"]]
    split = [np.where(a["inactive_split_bytes"] >= 0, a["inactive_split_bytes"], 0)]
    retries = [a["num_alloc_retries"]]
    for req in ctx.requests:
        for r in req.readings.values():
            if int(r["device"]) == device and int(r["reserved_bytes"]) >= 0 and int(r["allocated_bytes"]) >= 0:
                t.append(np.array([int(r["t_ns"])]))
                alloc.append(np.array([int(r["allocated_bytes"])]))
                res.append(np.array([int(r["reserved_bytes"])]))
                split.append(np.array([max(int(r["inactive_split_bytes"]), 0)]))
                retries.append(np.array([-1]))
    out = np.zeros(sum(x.size for x in t), dtype=[("t", "i8"), ("alloc", "i8"), ("res", "i8"),
                                                    ("split", "i8"), ("retries", "i8")])
    out["t"], out["alloc"], out["res"] = np.concatenate(t), np.concatenate(alloc), np.concatenate(res)
    out["split"], out["retries"] = np.concatenate(split), np.concatenate(retries)
    return out[np.argsort(out["t"], kind="stable")]


@register
class Fragmentation(Detector):
    name = "fragmentation"
    needs = ("allocator",)
    summary = "reserved minus allocated over time: releasable cache vs inactive split blocks, with trend"

    def run(self, ctx: ReplayContext) -> list[Finding]:
        devices = sorted({int(d) for d in ctx.allocator["device"]} |
                         {int(r["device"]) for q in ctx.requests for r in q.readings.values()
                          if int(r["reserved_bytes"]) >= 0})
        out: list[Finding] = []
        for dev in devices:
            s = _samples(ctx, dev)
            if s.size:
                out.append(self._device(ctx, dev, s))
        return out

    def _device(self, ctx: ReplayContext, dev: int, s: np.ndarray) -> Finding:
        gap = np.maximum(s["res"] - s["alloc"], 0)
        split = np.minimum(s["split"], gap)
        releasable = gap - split
        gi = int(np.argmax(gap))
        si = int(np.argmax(split))
        share = float(split[si] / s["res"][si]) if s["res"][si] > 0 else 0.0
        t0 = int(ctx.requests[0].start_ns) if ctx.requests else int(s["t"][0])
        # Trend from the periodic samples only: labelled readings (after gc / empty_cache) are
        # taken at chosen instants and would bend the line.
        periodic = s["retries"] >= 0
        tr = periodic if periodic.sum() >= 3 else np.ones(s.size, dtype=bool)
        slope, _, r2 = linear_fit((s["t"][tr] - t0) / 1e9, split[tr].astype(np.float64))
        valid_retries = s["retries"][s["retries"] >= 0]
        retries = int(valid_retries.max() - valid_retries.min()) if valid_retries.size else 0
        score = min(ramp(share, *SPLIT_SHARE), ramp(float(split[si]), *SPLIT_BYTES))
        if retries > 0 and score > 0:
            score = min(1.0, score + RETRY_BONUS)
        where = self._when(ctx, int(s["t"][gi]), t0)
        trend = ""
        if slope > 0 and r2 >= 0.5:
            trend = f", growing by {format_bytes(slope)}/s"
        if score > 0:
            msg = (f"cuda:{dev}: up to {format_bytes(int(split[si]))} ({share:.0%} of reserved) sits in "
                   f"inactive split blocks that empty_cache cannot release{trend}; the largest reserved-"
                   f"unallocated gap was {format_bytes(int(gap[gi]))} {where}.")
            kind = "split_fragmentation"
        else:
            msg = (f"cuda:{dev}: the largest reserved-but-unallocated gap was {format_bytes(int(gap[gi]))} "
                   f"{where}, {format_bytes(int(releasable[gi]))} of it releasable cache (harmless) and "
                   f"{format_bytes(int(split[gi]))} split blocks.")
            kind = "allocator_cache"
        req = ctx.request_at(int(s["t"][gi]))
        return self.finding(
            kind, score, msg, device=dev,
            evidence={
                "largest_gap_bytes": ev(int(gap[gi]), "bytes"),
                "largest_gap_at_ns": ev(int(s["t"][gi]) - t0, "ns"),
                "releasable_at_largest_gap_bytes": ev(int(releasable[gi]), "bytes"),
                "split_at_largest_gap_bytes": ev(int(split[gi]), "bytes"),
                "max_inactive_split_bytes": ev(int(split[si]), "bytes"),
                "split_share_of_reserved": ev(round(share, 4), "ratio"),
                "reserved_at_max_split_bytes": ev(int(s["res"][si]), "bytes"),
                "split_trend_bytes_per_s": ev(round(slope, 1), "bytes/s"),
                "split_trend_r2": ev(round(r2, 4), "ratio"),
                "num_alloc_retries": ev(retries, "count"),
                "samples": ev(int(s.size), "count"),
            },
            requests=[req.request] if req is not None else [],
        )

    @staticmethod
    def _when(ctx: ReplayContext, t: int, t0: int) -> str:
        req = ctx.request_at(t)
        if req is None:
            return f"at +{format_ns(t - t0)} (between requests)"
        step = req.step_of_time(t)
        at_step = f", step {step}" if step is not None else ""
        return f"at +{format_ns(t - t0)} (request {req.request}{at_step})"
