"""Sampled tensors through a real TraceWriter and back through Trace.payload: bit-exact for every
dtype, with the selection (heads, last tokens, query groups, latents) described in the index."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from kvtrace.format import CacheDType, EventKind, PayloadKind, TraceWriter, open_trace  # noqa: E402
from kvtrace.recorder.sampling import PayloadSampler, SamplingSettings  # noqa: E402

BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(BITS[t.element_size()]).numpy().view(f"u{t.element_size()}")


def _random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Every bit pattern is fair game (NaN payloads, infinities, -0.0, subnormals)."""
    gen = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(-(2 ** 15), 2 ** 15, shape, generator=gen, dtype=torch.int32)
    if size == 1:
        return (raw & 0xFF).to(torch.uint8).view(dtype)
    if size == 2:
        return raw.to(torch.int16).view(dtype)
    hi = torch.randint(-(2 ** 15), 2 ** 15, shape, generator=gen, dtype=torch.int32)
    return ((hi << 16) | (raw & 0xFFFF)).view(dtype)


def _record(tmp_path, settings: SamplingSettings, submits) -> tuple[list, dict]:
    path = tmp_path / "s.kvt.h5"
    with TraceWriter(path) as writer:
        sampler = PayloadSampler(writer, settings)
        accepted = [sampler.submit(*args, **kwargs) for args, kwargs in submits]
        stats = sampler.close()
    with open_trace(path) as trace:
        payloads = [trace.payload(i) for i in range(trace.nrows("payloads/index"))]
        events = trace.events[:]
        readings = trace.readings[:]
    payloads.sort(key=lambda p: (p.step, p.layer, int(p.kind)))
    return payloads, {"accepted": accepted, "stats": stats, "events": events, "readings": readings}


DTYPES = [
    (torch.float32, CacheDType.FLOAT32),
    (torch.float16, CacheDType.FLOAT16),
    (torch.bfloat16, CacheDType.BFLOAT16),
    (torch.float8_e4m3fn, CacheDType.FLOAT8_E4M3FN),
    (torch.float8_e5m2, CacheDType.FLOAT8_E5M2),
    (torch.int8, CacheDType.INT8),
]


@pytest.mark.parametrize(("dtype", "code"), DTYPES, ids=[str(d[0]) for d in DTYPES])
def test_every_dtype_round_trips_bit_exactly(tmp_path, dtype, code) -> None:
    k = _random_bits((2, 3, 5, 8), dtype, seed=1)
    v = _random_bits((2, 3, 5, 8), dtype, seed=2)
    settings = SamplingSettings(every_n_steps=1)
    submits = [((0, 0, 1, PayloadKind.KEY, k), {}), ((0, 0, 1, PayloadKind.VALUE, v), {"token_start": 11})]
    payloads, info = _record(tmp_path, settings, submits)
    assert info["accepted"] == [True, True]
    assert info["stats"]["written"] == 2 and info["stats"]["dropped"] == 0
    assert [p.kind for p in payloads] == [PayloadKind.KEY, PayloadKind.VALUE]
    for p, src, start in zip(payloads, (k, v), (0, 11), strict=True):
        assert p.dtype == code
        assert p.shape == (2, 3, 5, 8)
        assert (p.head_start, p.head_stride, p.token_start) == (0, 1, start)
        np.testing.assert_array_equal(p.data.view(f"u{src.element_size()}").reshape(p.shape), _bits(src))
    if dtype in (torch.float32, torch.float16, torch.bfloat16):  # and the reader widens them right
        np.testing.assert_array_equal(payloads[0].to_float32(), k.float().numpy())
    # CPU-only run: the sampler allocated nothing on any device, and says so.
    assert info["stats"]["own_device_bytes"] == 0


def test_bf16_special_values_survive(tmp_path) -> None:
    special = torch.tensor([0x7FC1, 0xFFFF, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x7F7F], dtype=torch.int32)
    t = special.to(torch.int16).view(torch.bfloat16).reshape(1, 1, 7, 1)
    payloads, _ = _record(tmp_path, SamplingSettings(every_n_steps=1), [((0, 0, 0, PayloadKind.KEY, t), {})])
    np.testing.assert_array_equal(payloads[0].data, special.numpy().astype(np.uint16))


def test_head_and_token_selection(tmp_path) -> None:
    k = torch.arange(2 * 6 * 10 * 4, dtype=torch.float32).reshape(2, 6, 10, 4)
    q = torch.randn(2, 12, 10, 4)  # 2 query heads per KV head
    latent = torch.randn(2, 1, 10, 32)  # MLA c_KV: shared by every head, never head-selected
    settings = SamplingSettings(every_n_steps=1, heads=[1, 3, 5], max_tokens=4, queries=True)
    payloads, info = _record(tmp_path, settings, [
        ((0, 2, 0, PayloadKind.KEY, k), {"token_start": 100}),
        ((0, 2, 1, PayloadKind.QUERY, q), {"token_start": 100, "group_size": 2}),
        ((0, 2, 2, PayloadKind.LATENT, latent), {}),
    ])
    key, query, lat = payloads
    assert key.shape == (2, 3, 4, 4)
    assert (key.head_start, key.head_stride, key.token_start) == (1, 2, 106)
    np.testing.assert_array_equal(key.to_float32(), k[:, 1::2, 6:].numpy())
    # A strided KV-head selection does not map onto an evenly spaced query-head set: all kept.
    assert query.shape == (2, 12, 4, 4) and (query.head_start, query.head_stride) == (0, 1)
    np.testing.assert_array_equal(query.to_float32(), q[:, :, 6:].numpy())
    assert lat.shape == (2, 1, 4, 32) and lat.token_start == 6
    np.testing.assert_array_equal(lat.to_float32(), latent[:, :, 6:].numpy())


def test_query_heads_follow_contiguous_kv_head_selection(tmp_path) -> None:
    q = torch.randn(1, 8, 3, 4)  # 4 KV heads x 2
    settings = SamplingSettings(every_n_steps=1, heads=[1, 2], queries=True)
    payloads, _ = _record(tmp_path, settings, [((0, 0, 0, PayloadKind.QUERY, q), {"group_size": 2})])
    (p,) = payloads
    assert (p.head_start, p.head_stride, p.shape) == (2, 1, (1, 4, 3, 4))
    np.testing.assert_array_equal(p.to_float32(), q[:, 2:6].numpy())


def test_selection_filters_and_settings(tmp_path) -> None:
    t = torch.ones(1, 2, 3, 4)
    settings = SamplingSettings(every_n_steps=4, layers=[1], heads=[5])
    _, info = _record(tmp_path, settings, [
        ((0, 0, 0, PayloadKind.KEY, t), {}),  # layer not selected
        ((0, 0, 1, PayloadKind.QUERY, t), {}),  # queries not asked for
        ((0, 0, 1, PayloadKind.KEY, t), {}),  # head 5 does not exist in a 2-head tensor
        ((0, 0, 1, PayloadKind.KEY, torch.ones(2, 2, dtype=torch.complex64)), {}),  # unsupported dtype
    ])
    assert info["accepted"] == [False, False, False, False]
    assert info["stats"]["written"] == 0 and info["stats"]["skipped"] == 2
    (note,) = info["events"][info["events"]["kind"] == int(EventKind.NOTE)]
    assert note["value"] == 2

    with TraceWriter(tmp_path / "w.kvt.h5") as writer:
        off = PayloadSampler(writer, SamplingSettings())
        assert not off.enabled
        assert not off.wants(0, is_prefill=True, is_last=False)
        off.close()
        on = PayloadSampler(writer, SamplingSettings(every_n_steps=4, at_prefill_end=False))
        chosen = [s for s in range(1, 11) if on.wants(s, is_prefill=False, is_last=s == 10)]
        assert chosen == [4, 8, 10]
        assert not on.wants(0, is_prefill=True, is_last=False)
        on.close()
    for bad in (dict(every_n_steps=-1), dict(queue_size=0), dict(heads=[0, 1, 3]), dict(max_tokens=0),
                dict(level=0), dict(layers=[-1])):
        with pytest.raises(ValueError):
            SamplingSettings(**bad)
    assert SamplingSettings(heads=[4, 0, 2]).head_range() == (0, 2, 3)


def test_no_reference_to_the_cache_tensor_survives_submit(tmp_path) -> None:
    with TraceWriter(tmp_path / "r.kvt.h5") as writer:
        sampler = PayloadSampler(writer, SamplingSettings(every_n_steps=1))
        cache = torch.randn(1, 2, 16, 8)
        expected = cache.clone()
        ref = weakref.ref(cache)
        assert sampler.submit(0, 0, 0, PayloadKind.KEY, cache)
        cache.zero_()  # the model goes on mutating its cache: the sample must not see it
        del cache
        gc.collect()
        assert ref() is None
        sampler.close()
    with open_trace(tmp_path / "r.kvt.h5") as trace:
        np.testing.assert_array_equal(trace.payload(0).to_float32(), expected.numpy())


def test_failed_writes_are_counted_and_recorded(tmp_path) -> None:
    path = tmp_path / "f.kvt.h5"
    with TraceWriter(path) as writer:
        sampler = PayloadSampler(writer, SamplingSettings(every_n_steps=1))

        def broken(payload):
            raise OSError("disk full")

        writer.write_payload = broken  # instance attribute shadows the method
        assert sampler.submit(0, 0, 0, PayloadKind.KEY, torch.ones(1, 1, 2, 2))
        stats = sampler.close()
        del writer.write_payload
    assert stats["failed"] == 1 and stats["written"] == 0
    with open_trace(path) as trace:
        errors = trace.events.where(kind=EventKind.RECORDER_ERROR)
        assert len(errors) == 1 and errors[0]["value"] == 1
        assert "disk full" in trace.text(int(errors[0]["text_off"]), int(errors[0]["text_len"]))


@given(
    shape=st.tuples(st.integers(1, 2), st.integers(1, 6), st.integers(1, 9), st.integers(1, 3)),
    start=st.integers(0, 6), stride=st.integers(1, 3), count=st.integers(1, 4),
    max_tokens=st.one_of(st.none(), st.integers(1, 10)), token_start=st.integers(0, 50),
)
def test_selection_matches_plain_indexing(shape, start, stride, count, max_tokens, token_start) -> None:
    heads = [start + i * stride for i in range(count)]
    sampler = PayloadSampler(None, SamplingSettings(every_n_steps=1, heads=heads, max_tokens=max_tokens),
                             workers=1)
    try:
        data = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
        view, h0, hs, t0 = sampler._select(torch.from_numpy(data), PayloadKind.KEY, token_start, None)
    finally:
        sampler.close()
    kept_heads = [h for h in heads if h < shape[1]]
    if not kept_heads:
        assert view is None
        return
    keep_t = shape[2] if max_tokens is None else min(shape[2], max_tokens)
    expected = data[:, kept_heads][:, :, shape[2] - keep_t:]
    np.testing.assert_array_equal(view.numpy(), expected)
    assert h0 == kept_heads[0] and (hs == stride or len(kept_heads) == 1)
    assert [h0 + i * hs for i in range(view.shape[1])] == kept_heads
    assert t0 == token_start + shape[2] - keep_t
