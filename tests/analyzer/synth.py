"""Synthetic traces for analyser unit tests: rows shaped exactly like the recorder's, computed
from a config with kvtrace.geometry, with knobs to plant a defect. (The planted-pathology suite
uses the real recorder; these traces test detector logic in isolation and run in milliseconds.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtrace import geometry as geo
from kvtrace.format import DeviceInfo, TraceWriter, schema

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
            rows.append((g.index, int(_RECORDED.get(g.kind, schema.LayerType.FULL)), g.num_kv_heads,
                         g.k_head_dim, g.v_head_dim, g.window or -1,
                         g.shares_kv_with if g.shares_kv_with is not None else -1, 0, 0))
        self.w.append("layers", rows)
        self._layers_written = True

    def _reading(self, rid: int, label: schema.ReadingLabel, alloc: int, split: int = 0) -> None:
        if self.gpu:
            reserved = alloc + 64 * MiB + split
            self.w.append("readings", (self._tick(), rid, int(label), 0, alloc, reserved, alloc, split,
                                       reserved + 500 * MiB, reserved + 400 * MiB, 3 * GiB))
        else:
            self.w.append("readings", (self._tick(), rid, int(label), -1, -1, -1, -1, -1, -1, -1, 3 * GiB))

    def request(self, r: Req) -> int:
        if not self._layers_written:
            self._write_layers()
        rid = self.next_id
        self.next_id += 1
        start = self._tick()
        self.w.begin_request((rid, int(schema.Outcome.RUNNING), r.batch, r.prompt, 0, -1, start, 0,
                              b"0" * 64, 0, 0, 0, 0, 0, 0))
        base_alloc = self.weights + (self._retained_so_far if hasattr(self, "_retained_so_far") else 0)
        self._reading(rid, schema.ReadingLabel.BASELINE, base_alloc)
        self.w.append("events", (self._tick(), int(schema.EventKind.REQUEST_START), rid, -1, -1, self.device, 0, 0, 0))
        seen = 0
        peak_resident = base_alloc
        arena_bytes: dict[int, int] = {}
        leak = 0
        n_steps = r.new if r.outcome != schema.Outcome.OOM else max(r.new // 2, 1)
        for step in range(n_steps):
            q = r.prompt if step == 0 else 1
            seen += q
            if step == 0:
                self.w.append("events", (self._tick(), int(schema.EventKind.PREFILL_START), rid, 0, -1,
                                         self.device, 0, 0, 0))
            t = self._tick()
            naive = unique = valid_total = 0
            rows = []
            for g in self.model.decoder_layers:
                kind = "static" if r.static_len else "dynamic"
                layer = g.index
                if not g.stores_kv:
                    rtype = schema.LayerType.SHARED_CONSUMER
                    rows.append((rid, step, layer, int(rtype), self.device, int(self.dtype), int(self.dtype),
                                 [0, 0, 0, 0], [0, 0, 0, 0], seen, 0, 0, 0, 0, 0, 0, 0, 0, 0, t))
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
                rows.append((rid, step, layer, int(rtype), self.device, int(self.dtype), int(self.dtype),
                             kshape, vshape, seen, kept, alloc, valid, alloc, kptr, kptr + 8,
                             alloc // 2, alloc - alloc // 2, 0, t))
                naive += alloc
                unique += alloc
                valid_total += valid
            self.w.append("kv", rows)
            if step >= 1:
                leak += r.device_leak_per_step
            resident = base_alloc + unique + leak
            peak_resident = max(peak_resident, resident)
            phase = schema.Phase.PREFILL if step == 0 else schema.Phase.DECODE
            self.w.append("steps", (rid, step, int(phase), t, seen, naive, unique, valid_total,
                                    resident if self.gpu else -1, resident + 64 * MiB if self.gpu else -1,
                                    3 * GiB))
            if self.gpu:
                split = int(self.split_fn(step)) if self.split_fn else 0
                self.w.append("telemetry/allocator", (t, 0, resident, resident + 64 * MiB + split, resident,
                                                      split, 0, 0))
            if step == 0:
                self.w.append("events", (self._tick(), int(schema.EventKind.PREFILL_END), rid, 0, -1,
                                         self.device, 0, 0, 0))
            else:
                self.w.append("events", (t, int(schema.EventKind.DECODE_STEP), rid, step, -1, self.device, step, 0, 0))
        if r.outcome == schema.Outcome.OOM:
            off, ln = self.w.add_text(r.oom_text)
            t = self._tick()
            self.w.append("events", (t, int(schema.EventKind.OOM), rid, n_steps, -1, self.device, 0, off, ln))
            self._reading(rid, schema.ReadingLabel.AT_OOM, peak_resident, split=8 * GiB)
        self._reading(rid, schema.ReadingLabel.PEAK, peak_resident + r.peak_extra)
        self._reading(rid, schema.ReadingLabel.AFTER_RETURN, base_alloc + r.retained + 4096)
        self._reading(rid, schema.ReadingLabel.AFTER_GC, base_alloc + r.retained)
        self._reading(rid, schema.ReadingLabel.AFTER_EMPTY_CACHE, base_alloc + r.retained)
        for layer in r.retention_layers:
            off, ln = self.w.add_text(r.referrers)
            for j in range(2):
                self.w.append("retention", (rid, layer, self.device, 0xABC000 + layer * 16 + j, 4096, off, ln))
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


