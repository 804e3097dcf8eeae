"""Full-size Triton-vs-reference checks on a CUDA GPU (marker ``gpu``; skipped without CUDA).

    PYTHONPATH=. python3 -m pytest tests/kernels -m gpu -q

Tolerances are looser than the interpreter tests: the compiled kernels use the GPU's approximate
exp2/log2/sqrt/division (a few ulp), tensor-core bf16/fp16 products with fp32 accumulation in a
different order, and sums run over thousands of terms.
  norms:     rtol 2e-5
  entropy:   atol 2e-3, rtol 1e-3 (nats);  norm_entropy atol 5e-4
  lse/log_z: atol 1e-3, rtol 1e-5
  received:  atol 1e-3, rtol 2e-3 (masses up to group * Tq)
  MLA Gram:  max abs error <= 1e-5 * max |G|
"""

from __future__ import annotations

import math
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiled kernels only"),
]

from kvtrace.kernels import attention as A  # noqa: E402
from kvtrace.kernels import mla, norms  # noqa: E402

TOL = {
    "entropy": dict(atol=2e-3, rtol=1e-3),
    "norm_entropy": dict(atol=5e-4, rtol=1e-3),
    "lse": dict(atol=1e-3, rtol=1e-5),
    "log_z": dict(atol=1e-3, rtol=1e-5),
    "row_max": dict(atol=1e-3, rtol=1e-5),
    "received": dict(atol=1e-3, rtol=2e-3),
}


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference is fp32
    yield
    torch.backends.cuda.matmul.allow_tf32 = old
    torch.cuda.empty_cache()


def _compare(got: A.AttentionStats, ref: A.AttentionStats) -> None:
    for f, tol in TOL.items():
        torch.testing.assert_close(getattr(got, f), getattr(ref, f), **tol, msg=lambda m, f=f: f"{f}: {m}")
    assert torch.equal(got.n_visible, ref.n_visible)


# --------------------------------------------------------------------------------- norms


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_norms_full_size(dtype, d):
    x = torch.randn(1, 32, 8192, d, device="cuda").to(dtype)
    got, ref = norms.head_norms(x), norms.head_norms_reference(x)  # auto -> triton on CUDA
    torch.testing.assert_close(got.token_norms, ref.token_norms, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(got.head_mean, ref.head_mean, rtol=2e-5, atol=1e-6)
    sl = torch.randn(2, 8, 9000, d, device="cuda").to(dtype)[:, :, :8191]  # static-cache prefix
    torch.testing.assert_close(norms.head_norms(sl).token_norms, norms.head_norms_reference(sl).token_norms,
                               rtol=2e-5, atol=1e-6)


def test_norms_fp16_near_max_and_int64_offsets():
    x = torch.full((1, 4, 4096, 128), 6.0e4, device="cuda", dtype=torch.float16)
    got = norms.head_norms(x).token_norms
    torch.testing.assert_close(got, torch.full_like(got, 6.0e4 * math.sqrt(128)), rtol=2e-5, atol=0)
    # > 2**31 elements: element offsets need 64-bit arithmetic. Reference per head to bound memory.
    big = torch.empty(1, 33, 131072, 512, device="cuda", dtype=torch.bfloat16).normal_()
    got = norms.head_norms(big)
    for h in (0, 17, 32):
        ref = norms.head_norms_reference(big[:, h:h + 1])
        torch.testing.assert_close(got.token_norms[:, h:h + 1], ref.token_norms, rtol=2e-5, atol=1e-6)
    del big


@pytest.mark.parametrize("block_t,programs", [(32, 8), (64, 1), (16, 4096), (1, 64)])
def test_norms_forced_segment_plans(block_t, programs):
    from kvtrace.kernels import _triton_norms as tn

    x = torch.randn(2, 4, 5003, 128, device="cuda", dtype=torch.bfloat16)
    plan = tn.plan_launch(tuple(x.shape), 2, tn.sm_count(x.device.index), block_t=block_t, programs=programs)
    token, mean = tn.head_norms(x, plan)
    ref = norms.head_norms_reference(x)
    torch.testing.assert_close(token, ref.token_norms, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(mean, ref.head_mean, rtol=2e-5, atol=1e-6)


def test_norms_ragged_lengths_do_not_recompile():
    from kvtrace.kernels import _triton_norms as tn

    buf = torch.randn(8, 8, 9000, 128, device="cuda", dtype=torch.bfloat16)
    norms.head_norms(buf[:, :, :4000])
    cache = tn._token_norms_kernel.device_caches[torch.cuda.current_device()][0]
    compiled = len(cache)
    per_segment = set()
    for t in (4001, 4017, 5100, 7133, 8999):  # same constexprs; T and tiles per segment vary
        x = buf[:, :, :t]
        per_segment.add(tn.default_plan(x).tiles_per_segment)
        got = norms.head_norms(x)
        torch.testing.assert_close(got.head_mean, norms.head_norms_reference(x).head_mean, rtol=2e-5, atol=1e-6)
    assert len(per_segment) > 1
    assert len(cache) == compiled


def test_norms_capture_in_cuda_graph():
    x = torch.randn(1, 8, 3000, 128, device="cuda", dtype=torch.bfloat16)
    norms.head_norms(x)  # compile and cache the SM count outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        res = norms.head_norms(x)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    ref = norms.head_norms_reference(x)
    torch.testing.assert_close(res.token_norms, ref.token_norms, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(res.head_mean, ref.head_mean, rtol=2e-5, atol=1e-6)


# ------------------------------------------------------------------------------ attention


def _qk(b, hq, hkv, tq, tk, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, hq, tq, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(b, hkv, tk, d, device="cuda", generator=g).to(dtype)
    return q, k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("window", [None, 4096])
def test_attention_sampled_queries_8k(dtype, window):
    q, k = _qk(1, 32, 8, 256, 8192, 128, dtype)
    pos = torch.sort(torch.randperm(8192, device="cuda")[:256]).values
    ref = A.attention_stats_reference(q, k, q_positions=pos, window=window)
    _compare(A.attention_stats(q, k, q_positions=pos, window=window), ref)
    # last 512 tokens as queries (contiguous positions: pass 2 takes the exact-range path)
    q2, _ = _qk(1, 32, 8, 512, 8192, 128, dtype, seed=1)
    _compare(A.attention_stats(q2, k, window=window), A.attention_stats_reference(q2, k, window=window))


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_attention_full_causal_prefill(group):
    q, k = _qk(1, 4 * group, 4, 2048, 2048, 128, torch.bfloat16)
    _compare(A.attention_stats(q, k), A.attention_stats_reference(q, k))
    _compare(A.attention_stats(q, k, window=300), A.attention_stats_reference(q, k, window=300))


@pytest.mark.parametrize("d", [64, 256, 512])
def test_attention_head_dims(d):
    q, k = _qk(2, 8, 2, 300, 3000, d, torch.bfloat16)
    _compare(A.attention_stats(q, k, q_offset=2000), A.attention_stats_reference(q, k, q_offset=2000))
    _compare(A.attention_stats(q, k, window=777), A.attention_stats_reference(q, k, window=777))


def test_attention_decode_like_splits():
    # 4 sampled queries against 64k keys: pass 1 splits the keys across programs.
    q, k = _qk(1, 32, 8, 4, 65536, 128, torch.bfloat16)
    _compare(A.attention_stats(q, k), A.attention_stats_reference(q, k))
    _compare(A.attention_stats_triton(q, k, num_splits=1), A.attention_stats_reference(q, k))


def test_attention_fp16_near_max_received_mass():
    # Scores ~4e10: pass 2 must recompute them bitwise as pass 1 did, or one fp32 ulp (4096 here)
    # turns exp(s - max) into 0 or inf. Failed on an H200 while the compiler fused dot * scale - max
    # into one FMA (fixed 2026-11-22 by rounding the product on its own).
    q = torch.full((1, 8, 64, 128), 6.0e4, device="cuda", dtype=torch.float16)
    k = torch.full((1, 2, 8192, 128), 6.0e4, device="cuda", dtype=torch.float16)
    st_ = A.attention_stats(q, k, causal=False)
    torch.testing.assert_close(st_.received, torch.full_like(st_.received, 4 * 64 / 8192), rtol=1e-4, atol=0)


def test_attention_extreme_random_scores_keep_total_mass():
    # Random fp16 inputs up to 6e4: scores ~1e9 apart, so each query's mass sits on one key whose
    # recomputed score must equal pass 1's row max exactly. Each query of each query head hands
    # out mass 1, so a KV head of a 4-head group receives 4 * 64 in total.
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = ((torch.rand(1, 8, 64, 128, device="cuda", generator=gen) * 2 - 1) * 6e4).half()
    k = ((torch.rand(1, 2, 4096, 128, device="cuda", generator=gen) * 2 - 1) * 6e4).half()
    for causal in (True, False):
        st_ = A.attention_stats(q, k, causal=causal)
        total = st_.received.sum(-1)
        torch.testing.assert_close(total, torch.full_like(total, 4 * 64), rtol=1e-3, atol=0)
        again = A.received_attention(q, k, st_.row_max, st_.log_z, causal=causal)
        assert torch.equal(again, st_.received)


def test_attention_fp16_near_max():
    q = torch.full((1, 8, 64, 128), 6.0e4, device="cuda", dtype=torch.float16)
    k = torch.full((1, 2, 8192, 128), 6.0e4, device="cuda", dtype=torch.float16)
    st_ = A.attention_stats(q, k, causal=False)
    assert torch.isfinite(st_.lse).all()
    torch.testing.assert_close(st_.entropy, torch.full_like(st_.entropy, math.log(8192)), atol=1e-4, rtol=0)


def test_attention_128k_keys_against_chunked():
    q, k = _qk(1, 32, 8, 64, 131072, 128, torch.bfloat16)
    _compare(A.attention_stats(q, k), A.attention_stats_chunked(q, k))


# ------------------------------------------------------------------------------------ MLA


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1, 16384, 512), (4, 5000, 576), (70000, 64)])
def test_mla_gram_full_size(dtype, shape):
    x = torch.randn(shape, device="cuda").to(dtype)
    got, ref = mla.latent_gram(x), mla.latent_gram_reference(x)
    # fp32 sums over T rows in a different order: relative error ~ sqrt(T) * 2^-24 (1.6e-5 at
    # T = 70k). Seen on an H200: 1.06e-5 and 1.8e-5. Bound: 5e-5.
    assert float((got - ref).abs().max()) <= 5e-5 * float(ref.abs().max())
    a = mla.mla_spectrum(x, num_heads=128, head_dim=128, rope_dim=64)
    b = mla.mla_spectrum(x, num_heads=128, head_dim=128, rope_dim=64, backend="torch")
    # discrete ranks may flip by one when a cumulative share sits on the threshold
    assert abs(a.energy_rank_99 - b.energy_rank_99) <= 1 and abs(a.energy_rank_90 - b.energy_rank_90) <= 1
    assert a.effective_rank == pytest.approx(b.effective_rank, rel=1e-5)
