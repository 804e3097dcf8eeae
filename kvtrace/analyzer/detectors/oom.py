"""oom: for every out-of-memory event, what was allocated, reserved and fragmented at that
instant, how much the failed allocation asked for, and the likely cause (fragmentation,
KV growth, a prefill transient, or memory held outside the cache).
"""

from __future__ import annotations

import re

import numpy as np

from kvtrace.analyzer.base import Detector, Finding, ev, register
from kvtrace.analyzer.replay import ReplayContext, RequestTimeline
from kvtrace.format import schema
from kvtrace.units import format_bytes

_TRIED = re.compile(r"[Tt]ried to allocate\s+([0-9.]+)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB)")
_SCALE = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
          "KB": 1000, "MB": 1000**2, "GB": 1000**3}


def requested_bytes(text: str) -> int | None:
    """The size torch's OOM message says it tried to allocate (torch prints binary units)."""
    m = _TRIED.search(text or "")
    return int(float(m.group(1)) * _SCALE[m.group(2)]) if m else None


@register
class Oom(Detector):
    name = "oom"
    needs = ("requests",)
    summary = "allocator state at each out-of-memory event and its likely cause"

    def run(self, ctx: ReplayContext) -> list[Finding]:
        out: list[Finding] = []
        oom_events = ctx.events[ctx.events["kind"] == int(schema.EventKind.OOM)] if ctx.events.size else ctx.events
        handled: set[int] = set()
        for e in oom_events:
            rid = int(e["request"])
            req = next((r for r in ctx.requests if r.request == rid), None)
            out.append(self._one(ctx, req, int(e["t_ns"]), int(e["step"]),
                                 ctx.trace.text(int(e["text_off"]), int(e["text_len"])), int(e["device"])))
            handled.add(rid)
        for req in ctx.requests:  # an OOM outcome without its event (e.g. the event was lost)
            if req.outcome == schema.Outcome.OOM and req.request not in handled:
                r = req.reading(schema.ReadingLabel.AT_OOM)
                t = int(r["t_ns"]) if r is not None else req.end_or_last_ns
                out.append(self._one(ctx, req, t, -1, "", int(r["device"]) if r is not None else -1))
        return out

    def _one(self, ctx: ReplayContext, req: RequestTimeline | None, t: int, step: int, text: str,
             device: int) -> Finding:
        state = self._state(ctx, req, t, device)
        alloc, reserved, split = state["allocated"], state["reserved"], state["split"]
        total = ctx.device_total(device)
        want = requested_bytes(text)
        kv = 0
        if req is not None and req.steps.size:
            before = req.steps[req.steps["t_ns"] <= t]
            kv = int(before["kv_bytes_unique"][-1]) if before.size else 0
            if step < 0 and before.size:
                step = int(before["step"][-1]) + 1
        prefill = req is not None and (step <= 0 or not (req.steps.size and (req.steps["step"] >= 1).any()))
        gap = reserved - alloc if reserved >= 0 and alloc >= 0 else -1
        if want is not None and gap >= want:
            cause = (f"fragmentation: {format_bytes(gap)} was reserved but unallocated, yet no free block of "
                     f"{format_bytes(want)} existed ({format_bytes(max(split, 0))} in split blocks)")
            kind = "oom_fragmentation"
        elif prefill:
            cause = "the prefill's working memory (attention and activations over the prompt), before decoding began"
            kind = "oom_prefill"
        elif alloc > 0 and kv >= 0.5 * alloc:
            cause = f"KV cache growth: the cache held {format_bytes(kv)}, {kv / alloc:.0%} of allocated memory"
            kind = "oom_kv_growth"
        else:
            cause = (f"memory outside the KV cache (the cache held {format_bytes(kv)} of "
                     f"{format_bytes(max(alloc, 0))} allocated)")
            kind = "oom_other"
        where = f"request {req.request}" if req is not None else "outside any request"
        at = f", step {step}" if step >= 0 else ""
        asked = f" asking for {format_bytes(want)}" if want is not None else ""
        held = (f"{format_bytes(alloc)} allocated, {format_bytes(reserved)} reserved, "
                f"{format_bytes(max(split, 0))} in split blocks" if alloc >= 0 else "allocator state not recorded")
        dev_total = f" of {format_bytes(total)}" if total else ""
        msg = f"Out of memory in {where}{at}{asked} ({held}{dev_total}); likely cause: {cause}."
        evidence = {
            "allocated_bytes": ev(alloc if alloc >= 0 else None, "bytes"),
            "reserved_bytes": ev(reserved if reserved >= 0 else None, "bytes"),
            "inactive_split_bytes": ev(split if split >= 0 else None, "bytes"),
            "requested_bytes": ev(want, "bytes"),
            "kv_bytes": ev(kv, "bytes"),
            "device_memory_bytes": ev(total, "bytes"),
        }
        return self.finding(kind, 1.0, msg, evidence=evidence,
                            requests=[req.request] if req is not None else [],
                            steps=[step] if step >= 0 else [], device=device)

    @staticmethod
    def _state(ctx: ReplayContext, req: RequestTimeline | None, t: int, device: int) -> dict[str, int]:
        """Allocator state at the OOM: the AT_OOM reading, else the nearest earlier sample."""
        if req is not None:
            r = req.reading(schema.ReadingLabel.AT_OOM)
            if r is not None and int(r["allocated_bytes"]) >= 0:
                return {"allocated": int(r["allocated_bytes"]), "reserved": int(r["reserved_bytes"]),
                        "split": int(r["inactive_split_bytes"])}
        a = ctx.allocator
        if a.size:
            a = a[(a["device"] == device) & (a["t_ns"] <= t)]
            if a.size:
                last = a[int(np.argmax(a["t_ns"]))]
                return {"allocated": int(last["allocated_bytes"]), "reserved": int(last["reserved_bytes"]),
                        "split": int(last["inactive_split_bytes"])}
        return {"allocated": -1, "reserved": -1, "split": -1}
