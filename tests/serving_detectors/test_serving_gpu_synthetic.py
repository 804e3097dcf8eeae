"""The GPU-side serving judgements on synthetic 1.4 traces (written with the real TraceWriter): the
over-reserved pool and device usage need a GPU of known size, which the CPU recordings lack."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvtrace
from kvtrace.analyzer.base import Severity
from kvtrace.format import DeviceInfo, TraceWriter, schema

GiB = 1 << 30
TOTAL = 80 * GiB
BLOCK = 2 << 20  # 2 MiB blocks of 16 tokens


def _write(path: Path, *, pool: int, used: list[int], nvml_used: list[int] | None = None,
           reserved: list[int] | None = None, cached: int = 0) -> Path:
    """One manager, one full-attention group; `used` pool bytes per step in referenced blocks, `cached`
    bytes more in unreferenced cached prefix blocks (not free in the cache's own count); NVML samples
    per step."""
    with TraceWriter(path, {"model_id": "test/cb-gpu", "model_type": "llama"},
                     [DeviceInfo(0, "Synthetic GPU", TOTAL)]) as w:
        off, n = w.add_text(json.dumps({"cb_request_id": "req_0", "manager": 0, "max_new_tokens": 4}))
        w.begin_request(schema.RequestRow(request=0, outcome=int(schema.Outcome.OK), batch_size=1, prompt_tokens=16,
                                          new_tokens=len(used), eos_step=-1, start_ns=10, end_ns=10_000,
                                          prompt_sha256=b"0" * 64, gen_args_off=off, gen_args_len=n))
        for step, u in enumerate(used):
            t = 100 + 100 * step
            blocks = u // BLOCK
            kept = cached // BLOCK
            w.append("sched", schema.SchedRow(t, 0, step, 1, 16 if step == 0 else 0, 0 if step == 0 else 1, 1, 0, 0,
                                              256, pool, pool - u - cached, blocks * BLOCK, blocks, kept, 16 + step,
                                              0, 0, 0, 0))
            w.append("sched_groups", schema.SchedGroupRow(0, step, 0, int(schema.LayerType.FULL), 2, -1, 16, BLOCK,
                                                          pool // BLOCK, blocks, kept, pool // BLOCK - blocks - kept,
                                                          16 * blocks))
            w.append("blocks", [schema.BlockRow(0, step, 0, 0, blocks, 0, 16 * blocks)])
            if nvml_used is not None:
                w.append("telemetry/nvml", schema.NvmlRow(t, 0, nvml_used[step], TOTAL - nvml_used[step], 0, TOTAL, -1))
            if reserved is not None:
                w.append("telemetry/allocator", schema.AllocatorRow(t, 0, reserved[step], reserved[step], reserved[step],
                                                                    0, 0, 0))
    return path


def _finding(path: Path, detector: str):
    r = kvtrace.analyze(path).result(detector)
    assert r.status == "ran", r.reason
    (f,) = [f for f in r.findings if f.kind != "pool_usage"]
    return f


def test_over_reserved_pool_on_a_gpu(tmp_path):
    # a 60 GiB pool (75% of the device) of which at most 4 GiB ever held blocks: 93% never used
    f = _finding(_write(tmp_path / "over.kvt.h5", pool=60 * GiB, used=[2 * GiB, 4 * GiB, 3 * GiB]), "over_reservation")
    assert f.evidence["never_used_share"].value == pytest.approx(1 - 4 / 60, abs=1e-4)
    assert f.evidence["pool_share_of_device"].value == 0.75 and f.device == 0
    assert f.severity == Severity.HIGH  # never critical: the room may be a burst's headroom


def test_pool_sized_to_the_load_is_info(tmp_path):
    f = _finding(_write(tmp_path / "fit.kvt.h5", pool=60 * GiB, used=[40 * GiB, 50 * GiB, 45 * GiB]), "over_reservation")
    assert f.severity == Severity.INFO


def test_gpu_usage_counts_the_reserved_pool_as_free_room(tmp_path):
    # NVML sees 70 GiB used, 57-59 GiB of it the pool's free blocks: 11-13 GiB really in use (info)
    pool, used = 60 * GiB, [1 * GiB, 3 * GiB, 2 * GiB]
    nvml = [70 * GiB] * 3
    f = _finding(_write(tmp_path / "reserved.kvt.h5", pool=pool, used=used, nvml_used=nvml), "serving_capacity")
    assert f.kind == "gpu_usage" and f.severity == Severity.INFO
    assert f.evidence["used_without_free_pool_bytes"].value == 70 * GiB - (pool - 3 * GiB)


def test_cached_prefix_blocks_are_room_for_the_pool_and_the_gpu(tmp_path):
    # 4 GiB of the 60 GiB pool referenced, 40 GiB in cached prefix blocks (evicted on demand), 16 GiB free;
    # NVML 76 GiB: 20 GiB in use beside the pool's room (25%), not 60 GiB (75%)
    path = _write(tmp_path / "cached.kvt.h5", pool=60 * GiB, used=[4 * GiB] * 3, nvml_used=[76 * GiB] * 3,
                  cached=40 * GiB)
    report = kvtrace.analyze(path)
    by_kind = {f.kind: f for f in report.result("serving_capacity").findings}
    pool, gpu = by_kind["pool_usage"], by_kind["gpu_usage"]
    assert pool.evidence["held_block_usage"].value == pytest.approx(4 / 60, abs=1e-4)
    assert pool.evidence["cached_prefix_bytes_at_peak"].value == 40 * GiB and pool.severity == Severity.INFO
    assert gpu.evidence["used_without_free_pool_bytes"].value == 20 * GiB and gpu.severity == Severity.INFO
    # over_reservation counts cached blocks as used: they hold KV that later prompts reuse
    (over,) = report.result("over_reservation").findings
    assert over.evidence["max_used_bytes"].value == 44 * GiB


def test_gpu_near_full_outside_the_pool_is_critical(tmp_path):
    # the pool is nearly all in use and the device holds 76-77 GiB of 80 GiB: 95% held
    pool, used = 60 * GiB, [58 * GiB, 59 * GiB, 59 * GiB]
    nvml = [76 * GiB, 77 * GiB, 77 * GiB]
    f = _finding(_write(tmp_path / "full.kvt.h5", pool=pool, used=used, nvml_used=nvml), "serving_capacity")
    assert f.kind == "gpu_usage" and f.severity == Severity.CRITICAL
    assert f.evidence["held_usage"].value == pytest.approx((77 - 1) / 80, abs=1e-4)


def test_serving_detectors_run_without_torch(tmp_path):
    """The serving detectors are analyser code: numpy and the format only, no torch/transformers."""
    import subprocess
    import sys
    import textwrap

    path = _write(tmp_path / "nt.kvt.h5", pool=60 * GiB, used=[2 * GiB, 4 * GiB, 3 * GiB], nvml_used=[70 * GiB] * 3)
    code = textwrap.dedent(f"""
        import sys
        class _NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "transformers"):
                    raise ImportError(name + " is blocked for this test")
                return None
        sys.meta_path.insert(0, _NoTorch())
        import kvtrace
        r = kvtrace.analyze({str(path)!r})
        names = ("serving_capacity", "concurrency_headroom", "block_waste", "over_reservation")
        assert all(r.result(n).status == "ran" for n in names), [(x.name, x.status, x.reason) for x in r.results]
        assert "torch" not in sys.modules
        print("OK")
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "OK" in p.stdout, p.stderr[-2000:]


def test_offloads_are_not_recomputation_and_waste_past_2_gib_is_critical(tmp_path):
    """An offload (OFFLOADED beside PREEMPTED) recomputes nothing: medium, not more. A 40 GiB pool
    with 2.5 GiB of block tails (6%) while 90% full reaches critical on the 2 GiB alert alone."""
    path = tmp_path / "off.kvt.h5"
    pool, block = 40 * GiB, BLOCK
    with TraceWriter(path, {"model_id": "test/cb-gpu", "model_type": "llama"},
                     [DeviceInfo(0, "Synthetic GPU", TOTAL)]) as w:
        off, n = w.add_text(json.dumps({"cb_request_id": "req_0", "manager": 0, "max_new_tokens": 4}))
        w.begin_request(schema.RequestRow(request=0, outcome=int(schema.Outcome.OK), batch_size=1, prompt_tokens=16,
                                          new_tokens=4, eos_step=-1, start_ns=10, end_ns=10_000,
                                          prompt_sha256=b"0" * 64, gen_args_off=off, gen_args_len=n))
        used_blocks = int(0.9 * pool) // block
        tail_tokens = (5 * GiB // 2) // (block // 16)  # 2.5 GiB of unfilled positions
        for step in range(3):
            t = 100 + 100 * step
            w.append("sched", schema.SchedRow(t, 0, step, 1, 0, 1, 1, 0, 0, 256, pool, pool - used_blocks * block,
                                              -1, used_blocks, 0, 16, 0, 0, 0, 1 if step == 1 else 0))
            w.append("sched_groups", schema.SchedGroupRow(0, step, 0, int(schema.LayerType.FULL), 2, -1, 16, block,
                                                          pool // block, used_blocks, 0, pool // block - used_blocks,
                                                          16 * used_blocks - tail_tokens))
            w.append("blocks", [schema.BlockRow(0, step, 0, 0, used_blocks, 0, 16 * used_blocks - tail_tokens)])
        w.append("events", schema.EventRow(150, int(schema.EventKind.PREEMPTED), 0, 1, -1, -1, 4096, 0, 0))
        w.append("events", schema.EventRow(151, int(schema.EventKind.OFFLOADED), 0, 1, -1, -1, 1 << 20, 0, 0))
    report = kvtrace.analyze(path)
    (pre,) = report.result("preemption").findings
    assert pre.evidence["offloads"].value == 1 and pre.evidence["tokens_recomputed"].value == 0
    assert pre.severity == Severity.MEDIUM
    (waste,) = report.result("block_waste").findings
    assert waste.evidence["waste_bytes"].value == 5 * GiB // 2
    assert waste.evidence["waste_share_of_pool"].value == pytest.approx(2.5 / 40, abs=1e-4)
    assert waste.severity == Severity.CRITICAL


def test_without_nvml_the_allocator_reserved_bytes_are_judged(tmp_path):
    # --no-nvml: the allocator reserved 78 GiB, the pool (60 GiB) nearly all in blocks: 96% of the device
    pool, used = 60 * GiB, [59 * GiB, 59 * GiB, 59 * GiB]
    f = _finding(_write(tmp_path / "alloc.kvt.h5", pool=pool, used=used, reserved=[78 * GiB] * 3), "serving_capacity")
    assert f.kind == "gpu_usage" and f.severity == Severity.CRITICAL and "allocator reserved" in f.message
    assert f.evidence["used_without_free_pool_bytes"].value == 77 * GiB
