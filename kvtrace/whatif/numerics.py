"""Exact CPU reference numerics of the what-if replay (numpy, float64): masked attention, the
mass and output error of a keep-set, and quantise-dequantise round trips.

No torch here: ``kvtrace whatif`` runs where only numpy and h5py are installed. The GPU fast path
(Triton kernels in kvtrace/kernels/whatif.py, reached through kvtrace/whatif/accelerated.py with
``--device cuda``) is checked against these functions.

Shapes: queries ``[B, Hq, Tq, D]``, keys ``[B, Hk, T, D]``, values ``[B, Hk, T, Dv]``; a query head
``h`` reads KV head ``h // (Hq // Hk)`` (transformers' ``repeat_kv`` order).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "attention_probs", "column_sums", "keep_measures", "visible_mask", "quantize_minmax", "round_fp8",
    "reconstruction", "FP8_FORMATS",
]


def visible_mask(q_pos: np.ndarray, k_pos: np.ndarray, window: int | None = None) -> np.ndarray:
    """[Tq, T] bool: key ``j`` is visible to query ``i`` (causal, and inside a sliding window of
    ``window`` tokens that includes the query's own position)."""
    q = np.asarray(q_pos)[:, None]
    k = np.asarray(k_pos)[None, :]
    vis = k <= q
    if window:
        vis &= k > q - window
    return vis


def _expand(x: np.ndarray, hq: int) -> np.ndarray:
    hk = x.shape[1]
    if hq % hk:
        raise ValueError(f"{hq} query heads do not divide into {hk} KV heads")
    return np.repeat(x, hq // hk, axis=1)


def attention_probs(q: np.ndarray, k: np.ndarray, vis: np.ndarray, scale: float,
                    keep: np.ndarray | None = None) -> np.ndarray:
    """Softmax weights [B, Hq, Tq, T] over the visible keys (and, with ``keep`` [B, Hk, T], only
    the kept ones). A query with nothing visible gets all-zero weights."""
    kk = _expand(k.astype(np.float64), q.shape[1])
    logits = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), kk) * scale
    mask = np.broadcast_to(vis[None, None], logits.shape)
    if keep is not None:
        mask = mask & _expand(keep, q.shape[1])[:, :, None, :]
    logits = np.where(mask, logits, -np.inf)
    top = logits.max(axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.where(mask, np.exp(logits - top), 0.0)
    s = e.sum(axis=-1, keepdims=True)
    return np.divide(e, s, out=np.zeros_like(e), where=s > 0)


def column_sums(q: np.ndarray, k: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray, window: int | None,
                scale: float, chunk: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """(softmax weights summed over the queries [B, Hq, T], queries that see each key [T]), over
    chunks of ``chunk`` queries."""
    total = np.zeros((k.shape[0], q.shape[1], k.shape[2]))
    count = np.zeros(k.shape[2])
    for i in range(0, q.shape[2], chunk):
        vis = visible_mask(q_pos[i:i + chunk], k_pos, window)
        total += attention_probs(q[:, :, i:i + chunk], k, vis, scale).sum(axis=2)
        count += vis.sum(axis=0)
    return total, count


def keep_measures(q: np.ndarray, k: np.ndarray, v: np.ndarray, vis: np.ndarray, scale: float,
                  keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per query head and query ([B, Hq, Tq] each): the full attention's mass on the kept keys
    (recall) and ||o' - o|| / ||o|| of the output over the kept keys against all keys."""
    p = attention_probs(q, k, vis, scale)
    recall = (p * _expand(keep, q.shape[1])[:, :, None, :]).sum(axis=-1)
    vv = _expand(v.astype(np.float64), q.shape[1])
    o = np.einsum("bhqk,bhkd->bhqd", p, vv)
    o2 = np.einsum("bhqk,bhkd->bhqd", attention_probs(q, k, vis, scale, keep), vv)
    return recall, rel_error(o2, o)


def rel_error(approx: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """||approx - exact|| / ||exact|| over the last axis (nan where ||exact|| is 0)."""
    num = np.linalg.norm(approx - exact, axis=-1)
    den = np.linalg.norm(exact, axis=-1)
    return np.divide(num, den, out=np.full_like(num, np.nan), where=den > 0)


def output_error(q: np.ndarray, k: np.ndarray, v: np.ndarray, k2: np.ndarray, v2: np.ndarray,
                 vis: np.ndarray, scale: float) -> np.ndarray:
    """||o' - o|| / ||o|| [B, Hq, Tq] of attention with (k2, v2) (e.g. dequantised) against (k, v)."""
    o = np.einsum("bhqk,bhkd->bhqd", attention_probs(q, k, vis, scale), _expand(v.astype(np.float64), q.shape[1]))
    o2 = np.einsum("bhqk,bhkd->bhqd", attention_probs(q, k2, vis, scale), _expand(v2.astype(np.float64), q.shape[1]))
    return rel_error(o2, o)


# ------------------------------------------------------------------------------ quantisation


def quantize_minmax(x: np.ndarray, bits: int, axis: int, group: int) -> np.ndarray:
    """Asymmetric round-to-nearest with a scale and zero per group of ``group`` consecutive
    elements along ``axis`` (the last group may be shorter), dequantised back to float64.

    q = round((x - min) / scale), scale = (max - min) / (2^bits - 1); a constant group is exact.
    This is the KIVI / quanto layout; HQQ's optimised zero points are not emulated."""
    x = np.moveaxis(x.astype(np.float64), axis, -1)
    n = x.shape[-1]
    out = np.empty_like(x)
    levels = (1 << bits) - 1
    for s in range(0, n, group):
        g = x[..., s:s + group]
        lo = g.min(axis=-1, keepdims=True)
        hi = g.max(axis=-1, keepdims=True)
        scale = (hi - lo) / levels
        safe = np.where(scale > 0, scale, 1.0)
        out[..., s:s + group] = np.clip(np.round((g - lo) / safe), 0, levels) * scale + lo
    return np.moveaxis(out, -1, axis)


# name -> (mantissa bits, minimum normal exponent, largest finite value)
FP8_FORMATS: dict[str, tuple[int, int, float]] = {
    "e4m3": (3, -6, 448.0),  # float8_e4m3fn: bias 7, no infinities
    "e5m2": (2, -14, 57344.0),  # float8_e5m2: bias 15, IEEE-like
}


def round_fp8(x: np.ndarray, fmt: str) -> np.ndarray:
    """Round to the nearest fp8 value (ties to even), saturating at the largest finite value (a
    cast to fp8 without a scale; torch's own cast gives NaN/inf on overflow instead)."""
    man, emin, top = FP8_FORMATS[fmt]
    x = np.clip(x.astype(np.float64), -top, top)
    ax = np.abs(x)
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(ax > 0, ax, 1.0)))
    quantum = np.exp2(np.maximum(e, emin) - man)  # below 2^emin: subnormal spacing
    return np.clip(np.round(x / quantum) * quantum, -top, top)


def reconstruction(x: np.ndarray, xq: np.ndarray) -> tuple[float, float]:
    """(MSE, mean cosine over the last axis) of a reconstruction ``xq`` of ``x``."""
    a = x.astype(np.float64)
    b = xq.astype(np.float64)
    mse = float(np.mean((a - b) ** 2))
    na = np.linalg.norm(a, axis=-1)
    nb = np.linalg.norm(b, axis=-1)
    ok = (na > 0) & (nb > 0)
    cos = (a * b).sum(axis=-1)[ok] / (na[ok] * nb[ok])
    return mse, float(cos.mean()) if cos.size else float("nan")
