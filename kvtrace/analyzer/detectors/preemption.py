"""preemption: requests the scheduler took out of the pool to make room (PREEMPTED events), how
many tokens had to be recomputed for it, and which requests paid.

A soft reset drops the request's blocks: every token it held is computed again when it is
re-admitted (recomputed tokens = the event's value). An offload (an OFFLOADED event for the same
request and step) moves the blocks to the CPU swap pool: nothing is recomputed, the cost is the
copy. Any preemption is a proven mechanism (vLLM dashboards and AIPerf flag preemptions > 0 as
memory pressure), so it starts at medium (0.3) whatever its cost; the score grows with the share
of all scheduled tokens spent on recomputation: high at 5% (a twentieth of the compute thrown away,
about what a healthy server spends on padding), critical at 20% (a fifth of the throughput lost).
Offload-only preemptions recompute nothing and stay at medium (not exercised on CPU: transformers
needs an accelerator's pinned memory for its swap pool).
"""

from __future__ import annotations

import numpy as np

from kvtrace.analyzer.base import Finding, ev, register
from kvtrace.analyzer.detectors._common import plural
from kvtrace.analyzer.detectors._serving import ServingDetector, alert, phase_at
from kvtrace.analyzer.replay import ReplayContext
from kvtrace.format import schema

RECOMPUTE_ALERT = ((0.0, 0.05, 0.2), (0.3, 0.5, 0.8))
E = schema.EventKind


@register
class Preemption(ServingDetector):
    name = "preemption"
    summary = "preemptions (soft resets and offloads), tokens recomputed, requests preempted"

    def run(self, ctx: ReplayContext) -> list[Finding]:
        ev_rows = ctx.trace.serving_events
        pre = ev_rows[ev_rows["kind"] == int(E.PREEMPTED)]
        sched = ctx.trace.sched[:]
        counted = int(sched["preempted"].sum())
        if not pre.size and not counted:
            return []
        off = ev_rows[ev_rows["kind"] == int(E.OFFLOADED)]
        offloaded_keys = {(int(r), int(s)) for r, s in zip(off["request"], off["step"], strict=True)}
        is_off = np.array([(int(r), int(s)) in offloaded_keys for r, s in zip(pre["request"], pre["step"], strict=True)],
                          dtype=bool)
        recomputed = int(pre["value"][~is_off].sum())
        scheduled = int(sched["prefill_tokens"].sum() + sched["decode_tokens"].sum())
        share = recomputed / scheduled if scheduled > 0 else 0.0
        n = max(int(pre.size), counted)
        score = alert(share, *RECOMPUTE_ALERT) if recomputed else 0.3
        reqs = sorted({int(r) for r in pre["request"] if int(r) >= 0})
        by_req = {r: int(np.sum(pre["request"] == r)) for r in reqs}
        worst = sorted(by_req.items(), key=lambda kv: (-kv[1], kv[0]))[:5]
        named = ", ".join(f"{r} ({plural(k, 'time')})" for r, k in worst) + (", ..." if len(by_req) > 5 else "")
        first = phase_at(ctx, int(pre["t_ns"].min())) if pre.size else ""
        msg = (f"The scheduler preempted requests {plural(n, 'time')}" + (f", first{first}" if first else "") + " "
               f"({int((~is_off).sum()):,} soft resets, {int(is_off.sum()):,} offloads to the CPU): "
               f"{recomputed:,} tokens recomputed, {share:.1%} of the {scheduled:,} tokens scheduled"
               + (f"; preempted: {named}" if named else "") + ". The pool is too small for the load offered.")
        return [self.finding(
            "preemption", score, msg,
            evidence={
                "preemptions": ev(n, "count"),
                "soft_resets": ev(int((~is_off).sum()), "count"),
                "offloads": ev(int(is_off.sum()), "count"),
                "tokens_recomputed": ev(recomputed, "tokens"),
                "tokens_scheduled": ev(scheduled, "tokens"),
                "recomputed_share": ev(round(share, 4), "ratio"),
                "requests_preempted": ev(len(reqs), "count"),
            },
            requests=reqs, steps=sorted({int(s) for s in pre["step"] if int(s) >= 0}),
        )]
