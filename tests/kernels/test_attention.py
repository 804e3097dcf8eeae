"""Attention statistics: Triton (two passes) and chunked torch vs the materialising reference.

Tolerances (fp32 scores; exp/log in fp32; sums in different orders):
  entropy, norm_entropy: atol 1e-4, rtol 1e-4 (nats; entropies are at most ln(40) ~ 3.7 here)
  lse, row_max, log_z:   atol 1e-4, rtol 1e-5
  received mass:         atol 1e-4, rtol 1e-4 (masses are at most group * Tq = 160 here)
  reference vs float64 numpy: same tolerances.
Cases with huge scores (fp16 inputs near 6e4) compare LSE / row max relatively (rtol D * 6e-8,
the worst case of summing D equal-magnitude fp32 products in different orders) because the scores
themselves are ~1e10, where one fp32 ulp is ~1e3; entropy, log Z and mass keep the tight tolerances.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("hypothesis")  # the GPU image may lack it; test_gpu.py does not need it
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

torch = pytest.importorskip("torch")

from kvtrace.kernels import attention as A  # noqa: E402
from kvtrace.kernels.numpy_ref import attention_stats_numpy  # noqa: E402

TOL = {
    "row_max": dict(atol=1e-4, rtol=1e-5),
    "log_z": dict(atol=1e-4, rtol=1e-5),
    "entropy": dict(atol=1e-4, rtol=1e-4),
    "norm_entropy": dict(atol=1e-4, rtol=1e-4),
    "lse": dict(atol=1e-4, rtol=1e-5),
    "received": dict(atol=1e-4, rtol=1e-4),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


FIELDS = ("entropy", "norm_entropy", "lse", "row_max", "log_z", "received")


def _compare(got: A.AttentionStats, ref: A.AttentionStats, fields=FIELDS):
    for f in fields:
        g, r = getattr(got, f), getattr(ref, f)
        assert g.dtype == torch.float32, f
        assert g.shape == r.shape, (f, g.shape, r.shape)
        torch.testing.assert_close(g.cpu(), r.cpu(), **TOL[f], msg=lambda m, f=f: f"{f}: {m}")
    assert torch.equal(got.n_visible.cpu(), ref.n_visible.cpu())


@st.composite
def cases(draw):
    group = draw(st.sampled_from([1, 2, 4, 8]))
    hkv = 1 if group == 8 else draw(st.integers(1, 2))
    tq = draw(st.integers(1, 20))
    tk = draw(st.integers(1, 40))
    mode = draw(st.sampled_from(["default", "offset", "positions"]))
    kw = {}
    if mode == "offset":
        kw["q_offset"] = draw(st.integers(-3, tk + 3))
    elif mode == "positions":  # sampled queries: unsorted, repeated, out of range on both sides
        kw["q_positions"] = draw(st.lists(st.integers(-2, tk + 4), min_size=tq, max_size=tq))
    kw["causal"] = draw(st.booleans())
    kw["window"] = draw(st.one_of(st.none(), st.integers(1, tk + 3)))
    return dict(
        b=draw(st.integers(1, 2)), hkv=hkv, group=group, tq=tq, tk=tk,
        d=draw(st.sampled_from([64, 128, 256, 512])), dtype=draw(st.sampled_from(DTYPES)),
        temp=draw(st.sampled_from([1.0, 8.0])), splits=draw(st.integers(1, 3)),
        seed=draw(st.integers(0, 2**31 - 1)), kw=kw,
    )


def _make(c):
    g = torch.Generator().manual_seed(c["seed"])
    q = (torch.randn(c["b"], c["hkv"] * c["group"], c["tq"], c["d"], generator=g) * c["temp"]).to(c["dtype"])
    k = torch.randn(c["b"], c["hkv"], c["tk"], c["d"], generator=g).to(c["dtype"])
    return q, k


@pytest.mark.slow
@settings(max_examples=30, deadline=None, database=None)
@given(c=cases())
def test_triton_matches_reference(tri_device, c):
    q, k = _make(c)
    ref = A.attention_stats_reference(q, k, **c["kw"])
    got = A.attention_stats_triton(q.to(tri_device), k.to(tri_device), num_splits=c["splits"], **c["kw"])
    _compare(got, ref)
    # pass 2 alone, from the saved LSE
    for norm in ((got.lse,), (got.row_max, got.log_z)):
        mass = A.received_attention(q.to(tri_device), k.to(tri_device), *norm, backend="triton", **c["kw"])
        torch.testing.assert_close(mass.cpu(), ref.received, **TOL["received"])


@settings(max_examples=40, deadline=None, database=None)
@given(c=cases(), chunk=st.integers(1, 7))
def test_chunked_and_numpy_match_reference(c, chunk):
    q, k = _make(c)
    ref = A.attention_stats_reference(q, k, **c["kw"])
    _compare(A.attention_stats_chunked(q, k, chunk_size=chunk, **c["kw"]), ref)
    _compare(A.attention_stats(q, k, backend="torch", **c["kw"]), ref)
    npr = attention_stats_numpy(q.float().numpy(), k.float().numpy(), **c["kw"])
    for f in ("entropy", "norm_entropy", "lse", "received"):
        np.testing.assert_allclose(npr[f], getattr(ref, f).double().numpy(), **TOL[f], err_msg=f)
    for norm in ((ref.lse,), (ref.row_max, ref.log_z)):
        mass = A.received_attention(q, k, *norm, backend="torch", **c["kw"])
        torch.testing.assert_close(mass, ref.received, **TOL["received"])


def _backends(device):
    yield "reference", lambda q, k, **kw: A.attention_stats_reference(q, k, **kw)
    yield "triton", lambda q, k, **kw: A.attention_stats_triton(q.to(device), k.to(device), num_splits=2, **kw)


@pytest.mark.parametrize("window", [None, 5])
def test_uniform_attention_closed_form(tri_device, window):
    # q = 0: every visible key scores 0, p = 1/n, H = ln n, lse = ln n, norm = 1 (n > 1).
    q = torch.zeros(1, 4, 6, 64)
    k = torch.randn(1, 2, 30, 64)
    pos = [0, 1, 7, 29, 29, 12]
    n = A.visible_counts(torch.tensor(pos), 30, True, window).double()
    j = torch.arange(30)
    vis = (j[None] <= torch.tensor(pos)[:, None])
    if window:
        vis &= j[None] > torch.tensor(pos)[:, None] - window
    expect_mass = 2 * (vis.double() / n[:, None]).sum(0)  # group 2
    for name, fn in _backends(tri_device):
        st_ = fn(q, k, q_positions=pos, window=window)
        ln = torch.log(n).float()
        torch.testing.assert_close(st_.entropy[0, 0].cpu(), ln, atol=1e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(st_.lse[0, 3].cpu(), ln, atol=1e-5, rtol=1e-5, msg=name)
        expect_norm = torch.where(n > 1, torch.ones_like(n), torch.zeros_like(n)).float()
        torch.testing.assert_close(st_.norm_entropy[0, 1].cpu(), expect_norm, atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(st_.received[0, 1].cpu().double(), expect_mass, atol=1e-5, rtol=1e-5)


def test_no_visible_and_single_visible_keys(tri_device):
    q = torch.randn(1, 2, 4, 64)
    k = torch.randn(1, 1, 10, 64)
    pos = [-1, 0, 3, 15]  # nothing visible / only key 0 / window 1 -> one key / beyond the keys
    for name, fn in _backends(tri_device):
        s = fn(q, k, q_positions=pos, causal=True, window=None)
        assert s.n_visible.tolist() == [0, 1, 4, 10]
        assert torch.isneginf(s.lse[:, :, 0]).all(), name
        assert float(s.entropy[:, :, :2].abs().max()) == 0.0 and float(s.norm_entropy[:, :, :2].abs().max()) == 0.0
        # every query that sees something contributes total mass 1 per query head
        assert math.isclose(float(s.received.sum()), 2 * 3, rel_tol=1e-5), name
        w = fn(q, k, q_positions=pos, causal=True, window=1)
        assert w.n_visible.tolist() == [0, 1, 1, 0]
        assert float(w.entropy.abs().max()) == 0.0 and float(w.norm_entropy.abs().max()) == 0.0


@pytest.mark.parametrize("d", [64, 512])
def test_fp16_near_max_does_not_overflow(tri_device, d):
    # Scores ~4e10: far beyond fp16, fine in fp32. Equal scores -> uniform -> H = ln n exactly.
    q = torch.full((1, 2, 3, d), 6.0e4, dtype=torch.float16)
    k = torch.full((1, 1, 20, d), 6.0e4, dtype=torch.float16)
    s0 = 6.0e4 * 6.0e4 * d / math.sqrt(d)
    for name, fn in _backends(tri_device):
        st_ = fn(q, k, causal=False)
        assert torch.isfinite(st_.lse).all() and torch.isfinite(st_.entropy).all(), name
        torch.testing.assert_close(st_.entropy.cpu(), torch.full((1, 2, 3), math.log(20)), atol=1e-5, rtol=0)
        # fp32 sums of D products ~3.6e9 round differently per backend: worst case ~D ulps
        torch.testing.assert_close(st_.lse.cpu().double(), torch.full((1, 2, 3), s0 + math.log(20)).double(),
                                   rtol=d * 6e-8, atol=0)
        torch.testing.assert_close(st_.received.cpu(), torch.full((1, 1, 20), 2 * 3 / 20), atol=1e-5, rtol=1e-5)


def test_fp16_random_extremes_match_reference(tri_device):
    g = torch.Generator().manual_seed(3)
    q = ((torch.rand(1, 4, 7, 128, generator=g) * 2 - 1) * 6.0e4).half()
    k = ((torch.rand(1, 2, 33, 128, generator=g) * 2 - 1) * 6.0e4).half()
    ref = A.attention_stats_reference(q, k, window=9)
    got = A.attention_stats_triton(q.to(tri_device), k.to(tri_device), window=9, num_splits=3)
    assert torch.isfinite(got.lse).all()
    for f in ("lse", "row_max"):  # ~1e10: relative, with room for D-term fp32 summation order
        torch.testing.assert_close(getattr(got, f).cpu(), getattr(ref, f), rtol=128 * 6e-8, atol=0)
    _compare(got, ref, fields=("entropy", "norm_entropy", "log_z", "received"))


def test_large_scores_entropy_has_no_cancellation(tri_device):
    # Scores ~1e4 + O(1) spread: H = m + ln Z - S/Z would lose ~1e-3 to cancellation in fp32; the
    # max-relative form must stay close to float64 truth.
    g = torch.Generator().manual_seed(5)
    k = 1.0 + 0.05 * torch.randn(1, 1, 40, 64, generator=g)
    q = torch.full((1, 2, 4, 64), 1.0e4 / 8.0)  # s ~ 1e4 * (1 + small)
    truth = attention_stats_numpy(q.double().numpy(), k.double().numpy(), causal=False)
    for name, fn in _backends(tri_device):
        st_ = fn(q, k, causal=False)
        # fp32 scores near 1e4 carry ~5e-4 rounding each, which moves H by about that much
        np.testing.assert_allclose(st_.entropy.cpu().double().numpy(), truth["entropy"], atol=5e-3, err_msg=name)


def test_gqa_matches_repeated_kv():
    # Query head h reads KV head h // group (transformers' repeat_kv order).
    q = torch.randn(2, 8, 5, 64)
    k = torch.randn(2, 2, 17, 64)
    gqa = A.attention_stats_reference(q, k, window=6)
    mha = A.attention_stats_reference(q, k.repeat_interleave(4, dim=1), window=6)
    torch.testing.assert_close(gqa.entropy, mha.entropy)
    torch.testing.assert_close(gqa.received, mha.received.view(2, 2, 4, 17).sum(2))


def test_scale_and_defaults():
    q = torch.randn(1, 2, 3, 64)
    k = torch.randn(1, 2, 9, 64)
    a = A.attention_stats_reference(q, k)
    assert a.positions.tolist() == [6, 7, 8]  # default q_offset = Tk - Tq
    b = A.attention_stats_reference(q * 2, k, scale=1 / 16)  # 2 * (1/16) == 1/sqrt(64)
    torch.testing.assert_close(a.entropy, b.entropy)


def test_validation():
    q, k = torch.randn(1, 3, 2, 64), torch.randn(1, 2, 5, 64)
    with pytest.raises(ValueError, match="multiple"):
        A.attention_stats_reference(q, k)
    q = torch.randn(1, 4, 2, 64)
    with pytest.raises(ValueError, match="not both"):
        A.attention_stats_reference(q, k, q_offset=1, q_positions=[1, 2])
    with pytest.raises(ValueError, match="window"):
        A.attention_stats_reference(q, k, window=0)
    with pytest.raises(ValueError, match="entries"):
        A.attention_stats_reference(q, k, q_positions=[1])
    with pytest.raises(ValueError, match="head_dim"):
        A.attention_stats_reference(q, torch.randn(1, 2, 5, 32))


def test_empty_inputs(tri_device):
    q = torch.randn(1, 2, 0, 64)
    k = torch.randn(1, 1, 5, 64)
    for _, fn in _backends(tri_device):
        s = fn(q, k)
        assert s.entropy.shape == (1, 2, 0) and float(s.received.abs().sum()) == 0.0
    q = torch.randn(1, 2, 3, 64)
    k = torch.randn(1, 1, 0, 64)
    for _, fn in _backends(tri_device):
        s = fn(q, k, q_offset=0)
        assert torch.isneginf(s.lse).all() and s.received.shape == (1, 1, 0)


def test_huge_window_is_no_window_and_int32_limits(tri_device):
    q, k = torch.randn(1, 2, 3, 64), torch.randn(1, 1, 20, 64)
    ref = A.attention_stats_reference(q, k)
    _compare(A.attention_stats_triton(q.to(tri_device), k.to(tri_device), window=2**40), ref)
    with pytest.raises(ValueError, match="2\\*\\*29"):
        A.attention_stats_triton(q.to(tri_device), k.to(tri_device), q_offset=2**30)
