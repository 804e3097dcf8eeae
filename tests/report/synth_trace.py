"""Small synthetic traces for report and export tests, written with the real TraceWriter.

The geometry is a tiny hybrid qwen3 config (sliding, full, sliding, full; window 8; 2 KV heads of
16; bf16), and KV rows follow the transformers cache rules kvtrace.geometry implements, so an
honest report finds measured == expected. Memory numbers are internally consistent (allocated =
weights + KV + residual; reserved rounded up to 2 MiB segments; NVML = reserved + context) and
every knob that should show up in a picture or a data card is a parameter.
The device is called "Synthetic GPU" so that nobody mistakes this data for a measurement.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvtrace.format import DeviceInfo, TraceWriter, encode_payload, schema

CONFIG = {
    "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 256,
    "sliding_window": 8, "max_position_embeddings": 256,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
}
LAYER_TYPES = [schema.LayerType.SLIDING, schema.LayerType.FULL, schema.LayerType.SLIDING, schema.LayerType.FULL]
WINDOW = 8
KV_HEADS, HEAD_DIM, ITEMSIZE = 2, 16, 2
PER_TOKEN = KV_HEADS * 2 * HEAD_DIM * ITEMSIZE  # K and V, one layer, one sequence
WEIGHTS = 3 * 1024 * 1024
CONTEXT = 300 * 1024 * 1024
SEGMENT = 2 * 1024 * 1024
MS = 1_000_000
HOST_RSS = 500 * 1024 * 1024  # cpu=True: the process's resident memory besides KV and residual


def kept(layer: int, tokens: int) -> int:
    return min(tokens, WINDOW - 1) if LAYER_TYPES[layer] == schema.LayerType.SLIDING else tokens


def stored(layer: int, tokens: int, last_step_tokens: int) -> int:
    """Tokens the layer's storage spans: a sliding layer keeps a view into the tensor that
    concatenated its kept tokens with the last forward's (transformers DynamicSlidingWindowLayer)."""
    if LAYER_TYPES[layer] != schema.LayerType.SLIDING:
        return tokens
    q = min(last_step_tokens, tokens)
    return min(tokens - q, WINDOW - 1) + q


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def write_synthetic_trace(
    path: Path,
    *,
    requests: int = 2,
    prompt_tokens: int = 5,
    new_tokens: int = 12,
    residual_bytes: int = 0,
    payloads: bool = False,
    prompt_text: bool = False,
    dropped_samples: int = 0,
    recorder_error: str | None = None,
    telemetry_gap_ms: int = 0,
    unavailable: tuple[str, ...] = ("process",),
    kv_extra_bytes: int = 0,
    close: bool = True,
    model_id: str = "synthetic/tiny-qwen3-hybrid",
    devices: int = 1,
    cpu: bool = False,
) -> Path:
    """Write a trace; `residual_bytes` stays allocated after each request (a retention bug),
    `kv_extra_bytes` is added to every full layer's valid bytes (a measurement that disagrees
    with the geometry), `telemetry_gap_ms` inserts one pause in the NVML/allocator sampling,
    `devices=2` puts layers 2-3 on a second device (pipeline split) with its own telemetry.
    `cpu=True` is a CPU recording: device -1 named "cpu", no NVML or allocator, process RSS
    telemetry and readings (RSS = HOST_RSS + KV + residual)."""
    sources = {"nvml": {"available": True}, "allocator": {"available": True},
               "process": {"available": True}}
    if cpu:
        unavailable = tuple(u for u in unavailable if u != "process") + ("nvml", "allocator")
    for name in unavailable:
        sources[name] = {"available": False, "reason": f"{name} sampling disabled in this synthetic trace"}
    meta = {
        "model_id": model_id, "model_type": "qwen3", "model_config_json": CONFIG,
        "sources_json": sources, "contains_prompt_text": prompt_text,
        "contains_tensor_payloads": payloads, "torch_version": "2.11.0", "transformers_version": "5.17.0",
        "cuda_version": "12.8", "driver_version": "570.00",
        "recorder_settings_json": {"telemetry_interval_s": 0.001},
    }
    w = TraceWriter(path, meta, [DeviceInfo(-1, "cpu", 16 * 1024**3, "")] if cpu else
                    [DeviceInfo(d, "Synthetic GPU", 80 * 1024**3, f"GPU-synthetic-{d}") for d in range(devices)])
    anchor = w._file["meta"].attrs["clock_anchor_mono_ns"]  # noqa: SLF001 - reuse the writer's anchor
    t = int(anchor) + MS
    residual = 0
    rng = np.random.default_rng(0)
    for layer, lt in enumerate(LAYER_TYPES):
        w.append("layers", (layer, int(lt), KV_HEADS, HEAD_DIM, HEAD_DIM,
                            WINDOW if lt == schema.LayerType.SLIDING else -1, -1, 0, 0))
    kv_now = 0
    kv_dev = [0] * devices

    def layer_device(layer: int) -> int:
        if cpu:
            return -1
        return 0 if devices == 1 else layer * devices // len(LAYER_TYPES)

    def telemetry() -> None:
        if cpu:
            w.append("telemetry/process", (t, HOST_RSS + kv_now + residual))
            return
        for d in range(devices):
            own = kv_dev[d] if devices > 1 else kv_now
            allocated = WEIGHTS + own + (residual if d == 0 else 0)
            reserved = -(-allocated // SEGMENT) * SEGMENT + SEGMENT
            w.append("telemetry/allocator", (t, d, allocated, reserved, allocated, SEGMENT // 4, 0, 0))
            w.append("telemetry/nvml", (t, d, CONTEXT + reserved, 80 * 1024**3 - CONTEXT - reserved,
                                        CONTEXT // 2, 80 * 1024**3, CONTEXT + reserved - 1024**2))

    def reading(request: int, label: schema.ReadingLabel) -> None:
        if cpu:
            w.append("readings", (t, request, int(label), -1, -1, -1, -1, -1, -1, -1, HOST_RSS + kv_now + residual))
            return
        allocated = WEIGHTS + kv_now + residual
        reserved = -(-allocated // SEGMENT) * SEGMENT + SEGMENT
        w.append("readings", (t, request, int(label), 0, allocated, reserved, allocated, SEGMENT // 4,
                              CONTEXT + reserved, CONTEXT + reserved - 1024**2, -1))

    def event(kind: schema.EventKind, request: int, step: int = -1, value: int = 0, text: str = "") -> None:
        off, ln = w.add_text(text) if text else (0, 0)
        w.append("events", (t, int(kind), request, step, -1, -1, value, off, ln))

    for r in range(requests):
        p = prompt_tokens + 3 * r
        sha = f"{r:064x}".encode()
        toff, tlen = w.add_text(f"synthetic prompt {r}") if prompt_text else (0, 0)
        goff, glen = w.add_text(json.dumps({"max_new_tokens": new_tokens}))
        w.begin_request((r, int(schema.Outcome.RUNNING), 1, p, 0, -1, t, 0, sha, toff, tlen, goff, glen, 0, 0))
        event(schema.EventKind.REQUEST_START, r)
        reading(r, schema.ReadingLabel.BASELINE)
        telemetry()
        for step in range(new_tokens):
            if step == 0:
                event(schema.EventKind.PREFILL_START, r, 0)
            t += MS
            seen = p + step
            kv_rows = []
            total_valid = 0
            total_alloc = 0
            for layer, lt in enumerate(LAYER_TYPES):
                k = kept(layer, seen)
                extra = kv_extra_bytes if lt == schema.LayerType.FULL else 0
                valid = k * PER_TOKEN + extra
                alloc = stored(layer, seen, p if step == 0 else 1) * PER_TOKEN + extra
                shape = [1, KV_HEADS, k, HEAD_DIM]
                kv_rows.append((r, step, layer, int(lt), layer_device(layer), int(schema.CacheDType.BFLOAT16),
                                int(schema.CacheDType.BFLOAT16), shape, shape, seen, k, alloc, valid, alloc,
                                1000 + 2 * layer, 1001 + 2 * layer, alloc // 2, alloc // 2, 0, t))
                total_valid += valid
                total_alloc += alloc
            w.append("kv", kv_rows)
            kv_now = total_alloc
            kv_dev = [sum(row[13] for row in kv_rows if row[4] == d) for d in range(devices)]
            w.append("steps", (r, step, int(schema.Phase.PREFILL if step == 0 else schema.Phase.DECODE), t,
                               seen, total_alloc, total_alloc, total_valid,
                               -1 if cpu else WEIGHTS + kv_now + residual, -1, -1))
            telemetry()
            if step == 0:
                event(schema.EventKind.PREFILL_END, r, 0)
            if telemetry_gap_ms and r == 0 and step == new_tokens // 2:
                t += telemetry_gap_ms * MS  # the sampler stalls: no rows in this window
            if payloads and step == new_tokens - 1:
                _write_payloads(w, r, step, seen, rng, t)
        event(schema.EventKind.EOS, r, new_tokens - 1)
        t += MS
        event(schema.EventKind.GENERATE_RETURN, r)
        reading(r, schema.ReadingLabel.PEAK)
        reading(r, schema.ReadingLabel.AFTER_RETURN)
        kv_now = 0
        kv_dev = [0] * devices
        residual += residual_bytes
        t += MS
        event(schema.EventKind.GC, r)
        reading(r, schema.ReadingLabel.AFTER_GC)
        t += MS
        event(schema.EventKind.EMPTY_CACHE, r)
        reading(r, schema.ReadingLabel.AFTER_EMPTY_CACHE)
        telemetry()
        event(schema.EventKind.REQUEST_END, r)
        w.update_request(r, outcome=int(schema.Outcome.OK), new_tokens=new_tokens,
                         eos_step=new_tokens - 1, end_ns=t)
        t += MS
    if dropped_samples:
        event(schema.EventKind.DROPPED_SAMPLES, -1, value=dropped_samples)
    if recorder_error:
        event(schema.EventKind.RECORDER_ERROR, -1, text=recorder_error)
    if close:
        w.close()
    else:
        w.flush()
        w._stop.set()  # noqa: SLF001 - leave the file unclosed like a killed recorder
        w._file.close()  # noqa: SLF001
    return path


def _write_payloads(w: TraceWriter, r: int, step: int, seen: int, rng: np.random.Generator, t: int) -> None:
    """K and V of every layer (head 1 scaled x4 so its norm stands out) and Q of layers 1 and 3:
    query head 0 is all zeros (uniform attention, entropy exactly 1), query head 2 equals 10x
    the last key of KV head 1 (peaked attention)."""
    for layer in range(len(LAYER_TYPES)):
        k_tokens = kept(layer, seen)
        k = rng.standard_normal((1, KV_HEADS, k_tokens, HEAD_DIM)).astype(np.float32)
        k[:, 1] *= 4.0
        v = rng.standard_normal((1, KV_HEADS, k_tokens, HEAD_DIM)).astype(np.float32)
        v[:, 1] *= 4.0
        for kind, x in ((schema.PayloadKind.KEY, k), (schema.PayloadKind.VALUE, v)):
            w.write_payload(encode_payload(r, step, layer, kind, schema.CacheDType.BFLOAT16, _bf16_bits(x),
                                           token_start=seen - k_tokens, t_ns=t))
        if LAYER_TYPES[layer] == schema.LayerType.FULL:
            q = rng.standard_normal((1, 4, 1, HEAD_DIM)).astype(np.float32)
            q[:, 0] = 0.0
            # bf16 rounding of k is what the reader sees: build q from the rounded key
            k_rounded = (_bf16_bits(k).astype(np.uint32) << 16).view(np.float32)
            q[0, 2, 0] = 10.0 * k_rounded[0, 1, -1]
            w.write_payload(encode_payload(r, step, layer, schema.PayloadKind.QUERY, schema.CacheDType.BFLOAT16,
                                           _bf16_bits(q), t_ns=t))
