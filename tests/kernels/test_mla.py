"""MLA latent Gram (Triton vs torch vs float64) and the spectral summary.

Tolerances: Gram entries are sums of N products; compared relative to the largest entry
(max |G_tri - G_ref| <= 1e-5 * max |G_ref|), because small off-diagonal entries are differences
of large sums and have no meaningful relative accuracy.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("hypothesis")  # the GPU image may lack it; test_gpu.py does not need it
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

torch = pytest.importorskip("torch")

from kvtrace.kernels import mla  # noqa: E402
from kvtrace.kernels.spectrum import (  # noqa: E402
    energy_rank,
    gram_numpy,
    spectrum_from_eigenvalues,
    spectrum_from_gram,
)

REL = 1e-5


def _close_gram(a: torch.Tensor, b: torch.Tensor, rel: float = REL) -> None:
    scale = float(b.abs().max()) or 1.0
    err = float((a.double().cpu() - b.double().cpu()).abs().max())
    assert err <= rel * scale, f"max err {err:.3e} > {rel:.0e} * {scale:.3e}"


@settings(max_examples=25, deadline=None, database=None)
@given(
    n=st.integers(1, 300), r=st.sampled_from([1, 8, 16, 40, 64, 96]),
    lead=st.sampled_from(["2d", "3d", "4d"]), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    splits=st.integers(1, 4), seed=st.integers(0, 2**31 - 1),
)
def test_gram_triton_matches_reference(tri_device, n, r, lead, dtype, splits, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, r, generator=g).to(dtype)
    if lead == "3d":
        x = x.view(1, n, r)
    elif lead == "4d":
        x = x.view(1, 1, n, r)
    ref = mla.latent_gram_reference(x)
    got = mla.latent_gram_triton(x.to(tri_device), num_splits=splits)
    assert got.shape == (r, r) and got.dtype == torch.float32
    _close_gram(got, ref)
    assert torch.equal(got.cpu(), got.cpu().T)  # mirrored exactly
    _close_gram(ref, torch.from_numpy(gram_numpy(x.float().numpy())))


def test_gram_r512_and_strided(tri_device):
    x = torch.randn(2, 70, 1024).to(torch.bfloat16)[..., ::2]  # last dim strided: copied
    _close_gram(mla.latent_gram_triton(x.to(tri_device)), mla.latent_gram_reference(x))


@pytest.mark.parametrize("dtype,value", [(torch.float16, 6.0e4), (torch.bfloat16, 1e15)])
def test_gram_large_values_no_overflow(tri_device, dtype, value):
    x = torch.full((50, 32), value).to(dtype)
    x[::3] *= -1
    got = mla.latent_gram_triton(x.to(tri_device)).cpu()
    assert torch.isfinite(got).all()
    _close_gram(got, torch.from_numpy(gram_numpy(x.float().numpy())))


def test_spectrum_known_eigenvalues():
    # Orthogonal directions scaled by sqrt(lambda): Gram eigenvalues are exactly lambda.
    lam = np.array([50.0, 30.0, 15.0, 4.0, 1.0, 0.0, 0.0, 0.0])
    q, _ = np.linalg.qr(np.random.default_rng(0).standard_normal((8, 8)))
    x = (q[:, :8] * np.sqrt(lam)).T  # 8 rows; X^T X = Q diag(lam) Q^T
    sp = spectrum_from_gram(x.T @ x, num_tokens=8, num_heads=128, head_dim=128, rope_dim=64)
    np.testing.assert_allclose(sp.eigenvalues, lam, atol=1e-9)
    assert sp.trace == pytest.approx(100.0)
    # cumulative 50, 80, 95, 99, 100: 90% needs 3; 99% is reached exactly at 4 (a tie that rounding
    # in the eigensolver must not push to 5)
    assert sp.energy_rank_90 == 3 and sp.energy_rank_99 == 4
    p = lam[lam > 0] / 100.0
    assert sp.effective_rank == pytest.approx(math.exp(-(p * np.log(p)).sum()))
    assert sp.structural_ratio == pytest.approx(2 * 128 * 128 / (8 + 64))
    assert sp.effective_ratio == pytest.approx(2 * 128 * 128 / (4 + 64))
    assert sp.to_dict()["eigenvalues"][0] == pytest.approx(50.0)


def test_energy_rank_edges():
    assert energy_rank(np.array([]), 0.9) == 0
    assert energy_rank(np.zeros(4), 0.9) == 0
    assert energy_rank(np.array([1.0, 1.0, 1.0, 1.0]), 0.5) == 2  # exactly half -> 2, not 3
    assert energy_rank(np.array([1.0, 1.0, 1.0, 1.0]), 1.0) == 4
    assert energy_rank(np.array([5.0, 0, 0]), 0.99) == 1


def test_spectrum_rank_one_identity_and_zero():
    one = spectrum_from_eigenvalues(np.array([0.0, 3.0, -1e-12]), num_tokens=5, num_heads=1,
                                    head_dim=4, rope_dim=0)
    assert one.effective_rank == pytest.approx(1.0) and one.energy_rank_99 == 1
    assert one.eigenvalues == (3.0, 0.0, 0.0)  # sorted, rounding negatives clamped
    ident = spectrum_from_eigenvalues(np.ones(16), num_tokens=5, num_heads=1, head_dim=4, rope_dim=0)
    assert ident.effective_rank == pytest.approx(16.0) and ident.energy_rank_90 == 15
    zero = spectrum_from_eigenvalues(np.zeros(4), num_tokens=0, num_heads=2, head_dim=4, rope_dim=0)
    assert zero.effective_rank == 0.0 and zero.energy_rank_99 == 0 and math.isinf(zero.effective_ratio)


def test_mla_spectrum_end_to_end_deepseek_dims(tri_device):
    # Latents living in a 12-dim subspace of r = 64: energy rank <= 12 whatever the noise-free mix.
    g = torch.Generator().manual_seed(1)
    basis = torch.linalg.qr(torch.randn(64, 12, generator=g))[0]
    x = (torch.randn(1, 1, 200, 12, generator=g) * torch.linspace(3, 0.5, 12)) @ basis.T
    for backend, dev in (("torch", "cpu"), ("triton", tri_device)):
        sp = mla.mla_spectrum(x.to(dev), num_heads=128, head_dim=128, rope_dim=64, backend=backend)
        assert sp.num_tokens == 200 and sp.kv_lora_rank == 64
        assert sp.energy_rank_99 <= 12 and sp.energy_rank_90 <= sp.energy_rank_99
        assert 1.0 <= sp.effective_rank <= 12.0 + 1e-6
        assert sp.structural_ratio == pytest.approx(2 * 128 * 128 / (64 + 64))
        assert sp.effective_ratio == pytest.approx(2 * 128 * 128 / (sp.energy_rank_99 + 64))
        assert sp.effective_ratio > sp.structural_ratio


def test_empty_and_validation(tri_device):
    assert mla.latent_gram_triton(torch.zeros(0, 16).to(tri_device)).shape == (16, 16)
    with pytest.raises(ValueError):
        mla.latent_gram_reference(torch.zeros(5))
    with pytest.raises(TypeError):
        mla.latent_gram_reference(torch.zeros(5, 4, dtype=torch.int64))
