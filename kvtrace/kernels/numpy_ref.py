"""numpy versions of the norm and attention statistics, for analysers without torch.

Same definitions as ``norms.py`` / ``attention.py`` (see their docstrings), computed in float64 over
chunks of queries. Slower than the torch paths and far slower than Triton; meant for the sampled
tensors of a trace, not for whole caches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["attention_stats_numpy", "head_norms_numpy", "visible_counts_numpy"]

_CHUNK_ELEMS = 1 << 23  # float64 elements per score chunk (64 MiB)


def _as_4d(x: Any, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim == 3:
        a = a[None]
    if a.ndim != 4:
        raise ValueError(f"{name} must be [B, H, T, D] or [H, T, D], got {a.shape}")
    return a


def head_norms_numpy(x: Any) -> tuple[np.ndarray, np.ndarray]:
    """(token_norms [B, H, T], head_mean [B, H]) in float64. ``x``: [B, H, T, D] or [H, T, D]."""
    a = _as_4d(x, "x").astype(np.float64, copy=False)
    amax = np.abs(a).max(axis=-1, keepdims=True) if a.shape[-1] else np.zeros(a.shape[:-1] + (1,))
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(amax > 0, a / np.where(amax > 0, amax, 1.0), 0.0)
    token = amax[..., 0] * np.sqrt((scaled * scaled).sum(axis=-1))
    with np.errstate(invalid="ignore"):
        head = token.mean(axis=-1) if token.shape[-1] else np.full(token.shape[:-1], np.nan)
    return token, head


def visible_counts_numpy(positions: np.ndarray, num_keys: int, causal: bool = True,
                         window: int | None = None) -> np.ndarray:
    pos = np.asarray(positions, dtype=np.int64)
    hi = np.minimum(pos + 1, num_keys) if causal else np.full_like(pos, num_keys)
    lo = np.maximum(pos - window + 1, 0) if window is not None else np.zeros_like(pos)
    return np.maximum(hi - lo, 0)


def attention_stats_numpy(
    q: Any, k: Any, *, q_offset: int | None = None, q_positions: Sequence[int] | None = None,
    causal: bool = True, window: int | None = None, scale: float | None = None,
) -> dict[str, np.ndarray]:
    """Keys: entropy, norm_entropy, lse ([B, Hq, Tq]), n_visible, positions ([Tq]), received
    ([B, Hkv, Tk]). Float64 throughout."""
    qa = _as_4d(q, "q").astype(np.float64, copy=False)
    ka = _as_4d(k, "k").astype(np.float64, copy=False)
    B, Hq, Tq, D = qa.shape
    Hkv, Tk = ka.shape[1], ka.shape[2]
    if ka.shape[0] != B or ka.shape[3] != D or Hkv == 0 or Hq % Hkv:
        raise ValueError(f"incompatible q {qa.shape} and k {ka.shape}")
    if q_positions is not None and q_offset is not None:
        raise ValueError("give q_offset or q_positions, not both")
    G = Hq // Hkv
    if q_positions is None:
        off = Tk - Tq if q_offset is None else int(q_offset)
        pos = np.arange(off, off + Tq, dtype=np.int64)
    else:
        pos = np.asarray(q_positions, dtype=np.int64).reshape(-1)
        if pos.size != Tq:
            raise ValueError(f"q_positions has {pos.size} entries for {Tq} queries")
    sc = 1.0 / math.sqrt(D) if scale is None else float(scale)
    j = np.arange(Tk)
    entropy = np.zeros((B, Hq, Tq))
    lse = np.full((B, Hq, Tq), -np.inf)
    received = np.zeros((B, Hkv, Tk))
    step = max(1, _CHUNK_ELEMS // max(1, B * Hq * Tk))
    qg = qa.reshape(B, Hkv, G, Tq, D)
    for i in range(0, Tq, step):
        pc = pos[i:i + step]
        vis = np.ones((pc.size, Tk), dtype=bool)
        if causal:
            vis &= j[None, :] <= pc[:, None]
        if window is not None:
            vis &= j[None, :] > pc[:, None] - window
        s = np.einsum("bkgqd,bktd->bkgqt", qg[:, :, :, i:i + step], ka) * sc
        s = np.where(vis, s, -np.inf)
        m = s.max(axis=-1, keepdims=True)
        m_safe = np.where(np.isfinite(m), m, 0.0)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            z = np.exp(s - m_safe).sum(axis=-1, keepdims=True)
            lse_c = np.where(z > 0, m_safe + np.log(z), -np.inf)
            d = s - lse_c
            p = np.where(vis, np.exp(d), 0.0)
            ent = np.where(vis, -p * d, 0.0).sum(axis=-1)
        n = pc.size
        entropy[:, :, i:i + n] = ent.reshape(B, Hq, n)
        lse[:, :, i:i + n] = lse_c[..., 0].reshape(B, Hq, n)
        received += p.sum(axis=(2, 3))
    n_vis = visible_counts_numpy(pos, Tk, causal, window)
    with np.errstate(divide="ignore", invalid="ignore"):
        norm = np.where(n_vis > 1, entropy / np.log(np.maximum(n_vis, 2)), 0.0)
    return {"entropy": entropy, "norm_entropy": norm, "lse": lse, "n_visible": n_vis,
            "positions": pos, "received": received}
