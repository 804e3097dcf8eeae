"""Per-phase verdicts against the alert thresholds of the diagnosis (seed document 001, "The Alert
Thresholds"): memory use warning at 80 %, critical at 90 %; fragmentation (reserved - allocated)
warning above 2 GiB; requests in flight warning at 80 % of the most that fit; context spikes at 2x
the typical context. Each check says where its number comes from, or "not measured" and why:
nothing is estimated where it was not seen.

The memory and context rules are the analyser's, through its own functions (no second copy):
pool use counts evictable cached prefix blocks as free (vLLM's kv_cache_usage_perc; the
serving_capacity detector), device memory is judged OUTSIDE the pool's free room (the pool is
reserved up front by design, vLLM's gpu_memory_utilization: 82 % of the device in use at idle is
not a warning; what is left beside the pool is what can run out), both reached at two samples at
least (held); the typical context is the one a fifth of the requests so far reach (the
context_spike detector). In a load test every context is the tester's choice (the long phase's
16K request is the planted probe), so a 2x spike is reported with its KV cost and is a WARNING
only when its phase also takes the pool or the device memory outside it past the 80 % threshold
(the detector's probe_memory_level: `kvtrace analyze` judges the long phase's probe the same way).

Sources, best first: the trace (``--trace``: every scheduler step, NVML and allocator readings),
then the live samples of ``GET /kvtrace/status`` (kvtrace serve only, every ``--poll`` seconds, so
a peak between two samples can be missed), then the client's own view (token counts, status)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtrace.analyzer.detectors._serving import USAGE_CRITICAL, USAGE_WARNING
from kvtrace.analyzer.detectors.context_spike import (
    SPIKE_RATIO,
    TAIL_SHARE,
    probe_memory_level,
    typical_context,
)
from kvtrace.serving.drive import PhaseRun
from kvtrace.serving.tracefacts import DeviceFacts, PhaseFacts, apply_occupancy, capacity
from kvtrace.units import format_bytes

MEMORY_WARNING, MEMORY_CRITICAL = USAGE_WARNING, USAGE_CRITICAL
FRAGMENTATION_WARNING = 2 * 1024**3
CONCURRENCY_WARNING = USAGE_WARNING
CONTEXT_SPIKE = SPIKE_RATIO

LEVELS = ("ok", "warning", "critical")  # "not measured" ranks below all of them


@dataclass
class Check:
    name: str
    level: str  # ok, warning, critical, not measured
    value: str  # as printed ("" when not measured)
    rule: str
    source: str  # where the number comes from, or why it is not measured


@dataclass
class PhaseVerdict:
    phase: str
    level: str  # the worst measured level, or "not measured"
    checks: list[Check]


def _level(value: float, warning: float, critical: float | None = None) -> str:
    if critical is not None and value >= critical:
        return "critical"
    return "warning" if value >= warning else "ok"


def worst(levels: list[str]) -> str:
    measured = [lv for lv in levels if lv in LEVELS]
    return max(measured, key=LEVELS.index) if measured else "not measured"


def _occupancy(run: PhaseRun, facts: PhaseFacts | None) -> tuple[PhaseFacts | None, str]:
    """Paged-cache peaks from the trace when it has them, else from the live samples."""
    if facts is not None and facts.pool_use_peak is not None:
        return facts, f"{facts.occupancy_source}, every scheduler step"
    if run.samples:
        live = PhaseFacts(run.phase.name, 0, 0)
        apply_occupancy(live, run.samples, run.groups, "live")
        return live, f"live GET /kvtrace/status ({len(run.samples)} samples)"
    why = [run.status_unavailable or "no live samples"]
    if facts is not None and "paged_cache" in facts.absent:
        why.append(f"trace: {facts.absent['paged_cache']}")
    elif facts is None:
        why.append("no --trace given")
    return None, "; ".join(why)


def judge_phase(run: PhaseRun, facts: PhaseFacts | None, history: list[int], max_tokens: int) -> PhaseVerdict:
    """``history``: context tokens of every request of the run so far, this phase's included."""
    checks: list[Check] = []
    occ, occ_source = _occupancy(run, facts)
    rule = f"warning >= {MEMORY_WARNING:.0%}, critical >= {MEMORY_CRITICAL:.0%}"
    if occ is not None and occ.pool_use_held is not None and occ.pool_use_peak is not None:
        peak = f", peak {occ.pool_use_peak:.1%}" if occ.pool_use_peak > occ.pool_use_held + 5e-4 else ""
        checks.append(Check("kv_pool_use", _level(occ.pool_use_held, MEMORY_WARNING, MEMORY_CRITICAL),
                            f"{occ.pool_use_held:.1%} of {format_bytes(occ.pool_bytes or 0)}{peak}",
                            rule + "; blocks in use, evictable cached prefix blocks count as free; held over two "
                            "samples", occ_source))
    else:
        checks.append(Check("kv_pool_use", "not measured", "", rule, occ_source))
    checks.append(_device(facts, rule))
    frag_rule = f"warning > {format_bytes(FRAGMENTATION_WARNING)}"
    if facts is not None and facts.fragmentation_peak is not None:
        level = "warning" if facts.fragmentation_peak > FRAGMENTATION_WARNING else "ok"
        checks.append(Check("fragmentation", level, format_bytes(facts.fragmentation_peak), frag_rule,
                            "trace /telemetry/allocator (reserved - allocated, peak)"))
    else:
        why = facts.absent.get("fragmentation", "") if facts is not None else "needs the trace's allocator readings (--trace)"
        checks.append(Check("fragmentation", "not measured", "", frag_rule, why))
    checks.append(_concurrency(run, occ, occ_source, max_tokens))
    if run.results:
        checks.append(_released(run))
    memory = probe_memory_level(occ.pool_use_held if occ is not None else None,
                                facts.device.outside_held if facts is not None and facts.device is not None else None)
    checks.append(_context(run, history, occ, memory))
    failed = [r for r in run.results if not r.ok]
    if run.results:
        checks.append(Check("requests", "critical" if failed else "ok", f"{len(run.results) - len(failed)}/"
                            f"{len(run.results)} ok", "critical if any fails",
                            "client" + (f" (first failure: {failed[0].status})" if failed else "")))
    health = run.health
    checks.append(Check("health", "ok" if health == 200 else "critical",
                        f"no answer ({run.health_error})" if health is None else
                        f"HTTP {health}" + (f": {run.health_error}" if health != 200 and run.health_error else ""),
                        "critical unless 200",
                        "GET /health after the phase"))
    return PhaseVerdict(run.phase.name, worst([c.level for c in checks]), checks)


def _device(facts: PhaseFacts | None, rule: str) -> Check:
    """Device memory outside the KV pool's room (serving_capacity's gpu_usage rule)."""
    rule = rule + "; device memory in use outside the KV pool's free room, held over two samples"
    if facts is None or facts.device is None:
        why = facts.absent.get("device_memory", "") if facts is not None else "needs the trace's NVML readings (--trace)"
        return Check("device_memory_use", "not measured", "", rule, why)
    d: DeviceFacts = facts.device
    raw = d.used_bytes / d.total_bytes
    if d.room_bytes is None:
        value = f"device {raw:.0%} ({format_bytes(d.used_bytes)} of {format_bytes(d.total_bytes)}), taken whole: {d.why_raw}"
    else:
        value = (f"device {raw:.0%} ({format_bytes(d.used_bytes)} of {format_bytes(d.total_bytes)}), of which the pool's "
                 f"unused room {format_bytes(d.room_bytes)}: {d.outside_peak:.0%} outside it")
    if d.outside_held + 5e-3 < d.outside_peak:
        value += f" ({d.outside_held:.0%} held)"
    return Check("device_memory_use", _level(d.outside_held, MEMORY_WARNING, MEMORY_CRITICAL), value, rule,
                 f"trace /telemetry/nvml ({d.samples} readings), the pool's room from the trace's scheduler steps")


def _concurrency(run: PhaseRun, occ: PhaseFacts | None, source: str, max_tokens: int) -> Check:
    rule = f"warning at >= {CONCURRENCY_WARNING:.0%} of the requests that fit"
    if occ is None or occ.in_flight_peak is None:
        return Check("concurrency", "not measured", "", rule, source)
    prompt_tokens = max([r.prompt_tokens if r.prompt_tokens >= 0 else r.prompt_words for r in run.results] +
                        [run.phase.prompt_tokens])
    context = prompt_tokens + max_tokens
    fit = capacity(occ.pool_bytes or 0, occ.groups, context)
    if fit is None:
        return Check("concurrency", "not measured", "", rule, f"{source}; the pool's block geometry is unknown")
    if fit == 0:
        return Check("concurrency", "critical", f"{occ.in_flight_peak} in flight; not one request of {context} "
                     f"tokens fits", rule, source)
    share = occ.in_flight_peak / fit
    return Check("concurrency", _level(share, CONCURRENCY_WARNING),
                 f"{occ.in_flight_peak} in flight of {fit} that fit at {context} tokens ({share:.0%})", rule,
                 f"{source}; fit = pool / blocks of one request")


def _released(run: PhaseRun) -> Check:
    """Seed 001, step 2: once the requests completed, the KV they held must be back in the pool.
    Blocks kept unreferenced for prefix reuse are evictable: they are named, not flagged."""
    rule = "warning if blocks stay referenced once every request ended"
    after = run.after
    if after is None or after.get("in_use", -1) < 0:
        return Check("kv_released", "not measured", "", rule, run.status_unavailable or
                     "needs kvtrace serve's /kvtrace/status after the phase")
    source = "live GET /kvtrace/status after the phase"
    if after["running"] + after["waiting"] > 0:
        return Check("kv_released", "not measured", "", rule, f"{source}: {after['running'] + after['waiting']} "
                     "request(s) still in flight (another client?)")
    cached = f", {after['cached']} cached for prefix reuse" if after.get("cached", 0) > 0 else ""
    if after["in_use"] > 0:
        return Check("kv_released", "warning", f"{after['in_use']} block(s) still in use with no request running"
                     f"{cached}", rule, source)
    return Check("kv_released", "ok", f"0 blocks in use{cached}", rule, source)


def _context(run: PhaseRun, history: list[int], occ: PhaseFacts | None, memory: str) -> Check:
    """The context_spike detector's rule over the run's requests so far; a spike is the tester's own
    probe (reported with its KV), a warning only where its phase's memory checks warn too."""
    rule = (f"spike at >= {CONTEXT_SPIKE:g}x the typical context (the one a fifth of the requests so far reach); "
            f"warning only if the phase's pool or device memory also reaches {MEMORY_WARNING:.0%}")
    mine = [r.context_tokens for r in run.results if r.ok]
    if not mine:
        return Check("context_spike", "not measured", "", rule, "no completed request in this phase")
    found = typical_context(np.array(history))
    if found is None:
        return Check("context_spike", "not measured", "", rule, f"{len(history)} completed request(s) so far: a "
                     "typical context needs 3 at least")
    typical, k = found
    ratio = max(mine) / typical
    source = "client: prompt + output tokens (server usage when reported)"
    value = (f"max {max(mine)} tokens = {ratio:.2f}x the typical {typical:.0f} (what the top 1/{TAIL_SHARE} of the "
             f"{len(history)} requests so far reach: #{k} from the top)")
    if ratio < CONTEXT_SPIKE:
        return Check("context_spike", "ok", value, rule, source)
    kv = _kv_of(max(mine), occ)
    pool = occ.pool_use_held if occ is not None else None
    value = "spike: " + value + kv + (f"; pool {pool:.0%} held" if pool is not None else "")
    if memory in ("warning", "critical"):
        return Check("context_spike", "warning", value + f"; the phase's memory reached {memory}", rule, source)
    if memory == "not measured":
        return Check("context_spike", "ok", value + "; its memory effect not measured", rule, source)
    return Check("context_spike", "ok", value + "; within the memory thresholds", rule, source)


def _kv_of(context: int, occ: PhaseFacts | None) -> str:
    """'; its blocks hold X, Y% of the pool' for one request of ``context`` tokens, from the pool's
    recorded block geometry (whole blocks per attention type, a sliding window's at most)."""
    if occ is None or not occ.groups or any(g.tokens_per_block <= 0 or g.bytes_per_block <= 0 for g in occ.groups):
        return ""
    kv = sum(g.bytes_for(context) for g in occ.groups)
    share = f", {kv / occ.pool_bytes:.0%} of the pool" if occ.pool_bytes else ""
    return f"; its blocks hold {format_bytes(kv)}{share}"


def judge(runs: list[PhaseRun], facts: list[PhaseFacts] | None, max_tokens: int) -> list[PhaseVerdict]:
    """One verdict per phase; ``facts``: the trace's numbers by phase name (None: no trace)."""
    by_name = {f.name: f for f in facts or []}
    history: list[int] = []
    out = []
    for run in runs:
        history += [r.context_tokens for r in run.results if r.ok]
        mine = by_name.get(run.phase.name)
        if facts is not None and mine is None:
            why = "the trace holds no marker for this phase (the server took no phase markers)"
            mine = PhaseFacts(run.phase.name, 0, 0, absent=dict.fromkeys(("paged_cache", "device_memory",
                                                                          "fragmentation"), why))
        out.append(judge_phase(run, mine, list(history), max_tokens))
    return out
