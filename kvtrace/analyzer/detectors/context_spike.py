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

A load test plants its own spike: kvtrace loadtest's ``long`` phase sends one long-context request
(16K tokens after 2K ones by default) to see what one costs. When the largest request was admitted
during that phase (its PHASE marker, kvtrace.serving.phases), the finding (kind
``long_context_probe``) says it is the load test's probe, with its KV and share of the pool, and is
info unless the phase's KV pool use or device memory outside the pool's room, held over two
samples, also reaches the 80 % warning (:func:`probe_memory_level`, the rule kvtrace loadtest's
verdict applies too); then it is scored as any spike. A spike outside the probe phase (one long
request among the concurrent ones) is judged as before, in its own finding.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtrace.analyzer.base import INFO_MAX_SCORE, Finding, ev, register
from kvtrace.analyzer.detectors._serving import (
    USAGE_CRITICAL,
    USAGE_WARNING,
    ServingDetector,
    admitted,
    alert,
    device_outside,
    held,
    in_use,
    known_pool,
    managers,
    phase_at,
    phase_window,
    pool_room,
    request_peak_bytes,
)
from kvtrace.analyzer.replay import ReplayContext
from kvtrace.units import format_bytes

SPIKE_ALERT = ((2.0, 4.0), (0.5, 0.8))
UNDER_ALERT = 0.1  # the most a context under 2x the typical scores: ordinary spread, info
MIN_REQUESTS = 3
TAIL_SHARE = 5  # a context reached by a fifth of the requests is typical of the traffic
SPIKE_RATIO = SPIKE_ALERT[0][0]  # the alert: a context at 2x the typical
# The phase kvtrace loadtest names for its planted long-context request (kvtrace.serving.phases; the
# analyser imports nothing from kvtrace.serving, tests/serving checks the two agree).
PROBE_PHASES = ("long",)


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


def probe_memory_level(pool_held: float | None, device_held: float | None) -> str:
    """The rule for a context spike that is the load test's own long-context probe (the tester's
    choice, not traffic): it alerts only where its phase's memory does. "critical" / "warning" when
    the phase's KV pool use or device memory outside the pool's room (each held over two samples)
    reaches 90 % / 80 %, "ok" under both, "not measured" when neither was measured. Shared by this
    detector and kvtrace loadtest's verdict (kvtrace.serving.verdict)."""
    measured = [u for u in (pool_held, device_held) if u is not None]
    if not measured:
        return "not measured"
    top = max(measured)
    return "critical" if top >= USAGE_CRITICAL else "warning" if top >= USAGE_WARNING else "ok"


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
        probe = np.array([_in_probe(ctx, int(t)) for t in cb["admitted_ns"]], dtype=bool)
        spike = context >= SPIKE_RATIO * typical
        probes = np.flatnonzero(probe & spike)  # the load test's planted long request(s), if spikes
        apart = probe if probes.size else np.zeros(cb.size, dtype=bool)
        out: list[Finding] = []
        others = np.flatnonzero(~apart)
        if others.size:  # every other request is judged as in any run (without a load test: all of them)
            j = int(others[np.argmax(context[others])])
            if spike[j] or not probes.size:
                out.append(self._spike(ctx, cb, context, j, typical, k, apart))
        if probes.size:
            out.append(self._probe(ctx, cb, context, int(probes[np.argmax(context[probes])]), typical))
        return out

    def _spike(self, ctx: ReplayContext, cb: np.ndarray, context: np.ndarray, i: int, typical: float, k: int,
               probe: np.ndarray) -> Finding:
        """The largest request but the load test's probe (``probe``: those reported apart), judged on
        its ratio to the typical."""
        ratio = context[i] / typical
        spikes = cb["request"][(context >= SPIKE_RATIO * typical) & ~probe]
        rid = int(cb["request"][i])
        kv, share = _kv(ctx, cb, i)
        msg = (f"Request {rid}{phase_at(ctx, int(cb['arrival_ns'][i]))} reached a {int(context[i]):,}-token context, "
               f"{ratio:.1f}x the typical "
               f"{typical:,.0f} tokens (the context a fifth of the {cb.size:,} requests reach, #{k} from the top; "
               f"median {np.median(context):,.0f})"
               + (f"; its blocks held {format_bytes(kv)}" + (f", {share:.0%} of the pool" if share is not None else "")
                  if kv is not None else "")
               + (f"; {spikes.size:,} requests at >= 2x" if spikes.size > 1 else "")
               + (" (besides the load test's long-context probe, reported apart)" if probe.any() else "") + ".")
        return self.finding(
            "context_spike", _score(float(ratio)), msg,
            evidence=_evidence(context, i, typical, int(spikes.size), kv, share),
            requests=[int(r) for r in spikes] or [rid],
        )

    def _probe(self, ctx: ReplayContext, cb: np.ndarray, context: np.ndarray, i: int, typical: float) -> Finding:
        """The largest request, admitted in the load test's long-context phase: the tester's probe."""
        ratio = context[i] / typical
        rid, manager = int(cb["request"][i]), int(cb["manager"][i])
        window = phase_window(ctx, int(cb["admitted_ns"][i]))
        assert window is not None
        name, t0, t1 = window
        pool_held, device_held = _phase_memory(ctx, manager, t0, t1)
        level = probe_memory_level(pool_held, device_held)
        kv, share = _kv(ctx, cb, i)
        memory = " and ".join(f"{what} at {u:.0%}" for what, u in (("the pool's use", pool_held),
                                                                   ("device memory outside the pool's room", device_held))
                              if u is not None)
        threshold = USAGE_CRITICAL if level == "critical" else USAGE_WARNING
        msg = (f"Request {rid} (phase {name!r}) is the load test's long-context probe: a {int(context[i]):,}-token "
               f"context, {ratio:.1f}x the typical {typical:,.0f} tokens, sent to see what one long request costs"
               + (f"; its blocks held {format_bytes(kv)}" + (f", {share:.0%} of the pool" if share is not None else "")
                  if kv is not None else "")
               + (f". Its phase held {memory} (over two steps at least)" if memory else "")
               + {"ok": f": under the {threshold:.0%} warning, so the pool holds one such request.",
                  "not measured": ". Its memory effect was not measured.",
                  }.get(level, f": at or past the {threshold:.0%} {level} threshold, so one request this long "
                               "takes the headroom the other traffic needs."))
        score = _score(float(ratio)) if level in ("warning", "critical") else min(_score(float(ratio)), INFO_MAX_SCORE)
        evidence = _evidence(context, i, typical, int(np.sum(context >= SPIKE_RATIO * typical)), kv, share)
        evidence.update(phase_pool_use_held=ev(round(pool_held, 4) if pool_held is not None else None, "ratio"),
                        phase_device_use_outside_pool_held=ev(round(device_held, 4) if device_held is not None
                                                              else None, "ratio"))
        return self.finding("long_context_probe", score, msg, evidence=evidence, requests=[rid])


def _in_probe(ctx: ReplayContext, t_ns: int) -> bool:
    window = phase_window(ctx, t_ns)
    return window is not None and window[0] in PROBE_PHASES


def _kv(ctx: ReplayContext, cb: np.ndarray, i: int) -> tuple[int | None, float | None]:
    """Request i's largest block tables (bytes) and their share of its manager's pool."""
    rid, manager = int(cb["request"][i]), int(cb["manager"][i])
    kv = request_peak_bytes(ctx, manager).get(rid)
    sched = ctx.trace.sched[:]
    pools = sched["pool_bytes"][sched["manager"] == manager]
    pool = int(pools.max()) if pools.size else -1
    return kv, (kv / pool if kv is not None and pool > 0 else None)


def _phase_memory(ctx: ReplayContext, manager: int, t0: int, t1: int) -> tuple[float | None, float | None]:
    """(KV pool use, device memory outside the pool's room) held over the phase [t0, t1): the
    serving_capacity rules (in_use: cached prefix blocks count as free; device_outside over NVML)."""
    rows = known_pool(managers(ctx).get(manager, ctx.trace.sched[:0]))
    rows = rows[(rows["t_ns"] >= t0) & (rows["t_ns"] < t1)]
    pool_held = held(in_use(ctx, manager, rows)) if rows.size else None
    nvml = ctx.nvml
    nvml = nvml[(nvml["total_bytes"] > 0) & (nvml["used_bytes"] >= 0)]
    devices = int(np.unique(nvml["device"]).size)
    mine = nvml[(nvml["t_ns"] >= t0) & (nvml["t_ns"] < t1)]
    if not mine.size:
        return pool_held, None
    room = pool_room(ctx.trace.sched[:], ctx.trace.sched_groups[:])
    outside, _, _ = device_outside(mine["t_ns"], mine["used_bytes"], mine["total_bytes"], room, devices)
    return pool_held, held(outside)


def _evidence(context: np.ndarray, i: int, typical: float, at_2x: int, kv: int | None,
              share: float | None) -> dict[str, Any]:
    return {
        "context_tokens": ev(int(context[i]), "tokens"),
        "typical_context_tokens": ev(round(typical, 1), "tokens"),
        "median_context_tokens": ev(round(float(np.median(context)), 1), "tokens"),
        "ratio_to_typical": ev(round(float(context[i] / typical), 3), "ratio"),
        "requests_at_2x": ev(at_2x, "count"),
        "spike_kv_bytes": ev(kv, "bytes"),
        "spike_share_of_pool": ev(round(share, 4) if share is not None else None, "ratio"),
    }


def _score(ratio: float) -> float:
    """0 at 1x rising to 0.1 just under 2x (info), then the alert: 0.5 at 2x, 0.8 at 4x."""
    if ratio < SPIKE_ALERT[0][0]:
        return UNDER_ALERT * max(ratio - 1.0, 0.0) / (SPIKE_ALERT[0][0] - 1.0)
    return alert(ratio, *SPIKE_ALERT)
