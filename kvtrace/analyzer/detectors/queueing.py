"""queueing: requests waiting for admission while the paged pool is full (memory-bound queueing),
told apart from waiting for the scheduler's token budget while the pool has room (compute-bound).

A pressured step has requests waiting and block usage >= 80% (the capacity warning; cached prefix
blocks count as free, they are evicted on demand) or running requests starved of blocks. The score
is the share of scheduler steps that are pressured, counted once the queue has been seen at two
such steps (persistence): 0.1 at 2% (a moment of a burst), high at 10%, critical at 30% (the queue
is the normal state). The queue time each request spent before its first admission (/events
SCHEDULED - arrival) is quoted.

Waiting on the budget is normal under load (info), except when the budget per step
(max_batch_tokens) is below the median prompt and the pool never got half used: then not even
one typical prompt fits a step, every prefill is chunked over several steps and the queue forms
while the memory that could hold the waiting requests idles. That is a misconfiguration scored on
the share of steps with requests waiting, on the same ramp, capped at 0.6 (high, never critical:
latency is lost, no memory is at risk). A deliberately small chunked-prefill budget under long
prompts on an idle pool is named too: the advice (raise max_batch_tokens) holds there as well.
"""

from __future__ import annotations

import numpy as np

from kvtrace.analyzer.base import Finding, ev, register
from kvtrace.analyzer.detectors._serving import ServingDetector, admitted, alert, in_use
from kvtrace.analyzer.replay import ReplayContext
from kvtrace.units import format_ns

PRESSURE = 0.8
STEPS_ALERT = ((0.02, 0.1, 0.3), (0.1, 0.5, 0.8))
BUDGET_CAP = 0.6
IDLE = 0.5  # a pool never half used had room for the requests the budget held back


@register
class Queueing(ServingDetector):
    name = "queueing"
    summary = "requests waiting while the pool is full (memory-bound) vs waiting on the token budget"

    def per_manager(self, ctx: ReplayContext, manager: int, rows: np.ndarray) -> Finding | None:
        waiting = rows["waiting"].astype(np.int64)
        if not np.any(waiting > 0):
            return None
        known = (rows["pool_bytes"] > 0) & (rows["free_bytes"] >= 0)
        usage = np.full(rows.size, -1.0)
        usage[known] = in_use(ctx, manager, rows[known])
        starved = rows["starved"].astype(np.int64) > 0
        pressured = (waiting > 0) & ((usage >= PRESSURE) | starved)
        n = int(pressured.sum())
        cb = admitted(ctx)
        cb = cb[cb["manager"] == manager]
        queue_ns = cb["admitted_ns"].astype(np.int64) - cb["arrival_ns"].astype(np.int64)
        p50 = int(np.median(queue_ns)) if queue_ns.size else None
        worst = int(queue_ns.max()) if queue_ns.size else None
        evidence = {
            "steps_waiting": ev(int(np.sum(waiting > 0)), "count"),
            "steps_waiting_pool_full": ev(n, "count"),
            "steps": ev(int(rows.size), "count"),
            "max_waiting": ev(int(waiting.max()), "count"),
            "median_queue_ns": ev(p50, "ns"),
            "max_queue_ns": ev(worst, "ns"),
        }
        times = (f" Median queue time before admission {format_ns(p50)}, longest {format_ns(worst)}."
                 if p50 is not None and worst is not None else "")
        if n < 2:
            i = int(np.argmax(waiting))
            budgets = rows["max_batch_tokens"][rows["max_batch_tokens"] > 0]
            budget = int(budgets.min()) if budgets.size else None
            prompt = float(np.median(cb["prompt_tokens"])) if cb.size else 0.0
            evidence["max_batch_tokens"] = ev(budget, "tokens")
            evidence["median_prompt_tokens"] = ev(round(prompt, 1), "tokens")
            share = float(np.mean(waiting > 0))
            idle = not known.any() or float(usage[known].max()) < IDLE
            starved = budget is not None and budget < prompt and idle
            score = min(alert(share, *STEPS_ALERT), BUDGET_CAP) if starved else 0.0
            why = (f" The budget ({budget:,} tokens per step) is below the median prompt ({prompt:,.0f} tokens): "
                   f"each prefill takes several steps and requests waited at {share:.0%} of the steps while the pool "
                   f"stayed under {IDLE:.0%} used; raise max_batch_tokens." if starved else "")
            return self.finding(
                "queued_on_budget", score,
                f"Manager {manager}: up to {int(waiting[i]):,} requests waited (step {int(rows['step'][i])}) while the "
                f"pool had room: the scheduler's token budget per step, not memory, held them back.{why}{times}",
                evidence=evidence, steps=[int(rows["step"][i])])
        share = n / rows.size
        idx = np.flatnonzero(pressured)
        i = int(idx[np.argmax(waiting[idx])])
        grew = int(waiting[idx].max() - waiting[idx[0]])
        msg = (f"Manager {manager}: requests waited while the pool was full at {n:,} of {rows.size:,} steps "
               f"(block usage >= {PRESSURE:.0%} or running requests starved of blocks); the queue peaked at "
               f"{int(waiting[i]):,} at step {int(rows['step'][i])}"
               + (f" (+{grew:,} since the pool filled)" if grew > 0 else "") + f".{times}")
        evidence["waiting_growth"] = ev(grew, "count")
        return self.finding("queued_on_memory", alert(share, *STEPS_ALERT), msg, evidence=evidence,
                            steps=[int(rows["step"][i])])
