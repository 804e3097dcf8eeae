"""post_eos: memory a request leaves behind after generate returned, gc ran and the allocator
cache was emptied.

Per request: retained = (reading after gc and empty_cache) - (that request's own baseline, taken
just before it), on the allocator's allocated bytes first and NVML's process usage second, minus
the recorder's own device allocations. Score = retained / the request's peak KV bytes. Which KV
tensors are still alive and what refers to them comes from the recorder's retention tracking (on
CPU traces, where neither allocator nor NVML exists, that tracking is the measurement itself).
"""

from __future__ import annotations

from kvtrace.analyzer.base import Detector, Finding, ev, register
from kvtrace.analyzer.detectors._common import layers_phrase
from kvtrace.analyzer.replay import ReplayContext, RequestTimeline
from kvtrace.analyzer.stats import ramp
from kvtrace.format import schema
from kvtrace.units import format_bytes

R = schema.ReadingLabel
# retained / peak KV: below 2% is measurement noise (allocator block rounding, the output tensor).
SCORE_RAMP = (0.02, 0.5)
# Without any KV tensor alive, a few MiB is allocator noise (block rounding, the returned ids).
NOISE_BYTES = 2 << 20
# One-time allocations (the cuBLAS workspace: 32 MiB on Hopper, taken at the first matmul; lazily
# built buffers) stay after the first request but do not grow with later ones: seen on an H100
# fixture (tests/data/gpu_gemma3_tiny.kvt.h5), where request 0 "kept" exactly 32 MiB.
ONE_TIME_CAP = 0.1
UNDECIDED_CAP = 0.3


def _retained_by(req: RequestTimeline, field_name: str) -> int | None:
    base = req.reading(R.BASELINE)
    after = next((req.reading(lbl) for lbl in (R.AFTER_EMPTY_CACHE, R.AFTER_GC, R.AFTER_RETURN)
                  if req.reading(lbl) is not None), None)
    if base is None or after is None or int(base[field_name]) < 0 or int(after[field_name]) < 0:
        return None
    return int(after[field_name]) - int(base[field_name])


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
        peak = req.peak_kv_unique
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
        if source is None:
            if not ctx.has_retention_tracking():
                return None
            source, retained = "retention tracking (KV storages still alive)", kv_alive
        retained = max(int(retained), 0)
        ratio = retained / peak
        score = ramp(ratio, *SCORE_RAMP)
        one_time = ""
        if not kv_alive and source in ("allocator allocated bytes", "NVML process memory", "NVML device memory"):
            field_name = {"allocator allocated bytes": "allocated_bytes", "NVML process memory":
                          "nvml_process_used_bytes"}.get(source, "nvml_used_bytes")
            later = [r for r in ctx.requests if r.start_ns > req.start_ns]
            nxt = _retained_by(later[0], field_name) if later else None
            if retained <= NOISE_BYTES:
                score = 0.0
            elif nxt is not None and nxt <= max(NOISE_BYTES, retained // 20):
                score = min(score, ONE_TIME_CAP)
                one_time = (f"; request {later[0].request} added no more ({format_bytes(max(nxt, 0))}), so this is a "
                            "one-time allocation (e.g. the cuBLAS workspace or lazily built buffers), not a "
                            "per-request leak")
            elif nxt is None:
                score = min(score, UNDECIDED_CAP)
                one_time = ("; no later request to compare with, so a one-time allocation (e.g. the cuBLAS "
                            "workspace) cannot be told from a leak: record two or more requests")
        after_what = {R.AFTER_EMPTY_CACHE: "after gc and empty_cache", R.AFTER_GC: "after gc",
                      R.AFTER_RETURN: "after generate returned"}.get(after_label, "after the request")
        if kv_alive:
            who = ", ".join(referrers[:4]) or "unknown objects"
            attribution = (f"KV tensors of {layers_phrase(kv_layers)} ({format_bytes(kv_alive)}) are still "
                           f"alive, referred to by {who}")
            if any(r.startswith("Generate") and r.endswith("Output") for r in referrers):
                attribution += (" (the generate output keeps past_key_values: drop it, or do not ask for "
                                "return_dict_in_generate)")
        elif ctx.has_retention_tracking():
            attribution = "no KV tensor of the request survived, so the memory is held by something else"
        else:
            attribution = "retention tracking was off, so what holds it is unknown"
        if score == 0 and not kv_alive:
            msg = (f"Request {req.request} released its KV cache: {format_bytes(retained)} retained "
                   f"{after_what} against a {format_bytes(peak)} peak ({source}).")
        else:
            share = f"{ratio:.1f}x" if ratio >= 2 else f"{ratio:.0%} of"
            msg = (f"Request {req.request} kept {format_bytes(retained)} ({share} its "
                   f"{format_bytes(peak)} peak KV) {after_what}, by {source}; {attribution}{one_time}.")
        evidence = {
            "retained_bytes": ev(retained, "bytes"),
            "peak_kv_bytes": ev(peak, "bytes"),
            "ratio": ev(round(ratio, 4), "ratio"),
            "kv_alive_bytes": ev(kv_alive, "bytes"),
            "recorder_own_bytes": ev(own_bytes, "bytes"),
        }
        if base is not None:
            evidence["baseline_allocated_bytes"] = ev(int(base["allocated_bytes"]), "bytes")
        kind = "one_time_allocation" if one_time.startswith("; request") else (
            "retained_after_request" if score > 0 or kv_alive else "released")
        return self.finding(
            kind,
            score, msg, evidence=evidence, requests=[req.request], layers=kv_layers,
            device=int(base["device"]) if base is not None else None,
        ) if (score > 0 or kv_alive or retained > 0) else None


