"""Spectral summary of an MLA latent Gram matrix. numpy only (the analyser imports this without torch).

For latents ``c`` (``T`` rows of width ``r = kv_lora_rank``), ``G = sum_t c_t c_t^T`` (uncentred
second moment, so a non-zero mean shows up as one strong direction). With eigenvalues
``l_1 >= ... >= l_r >= 0`` (tiny negative rounding clamped to 0) and ``p_i = l_i / sum(l)``:

* ``effective_rank = exp(-sum p_i ln p_i)`` (Roy & Vetterli 2007), in ``[1, r]``; 0 for all-zero
  latents;
* ``energy_rank_f`` = smallest ``k`` with ``l_1 + ... + l_k >= f * sum(l)`` (0 for all-zero latents);
* ``structural_ratio = 2 * num_heads * head_dim / (kv_lora_rank + rope_dim)``: bytes an MHA cache
  of the same heads would hold per token, over the bytes MLA holds (latent + decoupled RoPE key);
* ``effective_ratio`` = the same with ``energy_rank_99`` in place of ``kv_lora_rank``: what a cache
  that kept only the directions carrying 99% of the latent energy would achieve (``inf`` when the
  denominator is 0).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = ["MLASpectrum", "energy_rank", "gram_numpy", "spectrum_from_eigenvalues", "spectrum_from_gram"]


@dataclass(frozen=True)
class MLASpectrum:
    num_tokens: int
    kv_lora_rank: int
    rope_dim: int
    num_heads: int
    head_dim: int
    trace: float
    eigenvalues: tuple[float, ...]  # descending
    effective_rank: float
    energy_rank_90: int
    energy_rank_99: int
    structural_ratio: float
    effective_ratio: float

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["eigenvalues"] = list(self.eigenvalues)
        return d


def energy_rank(eigenvalues_desc: np.ndarray, fraction: float) -> int:
    """Smallest k whose top-k eigenvalues hold at least ``fraction`` of the trace (0 if trace is 0)."""
    lam = np.asarray(eigenvalues_desc, dtype=np.float64)
    total = float(lam.sum())
    if lam.size == 0 or total <= 0.0:
        return 0
    cum = np.cumsum(lam)
    # A relative slack of 1e-9 so that an exact tie (top-k holding exactly the fraction) is not
    # lost to rounding in the cumulative sum or the eigensolver.
    k = int(np.searchsorted(cum, fraction * total * (1.0 - 1e-9), side="left")) + 1
    return min(k, lam.size)


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else math.inf


def spectrum_from_eigenvalues(
    eigenvalues: np.ndarray, *, num_tokens: int, num_heads: int, head_dim: int, rope_dim: int,
    kv_lora_rank: int | None = None,
) -> MLASpectrum:
    """Build :class:`MLASpectrum` from the Gram's eigenvalues (any order)."""
    lam = np.sort(np.clip(np.asarray(eigenvalues, dtype=np.float64).ravel(), 0.0, None))[::-1]
    r = int(lam.size if kv_lora_rank is None else kv_lora_rank)
    total = float(lam.sum())
    if total > 0:
        p = lam[lam > 0] / total
        erank = float(np.exp(-(p * np.log(p)).sum()))
    else:
        erank = 0.0
    e90, e99 = energy_rank(lam, 0.90), energy_rank(lam, 0.99)
    mha = 2.0 * num_heads * head_dim
    return MLASpectrum(
        num_tokens=int(num_tokens), kv_lora_rank=r, rope_dim=int(rope_dim), num_heads=int(num_heads),
        head_dim=int(head_dim), trace=total, eigenvalues=tuple(float(v) for v in lam),
        effective_rank=erank, energy_rank_90=e90, energy_rank_99=e99,
        structural_ratio=_ratio(mha, r + rope_dim), effective_ratio=_ratio(mha, e99 + rope_dim),
    )


def spectrum_from_gram(gram: np.ndarray, **kwargs: Any) -> MLASpectrum:
    """Eigen-decompose a symmetric ``r x r`` Gram in float64 and summarise it."""
    g = np.asarray(gram, dtype=np.float64)
    if g.ndim != 2 or g.shape[0] != g.shape[1]:
        raise ValueError(f"gram must be square, got {g.shape}")
    return spectrum_from_eigenvalues(np.linalg.eigvalsh(g), **kwargs)


def gram_numpy(latents: np.ndarray) -> np.ndarray:
    """``X^T X`` in float64 for latents shaped ``[..., T, r]`` (all leading dims are rows)."""
    x = np.asarray(latents)
    x = x.reshape(-1, x.shape[-1]).astype(np.float64, copy=False)
    return x.T @ x
