"""oom: for every out-of-memory error, what was allocated, reserved and fragmented at that
instant, how much the failed allocation asked for, which limit it hit (the device, the caching
allocator's per-process cap from torch.cuda.set_per_process_memory_fraction, or the process's
RLIMIT_AS / cgroup memory.max on a CPU) and the likely cause (fragmentation, KV growth, a prefill
transient, or memory held outside the cache). CUDA OOMs come as oom events; a CPU allocator's
failure ("can't allocate memory") is recorded as an exception and recognised by its message.

The post-mortem: when the trace holds the owner reading taken at the failure (/owners moment oom,
format 1.5), the finding says who filled the device ("KV of request 3 61%, weights 22%, copies of KV
9%, unknown 4%"), and owners decide the cause where they can: KV of earlier requests still alive
(`oom_retained_kv`), copies of the cache (`oom_kv_copies`), the request's own KV (`oom_kv_growth`).

Continuous batching: transformers fails every request of a batch whose forward ran out; the serving
recorder writes one oom event for the manager (request -1, "manager N: ...; running requests 3, 4")
and the manager's owner reading, where the paged KV pool is KV of the running requests. One finding
names the manager, the step and those requests ("who held it: paged KV pool (2 running requests)
22%, ..."); the pool holding at least half of the allocated memory is `oom_paged_pool`.
"""

from __future__ import annotations

import re

import numpy as np

from kvtrace.analyzer import owners as own
from kvtrace.analyzer.base import Detector, Finding, ev, register
from kvtrace.analyzer.detectors._common import device_cap
from kvtrace.analyzer.replay import ReplayContext, RequestTimeline
from kvtrace.format import schema
from kvtrace.labels import device_where
from kvtrace.memory_errors import SIZE_TEXT, is_cpu_oom_text, named_gpu, requested_bytes, size_bytes
from kvtrace.units import format_bytes

_ALLOWED = re.compile(r"with\s+" + SIZE_TEXT + r"\s+allowed")
# A cap "binds" when it is below the device (or host) memory by more than rounding.
CAP_BELOW_TOTAL = 0.99
# An owner class named as the cause when it holds at least this share of allocated memory at the OOM.
OWNER_CAUSE_SHARE = 0.25
# The serving recorder's OOM event: "manager N: <error>; running requests 3, 4" (request -1)
_MANAGER = re.compile(r"manager (\d+): ")
_RUNNING = re.compile(r"; running requests ([\d, ]+)$")


def _nearest_after(rds: list[own.Reading], t: int) -> own.Reading | None:
    """The first reading taken at or after ``t`` (an event's readings follow it), else the last one."""
    after = [r for r in rds if r.t_ns >= t]
    return min(after, key=lambda r: r.t_ns) if after else (rds[-1] if rds else None)


def _running(pool: own.OwnerClass | None, text: str) -> list[int]:
    """The trace ids of the requests running when a continuous batch ran out: the pool reading's
    detail, else the event's text."""
    reqs = pool.detail.get("requests") if pool is not None else None
    if isinstance(reqs, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in reqs):
        return sorted(set(reqs))
    m = _RUNNING.search(text or "")
    return sorted({int(x) for x in m.group(1).split(",") if x.strip().isdigit()}) if m else []


def failed_device(ctx: ReplayContext, text: str, recorded: int) -> int:
    """The device an OOM happened on: the one torch's message names when the trace knows it (a
    model spread over GPUs fails on any of them; recorders before the fix stamped the model's
    first device), else the event's device."""
    named = named_gpu(text)
    if named is not None and named in ctx.gpu_devices:
        return named
    return recorded


def allowed_bytes(text: str) -> int | None:
    """The per-process cap torch's CUDA OOM message states ("..., with 819.20 MiB allowed")."""
    return size_bytes(_ALLOWED.search(text or ""))


def is_cpu_oom(text: str) -> bool:
    return is_cpu_oom_text(text)


@register
class Oom(Detector):
    name = "oom"
    needs = ("requests",)
    summary = "allocator state at each out-of-memory event and its likely cause"

    def run(self, ctx: ReplayContext) -> list[Finding]:
        out: list[Finding] = []
        events = ctx.events
        if events.size:
            oom_kind = events["kind"] == int(schema.EventKind.OOM)
            exc = np.flatnonzero(events["kind"] == int(schema.EventKind.EXCEPTION))
            for i in exc:  # a CPU allocator failure is an exception with a recognisable message
                if is_cpu_oom(ctx.trace.text(int(events["text_off"][i]), int(events["text_len"][i]))):
                    oom_kind[i] = True
            oom_events = events[oom_kind]
        else:
            oom_events = events
        handled: set[int] = set()
        for e in oom_events:
            rid = int(e["request"])
            req = next((r for r in ctx.requests if r.request == rid), None)
            text = ctx.trace.text(int(e["text_off"]), int(e["text_len"]))
            f = self._one(ctx, req, int(e["t_ns"]), int(e["step"]), text, failed_device(ctx, text, int(e["device"])))
            out.append(f)
            handled.add(rid)
            handled.update(f.requests)  # a continuous-batching OOM fails every request of its batch at once
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
        manager = _MANAGER.match(text) if req is None else None
        if req is not None:
            at_oom = own.merged([r for r in own.latest(ctx, req.request, schema.OwnerMoment.OOM) if r.device == device])
        else:  # continuous batching: the manager's reading (request -1) taken as the batch failed
            at_oom = _nearest_after([r for r in own.of_request(ctx, -1, schema.OwnerMoment.OOM)
                                     if r.device == device], t)
        pool = at_oom.classes.get(schema.Owner.KV_REQUEST) if at_oom is not None else None
        pool = pool if pool is not None and pool.detail.get("pool") == "paged" else None
        running = _running(pool, text) if manager is not None or pool is not None else []
        OW = schema.Owner  # noqa: N806
        owned = at_oom.allocated if at_oom is not None else 0
        if at_oom is not None and owned > 0 and at_oom.bytes(OW.KV_REQUEST):
            kv = at_oom.bytes(OW.KV_REQUEST)  # the allocator's blocks of the cache, at the failure
        gap = reserved - alloc if reserved >= 0 and alloc >= 0 else -1
        limit, limit_name, cap = self._limit(ctx, device, text, total)
        cap_hit = cap and want is not None and (
            (alloc >= 0 and alloc + want > limit) or (reserved >= 0 and reserved + want > limit)
            or device < 0)  # a CPU cap: the process's whole mapping counts, not only tensors
        if cap_hit and total and want is not None and want > total:
            cap_hit = False  # the request alone exceeds the device/host: the cap is not what stopped it
        if cap_hit:
            cause = (f"the {limit_name} of {format_bytes(limit)} was hit, not the "
                     f"{'device' if device >= 0 else 'host'}'s {format_bytes(total) if total else 'memory'}: "
                     "raise or remove the cap, or shrink the request")
            kind = "oom_memory_cap"
        elif want is not None and gap >= want:
            cause = (f"fragmentation: {format_bytes(gap)} was reserved but unallocated, yet no free block of "
                     f"{format_bytes(want)} existed ({format_bytes(max(split, 0))} in split blocks)")
            kind = "oom_fragmentation"
        elif at_oom is not None and owned > 0 and at_oom.bytes(OW.KV_EARLIER) >= OWNER_CAUSE_SHARE * owned:
            c = at_oom.classes[OW.KV_EARLIER]
            cause = (f"KV retained from earlier requests: {own.class_name(OW.KV_EARLIER, c)} still held "
                     f"{format_bytes(c.bytes)} ({c.bytes / owned:.0%} of allocated memory) when this one ran out "
                     "(see post_eos for what holds it)")
            kind = "oom_retained_kv"
        elif at_oom is not None and owned > 0 and at_oom.bytes(OW.KV_COPIES) >= OWNER_CAUSE_SHARE * owned:
            c = at_oom.classes[OW.KV_COPIES]
            cause = (f"copies of the KV cache: {c.blocks:,} blocks sized like its K/V, {format_bytes(c.bytes)} "
                     f"({c.bytes / owned:.0%} of allocated memory), outside the cache itself")
            kind = "oom_kv_copies"
        elif pool is not None:
            base = alloc if alloc > 0 else owned
            if base > 0 and pool.bytes >= 0.5 * base:
                cause = (f"the paged KV pool, preallocated when the manager started, held {format_bytes(pool.bytes)} "
                         f"({pool.bytes / base:.0%} of allocated memory) and the batch's forward found too little room "
                         "beside it: give the pool a smaller share (num_blocks, max_memory_percent) or the batch fewer "
                         "tokens (max_batch_tokens)")
                kind = "oom_paged_pool"
            else:
                cause = (f"memory outside the paged KV pool (the pool held {format_bytes(pool.bytes)} of "
                         f"{format_bytes(max(base, 0))} allocated)")
                kind = "oom_other"
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
        if not cap_hit and total and want is not None and want > total:
            cause += (f"; the failed allocation alone ({format_bytes(want)}) is larger than the "
                      f"{'device' if device >= 0 else 'host memory'} ({format_bytes(total)})")
        if req is not None:
            where = f"request {req.request}"
        elif manager is not None or pool is not None:
            where = f"continuous-batching manager {manager.group(1)}" if manager is not None else "continuous batching"
        else:
            where = "outside any request"
        if len(ctx.gpu_devices) > 1:  # a model spread over GPUs: say which one ran out
            where += f" on {device_where(device)}"
        at = f", step {step}" if step >= 0 else ""
        if running:
            at += f" (running request{'s' if len(running) > 1 else ''} {', '.join(map(str, running[:16]))}" \
                  f"{', ...' if len(running) > 16 else ''})"
        asked = f" asking for {format_bytes(want)}" if want is not None else ""
        held = (f"{format_bytes(alloc)} allocated, {format_bytes(reserved)} reserved, "
                f"{format_bytes(max(split, 0))} in split blocks" if alloc >= 0 else "allocator state not recorded")
        if alloc >= 0:
            dev_total = f" of {format_bytes(total)}" if total else ""
        else:  # a CPU trace: no allocator statistics, only the host's size
            held = "no allocator statistics on the CPU"
            dev_total = f"; host memory {format_bytes(total)}" if total else ""
        if cap and not cap_hit:
            dev_total += f"; {limit_name} {format_bytes(limit)} not reached"
        owners = ""
        if at_oom is not None and at_oom.classes:
            owners = f"; who held it: {own.describe(at_oom)}"
            sites = at_oom.largest_sites(OW.UNKNOWN, 2)
            if sites:
                owners += f" (largest unknown: {'; '.join(sites)})"
        msg = f"Out of memory in {where}{at}{asked} ({held}{dev_total}){owners}; likely cause: {cause}."
        evidence = {
            "allocated_bytes": ev(alloc if alloc >= 0 else None, "bytes"),
            "reserved_bytes": ev(reserved if reserved >= 0 else None, "bytes"),
            "inactive_split_bytes": ev(split if split >= 0 else None, "bytes"),
            "requested_bytes": ev(want, "bytes"),
            "kv_bytes": ev(kv, "bytes"),
            "device_memory_bytes": ev(total, "bytes"),
            "limit_bytes": ev(limit if cap else total, "bytes"),
            "cap_hit": ev(int(bool(cap_hit)), "count"),
        }
        if at_oom is not None:
            for o in OW:
                if o in at_oom.classes:
                    evidence[f"owner_{o.name.lower()}_bytes"] = ev(at_oom.classes[o].bytes, "bytes")
        return self.finding(kind, 1.0, msg, evidence=evidence,
                            requests=[req.request] if req is not None else running,
                            steps=[step] if step >= 0 else [], device=device)

    @staticmethod
    def _limit(ctx: ReplayContext, device: int, text: str, total: int | None) -> tuple[int, str, bool]:
        """(bytes, name, binding) of the tightest cap below the device or host memory."""
        limits = ctx.meta.sources.get("limits") if isinstance(ctx.meta.sources, dict) else None
        limits = limits if isinstance(limits, dict) else {}
        caps: list[tuple[int, str]] = []
        if device >= 0:
            allowed = allowed_bytes(text)
            entry = (limits.get("devices") or {}).get(str(device)) or {}
            frac = entry.get("per_process_memory_fraction")
            if allowed is None:
                allowed = device_cap(ctx, device)
            if allowed is not None:
                what = f"fraction {frac:g}" if isinstance(frac, (int, float)) else "set_per_process_memory_fraction"
                caps.append((allowed, f"per-process memory cap ({what})"))  # "... cap (fraction 0.05) of 4.0 GiB"
        else:
            proc = limits.get("process") or {}
            for key, name in (("rlimit_as_bytes", "process's RLIMIT_AS"), ("rlimit_data_bytes", "process's RLIMIT_DATA"),
                              ("cgroup_memory_max_bytes", "cgroup's memory.max")):
                v = proc.get(key)
                if isinstance(v, int) and v > 0:
                    caps.append((v, name))
        caps = [c for c in caps if not total or c[0] < CAP_BELOW_TOTAL * total]
        if not caps:
            return (total or -1), "device memory" if device >= 0 else "host memory", False
        b, name = min(caps)
        return b, name, True

    @staticmethod
    def _state(ctx: ReplayContext, req: RequestTimeline | None, t: int, device: int) -> dict[str, int]:
        """Allocator state at the OOM: the AT_OOM reading (a continuous-batching manager's: request -1,
        the first after the event), else the nearest earlier sample."""
        if req is not None:
            r = req.reading_at(schema.ReadingLabel.AT_OOM, device)
            r = r if r is not None else req.reading(schema.ReadingLabel.AT_OOM)
        else:
            rows = ctx.unattributed_readings
            rows = rows[(rows["label"] == int(schema.ReadingLabel.AT_OOM)) & (rows["device"] == device)
                        & (rows["t_ns"] >= t)] if rows.size else rows
            r = rows[int(np.argmin(rows["t_ns"]))] if rows.size else None
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
