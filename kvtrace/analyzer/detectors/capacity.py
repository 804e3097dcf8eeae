"""capacity: headroom on the GPU and how many concurrent requests of the observed length fit,
from the observed per-token KV cost, the resident memory before the request, the request's
transient peak, and the device's memory size. Thresholds follow the usual memory alerts
(warning at 80% of the device, critical at 90-95%).
"""

from __future__ import annotations

from kvtrace.analyzer.base import Detector, Finding, ev, register
from kvtrace.analyzer.replay import ReplayContext, RequestTimeline
from kvtrace.analyzer.stats import linear_fit, ramp
from kvtrace.format import schema
from kvtrace.labels import device_where
from kvtrace.units import format_bytes

UTIL_RAMP = (0.8, 0.95)  # share of device memory one request brings the process to -> score


@register
class Capacity(Detector):
    name = "capacity"
    needs = ("device_memory", "steps")
    summary = "GPU headroom and how many concurrent requests of this length fit"

    def run(self, ctx: ReplayContext) -> list[Finding]:
        reqs = [r for r in ctx.requests if r.steps.size and r.peak_kv_unique > 0]
        if not reqs:
            return []
        req = max(reqs, key=lambda r: (r.final_tokens, r.request))
        f = self._request(ctx, req)
        return [f] if f is not None else []

    def _request(self, ctx: ReplayContext, req: RequestTimeline) -> Finding | None:
        base = req.reading(schema.ReadingLabel.BASELINE)
        peak_row = req.reading(schema.ReadingLabel.PEAK)
        device = int(base["device"]) if base is not None else (ctx.gpu_devices[0] if ctx.gpu_devices else -1)
        total = ctx.device_total(device)
        if total is None:
            return None
        # Resident before the request: NVML (includes the CUDA context) else the allocator.
        resident, source = None, ""
        if base is not None:
            if int(base["nvml_process_used_bytes"]) >= 0:
                resident, source = int(base["nvml_process_used_bytes"]), "NVML process memory"
            elif int(base["reserved_bytes"]) >= 0:
                resident, source = int(base["reserved_bytes"]), "allocator reserved bytes"
        if resident is None:
            return None
        batch = max(req.batch_size, 1)
        kv_request = req.peak_kv_unique
        kv_per_seq = kv_request / batch
        s = req.steps[req.steps["step"] >= 1]
        per_token = 0.0
        if s.size >= 2:
            per_token, _, _ = linear_fit(s["tokens_seen"], s["kv_bytes_unique"] / batch)
        transient = 0
        if peak_row is not None and base is not None and int(peak_row["allocated_bytes"]) >= 0:
            transient = max(int(peak_row["allocated_bytes"]) - int(base["allocated_bytes"]) - kv_request, 0)
        free = total - resident - transient
        fit = int(free // kv_per_seq) if kv_per_seq > 0 and free > 0 else 0
        used = resident + kv_request + transient
        util = used / total
        score = max(ramp(util, *UTIL_RAMP), 1.0 if fit < 1 else 0.0)
        tokens = req.final_tokens
        name = next((d["name"] for d in ctx.devices if d["index"] == device), device_where(device))
        msg = (f"On {name} ({format_bytes(total)}), with {format_bytes(resident)} resident, a {tokens:,}-token "
               f"sequence costs {format_bytes(kv_per_seq)} of KV ({format_bytes(per_token)}/token while "
               f"decoding) plus a {format_bytes(transient)} transient peak: {fit:,} such sequences fit at once; "
               f"request {req.request} brought the device to {util:.0%}.")
        return self.finding(
            "capacity", score, msg, device=device,
            evidence={
                "device_memory_bytes": ev(total, "bytes"),
                "resident_bytes": ev(resident, "bytes"),
                "kv_per_sequence_bytes": ev(int(kv_per_seq), "bytes"),
                "kv_bytes_per_token": ev(round(per_token, 2), "bytes/token"),
                "transient_bytes": ev(transient, "bytes"),
                "free_for_kv_bytes": ev(max(free, 0), "bytes"),
                "max_concurrent_sequences": ev(fit, "count"),
                "tokens_per_sequence": ev(tokens, "tokens"),
                "utilization": ev(round(util, 4), "ratio"),
            },
            requests=[req.request],
        ) if source else None
