"""MLA latent analysis: Gram matrix of c_KV in one pass, then its spectrum (see ``spectrum.py``).

Latents: ``[T, r]``, ``[B, T, r]`` or ``[B, 1, T, r]`` (any leading dims are flattened into rows),
bf16 / fp16 / fp32. The Gram ``G = X^T X`` is accumulated in fp32 (Triton: products of 16-bit
inputs are exact in fp32, sums are fp32), symmetrised, and eigen-decomposed in float64 on the
small ``r x r`` matrix with ``torch.linalg.eigvalsh``.
"""

from __future__ import annotations

import torch

from kvtrace.kernels._env import resolve_backend
from kvtrace.kernels.spectrum import MLASpectrum, spectrum_from_eigenvalues

__all__ = ["MLASpectrum", "latent_gram", "latent_gram_reference", "latent_gram_triton", "mla_spectrum"]


def _rows(latents: torch.Tensor) -> torch.Tensor:
    if latents.dim() < 2:
        raise ValueError(f"latents must be [..., T, r], got {tuple(latents.shape)}")
    if not latents.is_floating_point():
        raise TypeError(f"latents must be floating point, got {latents.dtype}")
    return latents.reshape(-1, latents.shape[-1])


def latent_gram_reference(latents: torch.Tensor) -> torch.Tensor:
    """``X^T X`` as fp32 ``[r, r]`` with plain torch (fp32 matmul)."""
    x = _rows(latents).float()
    return x.T @ x


def latent_gram_triton(latents: torch.Tensor, num_splits: int | None = None) -> torch.Tensor:
    """``X^T X`` as fp32 ``[r, r]``: one Triton pass over the rows, partials summed in torch."""
    from kvtrace.kernels import _triton_mla as tm

    x = _rows(latents)
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        x = x.float()
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        x = x.contiguous()
    N, r = x.shape
    if N == 0 or r == 0:
        return torch.zeros(r, r, dtype=torch.float32, device=x.device)
    if num_splits is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 2
        tiles = -(-r // 64)
        tiles = tiles * (tiles + 1) // 2
        num_splits = max(1, min(-(-2 * sms // tiles), -(-N // 1024)))
    per = -(-N // max(1, num_splits))
    unit = tm.split_unit()
    per = -(-per // unit) * unit
    n_splits = -(-N // per)
    part = torch.zeros(n_splits, r, r, dtype=torch.float32, device=x.device)
    tm.run_gram(x, part, rows_per_split=per, n_splits=n_splits)
    upper = part.sum(dim=0).triu()
    return upper + upper.triu(1).T


def latent_gram(latents: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Gram ``X^T X`` (fp32 ``[r, r]``). ``backend``: ``auto`` | ``triton`` | ``torch``."""
    if resolve_backend(backend, latents) == "triton":
        return latent_gram_triton(latents)
    return latent_gram_reference(latents)


def mla_spectrum(
    latents: torch.Tensor, *, num_heads: int, head_dim: int, rope_dim: int,
    kv_lora_rank: int | None = None, backend: str = "auto",
) -> MLASpectrum:
    """Spectrum, effective/energy ranks and compression ratios of one layer's c_KV latents.

    ``num_heads`` and ``head_dim`` describe the multi-head equivalent (per-head K/V width the
    latent replaces); ``rope_dim`` is the decoupled RoPE key width cached beside the latent;
    ``kv_lora_rank`` defaults to the latents' last dim.
    """
    gram = latent_gram(latents, backend=backend)
    eig = torch.linalg.eigvalsh(gram.double()).cpu().numpy()
    n_tok = _rows(latents).shape[0]
    return spectrum_from_eigenvalues(
        eig, num_tokens=n_tok, num_heads=num_heads, head_dim=head_dim, rope_dim=rope_dim,
        kv_lora_rank=latents.shape[-1] if kv_lora_rank is None else kv_lora_rank,
    )
