"""Synthetic traces of one model spread over two GPUs by a device_map (layers 0-1 on cuda:0,
layers 2-3 on cuda:1), written with the real TraceWriter in the recorder's row shapes: one
labelled reading per device per label, allocator telemetry per device, KV rows on their layer's
device. Knobs plant what one device does differently. Synthetic: for detector logic only; the
recorder side of device_map is tested on real models (test_parallel_recorder, tests/gpu)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvtrace import geometry as geo
from kvtrace.format import DeviceInfo, TraceWriter, schema

GiB, MiB = 1 << 30, 1 << 20
CONFIG = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
          "num_key_value_heads": 4, "head_dim": 32, "intermediate_size": 512, "vocab_size": 256,
          "max_position_embeddings": 4096}
LAYER_DEVICE = {0: 0, 1: 0, 2: 1, 3: 1}
R = schema.ReadingLabel


@dataclass
class Plan:
    prompt: int = 512
    new: int = 16
    total: dict[int, int] = field(default_factory=lambda: {0: 80 * GiB, 1: 80 * GiB})
    resident: dict[int, int] = field(default_factory=lambda: {0: 10 * GiB, 1: 10 * GiB})  # weights etc.
    retained: dict[int, int] = field(default_factory=lambda: {0: 0, 1: 0})  # allocated bytes left after
    split: dict[int, int] = field(default_factory=lambda: {0: 0, 1: 0})  # persistent inactive split bytes
    layer_device: dict[int, int] = field(default_factory=lambda: dict(LAYER_DEVICE))  # -1: the CPU
    alive_layers: list[int] = field(default_factory=list)  # layers whose KV storages outlive the request
    oom_text: str = ""  # non-empty: the request ends OOM with this message (event recorded on cuda:0)
    parallel: dict | None = field(default_factory=lambda: {"mode": "device_map", "device_map": {
        "model.layers.0": "cuda:0", "model.layers.1": "cuda:0", "model.layers.2": "cuda:1",
        "model.layers.3": "cuda:1"}})


def write(path: Path, plan: Plan) -> Path:
    model = geo.model_geometry(CONFIG)
    meta = {"model_id": "synthetic/two-gpu", "model_type": "llama", "model_config_json": CONFIG,
            "sources_json": {"nvml": {"available": True, "reason": ""}, "allocator": {"available": True, "reason": ""},
                             "process_rss": {"available": True, "reason": ""},
                             "cache_structure": {"available": True, "reason": ""}},
            "cuda_version": "12.8", "recorder_settings_json": {"retention": True}}
    if plan.parallel is not None:
        meta["parallel_json"] = plan.parallel
    gpus = sorted({d for d in plan.layer_device.values() if d >= 0})
    devs = [DeviceInfo(d, "Synthetic GPU", plan.total[d]) for d in gpus]
    t = 1_000_000_000
    with TraceWriter(path, meta, devs) as w:
        w.append("layers", [schema.LayerRow(g.index, int(schema.LayerType.FULL), g.num_kv_heads, g.k_head_dim,
                                            g.v_head_dim, window=-1, shared_from=-1) for g in model.decoder_layers])
        w.begin_request(schema.RequestRow(0, int(schema.Outcome.RUNNING), batch_size=1, prompt_tokens=plan.prompt,
                                          new_tokens=0, eos_step=-1, start_ns=t, end_ns=0, prompt_sha256=b"0" * 64))

        def reading(label: R, alloc: dict[int, int]) -> None:
            nonlocal t
            for d in gpus:
                t += 1000
                res = alloc[d] + 64 * MiB + plan.split[d]
                w.append("readings", [schema.ReadingRow(t, 0, int(label), d, alloc[d], res, alloc[d], plan.split[d],
                                                        res + 500 * MiB, res + 400 * MiB, 3 * GiB)])

        reading(R.BASELINE, dict(plan.resident))
        seen = 0
        kv_on = {-1: 0, 0: 0, 1: 0}
        steps = plan.new if not plan.oom_text else plan.new // 2
        for step in range(steps):
            q = plan.prompt if step == 0 else 1
            seen += q
            t += 1_000_000
            rows, kv_on = [], {-1: 0, 0: 0, 1: 0}
            for g in model.decoder_layers:
                d = plan.layer_device[g.index]
                alloc, valid = geo.layer_kv_bytes(g, seen, 2, 1, "dynamic", None, last_step_tokens=q)
                klen = geo.allocated_tokens(g, seen, "dynamic", None, last_step_tokens=q)
                ptr = 0x10000 + g.index * 0x100000 + step * 0x10
                rows.append(schema.KvRow(0, step, g.index, int(schema.LayerType.FULL), d, 3, 3,
                                         [1, g.num_kv_heads, klen, g.k_head_dim], [1, g.num_kv_heads, klen, g.v_head_dim],
                                         seen, seen, alloc, valid, alloc, ptr, ptr + 8, alloc // 2, alloc - alloc // 2,
                                         0, t))
                kv_on[d] += alloc
            w.append("kv", rows)
            total_kv = sum(kv_on.values())
            w.append("steps", [schema.StepRow(0, step, int(schema.Phase.PREFILL if step == 0 else schema.Phase.DECODE),
                                              t, seen, total_kv, total_kv, total_kv,
                                              sum(plan.resident.values()) + total_kv,
                                              sum(plan.resident.values()) + total_kv + 128 * MiB, 3 * GiB)])
            for d in gpus:
                a = plan.resident[d] + kv_on[d]
                w.append("telemetry/allocator", [schema.AllocatorRow(t + d, d, a, a + 64 * MiB + plan.split[d], a,
                                                                     plan.split[d], 0, 0)])
            kind = schema.EventKind.PREFILL_END if step == 0 else schema.EventKind.DECODE_STEP
            w.append("events", [schema.EventRow(t, int(kind), 0, step, -1, 0, step, 0, 0)])
        outcome = schema.Outcome.OK
        if plan.oom_text:
            off, ln = w.add_text(plan.oom_text)
            t += 1000
            w.append("events", [schema.EventRow(t, int(schema.EventKind.OOM), 0, steps, -1, 0, 0, off, ln)])
            reading(R.AT_OOM, {d: plan.resident[d] + kv_on[d] for d in (0, 1)})
            outcome = schema.Outcome.OOM
        t += 1000
        w.append("events", [schema.EventRow(t, int(schema.EventKind.GENERATE_RETURN), 0, steps, -1, 0, 0, 0, 0)])
        reading(R.PEAK, {d: plan.resident[d] + kv_on[d] for d in (0, 1)})
        reading(R.AFTER_RETURN, {d: plan.resident[d] + plan.retained[d] for d in (0, 1)})
        reading(R.AFTER_GC, {d: plan.resident[d] + plan.retained[d] for d in (0, 1)})
        reading(R.AFTER_EMPTY_CACHE, {d: plan.resident[d] + plan.retained[d] for d in (0, 1)})
        if plan.alive_layers:
            off, ln = w.add_text("DynamicCache,GenerateDecoderOnlyOutput")
            w.append("retention", [schema.RetentionRow(0, layer, plan.layer_device[layer], 0xABC000 + layer * 16 + j,
                                                       128 * 1024, off, ln)
                                   for layer in plan.alive_layers for j in range(2)])
        for d in gpus:  # allocator samples after the request, split blocks still there
            t += 1000
            a = plan.resident[d] + plan.retained[d]
            w.append("telemetry/allocator", [schema.AllocatorRow(t, d, a, a + 64 * MiB + plan.split[d], a,
                                                                 plan.split[d], 0, 0)])
        w.update_request(0, outcome=int(outcome), new_tokens=steps, end_ns=t + 1000)
    return path
