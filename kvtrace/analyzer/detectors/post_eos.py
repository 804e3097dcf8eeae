"""post_eos: memory a request leaves behind after generate returned (and, when the recorder ran
them, gc and empty_cache).

Retention is decided by proof, not by a memory delta: the recorder keeps weak references to
every KV storage it saw and, after the request (and after the caller could drop its output),
lists those still alive with the types of the objects holding them (/retention). Storages alive
there are retention: score = retained / the request's peak KV, where retained is the larger of
the surviving storages' bytes and the measured delta (allocator allocated bytes first, NVML
process memory second, minus the recorder's own device allocations, against that request's own
baseline). When tracking ran and nothing survived, a memory delta is a first-use allocation of
the process (the cuBLAS/cuDNN workspace created by the first matmul, CUDA context growth, lazily
built buffers, the allocator's rounding): information, never a leak. Only traces recorded
without tracking fall back to comparing consecutive requests.
"""

from __future__ import annotations

from kvtrace.analyzer.base import Detector, Finding, ev, register
from kvtrace.analyzer.detectors._common import layers_phrase
from kvtrace.analyzer.replay import ReplayContext, RequestTimeline
from kvtrace.analyzer.stats import ramp
from kvtrace.format import schema
from kvtrace.labels import device_where
from kvtrace.units import format_bytes

R = schema.ReadingLabel
# retained / peak KV: below 2% is measurement noise (allocator block rounding, the output tensor);
# a whole cache kept (ratio ~1) is critical. Clean controls: tests/accuracy (every architecture
# keeps 0 storages); planted: the accuracy suite's retention cases keep their whole cache.
SCORE_RAMP = (0.02, 0.5)
# Without any KV tensor alive, a few MiB is allocator noise (block rounding, the returned ids).
NOISE_BYTES = 2 << 20
# Without retention tracking (recorded with retention=False) nothing proves a leak: a delta that
# the next request does not repeat is a one-time allocation (info); one with no later request to
# compare is at most low (worth a look, not proven). 0.25 stays clear of the 0.3 medium bound.
ONE_TIME_CAP = 0.1
UNTRACKED_CAP = 0.25
# No KV storage alive, yet the next request also kept more than noise: memory outside the cache
# that grows per request. Worth a look (low), not proven to be a leak of this request.
REPEATED_NON_KV = 0.2
_AFTER = (R.AFTER_EMPTY_CACHE, R.AFTER_GC, R.AFTER_RETURN)


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
        return out

    def _request(self, ctx: ReplayContext, req: RequestTimeline) -> Finding | None:
        # A hybrid model's conv/recurrent state is cache memory too (its storages are in /retention
        # beside the KV's): the peak it is judged against holds both.
        peak = req.peak_kv_unique + req.state_bytes
        if peak <= 0:
            return None
        base = req.reading(R.BASELINE)
        after = next((req.reading(lbl) for lbl in (R.AFTER_EMPTY_CACHE, R.AFTER_GC, R.AFTER_RETURN)
                      if req.reading(lbl) is not None), None)
        after_label = next((lbl for lbl in (R.AFTER_EMPTY_CACHE, R.AFTER_GC, R.AFTER_RETURN)
                            if req.reading(lbl) is not None), None)
        own = req.reading(R.RECORDER_OWN)
        own_bytes = max(int(own["allocated_bytes"]), 0) if own is not None else 0
        kv_alive, kv_layers, referrers = retention_summary(ctx, req)
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
        if kv_alive:  # proof: cache storages outlived the request
            retained = max(retained, kv_alive)
        ratio = retained / peak
        score = ramp(ratio, *SCORE_RAMP) if kv_alive else 0.0
        one_time = ""
        kind = "retained_after_request" if kv_alive else "released"
        if not kv_alive and retained > NOISE_BYTES:
            field_name = {"allocator allocated bytes": "allocated_bytes", "NVML process memory":
                          "nvml_process_used_bytes"}.get(source, "nvml_used_bytes")
            later = [r for r in ctx.requests if r.start_ns > req.start_ns]
            nxt = _retained_by(later[0], field_name) if later else None
            repeated = nxt is not None and nxt > max(NOISE_BYTES, retained // 20)
            if tracked:
                kind = "first_use_allocation"
                one_time = ("; the recorder's weak references show no KV storage of the request alive, so this is a "
                            "first-use allocation of the process (e.g. the cuBLAS workspace of the first matmul, "
                            "lazily built buffers, allocator rounding), not retention")
                if repeated:  # worth a look: something outside the KV cache may grow per request
                    kind = "non_kv_growth"
                    score = REPEATED_NON_KV
                    one_time = (f"; no KV storage of the request is alive (weak references), but request "
                                f"{later[0].request} kept {format_bytes(nxt)} more as well: memory outside the KV "
                                "cache grows per request (kept outputs, logits, user buffers)")
            elif nxt is not None and not repeated:
                kind = "one_time_allocation"
                score = min(ramp(ratio, *SCORE_RAMP), ONE_TIME_CAP)
                one_time = (f"; request {later[0].request} added no more ({format_bytes(max(nxt, 0))}), so this is a "
                            "one-time allocation (e.g. the cuBLAS workspace or lazily built buffers), not a "
                            "per-request leak")
            else:
                kind = "retained_after_request"
                score = min(ramp(ratio, *SCORE_RAMP), UNTRACKED_CAP)
                one_time = ("; retention tracking was off, so a leak cannot be told from a one-time allocation "
                            "(e.g. the cuBLAS workspace): record with retention tracking on"
                            + ("" if nxt is not None else " or with two or more requests"))
        after_what = {R.AFTER_EMPTY_CACHE: "after gc and empty_cache", R.AFTER_GC: "after gc",
                      R.AFTER_RETURN: "after generate returned"}.get(after_label, "after the request")
        if kv_alive:
            who = ", ".join(referrers[:4]) or "unknown objects"
            what = "KV and state tensors" if req.state_bytes else "KV tensors"
            attribution = (f"{what} of {layers_phrase(kv_layers)} ({format_bytes(kv_alive)}) are still "
                           f"alive, referred to by {who}")
            if any(r.startswith("Generate") and r.endswith("Output") for r in referrers):
                attribution += (" (the generate output keeps the cache: keep only out.sequences, or do not "
                                "ask for return_dict_in_generate)")
        elif ctx.has_retention_tracking():
            attribution = "no KV tensor of the request survived, so the memory is held by something else"
        else:
            attribution = "retention tracking was off, so what holds it is unknown"
        if kind in ("released", "first_use_allocation", "one_time_allocation"):
            msg = (f"Request {req.request} released its KV cache: {format_bytes(retained)} retained "
                   f"{after_what} against a {format_bytes(peak)} peak ({source}){one_time}.")
        else:
            share = f"{ratio:.1f}x" if ratio >= 2 else f"{ratio:.0%} of"
            msg = (f"Request {req.request} kept {format_bytes(retained)} ({share} its "
                   f"{format_bytes(peak)} peak {'KV + state' if req.state_bytes else 'KV'}) {after_what}, by {source}; "
                   f"{attribution}{one_time}.")
        device = int(base["device"]) if base is not None else None
        if split is not None:
            device = max(split, key=lambda d: (split[d], -d))  # the device that kept the most
            msg = msg[:-1] + " (" + ", ".join(f"{device_where(d)} {format_bytes(max(b, 0))}"
                                             for d, b in sorted(split.items())) + ")."
        evidence = {
            "retained_bytes": ev(retained, "bytes"),
            "peak_kv_bytes": ev(req.peak_kv_unique, "bytes"),
            "ratio": ev(round(ratio, 4), "ratio"),
            "kv_alive_bytes": ev(kv_alive, "bytes"),
            "recorder_own_bytes": ev(own_bytes, "bytes"),
        }
        if req.state_bytes:
            evidence["state_bytes"] = ev(req.state_bytes, "bytes")
        if base is not None:
            evidence["baseline_allocated_bytes"] = ev(int(base["allocated_bytes"]), "bytes")
        return self.finding(
            kind,
            score, msg, evidence=evidence, requests=[req.request], layers=kv_layers,
            device=device,
        ) if (score > 0 or kv_alive or retained > 0) else None


