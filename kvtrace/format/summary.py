"""What a trace holds, cheaply: counts from dataset shapes, a few small tables read. Privacy
answers come from the contents (payload rows and chunks, stored prompt text), not from /meta flags."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtrace.format import schema
from kvtrace.format.reader import Trace


def stopped(trace: Trace) -> dict[str, Any] | None:
    """Why the writer stopped early (spec §4.14, §8.1): {"errno", "reason", "stopped_ns"}, or
    None when it did not (or the trace predates /stop, or /stop is unreadable)."""
    try:
        ds = trace._file.get("stop")
        if ds is None or ds.shape != (1,) or ds.dtype != schema.STOP:
            return None
        row = ds[0]
    except (OSError, ValueError, KeyError, RuntimeError):
        return None
    if int(row["stopped_ns"]) == 0:
        return None
    return {"errno": int(row["errno"]), "reason": bytes(row["reason"]).decode("utf-8", errors="replace"),
            "stopped_ns": int(row["stopped_ns"])}


def summarize(trace: Trace) -> dict[str, Any]:
    """The info document; ``serving`` only for traces with continuous batching (older outputs unchanged)."""
    out = _summary(trace)
    sv = serving(trace)
    if sv is not None:
        out["serving"] = sv
    st = state(trace)
    if st is not None:
        out["state"] = st
    return out


def state(trace: Trace) -> dict[str, Any] | None:
    """Hybrid caches at a glance (1.5 /state, spec §4.18), or None when the trace holds no state:
    the (request, step) holding the most state, its bytes by kind, per sequence, and the KV beside it."""
    from kvtrace.format.state_rules import checked_state

    rows = checked_state(trace)
    if not rows.size:
        return None
    key = rows["request"].astype(np.int64) << 32 | rows["step"].astype(np.int64)
    keys, inverse = np.unique(key, return_inverse=True)
    totals = np.bincount(inverse, weights=rows["bytes_unique"].astype(np.float64))
    top = int(totals.size - 1 - np.argmax(totals[::-1]))  # the latest (request, step) holding the most
    at = rows[inverse == top]
    request, step = int(keys[top] >> 32), int(keys[top] & 0xFFFFFFFF)
    by_kind = {schema.StateKind(int(k)).name.lower(): int(at["bytes_unique"][at["kind"] == k].sum(dtype=np.uint64))
               for k in np.unique(at["kind"])}
    req = trace.requests[:]
    batch = req["batch_size"][req["request"] == request]
    batch_size = int(batch[0]) if batch.size and int(batch[0]) > 0 else 1
    steps = trace.steps.where(request=request)
    kv = steps["kv_bytes_unique"][steps["step"] == step]
    total = int(at["bytes_unique"].sum(dtype=np.uint64))
    return {
        "rows": int(rows.size),
        "layers": int(np.unique(at["layer"][at["layer"] >= 0]).size),
        "request": request, "step": step, "bytes": total, "by_kind": by_kind,
        "batch_size": batch_size, "bytes_per_sequence": total // batch_size,
        "kv_bytes": int(kv[0]) if kv.size else -1,
    }


def _summary(trace: Trace) -> dict[str, Any]:
    meta = trace.meta
    held = trace.stored_contents()
    requests = trace.requests[:]
    outcomes: dict[str, int] = {}
    for code in requests["outcome"]:
        name = schema.Outcome(int(code)).name.lower()
        outcomes[name] = outcomes.get(name, 0) + 1
    layers = trace.layers[:]
    layer_types: dict[str, int] = {}
    for code in layers["layer_type"]:
        name = schema.LayerType(int(code)).name.lower()
        layer_types[name] = layer_types.get(name, 0) + 1
    payload_bytes = trace.payload_stored_bytes()
    devices = [
        {"index": int(d["device"]), "name": d["name"].decode(errors="replace"),
         "total_memory_bytes": int(d["total_memory_bytes"])}
        for d in trace.devices[:]
    ]
    return {
        "path": str(trace.path),
        "format_version": trace.version,
        "complete": trace.complete,
        "stopped": stopped(trace),
        "file_bytes": trace.path.stat().st_size,
        "model": {"id": meta.model_id, "type": meta.model_type},
        "software": {
            "kvtrace": meta.kvtrace_version, "torch": meta.torch_version,
            "transformers": meta.transformers_version, "cuda": meta.cuda_version,
            "driver": meta.driver_version, "python": meta.python_version,
        },
        "devices": devices,
        "sources": meta.sources,
        # From the contents: a flag that says "not stored" is not believed over the data (spec §3).
        "contains_prompt_text": meta.contains_prompt_text or bool(held["prompt_text"]),
        "contains_tensor_payloads": meta.contains_tensor_payloads or bool(held["tensor_payloads"]),
        "privacy_flags": {"contains_prompt_text": meta.contains_prompt_text,
                          "contains_tensor_payloads": meta.contains_tensor_payloads},
        "privacy_mismatches": trace.privacy_mismatches(),
        "requests": {"count": int(requests.shape[0]), "outcomes": outcomes,
                     "new_tokens": int(np.sum(requests["new_tokens"], dtype=np.int64))},
        "layers": {"count": int(layers.shape[0]), "types": layer_types},
        # optional tables (the 1.4 continuous-batching ones) only where the trace has them
        "rows": {name: trace.nrows(name) for name, (_, required) in schema.TABLES.items()
                 if required or trace.has(name)},
        "payloads": {"count": trace.nrows("payloads/index"), "stored_bytes": payload_bytes,
                     "tokens": meta.payload_tokens},
    }


def serving(trace: Trace) -> dict[str, Any] | None:
    """Continuous batching at a glance (1.4 tables, spec §4.15), or None when the trace has none:
    steps, the pool, peak block- and token-level use, peak running/waiting, preemptions, prefix
    hits, evictions, and the load-test phases named in /events."""
    sched = trace.sched[:]
    phase_rows = trace.events.where(kind=schema.EventKind.PHASE) if trace.has("events") else np.zeros(0, schema.EVENTS)
    phases = [trace.text(int(e["text_off"]), int(e["text_len"])) for e in np.sort(phase_rows, order="t_ns")]
    if not sched.size and not phases:
        return None
    pool = sched["pool_bytes"].astype(np.int64)
    known = (pool > 0) & (sched["free_bytes"] >= 0)
    used = (pool - sched["free_bytes"])[known]
    valid = known & (sched["valid_bytes"] >= 0)
    return {
        "steps": int(sched.size),
        "managers": int(np.unique(sched["manager"]).size),
        "pool_bytes": int(pool.max()) if sched.size else -1,
        "peak_used_bytes": int(used.max()) if used.size else -1,
        "peak_block_usage": float((used / pool[known]).max()) if used.size else None,
        "peak_token_usage": float((sched["valid_bytes"][valid] / pool[valid]).max()) if valid.any() else None,
        "peak_running": int(sched["running"].max()) if sched.size else 0,
        "peak_waiting": int(sched["waiting"].max()) if sched.size else 0,
        "preemptions": _total(sched["preempted"]),
        "prefix_hit_tokens": _total(sched["prefix_hit_tokens"]),
        "evicted_blocks": _total(sched["evicted_blocks"]),
        "phases": phases,
    }


def _total(column: np.ndarray) -> int:
    """Σ of a count column, exact: past int64 in Python ints (eight steps of 2^62 prefix-hit tokens
    summed in int64 wrapped to 0)."""
    if float(column.astype(np.float64).sum()) < 2.0**62:
        return int(column.sum(dtype=np.int64))
    return sum(int(v) for v in column)
