"""The segmented norm kernel: launch plans, and forced multi-segment launches vs the torch reference.

Each program of the kernel loops over ``tiles_per_segment`` tiles of one head and writes one partial
mean (the last program of a head sums them: test_norms_fused.py); these tests force tiny tiles and
few programs so that a head spans several segments, the last segment is short or ragged, and T can
be smaller than one tile. Tolerances as in test_norms.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis")
pytest.importorskip("triton")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

torch = pytest.importorskip("torch")

from kvtrace.kernels import _triton_norms as tn  # noqa: E402
from kvtrace.kernels import norms  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6


def _layout(b: int, h: int, t: int, d: int, dtype: torch.dtype, layout: str, g: torch.Generator) -> torch.Tensor:
    if layout == "t_slice":  # valid prefix of a longer static-cache buffer
        return torch.randn(b, h, t + 3, d, generator=g).to(dtype)[:, :, :t]
    if layout == "perm":  # [B, T, H, D] storage viewed as [B, H, T, D]
        return torch.randn(b, t, h, d, generator=g).to(dtype).transpose(1, 2)
    if layout == "head_slice":  # every other head of a larger tensor
        return torch.randn(b, 2 * h, t, d, generator=g).to(dtype)[:, ::2]
    return torch.randn(b, h, t, d, generator=g).to(dtype)


@settings(max_examples=30, deadline=None, database=None)
@given(
    b=st.integers(1, 2), h=st.integers(1, 3), t=st.integers(1, 45),
    d=st.sampled_from([1, 16, 64, 80]), block_t=st.sampled_from([1, 2, 4, 8]),
    programs=st.integers(1, 24),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    layout=st.sampled_from(["contig", "t_slice", "perm", "head_slice"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_forced_segments_match_reference(tri_device, b, h, t, d, block_t, programs, dtype, layout, seed):
    x = _layout(b, h, t, d, dtype, layout, torch.Generator().manual_seed(seed)).to(tri_device)
    plan = tn.plan_launch(tuple(x.shape), x.element_size(), sms=1, block_t=block_t, programs=programs)
    token, mean = tn.head_norms(x, plan)
    ref = norms.head_norms_reference(x.cpu())
    assert token.shape == (b, h, t) and mean.shape == (b, h)
    torch.testing.assert_close(token.cpu(), ref.token_norms, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(mean.cpu(), ref.head_mean, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("t", [1, 7, 8, 9, 31, 64, 65])
def test_several_segments_per_head(tri_device, t):
    # block 4, 6 programs for 2 heads: 3 segments per head once T > 8; T = 1, 7 fit fewer tiles
    x = torch.randn(1, 2, t, 32, generator=torch.Generator().manual_seed(t)).to(tri_device)
    plan = tn.plan_launch(tuple(x.shape), 4, sms=1, block_t=4, programs=6)
    tiles = -(-t // 4)
    assert plan.segments == min(3, tiles)
    token, mean = tn.head_norms(x, plan)
    ref = norms.head_norms_reference(x.cpu())
    torch.testing.assert_close(token.cpu(), ref.token_norms, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(mean.cpu(), ref.head_mean, rtol=RTOL, atol=ATOL)


def test_outputs_share_one_allocation(tri_device):
    x = torch.randn(2, 3, 20, 16).to(tri_device)
    multi = tn.plan_launch(tuple(x.shape), 4, sms=1, block_t=4, programs=12)
    single = tn.plan_launch(tuple(x.shape), 4, sms=1, block_t=4, programs=1)
    assert multi.segments == 2 and single.segments == 1
    token, mean = tn.head_norms(x, single)
    # one segment per head: the partial *is* the mean, read in place after the token norms
    assert mean.untyped_storage().data_ptr() == token.untyped_storage().data_ptr()
    assert mean.data_ptr() == token.data_ptr() + token.numel() * 4
    torch.testing.assert_close(mean.cpu(), token.cpu().mean(-1), rtol=RTOL, atol=ATOL)
    t2, m2 = tn.head_norms(x, multi)
    assert m2.data_ptr() == t2.data_ptr() + t2.numel() * 4  # several segments: the same place
    torch.testing.assert_close(m2.cpu(), mean.cpu(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(t2.cpu(), token.cpu(), rtol=0, atol=0)


@settings(max_examples=200, deadline=None, database=None)
@given(
    b=st.integers(1, 8), h=st.integers(1, 64), t=st.integers(1, 2**20),
    d=st.sampled_from([1, 64, 80, 128, 256, 512, 1024, 4096]), itemsize=st.sampled_from([2, 4]),
    sms=st.sampled_from([1, 78, 132]),
)
def test_plan_covers_every_tile_once(b, h, t, d, itemsize, sms):
    p = tn.plan_launch((b, h, t, d), itemsize, sms)
    tiles = -(-t // p.block_t)
    # the segments cover all tiles, and none is empty (each writes a meaningful partial)
    assert p.segments * p.tiles_per_segment >= tiles > (p.segments - 1) * p.tiles_per_segment
    assert 1 <= p.segments <= max(1, 16 * sms // (b * h))
    assert p.block_d >= d and p.block_d & (p.block_d - 1) == 0
    assert p.block_t & (p.block_t - 1) == 0 and p.block_t <= max(1, 2 * t)
    assert p.block_t * p.block_d <= 8192 or p.block_t == 1  # at most 8,192 elements per tile
    assert p.num_stages == 1


def test_plan_heuristic_on_h200_shapes():
    bf16 = tn.plan_launch((1, 32, 32768, 128), 2, sms=132)  # 256 MiB: 16 KiB tiles, 4 warps
    assert (bf16.block_t, bf16.num_warps, bf16.num_stages) == (64, 4, 1)
    assert bf16.segments * 32 <= 16 * 132 and (bf16.segments, bf16.tiles_per_segment) == (64, 8)
    large = tn.plan_launch((1, 32, 131072, 128), 2, sms=132)  # 1 GiB: same tiles, longer loops
    assert (large.block_t, large.num_warps, large.segments, large.tiles_per_segment) == (64, 4, 64, 32)
    wide = tn.plan_launch((1, 8, 4096, 512), 2, sms=132)
    assert wide.block_t * wide.block_d == 8192  # 8,192 elements whatever D
    fp32 = tn.plan_launch((1, 32, 32768, 128), 4, sms=132)  # 32 KiB tiles on 8 warps
    assert (fp32.block_t, fp32.num_warps, fp32.segments, fp32.tiles_per_segment) == (64, 8, 64, 8)
    batched = tn.plan_launch((8, 8, 16384, 128), 2, sms=132)  # 64 heads share the 2,112 programs
    assert (batched.segments, batched.tiles_per_segment) == (32, 8)
    short = tn.plan_launch((1, 8, 5, 128), 2, sms=132)  # one short tile per head
    assert (short.block_t, short.segments, short.tiles_per_segment, short.num_warps) == (8, 1, 1, 4)


def test_default_plan_under_interpreter_uses_segments(tri_device):
    if tri_device != "cpu":
        pytest.skip("interpreter-only plan")
    x = torch.randn(1, 2, 40, 16)
    p = tn.default_plan(x)
    # 8 programs over 2 heads -> 4 segments wanted; 5 tiles per head -> 2 + 2 + 1 tiles, 3 segments
    assert (p.block_t, p.segments, p.tiles_per_segment) == (8, 3, 2)
    res = norms.head_norms(x, backend="triton")
    ref = norms.head_norms_reference(x)
    torch.testing.assert_close(res.head_mean, ref.head_mean, rtol=RTOL, atol=ATOL)
