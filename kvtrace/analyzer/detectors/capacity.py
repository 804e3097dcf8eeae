"""capacity: headroom on the GPU and how many concurrent requests of the observed length fit,
from the observed per-token KV cost, the resident memory before the request, the request's
transient peak, and the device's memory size. Thresholds follow the usual memory alerts
(warning at 80% of the device, critical at 90-95%).

A model spread over several GPUs (device_map) is judged per device: each GPU against its own
memory, with the KV of the layers it holds (the /kv rows' device), its own resident bytes and
transient peak (the labelled readings taken on it); the device that fits the fewest sequences
limits the model and is the one the finding names. KV held on the CPU (offloaded layers) is
reported, not counted against a GPU.
"""

from __future__ import annotations

import numpy as np

from kvtrace.analyzer.base import Detector, Finding, ev, register
from kvtrace.analyzer.detectors._common import layers_phrase
from kvtrace.analyzer.replay import ReplayContext, RequestTimeline
from kvtrace.analyzer.stats import linear_fit, ramp
from kvtrace.format import schema
from kvtrace.labels import device_where
from kvtrace.units import format_bytes

UTIL_RAMP = (0.8, 0.95)  # share of device memory one request brings the process to -> score
R = schema.ReadingLabel


def _kv_gpus(req: RequestTimeline) -> tuple[list[int], bool]:
    """(CUDA devices holding some of the request's KV, whether some is on the CPU), from the /kv
    rows' device column."""
    g = req.kv
    if g.empty:
        return [], False
    devices = {int(d) for d in np.unique(g["device"][g.present])}
    return sorted(d for d in devices if d >= 0), -1 in devices


def _peak_row(req: RequestTimeline) -> int:
    """Grid row (step) where the request held the most KV, all devices together."""
    g = req.kv
    return int(np.argmax(np.where(g.present, g["bytes_unique"], 0).sum(axis=1)))


@register
class Capacity(Detector):
    name = "capacity"
    needs = ("device_memory", "steps")
    summary = "GPU headroom and how many concurrent requests of this length fit"

    def run(self, ctx: ReplayContext) -> list[Finding]:
        reqs = [r for r in ctx.requests if r.steps.size and (r.peak_kv_unique > 0 or r.state_bytes > 0)]
        if not reqs:
            return []
        req = max(reqs, key=lambda r: (r.final_tokens, r.request))
        gpus, on_cpu = _kv_gpus(req)
        # Several GPUs, or a GPU plus KV on the CPU (offloaded layers): per device.
        f = self._devices(ctx, req, gpus) if len(gpus) > 1 or (gpus and on_cpu) else self._request(ctx, req)
        return [f] if f is not None else []

    def _devices(self, ctx: ReplayContext, req: RequestTimeline, gpus: list[int]) -> Finding | None:
        """One model over several GPUs: each judged against its own memory; the tightest limits."""
        batch = max(req.batch_size, 1)
        g = req.kv
        row = _peak_row(req)
        seen = np.where(g.present, g["tokens_seen"], -1).max(axis=1)
        decode = np.flatnonzero(np.isin(g.steps, req.steps["step"][req.steps["step"] >= 1]))
        judged: list[dict] = []
        for dev in gpus:
            total = ctx.device_total(dev)
            base, peak_row = req.reading_at(R.BASELINE, dev), req.reading_at(R.PEAK, dev)
            if total is None or base is None:
                continue
            if int(base["nvml_process_used_bytes"]) >= 0:
                resident = int(base["nvml_process_used_bytes"])
            elif int(base["reserved_bytes"]) >= 0:
                resident = int(base["reserved_bytes"])
            else:
                continue
            on = g.present & (g["device"] == dev)
            per_step = np.where(on, g["bytes_unique"], 0).sum(axis=1)
            kv = int(per_step[row])
            per_token = 0.0
            if decode.size >= 2:
                per_token, _, _ = linear_fit(seen[decode], per_step[decode] / batch)
            transient = 0
            if peak_row is not None and int(peak_row["allocated_bytes"]) >= 0 and int(base["allocated_bytes"]) >= 0:
                transient = max(int(peak_row["allocated_bytes"]) - int(base["allocated_bytes"]) - kv, 0)
            free = total - resident - transient
            per_seq = kv / batch
            fit = int(free // per_seq) if per_seq > 0 and free > 0 else (0 if free <= 0 else -1)
            judged.append({"device": dev, "total": total, "resident": resident, "kv": kv, "per_seq": per_seq,
                           "per_token": per_token, "transient": transient, "free": free, "fit": fit,
                           "util": (resident + kv + transient) / total,
                           "layers": [int(x) for x in g.layers[on[row]]]})
        if not judged:
            return None
        holding = [j for j in judged if j["fit"] >= 0] or judged
        lim = min(holding, key=lambda j: (j["fit"], -j["util"]))
        worst_util = max(j["util"] for j in judged)
        score = max(ramp(worst_util, *UTIL_RAMP), 1.0 if lim["fit"] < 1 else 0.0)
        on_cpu = int(np.where(g.present & (g["device"] < 0), g["bytes_unique"], 0).sum(axis=1)[row])
        others = "; ".join(f"{device_where(j['device'])} " + (f"{j['fit']:,} fit" if j["fit"] >= 0 else "no KV")
                           + f" ({j['util']:.0%} used)" for j in judged if j is not lim)
        where = (f"Across {len(judged)} GPUs, {device_where(lim['device'])}" if len(judged) > 1
                 else f"On {device_where(lim['device'])}")
        msg = (f"{where} ({format_bytes(lim['total'])}, "
               f"{format_bytes(lim['resident'])} resident) limits: its {layers_phrase(lim['layers'])} hold "
               f"{format_bytes(lim['per_seq'])} of KV per {req.final_tokens:,}-token sequence "
               f"({format_bytes(lim['per_token'])}/token) plus a {format_bytes(lim['transient'])} transient peak: "
               f"{max(lim['fit'], 0):,} such sequences fit" + (f" (other devices: {others})" if others else "")
               + f"; request {req.request} brought "
               f"it to {lim['util']:.0%}."
               + (f" {format_bytes(on_cpu)} of KV is on the CPU (offloaded layers), not counted against a GPU."
                  if on_cpu else ""))
        return self.finding(
            "capacity", score, msg, device=lim["device"],
            evidence={
                **_evidence(lim["total"], lim["resident"], lim["per_seq"], lim["per_token"], lim["transient"],
                            lim["free"], max(lim["fit"], 0), req.final_tokens, lim["util"]),
                "devices_judged": ev(len(judged), "count"),
                "kv_on_cpu_bytes": ev(on_cpu, "bytes"),
            },
            requests=[req.request], layers=lim["layers"],
        )

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
        state = req.state_bytes  # hybrid models: constant per sequence, cache memory like the KV
        state_per_seq = state / batch
        s = req.steps[req.steps["step"] >= 1]
        per_token = 0.0
        if s.size >= 2:
            per_token, _, _ = linear_fit(s["tokens_seen"], s["kv_bytes_unique"] / batch)
        transient = 0
        if peak_row is not None and base is not None and int(peak_row["allocated_bytes"]) >= 0:
            transient = max(int(peak_row["allocated_bytes"]) - int(base["allocated_bytes"]) - kv_request - state, 0)
        free = total - resident - transient
        per_seq = kv_per_seq + state_per_seq
        fit = int(free // per_seq) if per_seq > 0 and free > 0 else 0
        used = resident + kv_request + state + transient
        util = used / total
        score = max(ramp(util, *UTIL_RAMP), 1.0 if fit < 1 else 0.0)
        tokens = req.final_tokens
        name = next((d["name"] for d in ctx.devices if d["index"] == device), device_where(device))
        with_state = (f" and {format_bytes(state_per_seq)} of conv/recurrent state (constant in tokens)"
                      if state else "")
        msg = (f"On {name} ({format_bytes(total)}), with {format_bytes(resident)} resident, a {tokens:,}-token "
               f"sequence costs {format_bytes(kv_per_seq)} of KV ({format_bytes(per_token)}/token while "
               f"decoding){with_state} plus a {format_bytes(transient)} transient peak: {fit:,} such sequences fit "
               f"at once; request {req.request} brought the device to {util:.0%}.")
        evidence = _evidence(total, resident, kv_per_seq, per_token, transient, free, fit, tokens, util)
        if state:
            evidence["state_per_sequence_bytes"] = ev(int(state_per_seq), "bytes")
        return self.finding(
            "capacity", score, msg, device=device, evidence=evidence, requests=[req.request],
        ) if source else None


def _evidence(total: int, resident: int, per_seq: float, per_token: float, transient: int, free: int, fit: int,
              tokens: int, util: float) -> dict:
    """The capacity evidence of one device (the one device, or the one that limits)."""
    return {
        "device_memory_bytes": ev(total, "bytes"),
        "resident_bytes": ev(resident, "bytes"),
        "kv_per_sequence_bytes": ev(int(per_seq), "bytes"),
        "kv_bytes_per_token": ev(round(per_token, 2), "bytes/token"),
        "transient_bytes": ev(transient, "bytes"),
        "free_for_kv_bytes": ev(max(free, 0), "bytes"),
        "max_concurrent_sequences": ev(fit, "count"),
        "tokens_per_sequence": ev(tokens, "tokens"),
        "utilization": ev(round(util, 4), "ratio"),
    }
