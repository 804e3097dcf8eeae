"""concurrency_headroom: how many requests of the sizes this run served fit in the paged KV pool
at once, against how many were offered at once (running + waiting at one scheduler step).

A request's size is the most pool bytes its block tables referenced at one step (all cache
groups, /blocks); the typical size is the median over the run's requests. The alert is the
issue's concurrency rule (the seed method's requests_in_flight vs max_concurrent): 0.1 at 70%,
the knee serving_capacity uses for the same 80% alert (offered / fit estimates the pool's usage at
every request's peak, so the two judge one load alike), high (warning) once the offered load
reaches 80% of what fits, critical at 100% (requests must wait or be preempted), 1.0 at 150% (a
queue half the pool deep).
"""

from __future__ import annotations

import numpy as np

from kvtrace.analyzer.base import Finding, ev, register
from kvtrace.analyzer.detectors._serving import ServingDetector, alert, held, phase_at, request_peak_bytes
from kvtrace.analyzer.replay import ReplayContext
from kvtrace.units import format_bytes

# offered / fit: 70% where a trend starts to matter (serving_capacity's knee), 80% the alert (high),
# 100% saturated (critical), 150% a queue half the pool deep (1.0).
RATIO_ALERT = ((0.7, 0.8, 1.0, 1.5), (0.1, 0.5, 0.8, 1.0))


@register
class ConcurrencyHeadroom(ServingDetector):
    name = "concurrency_headroom"
    summary = "requests that fit in the paged pool at their observed sizes vs requests offered at once (80% rule)"

    def per_manager(self, ctx: ReplayContext, manager: int, rows: np.ndarray) -> Finding | None:
        pools = rows["pool_bytes"][rows["pool_bytes"] > 0]
        sizes = request_peak_bytes(ctx, manager)
        sizes = {r: b for r, b in sizes.items() if b > 0}
        if not pools.size or not sizes:
            return None
        pool = int(pools.max())
        typical = float(np.median(list(sizes.values())))
        largest_req, largest = max(sizes.items(), key=lambda kv: (kv[1], -kv[0]))
        fit = int(pool // typical)
        fit_largest = int(pool // largest)
        offered = (rows["running"] + rows["waiting"]).astype(np.int64)
        level = held(offered)
        i = int(np.argmax(offered))
        ratio = level / fit if fit > 0 else float("inf")
        score = alert(ratio, *RATIO_ALERT)
        msg = (f"Manager {manager}: a typical request here holds {format_bytes(typical)} of the "
               f"{format_bytes(pool)} pool at its largest (median of {len(sizes):,} requests), so {fit:,} fit at once "
               f"({fit_largest:,} of the largest, request {largest_req}, {format_bytes(largest)}); "
               f"{int(offered[i]):,} were offered at once at step {int(rows['step'][i])}{phase_at(ctx, int(rows['t_ns'][i]))} "
               f"({int(rows['running'][i]):,} running, {int(rows['waiting'][i]):,} waiting): "
               + (f"{ratio:.0%} of capacity." if np.isfinite(ratio) else "not one fits."))
        return self.finding(
            "concurrency", score, msg,
            evidence={
                "pool_bytes": ev(pool, "bytes"),
                "typical_request_bytes": ev(int(typical), "bytes"),
                "largest_request_bytes": ev(int(largest), "bytes"),
                "requests_that_fit": ev(fit, "count"),
                "largest_requests_that_fit": ev(fit_largest, "count"),
                "offered_at_once": ev(int(level), "count"),
                "offered_over_fit": ev(round(ratio, 4) if np.isfinite(ratio) else None, "ratio"),
                "requests_sized": ev(len(sizes), "count"),
            },
            steps=[int(rows["step"][i])], requests=[largest_req],
        )
