"""GPU-only checks of telemetry and sampling: NVML and allocator readings follow a real 256 MiB
allocation, the telemetry thread keeps its rate, and the GPU-shuffled pinned async copy path
stores exactly encode_payload's frames.

Run on the device:  python -m pytest tests/gpu/test_telemetry_gpu.py -m gpu -q -s
(-s shows the measured per-call costs; nothing here asserts a timing.)
"""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("zstandard", reason="the trace writer needs zstandard (carry it to the GPU host)")

from kvtrace.format import PayloadKind, TraceWriter, encode_payload, open_trace, schema  # noqa: E402
from kvtrace.recorder.sampling import PayloadSampler, SamplingSettings  # noqa: E402
from kvtrace.recorder.telemetry import Telemetry  # noqa: E402

MiB = 1 << 20
BLOCK = 256 * MiB


def _cost_us(fn, n: int = 200) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def test_nvml_and_allocator_follow_a_256_mib_allocation() -> None:
    torch.zeros(1, device="cuda")  # the CUDA context exists before the baseline reading
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    tel = Telemetry([0])
    src = tel.sources()
    assert src["allocator"]["available"], src["allocator"]
    assert src["nvml"]["available"], src["nvml"]
    assert tel.versions()["driver_version"] != "unavailable"
    (info,) = tel.device_infos()
    assert info.index == 0 and info.total_memory_bytes > 0 and info.uuid

    before = tel.reading(0)
    block = torch.ones(BLOCK, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    after = tel.reading(0)
    print(f"\nreading before: {before}\nreading after:  {after}")

    assert after["allocated_bytes"] - before["allocated_bytes"] >= BLOCK
    assert after["reserved_bytes"] >= after["allocated_bytes"]
    assert after["active_bytes"] >= BLOCK
    assert tel.step_reading(0) == (torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0))
    mem = tel._nvml.memory(tel._handles[0])
    assert 0 < mem.used <= mem.total and mem.used + mem.free <= mem.total
    assert mem.reserved >= 0  # the v2 struct reports it separately
    assert after["nvml_used_bytes"] - before["nvml_used_bytes"] >= BLOCK - 16 * MiB
    del block
    proc = after["nvml_process_used_bytes"]
    assert (proc == -1) == (not src["nvml"]["process_usage"])  # declared up front, not discovered
    if proc == -1:
        pytest.skip("NVML does not list this pid (container pid namespace): process usage stays -1")
    assert proc > 0
    assert proc - before["nvml_process_used_bytes"] >= BLOCK - 16 * MiB
    tel.close()


def test_thread_rate_and_costs(tmp_path) -> None:
    torch.cuda.init()
    rate, duration = 50.0, 1.0
    tel = Telemetry([0], rate_hz=rate)
    path = tmp_path / "tel.kvt.h5"
    with TraceWriter(path, devices=tel.device_infos()) as writer:
        tel.attach(writer)
        tel.start()
        time.sleep(duration)
        tel.stop()
    # Tick cost on a scratch writer: ticks appended here must not count as sampler rows.
    with TraceWriter(tmp_path / "scratch.kvt.h5", devices=tel.device_infos()) as scratch:
        tel.attach(scratch)
        tick = _cost_us(tel._tick, 50)
    step = _cost_us(lambda: tel.step_reading(0))
    full = _cost_us(lambda: tel.reading(0))
    flat = _cost_us(lambda: torch.cuda.memory_stats(0))
    print(f"\ncosts (us): telemetry tick {tick:.0f}, step_reading {step:.0f}, reading {full:.0f}, "
          f"torch.cuda.memory_stats {flat:.0f}")
    with open_trace(path) as trace:
        nvml, alloc = trace.nvml[:], trace.allocator[:]
    expected = rate * duration
    for rows in (nvml, alloc):
        assert 0.6 * expected <= len(rows) <= 1.2 * expected + 2, len(rows)
        assert (rows["device"] == 0).all()
    assert (nvml["used_bytes"] <= nvml["total_bytes"]).all()
    assert (alloc["reserved_bytes"] >= alloc["allocated_bytes"]).all()
    tel.close()


BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _random_bits(shape, dtype, seed):
    """Every bit pattern is fair game (NaN payloads, infinities, subnormals)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, size), generator=gen, device="cuda", dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def _staging_bytes(view) -> int:
    """Device bytes the sampler holds to stage one sample: a gather when the view is not
    contiguous (kvtrace.recorder.staging), else none."""
    return 0 if view.is_contiguous() else view.numel() * view.element_size()


def _stored_frames(path, row) -> list[bytes]:
    import h5py

    itemsize = int(row["itemsize"])
    chunk = schema.payload_chunk_elements(itemsize)
    first = int(row["first_chunk"])
    with h5py.File(path, "r") as f:
        ds = f[schema.payload_dataset_name(itemsize)]
        return [bytes(ds.id.read_direct_chunk(((first + i) * chunk,))[1]) for i in range(int(row["n_chunks"]))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32], ids=["bf16", "fp8", "fp32"])
def test_pinned_async_copy_is_bit_exact(tmp_path, dtype) -> None:
    """Copied to pinned memory, shuffled and compressed by the workers: the stored frames
    are encode_payload's frames for the values at submit time, whatever the view's layout."""
    cache = _random_bits((2, 8, 96, 64), dtype, seed=3)
    transposed = _random_bits((2, 8, 64, 96), dtype, seed=4).transpose(2, 3)  # rows not contiguous
    long = _random_bits((1, 4, 1100, 128), dtype, seed=5)  # several chunks, the last one partial
    exact = _random_bits((1, 8, 512, 64), dtype, seed=6)  # whole chunks only
    views = {
        "full": cache,
        "strided": cache[:, 1::2, -32:],
        "gather": transposed[:, 1::2, -32:],
        "long": long,
        "exact": exact,
    }
    expected = {name: v.clone() for name, v in views.items()}
    own = {name: _staging_bytes(v) for name, v in views.items()}
    del views
    settings = SamplingSettings(every_n_steps=1, heads=[1, 3, 5, 7], max_tokens=32)
    path = tmp_path / "copy.kvt.h5"
    with TraceWriter(path) as writer:
        full = PayloadSampler(writer, SamplingSettings(every_n_steps=1))
        picked = PayloadSampler(writer, settings)
        t0 = time.perf_counter()
        assert full.submit(0, 0, 0, PayloadKind.KEY, cache)  # in place (the KEY default)
        assert picked.submit(0, 0, 1, PayloadKind.KEY, cache, token_start=5)  # head + token selection
        assert picked.submit(0, 0, 2, PayloadKind.KEY, transposed)  # selection of a transposed layout
        assert full.submit(0, 0, 3, PayloadKind.VALUE, long, mutable=False)  # record_stream path
        assert full.submit(0, 0, 4, PayloadKind.VALUE, exact, mutable=True)
        submit_us = (time.perf_counter() - t0) / 5 * 1e6
        # The model writes its cache in place right after (static cache): the samples must
        # still hold the values at submit time. (Integer views: fill_ is not defined for fp8.)
        for t in (cache, transposed, exact):
            t.view(BITS[t.element_size()]).zero_()
        del long  # nobody writes it in place; its block may go to new work at once
        reuse = torch.empty((1, 4, 1100, 128), dtype=dtype, device="cuda")
        reuse.view(BITS[reuse.element_size()]).fill_(0)
        full_stats, picked_stats = full.close(), picked.close()
    print(f"\nsubmit: {submit_us:.0f} us each; own device bytes full {full_stats['own_device_bytes']}, "
          f"picked {picked_stats['own_device_bytes']}")
    assert full_stats["written"] == 3 and picked_stats["written"] == 2
    assert full_stats["own_device_bytes"] == max(own["full"], own["long"], own["exact"])
    assert picked_stats["own_device_bytes"] == max(own["strided"], own["gather"])
    assert picked.own_device_bytes_on(torch.cuda.current_device()) == picked_stats["own_device_bytes"]
    with open_trace(path) as trace:
        index = trace.payload_index[:]
        payloads = {int(trace.payload(i).layer): trace.payload(i) for i in range(len(index))}
    rows = {int(r["layer"]): r for r in index}
    for layer, name in enumerate(("full", "strided", "gather", "long", "exact")):
        p, src = payloads[layer], expected[name]
        assert p.shape == tuple(src.shape)
        want = src.contiguous().view(BITS[src.element_size()]).cpu().numpy()
        np.testing.assert_array_equal(p.data.reshape(p.shape), want.view(p.data.dtype), err_msg=name)
        frames = encode_payload(0, 0, layer, p.kind, p.dtype, want, level=SamplingSettings().level).frames
        assert _stored_frames(path, rows[layer]) == frames, name
    assert (payloads[1].head_start, payloads[1].head_stride, payloads[1].token_start) == (1, 2, 5 + 64)


def test_overlapping_copy_of_memory_freed_right_after_submit(tmp_path) -> None:
    """mutable=False (DynamicLayer K/V, queries): the main stream does not wait for the copy, so
    the source may be freed and its block requested again at once: the sample must not change."""
    path = tmp_path / "free.kvt.h5"
    expected = []
    with TraceWriter(path) as writer:
        sampler = PayloadSampler(writer, SamplingSettings(every_n_steps=1, queries=True))
        for layer in range(4):
            src = _random_bits((1, 8, 1024, 128), torch.bfloat16, seed=10 + layer)  # 2 MiB
            expected.append(src.view(torch.int16).cpu().numpy().view(np.uint16))
            kind = PayloadKind.QUERY if layer % 2 else PayloadKind.KEY
            assert sampler.submit(0, 0, layer, kind, src, mutable=None if layer % 2 else False)
            del src
            reuse = torch.empty((1, 8, 1024, 128), dtype=torch.bfloat16, device="cuda")
            reuse.fill_(0)  # would overwrite the block under the copy without record_stream
            del reuse
        stats = sampler.close()
    assert stats["written"] == 4
    with open_trace(path) as trace:
        got = {int(trace.payload(i).layer): trace.payload(i).data for i in range(4)}
    for layer in range(4):
        np.testing.assert_array_equal(got[layer].reshape(expected[layer].shape), expected[layer])


def test_query_capture_keeps_gpu_outputs_identical() -> None:
    from kvtrace.recorder.qcapture import QueryCapture
    from tests.helpers.models import tiny_model, tiny_prompt

    model = tiny_model("llama", dtype=torch.bfloat16).cuda()
    ids = tiny_prompt(9).cuda()
    gen = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    with torch.no_grad():
        before = model.generate(ids, **gen)
        shapes = []
        with QueryCapture(model, lambda layer, q: shapes.append(tuple(q.shape))) as qc:
            during = model.generate(ids, **gen)
        after = model.generate(ids, **gen)
    assert torch.equal(before, during) and torch.equal(before, after)
    assert qc.errors == 0 and shapes[0] == (1, 4, 9, 16)


def test_batched_staging_is_bit_exact(tmp_path) -> None:
    """A sampling step stages all its layers in one batch (one event per device closes every copy,
    so jobs reach the workers only when the batch closes); in-place memory overwritten right after the batch still yields the values at submit time, and
    memory freed right after the batch is not reused under the copy (record_stream)."""
    path = tmp_path / "batch.kvt.h5"
    tensors = [_random_bits((1, 4, 300 + 37 * i, 64), torch.bfloat16, seed=20 + i) for i in range(6)]
    expected = [t.view(torch.int16).cpu().numpy() for t in tensors]
    with TraceWriter(path) as writer:
        sampler = PayloadSampler(writer, SamplingSettings(every_n_steps=1))
        with sampler.batch():
            for i, t in enumerate(tensors):
                assert sampler.submit(0, 0, i, PayloadKind.KEY, t, mutable=i % 2 == 0)
            assert sampler.stats()["written"] == 0 and not sampler._jobs.qsize()  # held until the batch closes
            assert len(sampler._batch_jobs) == 6 and all(job.event is None for job, _ in sampler._batch_jobs)
        for i, t in enumerate(tensors):  # in place (even) or freed and reused (odd) right away
            if i % 2 == 0:
                t.view(torch.int16).zero_()
        reuse = [torch.zeros_like(t) for t in tensors[1::2]]
        del tensors[1::2]
        stats = sampler.close()
    assert stats["written"] == 6 and stats["own_device_bytes"] == 0
    with open_trace(path) as trace:
        got = {int(trace.payload(i).layer): trace.payload(i) for i in range(6)}
    for i, want in enumerate(expected):
        np.testing.assert_array_equal(got[i].data.reshape(want.shape), want.view(got[i].data.dtype))
    del reuse


def test_failed_copy_leaves_the_side_stream(tmp_path, monkeypatch) -> None:
    """A copy that fails after the side stream's context was entered is counted, and the model's
    thread is back on its own stream afterwards."""
    import kvtrace.recorder.staging as staging

    main = torch.cuda.current_stream()
    t = _random_bits((1, 4, 64, 64), torch.bfloat16, seed=30)
    with TraceWriter(tmp_path / "fail.kvt.h5") as writer:
        sampler = PayloadSampler(writer, SamplingSettings(every_n_steps=1))

        def boom(*a, **k):
            raise RuntimeError("pinned allocation failed")

        monkeypatch.setattr(staging.torch, "empty", boom)
        assert not sampler.submit(0, 0, 0, PayloadKind.KEY, t)
        monkeypatch.undo()
        assert torch.cuda.current_stream() == main
        stats = sampler.close()
    assert stats["failed"] == 1 and stats["written"] == 0
