"""Per-token and per-head L2 norms of K or V cache tensors.

Input ``x``: ``[B, H, T, D]`` (a 3-D ``[H, T, D]`` is read as ``B = 1``), bf16 / fp16 / fp32.
Returned :class:`HeadNorms`:

* ``token_norms`` ``[B, H, T]`` fp32: ``||x[b, h, t, :]||_2``, accumulated in fp32 after scaling each
  row by its max ``|x|`` (so no intermediate overflows: fp16 values near 6.5e4 and bf16/fp32 values
  up to the fp32 maximum give finite, correct norms);
* ``head_mean`` ``[B, H]`` fp32: the mean over ``T`` of ``token_norms`` (NaN when ``T == 0``).

Strides: any strides on B, H and T are read in place (e.g. ``keys[:, :, :valid_len]`` of a static
cache costs no copy); if the last dim is not unit-stride the tensor is first made contiguous.
Rows holding inf/NaN give a non-finite norm (which of inf or NaN is unspecified).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvtrace.kernels._env import resolve_backend

__all__ = ["HeadNorms", "head_norms", "head_norms_reference", "head_norms_triton"]


class HeadNorms(NamedTuple):
    token_norms: torch.Tensor  # [B, H, T] fp32
    head_mean: torch.Tensor  # [B, H] fp32


def _as_4d(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 3:
        return x.unsqueeze(0)
    if x.dim() != 4:
        raise ValueError(f"expected [B, H, T, D] or [H, T, D], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"expected a floating-point tensor, got {x.dtype}")
    if x.shape[-1] == 0:
        raise ValueError("head_dim (last dim) must be > 0")
    return x


def head_norms_reference(x: torch.Tensor) -> HeadNorms:
    """Plain-torch implementation with the same semantics as the Triton kernel."""
    x = _as_4d(x)
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 1.0 / amax, torch.zeros_like(amax))
    scaled = xf * inv
    token = amax.squeeze(-1) * scaled.square().sum(dim=-1).sqrt()
    T = token.shape[-1]
    # Divided before summing, as the kernel does, so norms near the fp32 maximum give a finite mean.
    mean = (token * (1.0 / T)).sum(dim=-1) if T else token.new_full(token.shape[:-1], float("nan"))
    return HeadNorms(token, mean)


def head_norms_triton(x: torch.Tensor) -> HeadNorms:
    """Triton implementation: one read of ``x`` and one launch; the head means come from per-segment
    partial sums written by the same kernel (one small torch sum when a head spans several programs).

    ``token_norms`` is a view of one fp32 allocation that also holds the partial sums (and is
    ``head_mean`` itself when a head is one segment).
    """
    from kvtrace.kernels import _triton_norms

    x = _as_4d(x)
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        x = x.contiguous()
    return HeadNorms(*_triton_norms.head_norms(x))


def head_norms(x: torch.Tensor, backend: str = "auto") -> HeadNorms:
    """Per-token and per-head-mean L2 norms. ``backend``: ``auto`` (triton on CUDA), ``triton``, ``torch``."""
    if resolve_backend(backend, x) == "triton":
        return head_norms_triton(x)
    return head_norms_reference(x)
