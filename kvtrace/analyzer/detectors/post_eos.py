"""post_eos: memory a request leaves behind after generate returned (and, when the recorder ran
them, gc and empty_cache), for every request whatever its outcome (ok, error, interrupted, OOM).

Retention is decided by proof, not by a memory delta: the recorder keeps weak references to
every KV storage it saw and, after the request (and after the caller could drop its output or the
exception it raised), lists those still alive with what holds them (/retention: the holder types
and a path to a root, e.g. a kept exception's traceback). Storages alive there are retention, at
least low however small; the same retention in two or more requests, or a request's KV still alive
at a later request's verdict (accumulating), is critical. Otherwise score = retained / the request's
peak KV, where retained is the larger of the surviving storages' bytes and the measured delta
(allocator allocated bytes first, NVML process memory second, minus the recorder's own device
allocations, against that request's own baseline).

When no KV storage survived, the owner reading at the request's end (/owners, format 1.5) says who
holds the delta: copies of KV (blocks or tensors sized like the cache's K/V), the generate output the
caller asked for (scores, logits: named, at most information), library workspaces (a first-use
allocation has a known size and happens once per process: cuBLAS/cuBLASLt, at most 64 MiB per
device), or unknown. Without an owner reading a delta above that bound is never called first use.
Only traces recorded without tracking fall back to comparing consecutive requests.

Continuous batching: a request owns no storage (its blocks of the manager's paged pool are reused),
so no per-request proof exists; what is proven is that the pool dies with its manager. A pool the
recorder found alive after its manager was gone (/owners, request -1, moment request_end, kv_earlier
with the pool's detail) is `paged_pool_retained`, critical, with what holds it.
"""

from __future__ import annotations

from kvtrace.analyzer import owners as own
from kvtrace.analyzer.base import Detector, Finding, ev, register
from kvtrace.analyzer.detectors._common import layers_phrase
from kvtrace.analyzer.replay import ReplayContext, RequestTimeline
from kvtrace.analyzer.stats import ramp
from kvtrace.format import schema
from kvtrace.labels import device_where
from kvtrace.units import format_bytes

R = schema.ReadingLabel
OW = schema.Owner
# retained / peak KV: below 2% is measurement noise (allocator block rounding, the output tensor);
# a whole cache kept (ratio ~1) is critical. Clean controls: tests/accuracy (every architecture
# keeps 0 storages); planted: the accuracy suite's retention cases keep their whole cache.
SCORE_RAMP = (0.02, 0.5)
# Without any KV tensor alive, a few MiB is allocator noise (block rounding, the returned ids).
NOISE_BYTES = 2 << 20
MiB = 1 << 20
# Without retention tracking (recorded with retention=False) nothing proves a leak: a delta that
# the next request does not repeat is a one-time allocation (info); one with no later request to
# compare is at most low (worth a look, not proven). 0.25 stays clear of the 0.3 medium bound.
ONE_TIME_CAP = 0.1
UNTRACKED_CAP = 0.25
# No KV storage alive, yet the next request also kept more than noise: memory outside the cache
# that grows per request. Worth a look (low), not proven to be a leak of this request.
REPEATED_NON_KV = 0.2
_AFTER = (R.AFTER_EMPTY_CACHE, R.AFTER_GC, R.AFTER_RETURN)
# Proven KV alive after a request is at least low, however small (a kept slice holds its whole
# storage); repeated in another request or still alive at a later verdict: critical.
PROVEN_FLOOR = 0.2
ACCUMULATING = 1.0
# First-use allocations have known sizes and happen once per process: torch's cuBLAS and cuBLASLt
# workspaces (32 MiB each from Hopper on, 8.1 MiB / 1 MiB before) plus allocator rounding. A delta
# above this is never called first use.
FIRST_USE_MAX = 64 * MiB + 2 * MiB
# Memory held outside the KV with no owner reading to name it: worth a look (low), not proven.
UNNAMED_NON_KV = 0.25
# Copies of KV left alive after the request: score = copies / peak KV on this ramp, floored at low.
COPIES_RAMP = (0.1, 1.0)
REQUESTED_OUTPUTS_CAP = 0.1  # the generate output the caller asked for, still held: information
# KV held only by the exception the caller is handling at the next request (a retry inside the except
# block): real while it lasts, gone when the block ends: medium at most, unless it accumulates.
HANDLING_CAP = 0.45


def _retained_by(req: RequestTimeline, field_name: str) -> int | None:
    base = req.reading(R.BASELINE)
    after = next((req.reading(lbl) for lbl in (R.AFTER_EMPTY_CACHE, R.AFTER_GC, R.AFTER_RETURN)
                  if req.reading(lbl) is not None), None)
    if base is None or after is None or int(base[field_name]) < 0 or int(after[field_name]) < 0:
        return None
    return int(after[field_name]) - int(base[field_name])


def _per_device_retained(req: RequestTimeline) -> dict[int, int] | None:
    """{device: allocated after - baseline} when the request's readings cover two or more GPUs
    (a model spread over devices); the recorder's own bytes come off their device. None otherwise."""
    devices = [d for d in req.reading_devices if d >= 0]
    if len(devices) < 2:
        return None
    out: dict[int, int] = {}
    for d in devices:
        base = req.reading_at(R.BASELINE, d)
        after = next((req.reading_at(lbl, d) for lbl in _AFTER if req.reading_at(lbl, d) is not None), None)
        if base is None or after is None or int(base["allocated_bytes"]) < 0 or int(after["allocated_bytes"]) < 0:
            return None
        own_row = req.reading_at(R.RECORDER_OWN, d)
        own_bytes = max(int(own_row["allocated_bytes"]), 0) if own_row is not None else 0
        out[d] = int(after["allocated_bytes"]) - int(base["allocated_bytes"]) - own_bytes
    return out


def retention_summary(ctx: ReplayContext, req: RequestTimeline) -> tuple[int, list[int], list[str]]:
    """(unique bytes, layers, referrer types) of this request's KV storages still alive."""
    rows = req.retention
    if rows.size == 0:
        return 0, [], []
    seen: set[tuple[int, int]] = set()
    total = 0
    referrers: dict[str, None] = {}
    for r in rows:
        key = (int(r["device"]), int(r["storage"]))
        if key not in seen:
            seen.add(key)
            total += int(r["nbytes"])
        text = ctx.trace.text(int(r["referrers_off"]), int(r["referrers_len"]))
        for name in (t.strip() for t in text.split(",")):
            if name:
                referrers[name] = None
    layers = sorted({int(x) for x in rows["layer"] if int(x) >= 0})
    return total, layers, list(referrers)


@register
class PostEos(Detector):
    name = "post_eos"
    needs = ("requests",)
    summary = "memory retained after generate returned, gc and empty_cache, against the request's peak KV"

    def skip_reason(self, ctx: ReplayContext) -> str | None:
        base = super().skip_reason(ctx)
        if base:
            return base
        if ctx.has_allocator() or ctx.has_nvml() or ctx.has_retention_tracking():
            return None
        return ("no allocator, NVML or retention-tracking data in this trace "
                f"(allocator: {ctx.source_reason('allocator')}; nvml: {ctx.source_reason('nvml')})")

    def run(self, ctx: ReplayContext) -> list[Finding]:
        out: list[Finding] = []
        for req in ctx.requests:
            f = self._request(ctx, req)
            if f is not None:
                out.append(f)
        out.extend(self._retained_pools(ctx))
        return out

    def _retained_pools(self, ctx: ReplayContext) -> list[Finding]:
        """Continuous batching: a paged KV pool still alive after its manager stopped (the recorder's
        reading at moment request_end, request -1, names it kv_earlier with the pool's detail). Its
        requests own no storage of their own, so this is the retention a paged pool can show."""
        out = []
        for rd in own.readings(ctx):
            c = rd.classes.get(OW.KV_EARLIER)
            if rd.request != -1 or rd.moment != schema.OwnerMoment.REQUEST_END or c is None \
                    or c.detail.get("pool") != "paged":
                continue
            managers = [m for m in c.detail.get("managers", []) if isinstance(m, int)]
            reqs = [r for r in c.detail.get("requests", []) if isinstance(r, int) and not isinstance(r, bool)]
            held = c.detail.get("held_by")
            which = f"continuous-batching manager {managers[0]}" if managers else "a continuous-batching manager"
            ran = f", the KV of requests {', '.join(map(str, reqs[:8]))}{', ...' if len(reqs) > 8 else ''}" \
                if reqs else ""
            msg = (f"The paged KV pool of {which} ({format_bytes(c.bytes)}{ran}) is still alive after its manager "
                   f"stopped{f': held by {str(held)[:400]}' if isinstance(held, str) and held else ''}. A view or "
                   "slice of the pool holds all of it: copy what is needed (.clone()) or drop the reference.")
            out.append(self.finding("paged_pool_retained", ACCUMULATING, msg,
                                    evidence={"retained_bytes": ev(c.bytes, "bytes"),
                                              "storages": ev(c.blocks, "count")},
                                    requests=reqs, device=rd.device))
        return out

    def _request(self, ctx: ReplayContext, req: RequestTimeline) -> Finding | None:
        # A hybrid model's conv/recurrent state is cache memory too (its storages are in /retention
        # beside the KV's): the peak it is judged against holds both.
        peak = req.peak_kv_unique + req.state_bytes
        kv_alive, kv_layers, referrers = retention_summary(ctx, req)
        if peak <= 0 and not kv_alive:
            return None
        peak = max(peak, kv_alive, 1)
        base = req.reading(R.BASELINE)
        after = next((req.reading(lbl) for lbl in _AFTER if req.reading(lbl) is not None), None)
        after_label = next((lbl for lbl in _AFTER if req.reading(lbl) is not None), None)
        own_row = req.reading(R.RECORDER_OWN)
        own_bytes = max(int(own_row["allocated_bytes"]), 0) if own_row is not None else 0
        source, retained = None, None
        if base is not None and after is not None:
            for field_name, label in (("allocated_bytes", "allocator allocated bytes"),
                                      ("nvml_process_used_bytes", "NVML process memory"),
                                      ("nvml_used_bytes", "NVML device memory")):
                b, a = int(base[field_name]), int(after[field_name])
                if b >= 0 and a >= 0:
                    source = label
                    retained = a - b - (own_bytes if field_name == "allocated_bytes" else 0)
                    break
        split = _per_device_retained(req)
        if split is not None:  # a model over several GPUs: each device against its own baseline
            source, retained = "allocator allocated bytes", sum(split.values())
        if source is None:
            if not ctx.has_retention_tracking():
                return None
            source, retained = "retention tracking (KV storages still alive)", kv_alive
        retained = max(int(retained), 0)
        tracked = ctx.has_retention_tracking()
        end = own.merged(own.latest(ctx, req.request, schema.OwnerMoment.REQUEST_END))
        after_what = {R.AFTER_EMPTY_CACHE: "after gc and empty_cache", R.AFTER_GC: "after gc",
                      R.AFTER_RETURN: "after generate returned"}.get(after_label, "after the request")
        outcome = "" if req.outcome in (schema.Outcome.OK, schema.Outcome.RUNNING) else \
            f" (it ended {req.outcome.name.lower()})"
        evidence = {
            "retained_bytes": ev(retained, "bytes"),
            "peak_kv_bytes": ev(req.peak_kv_unique, "bytes"),
            "ratio": ev(round(max(retained, kv_alive) / peak, 4), "ratio"),
            "kv_alive_bytes": ev(kv_alive, "bytes"),
            "recorder_own_bytes": ev(own_bytes, "bytes"),
        }
        if req.state_bytes:
            evidence["state_bytes"] = ev(req.state_bytes, "bytes")
        if base is not None:
            evidence["baseline_allocated_bytes"] = ev(int(base["allocated_bytes"]), "bytes")
        device = int(base["device"]) if base is not None else None
        if kv_alive:
            kind, score, msg = self._kv_alive(ctx, req, peak, retained, kv_alive, kv_layers, referrers, source,
                                              after_what, outcome, evidence)
        else:
            kind, score, msg = self._no_kv_alive(ctx, req, peak, retained, source, after_what, outcome, tracked,
                                                 end, evidence)
            if kind is None:
                return None
        if split is not None:
            device = max(split, key=lambda d: (split[d], -d))  # the device that kept the most
            msg = msg[:-1] + " (" + ", ".join(f"{device_where(d)} {format_bytes(max(b, 0))}"
                                             for d, b in sorted(split.items())) + ")."
        if end is not None and kind in ("non_kv_growth", "one_time_allocation"):
            msg = msg[:-1] + f"; owners at the verdict: {own.describe(end)}."
        return self.finding(kind, score, msg, evidence=evidence, requests=[req.request], layers=kv_layers,
                            device=device) if (score > 0 or kv_alive or retained > 0) else None

    def _kv_alive(self, ctx: ReplayContext, req: RequestTimeline, peak: int, retained: int, kv_alive: int,
                  kv_layers: list[int], referrers: list[str], source: str, after_what: str, outcome: str,
                  evidence: dict) -> tuple[str, float, str]:
        """Proof: KV storages of the request outlived it. At least low; critical when the retention
        repeats in other requests or is still alive at a later request's verdict."""
        retained = max(retained, kv_alive)
        evidence["retained_bytes"] = ev(retained, "bytes")
        ratio = retained / peak
        score = max(ramp(ratio, *SCORE_RAMP), PROVEN_FLOOR)
        repeated = [r.request for r in ctx.requests if r.request != req.request and r.retention.size]
        persisted = _persisted(ctx, req.request)
        evidence["requests_retaining"] = ev(len(repeated) + 1, "count")
        evidence["later_verdicts_still_alive"] = ev(len(persisted), "count")
        names = [n for n in referrers if " < " not in n]
        paths = [n for n in referrers if " < " in n]
        who = ", ".join(names[:4]) or "unknown objects"
        what = "KV and state tensors" if req.state_bytes else "KV tensors"
        attribution = (f"{what} of {layers_phrase(kv_layers)} ({format_bytes(kv_alive)}) are still "
                       f"alive, referred to by {who}")
        if paths:
            attribution += f"; held by {paths[0]}"
        if any(" exception (its traceback)" in x for x in paths):
            attribution += (" (a kept exception's traceback holds generate's frames and, through them, the "
                            "cache: keep str(exc) or clear exc.__traceback__ after handling it)")
        elif any(r.startswith("Generate") and r.endswith("Output") for r in referrers):
            attribution += (" (the generate output keeps the cache: keep only out.sequences, or do not "
                            "ask for return_dict_in_generate)")
        if kv_alive < peak and kv_alive * 2 <= peak:
            attribution += " (a view or slice of a KV tensor keeps its whole storage alive)"
        handling = bool(paths) and all("the exception being handled now" in x for x in paths)
        if handling:  # held only while the caller's except block runs (a retry inside it)
            score = min(score, HANDLING_CAP)
            attribution += (" (only while the except block that handles it runs: a retry inside it holds the "
                            "failed request's cache beside its own; retry after the block, or drop the exception)")
        growing = ""
        if repeated or persisted:
            score = ACCUMULATING
            bits = []
            if repeated:
                bits.append(f"request{'s' if len(repeated) > 1 else ''} {', '.join(map(str, sorted(repeated)[:8]))} "
                            "kept KV too")
            if persisted:
                bits.append(f"it was still alive at the verdicts of request{'s' if len(persisted) > 1 else ''} "
                            f"{', '.join(map(str, persisted[:8]))}")
            growing = f"; retention accumulates: {' and '.join(bits)}"
        share = f"{ratio:.1f}x" if ratio >= 2 else f"{ratio:.0%} of"
        msg = (f"Request {req.request}{outcome} kept {format_bytes(retained)} ({share} its "
               f"{format_bytes(peak)} peak {'KV + state' if req.state_bytes else 'KV'}) {after_what}, by {source}; "
               f"{attribution}{growing}.")
        return "retained_after_request", score, msg

    def _no_kv_alive(self, ctx: ReplayContext, req: RequestTimeline, peak: int, retained: int, source: str,
                     after_what: str, outcome: str, tracked: bool, end: own.Reading | None,
                     evidence: dict) -> tuple[str | None, float, str]:
        """No KV storage of the request survived: who holds the delta, when anything does."""
        ratio = retained / peak
        head = (f"Request {req.request}{outcome} released its KV cache: {format_bytes(retained)} retained "
                f"{after_what} against a {format_bytes(peak)} peak ({source})")
        if retained <= NOISE_BYTES:
            return "released", 0.0, head + "."
        if end is not None:  # the owner reading names who holds it
            copies, outputs = end.bytes(OW.KV_COPIES), end.bytes(OW.GENERATE_OUTPUT)
            unknown, workspace = end.bytes(OW.UNKNOWN), end.bytes(OW.WORKSPACE)
            earlier = end.bytes(OW.KV_EARLIER)
            evidence.update(kv_copies_bytes=ev(copies, "bytes"), generate_output_bytes=ev(outputs, "bytes"),
                            unknown_bytes=ev(unknown, "bytes"), workspace_bytes=ev(workspace, "bytes"))
            if copies > max(NOISE_BYTES, COPIES_RAMP[0] * peak):
                score = max(ramp(copies / peak, *COPIES_RAMP), PROVEN_FLOOR)
                sites = end.largest_sites(OW.KV_COPIES)
                at = f", allocated at {'; '.join(sites)}" if sites else ""
                return "kv_copies_retained", score, (
                    f"Request {req.request}{outcome} released its own KV cache, but {format_bytes(copies)} of "
                    f"copies of it ({end.classes[OW.KV_COPIES].blocks:,} blocks sized like its layers' K/V, "
                    f"{copies / peak:.1f}x its {format_bytes(peak)} peak KV) are still alive {after_what}{at}: user "
                    "code keeps copies of the cache (torch.cat or clone of its layer tensors, a list of them).")
            if outputs and outputs >= 0.5 * (retained - workspace - earlier) and own.asked_outputs(ctx, req.request):
                asked = ", ".join(f"output_{x}" for x in own.asked_outputs(ctx, req.request))
                return "requested_outputs_held", min(ramp(ratio, *SCORE_RAMP), REQUESTED_OUTPUTS_CAP), (
                    f"{head}; {format_bytes(outputs)} of it is the generate output the call asked for ({asked}), "
                    "still held by the caller: by design, freed when the output is dropped.")
            ws = end.classes.get(OW.WORKSPACE)
            graphs = int(ws.detail.get("graph_pool_bytes", 0) or 0) if ws is not None else 0
            library = workspace - graphs
            first_use = workspace and library <= FIRST_USE_MAX and not (library and _claimed_first_use(ctx, req))
            if first_use and unknown + copies <= max(NOISE_BYTES, retained // 4):
                what = (f"{format_bytes(library)} of library workspaces" if library else "")
                what += (" and " if library and graphs else "") + (
                    f"{format_bytes(graphs)} of CUDA graph memory pools (a compiled forward's captured graphs, "
                    "kept for replay)" if graphs else "")
                return "first_use_allocation", 0.0, (
                    f"{head}; the owner reading names {what} ({own.class_name(OW.WORKSPACE, ws)}): allocated on "
                    "first use and kept by design (known sizes, once per process or compiled shape), not retention.")
            sites = end.largest_sites(OW.UNKNOWN)
            at = f"; largest unknown blocks: {'; '.join(sites)}" if sites else \
                "; record with memory_history=True (--memory-history) to name their allocation sites"
            repeated = _repeated_non_kv(ctx, req)
            score = REPEATED_NON_KV if repeated else min(ramp(ratio, *SCORE_RAMP), UNNAMED_NON_KV)
            return "non_kv_retained", score, (
                f"{head}; no KV storage of the request is alive and {format_bytes(unknown)} is held by owners "
                f"no rule names (unknown){at}" + (" (it repeats in later requests)" if repeated else "") + ".")
        field_name = {"allocator allocated bytes": "allocated_bytes", "NVML process memory":
                      "nvml_process_used_bytes"}.get(source, "nvml_used_bytes")
        later = [r for r in ctx.requests if r.start_ns > req.start_ns]
        nxt = _retained_by(later[0], field_name) if later else None
        repeated = nxt is not None and nxt > max(NOISE_BYTES, retained // 20)
        if tracked:
            if repeated:  # worth a look: something outside the KV cache may grow per request
                return "non_kv_growth", REPEATED_NON_KV, (
                    f"{head}; no KV storage of the request is alive (weak references), but request "
                    f"{later[0].request} kept {format_bytes(nxt)} more as well: memory outside the KV cache "
                    "grows per request (kept outputs, logits, user buffers).")
            if retained <= FIRST_USE_MAX and not _claimed_first_use(ctx, req):
                return "first_use_allocation", 0.0, (
                    f"{head}; the recorder's weak references show no KV storage of the request alive, so this is "
                    "a first-use allocation of the process (e.g. the cuBLAS workspace of the first matmul, lazily "
                    "built buffers, allocator rounding), not retention.")
            return "non_kv_retained", min(ramp(ratio, *SCORE_RAMP), UNNAMED_NON_KV), (
                f"{head}; no KV storage of the request is alive (weak references), and {format_bytes(retained)} is "
                f"more than a first-use allocation can be (library workspaces: at most "
                f"{format_bytes(FIRST_USE_MAX)}, once per process): memory outside the KV cache is held after "
                "the request (copies of the cache, kept outputs or logits, user buffers); a trace with owner "
                "readings (format 1.5) names them.")
        if nxt is not None and not repeated:
            return "one_time_allocation", min(ramp(ratio, *SCORE_RAMP), ONE_TIME_CAP), (
                f"{head}; request {later[0].request} added no more ({format_bytes(max(nxt, 0))}), so this is a "
                "one-time allocation (e.g. the cuBLAS workspace or lazily built buffers), not a per-request leak.")
        return "retained_after_request", min(ramp(ratio, *SCORE_RAMP), UNTRACKED_CAP), (
            f"Request {req.request}{outcome} kept {format_bytes(retained)} ({ratio:.0%} of its {format_bytes(peak)} "
            f"peak KV) {after_what}, by {source}; retention tracking was off, so what holds it is unknown; a leak "
            "cannot be told from a one-time allocation (e.g. the cuBLAS workspace): record with retention "
            "tracking on" + ("" if nxt is not None else " or with two or more requests") + ".")


def _persisted(ctx: ReplayContext, request: int) -> list[int]:
    """Later requests at whose verdict this request's KV was still alive (owner readings' kv_earlier)."""
    out = []
    for rd in own.readings(ctx):
        if rd.moment != schema.OwnerMoment.REQUEST_END or rd.request == request:
            continue
        c = rd.classes.get(schema.Owner.KV_EARLIER)
        if c is not None and request in [x for x in c.detail.get("requests", []) if isinstance(x, int)]:
            if rd.request not in out:
                out.append(rd.request)
    return sorted(out)


def _claimed_first_use(ctx: ReplayContext, req: RequestTimeline) -> bool:
    """Did an earlier request of the trace already leave a first-use-sized delta (it happens once)?"""
    for r in ctx.requests:
        if r.start_ns >= req.start_ns:
            break
        d = _retained_by(r, "allocated_bytes")
        if d is not None and d > NOISE_BYTES and not r.retention.size:
            return True
    return False


def _repeated_non_kv(ctx: ReplayContext, req: RequestTimeline) -> bool:
    later = [r for r in ctx.requests if r.start_ns > req.start_ns]
    nxt = _retained_by(later[0], "allocated_bytes") if later else None
    return nxt is not None and nxt > NOISE_BYTES
