"""Per-token / per-head L2 norms: Triton vs torch reference vs float64 truth.

Tolerances (fp32 accumulation of at most 512 scaled squares, sums in different orders):
  Triton vs reference: rtol 1e-5, atol 1e-6 (relative to the norms, which are O(sqrt(D)) here);
  reference vs float64: rtol 1e-5.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("hypothesis")  # the GPU image may lack it; test_gpu.py does not need it
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

torch = pytest.importorskip("torch")

from kvtrace.kernels import norms  # noqa: E402
from kvtrace.kernels.numpy_ref import head_norms_numpy  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _truth(x: torch.Tensor) -> torch.Tensor:
    return x.double().square().sum(-1).sqrt()


def _check(x: torch.Tensor, device: str) -> None:
    got = norms.head_norms(x.to(device), backend="triton")
    ref = norms.head_norms_reference(x)
    assert got.token_norms.dtype == torch.float32 and got.head_mean.dtype == torch.float32
    assert got.token_norms.shape == x.shape[:-1] and got.head_mean.shape == x.shape[:-2]
    torch.testing.assert_close(got.token_norms.cpu(), ref.token_norms, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got.head_mean.cpu(), ref.head_mean, rtol=RTOL, atol=ATOL)


@settings(max_examples=25, deadline=None, database=None)
@given(
    b=st.integers(1, 2), h=st.integers(1, 3), t=st.integers(1, 37),
    d=st.sampled_from([64, 128, 256, 512, 80, 96, 1, 17]),
    dtype=st.sampled_from(DTYPES), layout=st.sampled_from(["contig", "t_slice", "perm", "last_strided"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_triton_matches_reference(tri_device, b, h, t, d, dtype, layout, seed):
    g = torch.Generator().manual_seed(seed)
    if layout == "t_slice":  # static-cache style: valid prefix of a longer buffer (no copy)
        x = torch.randn(b, h, t + 5, d, generator=g).to(dtype)[:, :, :t]
    elif layout == "perm":  # [B, T, H, D] storage viewed as [B, H, T, D]
        x = torch.randn(b, t, h, d, generator=g).to(dtype).transpose(1, 2)
    elif layout == "last_strided":  # last dim not unit-stride: made contiguous
        x = torch.randn(b, h, t, 2 * d, generator=g).to(dtype)[..., ::2]
    else:
        x = torch.randn(b, h, t, d, generator=g).to(dtype)
    _check(x, tri_device)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_float64(dtype):
    x = torch.randn(2, 3, 11, 128).to(dtype)
    ref = norms.head_norms_reference(x)
    torch.testing.assert_close(ref.token_norms.double(), _truth(x), rtol=RTOL, atol=0)
    torch.testing.assert_close(ref.head_mean.double(), _truth(x).mean(-1), rtol=RTOL, atol=0)


@pytest.mark.parametrize(
    "dtype,value",
    [
        (torch.float16, 6.0e4),  # near fp16 max: squares (3.6e9) overflow fp16, not fp32
        (torch.float16, 65504.0),
        (torch.bfloat16, 1e30),  # squares overflow even fp32 without the max-scaling
        (torch.float32, 1e37),
        (torch.float32, 1e-30),  # squares underflow fp32 without the scaling
        (torch.float16, 6e-8),  # fp16 subnormal
    ],
)
@pytest.mark.parametrize("d", [64, 512])
def test_extreme_values_stay_finite_and_exact(tri_device, dtype, value, d):
    x = torch.full((1, 2, 5, d), value).to(dtype)
    x[0, 1, ::2] = -x[0, 1, ::2]
    x[0, 0, 3, : d // 2] = 0
    truth = _truth(x)
    for res in (norms.head_norms_reference(x), norms.head_norms(x.to(tri_device), backend="triton")):
        tok = res.token_norms.cpu().double()
        assert torch.isfinite(tok).all()
        torch.testing.assert_close(tok, truth, rtol=RTOL, atol=0)
        # fp32 1e37 x sqrt(512) = 2.3e38 per token: a sum of 5 before dividing would overflow
        torch.testing.assert_close(res.head_mean.cpu().double(), truth.mean(-1), rtol=RTOL, atol=0)


@pytest.mark.parametrize("dtype,big,tiny", [(torch.bfloat16, 1e30, 1e-30), (torch.float32, 1e37, 1e-30),
                                            (torch.float16, 65504.0, 6e-8)])
def test_extreme_rows_next_to_ordinary_rows(tri_device, dtype, big, tiny):
    # The kernel sums squares once per row and redoes only tiles holding a row whose sum
    # overflowed or underflowed: ordinary rows sharing such a tile must come out unchanged.
    x = torch.randn(1, 2, 24, 128)
    x[0, 0, 2] *= big / float(x[0, 0, 2].abs().max())
    x[0, 0, 5] *= tiny / float(x[0, 0, 5].abs().max())
    x[0, 1, 9] = 0
    x = x.to(dtype)
    truth = _truth(x)
    got = norms.head_norms(x.to(tri_device), backend="triton").token_norms.cpu().double()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, truth, rtol=RTOL, atol=0)


def test_zero_rows_and_empty(tri_device):
    x = torch.zeros(1, 2, 4, 64)
    for res in (norms.head_norms_reference(x), norms.head_norms(x.to(tri_device), backend="triton")):
        assert float(res.token_norms.abs().max()) == 0.0
    e = torch.zeros(1, 2, 0, 64)
    for res in (norms.head_norms_reference(e), norms.head_norms(e.to(tri_device), backend="triton")):
        assert res.token_norms.shape == (1, 2, 0)
        assert torch.isnan(res.head_mean.cpu()).all()  # mean over no tokens is NaN, documented


def test_non_finite_rows_are_non_finite(tri_device):
    x = torch.randn(1, 1, 3, 64)
    x[0, 0, 1, 5] = float("inf")
    x[0, 0, 2, 7] = float("nan")
    for res in (norms.head_norms_reference(x), norms.head_norms(x.to(tri_device), backend="triton")):
        tok = res.token_norms.cpu()
        assert torch.isfinite(tok[0, 0, 0]) and not torch.isfinite(tok[0, 0, 1:]).any()


def test_three_d_input_and_numpy_agree():
    x = torch.randn(3, 9, 64)
    ref = norms.head_norms_reference(x)
    assert ref.token_norms.shape == (1, 3, 9)
    tok, head = head_norms_numpy(x.numpy())
    np.testing.assert_allclose(tok, ref.token_norms.numpy(), rtol=RTOL)
    np.testing.assert_allclose(head, ref.head_mean.numpy(), rtol=RTOL)


def test_dispatch_and_validation(monkeypatch):
    x = torch.randn(1, 2, 3, 64)
    # auto on CPU tensors never needs triton
    torch.testing.assert_close(norms.head_norms(x).token_norms, norms.head_norms_reference(x).token_norms)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if "cuda" not in str(x.device):
        with pytest.raises(RuntimeError, match="CUDA"):
            norms.head_norms(x, backend="triton")
    with pytest.raises(ValueError):
        norms.head_norms(x, backend="nope")
    with pytest.raises(ValueError):
        norms.head_norms_reference(torch.randn(2, 3))
    with pytest.raises(TypeError):
        norms.head_norms_reference(torch.ones(1, 1, 2, 2, dtype=torch.int32))


def test_head_mean_is_mean_of_token_norms():
    x = torch.randn(2, 4, 33, 96)
    ref = norms.head_norms_reference(x)
    assert math.isclose(float(ref.head_mean[1, 2]), float(ref.token_norms[1, 2].mean()), rel_tol=1e-6)
