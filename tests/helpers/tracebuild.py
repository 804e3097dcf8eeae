"""The test trace builder: synthetic traces written with the real TraceWriter, rows built by
name with the schema's row types (kvtrace.format.schema.RequestRow, KvRow, ...).

Three scenario families, one module (they were three builders: tests/format/fmt_helpers.py,
tests/helpers/synth_trace.py, tests/helpers/synth.py, which now re-export from here):

- **minimal** (:func:`write_minimal`, :func:`request_row`, :func:`zero_row`): the smallest valid
  trace, for format tests.
- **report** (:func:`write_synthetic_trace`): a tiny hybrid qwen3 config (sliding, full, sliding,
  full; window 8; 2 KV heads of 16; bf16), KV rows following the transformers cache rules
  kvtrace.geometry implements, so an honest report finds measured == expected. Memory numbers are
  internally consistent (allocated = weights + KV + residual; reserved rounded up to 2 MiB
  segments; NVML = reserved + context) and every knob that should show up in a picture or a data
  card is a parameter. The device is called "Synthetic GPU" so that nobody mistakes this data
  for a measurement.
- **analyser** (:class:`SynthTrace`, :class:`Req`, :func:`build`): rows shaped exactly like the
  recorder's, computed from any config with kvtrace.geometry, with knobs to plant a defect. (The
  planted-pathology suite uses the real recorder; these traces test detector logic in isolation
  and run in milliseconds.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtrace import geometry as geo
from kvtrace.format import DeviceInfo, TraceWriter, encode_payload, schema

# ---- minimal ------------------------------------------------------------------------------------


def zero_row(dtype: np.dtype) -> tuple:
    return np.zeros((), dtype=dtype).item()


def request_row(request: int, outcome: int = schema.Outcome.RUNNING) -> tuple:
    return schema.RequestRow(request=request, outcome=int(outcome), batch_size=1, prompt_tokens=0,
                             new_tokens=0, eos_step=-1, start_ns=0, end_ns=0, prompt_sha256=b"0" * 64)


def write_minimal(path: Path, **writer_kwargs) -> None:
    with TraceWriter(path, {"model_id": "test/minimal", "model_type": "llama"},
                     [DeviceInfo(-1, "cpu", -1)], **writer_kwargs) as w:
        w.begin_request(request_row(0))
        w.update_request(0, outcome=int(schema.Outcome.OK), new_tokens=3)


# ---- report scenarios ---------------------------------------------------------------------------

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
        w.append("layers", schema.LayerRow(layer, int(lt), KV_HEADS, HEAD_DIM, HEAD_DIM,
                                           window=WINDOW if lt == schema.LayerType.SLIDING else -1))
    kv_now = 0
    kv_dev = [0] * devices

    def layer_device(layer: int) -> int:
        if cpu:
            return -1
        return 0 if devices == 1 else layer * devices // len(LAYER_TYPES)

    def telemetry() -> None:
        if cpu:
            w.append("telemetry/process", schema.ProcessRow(t, rss_bytes=HOST_RSS + kv_now + residual))
            return
        for d in range(devices):
            own = kv_dev[d] if devices > 1 else kv_now
            allocated = WEIGHTS + own + (residual if d == 0 else 0)
            reserved = -(-allocated // SEGMENT) * SEGMENT + SEGMENT
            w.append("telemetry/allocator", schema.AllocatorRow(
                t, d, allocated_bytes=allocated, reserved_bytes=reserved, active_bytes=allocated,
                inactive_split_bytes=SEGMENT // 4, num_alloc_retries=0, num_ooms=0))
            w.append("telemetry/nvml", schema.NvmlRow(
                t, d, used_bytes=CONTEXT + reserved, free_bytes=80 * 1024**3 - CONTEXT - reserved,
                reserved_bytes=CONTEXT // 2, total_bytes=80 * 1024**3,
                process_used_bytes=CONTEXT + reserved - 1024**2))

    def reading(request: int, label: schema.ReadingLabel) -> None:
        if cpu:
            w.append("readings", schema.ReadingRow(t, request, int(label), device=-1, allocated_bytes=-1,
                                                   reserved_bytes=-1, rss_bytes=HOST_RSS + kv_now + residual))
            return
        allocated = WEIGHTS + kv_now + residual
        reserved = -(-allocated // SEGMENT) * SEGMENT + SEGMENT
        w.append("readings", schema.ReadingRow(
            t, request, int(label), device=0, allocated_bytes=allocated, reserved_bytes=reserved,
            active_bytes=allocated, inactive_split_bytes=SEGMENT // 4, nvml_used_bytes=CONTEXT + reserved,
            nvml_process_used_bytes=CONTEXT + reserved - 1024**2))

    def event(kind: schema.EventKind, request: int, step: int = -1, value: int = 0, text: str = "") -> None:
        off, ln = w.add_text(text) if text else (0, 0)
        w.append("events", schema.EventRow(t, int(kind), request, step, layer=-1, device=-1, value=value,
                                           text_off=off, text_len=ln))

    for r in range(requests):
        p = prompt_tokens + 3 * r
        sha = f"{r:064x}".encode()
        toff, tlen = w.add_text(f"synthetic prompt {r}") if prompt_text else (0, 0)
        goff, glen = w.add_text(json.dumps({"max_new_tokens": new_tokens}))
        w.begin_request(schema.RequestRow(
            r, int(schema.Outcome.RUNNING), batch_size=1, prompt_tokens=p, new_tokens=0, eos_step=-1, start_ns=t,
            end_ns=0, prompt_sha256=sha, prompt_text_off=toff, prompt_text_len=tlen, gen_args_off=goff,
            gen_args_len=glen))
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
                kv_rows.append(schema.KvRow(
                    r, step, layer, int(lt), layer_device(layer), k_dtype=int(schema.CacheDType.BFLOAT16),
                    v_dtype=int(schema.CacheDType.BFLOAT16), k_shape=shape, v_shape=shape, tokens_seen=seen,
                    tokens_kept=k, bytes_allocated=alloc, bytes_valid=valid, bytes_unique=alloc,
                    k_storage=1000 + 2 * layer, v_storage=1001 + 2 * layer, k_storage_bytes=alloc // 2,
                    v_storage_bytes=alloc // 2, expanded_bytes=0, t_ns=t))
                total_valid += valid
                total_alloc += alloc
            w.append("kv", kv_rows)
            kv_now = total_alloc
            kv_dev = [sum(row.bytes_unique for row in kv_rows if row.device == d) for d in range(devices)]
            w.append("steps", schema.StepRow(
                r, step, int(schema.Phase.PREFILL if step == 0 else schema.Phase.DECODE), t, tokens_seen=seen,
                kv_bytes_naive=total_alloc, kv_bytes_unique=total_alloc, kv_bytes_valid=total_valid,
                allocated_bytes=-1 if cpu else WEIGHTS + kv_now + residual, reserved_bytes=-1, rss_bytes=-1))
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


# ---- analyser scenarios -------------------------------------------------------------------------

MiB = 1 << 20
GiB = 1 << 30

GPT_OSS_LIKE = {  # gpt-oss-120b KV geometry: 36 layers alternating sliding/full, 8 KV heads x 64, window 128
    "model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128, "vocab_size": 201088,
    "layer_types": ["sliding_attention", "full_attention"] * 18, "intermediate_size": 2880,
    "num_local_experts": 128, "num_experts_per_tok": 4,
}
LLAMA_LIKE = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "intermediate_size": 128,
}
MISTRAL_LIKE = {**LLAMA_LIKE, "model_type": "mistral", "sliding_window": 8}
GEMMA4_SHARED = {
    "model_type": "gemma4_text", "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32, "sliding_window": 8,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
    "num_kv_shared_layers": 3, "vocab_size": 256, "intermediate_size": 128,
}

_RECORDED = {
    "full": schema.LayerType.FULL, "sliding": schema.LayerType.SLIDING, "chunked": schema.LayerType.CHUNKED,
    "shared_consumer": schema.LayerType.SHARED_CONSUMER, "latent": schema.LayerType.LATENT,
}


@dataclass
class Req:
    prompt: int
    new: int
    batch: int = 1
    static_len: int | None = None  # a static cache of this many tokens
    layer_scale: dict[int, float] = field(default_factory=dict)  # planted duplication (valid + allocated)
    no_slide: set[int] = field(default_factory=set)  # sliding layers that keep everything
    arena: set[int] = field(default_factory=set)  # layers whose storage keeps every old copy
    retained: int = 0  # allocator bytes left after the request (GPU traces)
    retention_layers: list[int] = field(default_factory=list)  # KV still alive (all of these layers)
    referrers: str = "DynamicCache,GenerateDecoderOnlyOutput"
    peak_extra: int = 0  # transient above resident at the PEAK reading
    device_leak_per_step: int = 0  # allocator bytes added per decode step beyond the cache
    same_storage: tuple[int, ...] = ()  # layers whose K points at one storage (planted aliasing)
    outcome: schema.Outcome = schema.Outcome.OK
    oom_text: str = ""


class SynthTrace:
    def __init__(self, path: Path, config: dict[str, Any], *, dtype: schema.CacheDType = schema.CacheDType.BFLOAT16,
                 gpu: bool = False, total_memory: int = 80 * GiB, weights: int = 2 * GiB,
                 split_fn: Any = None, model_id: str = "synthetic") -> None:
        self.path = Path(path)
        self.config = config
        self.dtype = dtype
        self.item = schema.DTYPE_ITEMSIZE[dtype]
        self.gpu = gpu
        self.device = 0 if gpu else -1
        self.weights = weights
        self.split_fn = split_fn  # t_index -> inactive split bytes (GPU allocator samples)
        self.model = geo.model_geometry(config)
        sources = {
            "nvml": {"available": gpu, "reason": "" if gpu else "no CUDA device"},
            "allocator": {"available": gpu, "reason": "" if gpu else "no CUDA device"},
            "process_rss": {"available": True, "reason": ""},
            "cache_structure": {"available": True, "reason": ""},
        }
        dev = DeviceInfo(0, "NVIDIA H100 80GB HBM3", total_memory) if gpu else DeviceInfo(-1, "cpu", 16 * GiB)
        self.w = TraceWriter(self.path, {
            "model_id": model_id, "model_type": config["model_type"], "model_config_json": config,
            "sources_json": sources, "cuda_version": "12.8" if gpu else "unavailable",
        }, [dev])
        self.t = 1_000_000_000
        self.next_id = 0
        self._layers_written = False

    def _tick(self, ns: int = 1_000_000) -> int:
        self.t += ns
        return self.t

    def _write_layers(self) -> None:
        rows = []
        for g in self.model.decoder_layers:
            rows.append(schema.LayerRow(
                g.index, int(_RECORDED.get(g.kind, schema.LayerType.FULL)), g.num_kv_heads, g.k_head_dim,
                g.v_head_dim, window=g.window or -1,
                shared_from=g.shares_kv_with if g.shares_kv_with is not None else -1))
        self.w.append("layers", rows)
        self._layers_written = True

    def _event(self, t: int, kind: schema.EventKind, rid: int, step: int, *, value: int = 0,
               text: tuple[int, int] = (0, 0)) -> None:
        self.w.append("events", schema.EventRow(t, int(kind), rid, step, layer=-1, device=self.device, value=value,
                                                text_off=text[0], text_len=text[1]))

    def _reading(self, rid: int, label: schema.ReadingLabel, alloc: int, split: int = 0) -> None:
        if self.gpu:
            reserved = alloc + 64 * MiB + split
            self.w.append("readings", schema.ReadingRow(
                self._tick(), rid, int(label), device=0, allocated_bytes=alloc, reserved_bytes=reserved,
                active_bytes=alloc, inactive_split_bytes=split, nvml_used_bytes=reserved + 500 * MiB,
                nvml_process_used_bytes=reserved + 400 * MiB, rss_bytes=3 * GiB))
        else:
            self.w.append("readings", schema.ReadingRow(self._tick(), rid, int(label), device=-1, allocated_bytes=-1,
                                                        reserved_bytes=-1, rss_bytes=3 * GiB))

    def request(self, r: Req) -> int:
        if not self._layers_written:
            self._write_layers()
        rid = self.next_id
        self.next_id += 1
        start = self._tick()
        self.w.begin_request(schema.RequestRow(rid, int(schema.Outcome.RUNNING), batch_size=r.batch,
                                               prompt_tokens=r.prompt, new_tokens=0, eos_step=-1, start_ns=start,
                                               end_ns=0, prompt_sha256=b"0" * 64))
        base_alloc = self.weights + (self._retained_so_far if hasattr(self, "_retained_so_far") else 0)
        self._reading(rid, schema.ReadingLabel.BASELINE, base_alloc)
        self._event(self._tick(), schema.EventKind.REQUEST_START, rid, -1)
        seen = 0
        peak_resident = base_alloc
        arena_bytes: dict[int, int] = {}
        leak = 0
        n_steps = r.new if r.outcome != schema.Outcome.OOM else max(r.new // 2, 1)
        for step in range(n_steps):
            q = r.prompt if step == 0 else 1
            seen += q
            if step == 0:
                self._event(self._tick(), schema.EventKind.PREFILL_START, rid, 0)
            t = self._tick()
            naive = unique = valid_total = 0
            rows = []
            for g in self.model.decoder_layers:
                kind = "static" if r.static_len else "dynamic"
                layer = g.index
                if not g.stores_kv:
                    rtype = schema.LayerType.SHARED_CONSUMER
                    rows.append(schema.KvRow(rid, step, layer, int(rtype), self.device, int(self.dtype),
                                             int(self.dtype), [0, 0, 0, 0], [0, 0, 0, 0], tokens_seen=seen,
                                             tokens_kept=0, bytes_allocated=0, bytes_valid=0, bytes_unique=0,
                                             k_storage=0, v_storage=0, k_storage_bytes=0, v_storage_bytes=0,
                                             expanded_bytes=0, t_ns=t))
                    continue
                gg = g
                if layer in r.no_slide:
                    gg = geo.LayerGeometry(g.index, "full", "full", g.num_kv_heads, g.k_head_dim,
                                           g.v_head_dim, None, g.num_attention_heads)
                alloc, valid = geo.layer_kv_bytes(gg, seen, self.item, r.batch, kind, r.static_len,
                                                  last_step_tokens=q)
                kept = geo.kept_tokens(gg, seen, kind, r.static_len)
                scale = r.layer_scale.get(layer, 1.0)
                alloc, valid = int(alloc * scale), int(valid * scale)
                if layer in r.arena:
                    arena_bytes[layer] = arena_bytes.get(layer, 0) + alloc
                    alloc = arena_bytes[layer]
                if r.static_len:
                    rtype = schema.LayerType.STATIC_SLIDING if g.window else schema.LayerType.STATIC
                else:
                    rtype = _RECORDED.get(g.kind, schema.LayerType.FULL)
                klen = geo.allocated_tokens(gg, seen, kind, r.static_len, last_step_tokens=q)
                kshape = [r.batch, g.num_kv_heads, klen, g.k_head_dim]
                vshape = [r.batch, g.num_kv_heads, klen, g.v_head_dim]
                kptr = 0x10000 + (rid * 1000 + layer) * 0x1000 + step * 0x10
                if layer in r.same_storage:
                    kptr = 0x900000 + step * 0x10
                rows.append(schema.KvRow(rid, step, layer, int(rtype), self.device, int(self.dtype), int(self.dtype),
                                         kshape, vshape, tokens_seen=seen, tokens_kept=kept, bytes_allocated=alloc,
                                         bytes_valid=valid, bytes_unique=alloc, k_storage=kptr, v_storage=kptr + 8,
                                         k_storage_bytes=alloc // 2, v_storage_bytes=alloc - alloc // 2,
                                         expanded_bytes=0, t_ns=t))
                naive += alloc
                unique += alloc
                valid_total += valid
            self.w.append("kv", rows)
            if step >= 1:
                leak += r.device_leak_per_step
            resident = base_alloc + unique + leak
            peak_resident = max(peak_resident, resident)
            phase = schema.Phase.PREFILL if step == 0 else schema.Phase.DECODE
            self.w.append("steps", schema.StepRow(
                rid, step, int(phase), t, tokens_seen=seen, kv_bytes_naive=naive, kv_bytes_unique=unique,
                kv_bytes_valid=valid_total, allocated_bytes=resident if self.gpu else -1,
                reserved_bytes=resident + 64 * MiB if self.gpu else -1, rss_bytes=3 * GiB))
            if self.gpu:
                split = int(self.split_fn(step)) if self.split_fn else 0
                self.w.append("telemetry/allocator", schema.AllocatorRow(
                    t, 0, allocated_bytes=resident, reserved_bytes=resident + 64 * MiB + split, active_bytes=resident,
                    inactive_split_bytes=split, num_alloc_retries=0, num_ooms=0))
            if step == 0:
                self._event(self._tick(), schema.EventKind.PREFILL_END, rid, 0)
            else:
                self._event(t, schema.EventKind.DECODE_STEP, rid, step, value=step)
        if r.outcome == schema.Outcome.OOM:
            off, ln = self.w.add_text(r.oom_text)
            t = self._tick()
            self._event(t, schema.EventKind.OOM, rid, n_steps, text=(off, ln))
            self._reading(rid, schema.ReadingLabel.AT_OOM, peak_resident, split=8 * GiB)
        self._reading(rid, schema.ReadingLabel.PEAK, peak_resident + r.peak_extra)
        self._reading(rid, schema.ReadingLabel.AFTER_RETURN, base_alloc + r.retained + 4096)
        self._reading(rid, schema.ReadingLabel.AFTER_GC, base_alloc + r.retained)
        self._reading(rid, schema.ReadingLabel.AFTER_EMPTY_CACHE, base_alloc + r.retained)
        for layer in r.retention_layers:
            off, ln = self.w.add_text(r.referrers)
            for j in range(2):
                self.w.append("retention", schema.RetentionRow(rid, layer, self.device, storage=0xABC000 + layer * 16 + j,
                                                               nbytes=4096, referrers_off=off, referrers_len=ln))
        self._retained_so_far = getattr(self, "_retained_so_far", 0) + r.retained
        end = self._tick()
        self.w.update_request(rid, outcome=int(r.outcome), new_tokens=n_steps, end_ns=end)
        return rid

    def close(self) -> Path:
        self.w.close()
        return self.path


def build(path: Path, config: dict[str, Any], reqs: list[Req], **kw: Any) -> Path:
    s = SynthTrace(path, config, **kw)
    for r in reqs:
        s.request(r)
    return s.close()


def scores(report: Any) -> dict[str, float]:
    return {r.name: r.score for r in report.results}


def assert_clean(report: Any, bound: float = 0.1) -> None:
    bad = {r.name: (r.score, [f.message for f in r.findings if f.score > bound]) for r in report.results
           if r.score > bound or r.status == "error"}
    assert not bad, bad


