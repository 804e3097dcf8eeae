"""context_spike: a served request whose context (prompt + generated tokens) is at least twice the
run's typical context: the issue's 2x context-spike alert (the seed method's "long requests consume
disproportionate memory"). One such request holds twice the KV of the requests the pool was sized
around; a few of them at once fill it.

Typical is what the traffic itself sustains, not its middle: the context reached by the top fifth
of the admitted requests (the k-th largest, k = max(2, ceil(n / 5))). A long tail that is a fifth of
the requests or more (a mix of short chats and 4x longer documents) is the workload the pool must
hold, judged by concurrency_headroom and serving_capacity, not a spike; a spike is rarer than that
(one request among up to ten, or under a fifth of them). k >= 2 keeps a request from being its own
typical. Needs three requests at least (of two, neither is typical of anything). Score on the largest request's ratio: under 2x info
(0 at 1x rising to 0.1: answers that end at EOS spread that much from request to request, and the
alert is 2x), high at 2x (the alert), critical at 4x (four typical requests' KV in one). The
spike's KV (its largest block tables, /blocks) and its share of the pool are quoted.
"""

from __future__ import annotations

import numpy as np

from kvtrace.analyzer.base import Finding, ev, register
from kvtrace.analyzer.detectors._serving import ServingDetector, admitted, alert, phase_at, request_peak_bytes
from kvtrace.analyzer.replay import ReplayContext
from kvtrace.units import format_bytes

SPIKE_ALERT = ((2.0, 4.0), (0.5, 0.8))
UNDER_ALERT = 0.1  # the most a context under 2x the typical scores: ordinary spread, info
MIN_REQUESTS = 3
TAIL_SHARE = 5  # a context reached by a fifth of the requests is typical of the traffic
SPIKE_RATIO = SPIKE_ALERT[0][0]  # the alert: a context at 2x the typical


def typical_context(context: np.ndarray) -> tuple[float, int] | None:
    """(typical context, k): the k-th largest of `context` (tokens per request), k = max(2, ceil(n /
    5)); None under MIN_REQUESTS requests or at a typical of 0. The one rule of the detector and of
    kvtrace loadtest's verdict (kvtrace.serving.verdict)."""
    context = np.asarray(context, dtype=np.int64)
    if context.size < MIN_REQUESTS:
        return None
    k = max(2, -(-context.size // TAIL_SHARE))
    typical = float(np.sort(context)[-k])
    return (typical, k) if typical > 0 else None


@register
class ContextSpike(ServingDetector):
    name = "context_spike"
    summary = "a request at >= 2x the run's typical context (prompt + generated tokens)"

    def run(self, ctx: ReplayContext) -> list[Finding]:
        cb = admitted(ctx)
        if cb.size < MIN_REQUESTS:
            return []
        context = cb["prompt_tokens"].astype(np.int64) + cb["new_tokens"].astype(np.int64)
        found = typical_context(context)
        if found is None:
            return []
        typical, k = found
        i = int(np.argmax(context))
        ratio = context[i] / typical
        spikes = cb["request"][context >= SPIKE_RATIO * typical]
        rid, manager = int(cb["request"][i]), int(cb["manager"][i])
        kv = request_peak_bytes(ctx, manager).get(rid)
        pools = ctx.view.sched["pool_bytes"][ctx.view.sched["manager"] == manager]
        pool = int(pools.max()) if pools.size else -1
        share = kv / pool if kv is not None and pool > 0 else None
        msg = (f"Request {rid}{phase_at(ctx, int(cb['arrival_ns'][i]))} reached a {int(context[i]):,}-token context, "
               f"{ratio:.1f}x the typical "
               f"{typical:,.0f} tokens (the context a fifth of the {cb.size:,} requests reach, #{k} from the top; "
               f"median {np.median(context):,.0f})"
               + (f"; its blocks held {format_bytes(kv)}" + (f", {share:.0%} of the pool" if share is not None else "")
                  if kv is not None else "")
               + (f"; {spikes.size:,} requests at >= 2x." if spikes.size > 1 else "."))
        return [self.finding(
            "context_spike", _score(float(ratio)), msg,
            evidence={
                "context_tokens": ev(int(context[i]), "tokens"),
                "typical_context_tokens": ev(round(typical, 1), "tokens"),
                "median_context_tokens": ev(round(float(np.median(context)), 1), "tokens"),
                "ratio_to_typical": ev(round(float(ratio), 3), "ratio"),
                "requests_at_2x": ev(int(spikes.size), "count"),
                "spike_kv_bytes": ev(kv, "bytes"),
                "spike_share_of_pool": ev(round(share, 4) if share is not None else None, "ratio"),
            },
            requests=[int(r) for r in spikes] or [rid],
        )]


def _score(ratio: float) -> float:
    """0 at 1x rising to 0.1 just under 2x (info), then the alert: 0.5 at 2x, 0.8 at 4x."""
    if ratio < SPIKE_ALERT[0][0]:
        return UNDER_ALERT * max(ratio - 1.0, 0.0) / (SPIKE_ALERT[0][0] - 1.0)
    return alert(ratio, *SPIKE_ALERT)
