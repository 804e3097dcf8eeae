"""Report-ready analyses built on the kernels: dead KV heads, attention-entropy classes, eviction
what-ifs (H2O and StreamingLLM sinks + window).

Every result is a frozen dataclass of plain Python numbers (``to_dict()`` for JSON). The
``*_from_*`` functions take precomputed statistics as numpy arrays (or torch tensors) and need
only numpy; :func:`kv_head_report` and :func:`attention_report` take raw tensors, use the kernels
when torch is importable and the numpy versions otherwise. Thresholds are justified in
docs/kernels.md.

Bytes always count K and V: ``tokens * kv_heads * head_dim * dtype_bytes * 2`` (times batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "DEAD_HEAD_RATIO",
    "HIGH_ENTROPY",
    "LOW_ENTROPY",
    "DeadHeads",
    "EntropyHeads",
    "EvictionPlan",
    "attention_report",
    "classify_entropy",
    "dead_heads_from_means",
    "h2o_eviction",
    "kv_head_report",
    "streaming_eviction",
]

# A head whose mean norm is under 10% of its layer's median head contributes at most ~1% of a
# typical head's energy (0.1^2) -- see docs/kernels.md.
DEAD_HEAD_RATIO = 0.1
# Mean normalised entropy below 0.3: the effective number of attended keys exp(H) is at most
# n^0.3 (about 12 of 4096, 22 of 32768): sink + local heads. Above 0.7: broad / retrieval heads.
LOW_ENTROPY = 0.3
HIGH_ENTROPY = 0.7


def _np(x: Any) -> np.ndarray:
    """numpy float64 view of a numpy array, sequence or torch tensor (without importing torch)."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def _ints(a: np.ndarray) -> tuple[int, ...]:
    return tuple(int(v) for v in a)


def _floats(a: np.ndarray) -> tuple[float, ...]:
    return tuple(float(v) for v in a)


class _Dict:
    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}


# --------------------------------------------------------------------------------- dead heads


@dataclass(frozen=True)
class DeadHeads(_Dict):
    basis: str  # "v", "k", "either" (k or v dead) or "both" (k and v dead)
    threshold: float
    key_ratio: tuple[float, ...] | None  # per KV head: mean K norm / layer median
    value_ratio: tuple[float, ...] | None  # per KV head: mean V norm / layer median
    dead: tuple[int, ...]  # flagged KV head indices
    tokens: int
    batch: int
    head_dim: int  # K width
    value_dim: int  # V width (equal to head_dim except in some MLA-expanded caches)
    dtype_bytes: int
    bytes_per_head: int  # K+V bytes one KV head holds in this layer
    bytes_dead: int
    layer: int | None = None


def _ratios(head_means: Any) -> np.ndarray:
    m = _np(head_means)
    if m.ndim == 2:  # [B, H]: average the batch
        m = m.mean(axis=0)
    if m.ndim != 1:
        raise ValueError(f"head means must be [H] or [B, H], got shape {m.shape}")
    med = float(np.median(m)) if m.size else 0.0
    if med > 0:
        return m / med
    # Median 0: more than half the heads are all-zero; those are dead, the rest are not.
    return np.where(m > 0, np.inf, 0.0)


def dead_heads_from_means(
    key_means: Any | None = None, value_means: Any | None = None, *, tokens: int, head_dim: int,
    dtype_bytes: int, value_dim: int | None = None, batch: int = 1,
    threshold: float = DEAD_HEAD_RATIO, basis: str = "v", layer: int | None = None,
) -> DeadHeads:
    """Flag KV heads whose mean token norm / the layer's median head mean is below ``threshold``.

    ``basis="v"`` (default) looks at V: a head whose values are ~0 adds ~nothing to the output
    whatever its attention pattern, while a near-zero K only flattens attention (still useful).
    """
    if basis not in ("k", "v", "either", "both"):
        raise ValueError(f"basis must be k, v, either or both, got {basis!r}")
    kr = _ratios(key_means) if key_means is not None else None
    vr = _ratios(value_means) if value_means is not None else None
    if basis in ("k", "either", "both") and kr is None:
        raise ValueError(f"basis={basis!r} needs key_means")
    if basis in ("v", "either", "both") and vr is None:
        raise ValueError(f"basis={basis!r} needs value_means")
    if kr is not None and vr is not None and kr.size != vr.size:
        raise ValueError("key_means and value_means have different head counts")
    k_dead = kr < threshold if kr is not None else None
    v_dead = vr < threshold if vr is not None else None
    flags = {"k": k_dead, "v": v_dead}.get(basis)
    if basis == "either":
        flags = k_dead | v_dead
    elif basis == "both":
        flags = k_dead & v_dead
    dead = np.flatnonzero(flags)
    vdim = int(head_dim if value_dim is None else value_dim)
    per_head = int(batch) * int(tokens) * (int(head_dim) + vdim) * int(dtype_bytes)
    return DeadHeads(
        basis=basis, threshold=float(threshold),
        key_ratio=_floats(kr) if kr is not None else None,
        value_ratio=_floats(vr) if vr is not None else None,
        dead=_ints(dead), tokens=int(tokens), batch=int(batch), head_dim=int(head_dim),
        value_dim=vdim, dtype_bytes=int(dtype_bytes), bytes_per_head=per_head, bytes_dead=per_head * int(dead.size),
        layer=layer,
    )


def _head_means(x: Any, backend: str) -> tuple[np.ndarray, tuple[int, ...], int]:
    """Per-head mean norms [B, H] (numpy), shape [B, H, T, D], element bytes."""
    if hasattr(x, "detach"):  # torch tensor: use the kernel
        from kvtrace.kernels.norms import head_norms

        x4 = x if x.dim() == 4 else x.unsqueeze(0)
        return _np(head_norms(x4, backend=backend).head_mean), tuple(x4.shape), x4.element_size()
    from kvtrace.kernels.numpy_ref import head_norms_numpy

    a = np.asarray(x)
    a4 = a if a.ndim == 4 else a[None]
    return head_norms_numpy(a4)[1], a4.shape, a4.dtype.itemsize


def kv_head_report(
    keys: Any, values: Any, *, threshold: float = DEAD_HEAD_RATIO, basis: str = "v",
    dtype_bytes: int | None = None, layer: int | None = None, backend: str = "auto",
) -> DeadHeads:
    """Dead-head check for one layer from its K and V (``[B, H, T, D]`` tensors or arrays).

    ``dtype_bytes`` defaults to the element size of ``keys`` (pass the cache's real dtype size
    when the tensors were upcast after sampling).
    """
    km, kshape, kbytes = _head_means(keys, backend)
    vm, vshape, _ = _head_means(values, backend)
    if kshape[:3] != vshape[:3]:
        raise ValueError(f"keys {kshape} and values {vshape} disagree on [B, H, T]")
    B, _, T, D = kshape
    return dead_heads_from_means(
        km, vm, tokens=T, head_dim=D, value_dim=vshape[3],
        dtype_bytes=kbytes if dtype_bytes is None else dtype_bytes, batch=B, threshold=threshold,
        basis=basis, layer=layer,
    )


# ------------------------------------------------------------------------------ entropy classes


@dataclass(frozen=True)
class EntropyHeads(_Dict):
    low_threshold: float
    high_threshold: float
    mean_norm_entropy: tuple[float, ...]  # per query head, over batch and queries with n_visible > 1
    low: tuple[int, ...]  # query heads below low_threshold ("streaming": sinks + local)
    mixed: tuple[int, ...]
    high: tuple[int, ...]  # query heads at or above high_threshold (broad / retrieval)
    kv_low: tuple[int, ...]  # KV heads all of whose query heads are low
    queries_used: int  # queries with more than one visible key


def classify_entropy(
    norm_entropy: Any, *, n_visible: Any | None = None, kv_heads: int | None = None,
    low: float = LOW_ENTROPY, high: float = HIGH_ENTROPY,
) -> EntropyHeads:
    """Classify query heads by mean normalised entropy (``[B, Hq, Tq]``, ``[Hq, Tq]`` or ``[Hq]``).

    Queries with ``n_visible <= 1`` are left out: their normalised entropy is 0 by definition and
    says nothing about the head. ``kv_heads`` (default: Hq, i.e. MHA) maps heads to KV groups.
    """
    e = _np(norm_entropy)
    if e.ndim == 1:
        e = e[None, :, None]
    elif e.ndim == 2:
        e = e[None]
    if e.ndim != 3:
        raise ValueError(f"norm_entropy must be [B, Hq, Tq], [Hq, Tq] or [Hq], got {e.shape}")
    keep = np.ones(e.shape[2], dtype=bool) if n_visible is None else _np(n_visible).reshape(-1) > 1
    if keep.size != e.shape[2]:
        raise ValueError("n_visible must have one entry per query")
    hq = e.shape[1]
    if keep.any():
        means = e[:, :, keep].mean(axis=(0, 2))
    else:
        means = np.full(hq, np.nan)
    hkv = hq if kv_heads is None else int(kv_heads)
    if hkv <= 0 or hq % hkv:
        raise ValueError(f"{hq} query heads cannot be grouped into {hkv} KV heads")
    is_low = means < low
    is_high = means >= high
    kv_low = np.flatnonzero(is_low.reshape(hkv, hq // hkv).all(axis=1))
    return EntropyHeads(
        low_threshold=float(low), high_threshold=float(high), mean_norm_entropy=_floats(means),
        low=_ints(np.flatnonzero(is_low)), mixed=_ints(np.flatnonzero(~is_low & ~is_high & ~np.isnan(means))),
        high=_ints(np.flatnonzero(is_high)), kv_low=_ints(kv_low), queries_used=int(keep.sum()),
    )


# ------------------------------------------------------------------------------------ eviction


@dataclass(frozen=True)
class EvictionPlan(_Dict):
    policy: str  # "h2o" or "streaming"
    tokens: int  # cached tokens per sequence
    kept: int  # per sequence and KV head
    evicted: int
    kv_heads: int
    batch: int
    head_dim: int
    dtype_bytes: int
    bytes_total: int
    bytes_freed: int
    # Share of the received attention mass (summed over sampled queries) that the kept tokens
    # hold, per (sequence, KV head) row: mean and worst row. None without attention samples.
    mass_retained_mean: float | None
    mass_retained_min: float | None
    params: dict[str, int] = field(default_factory=dict)


def _count(value: int | float, total: int, name: str) -> int:
    """Ints are token counts; floats in [0, 1] are fractions of ``total`` (rounded up)."""
    if isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative int or a fraction in [0, 1], got {value!r}")
    if isinstance(value, float):
        if value > 1.0:
            raise ValueError(f"{name}={value}: floats are fractions in [0, 1]; pass an int for a count")
        return int(np.ceil(value * total))
    return int(value)


def _plan(policy: str, *, tokens: int, kept: int, kv_heads: int, batch: int, head_dim: int,
          dtype_bytes: int, retained: np.ndarray | None, params: dict[str, int]) -> EvictionPlan:
    kept = min(tokens, kept)
    per_token = kv_heads * head_dim * dtype_bytes * 2 * batch
    mean = mn = None
    if retained is not None:
        r = retained[np.isfinite(retained)]
        if r.size:
            mean, mn = float(r.mean()), float(r.min())
    return EvictionPlan(
        policy=policy, tokens=int(tokens), kept=int(kept), evicted=int(tokens - kept),
        kv_heads=int(kv_heads), batch=int(batch), head_dim=int(head_dim), dtype_bytes=int(dtype_bytes),
        bytes_total=int(tokens * per_token), bytes_freed=int((tokens - kept) * per_token),
        mass_retained_mean=mean, mass_retained_min=mn, params=params,
    )


def _mass_rows(received: Any) -> np.ndarray:
    m = _np(received)
    if m.ndim == 2:
        m = m[None]
    if m.ndim != 3:
        raise ValueError(f"received must be [Hkv, Tk] or [B, Hkv, Tk], got {m.shape}")
    return m


def _retained(mass: np.ndarray, keep: np.ndarray) -> np.ndarray:
    total = mass.sum(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(total > 0, (mass * keep).sum(axis=-1) / total, np.nan).ravel()


def h2o_eviction(
    received: Any, *, head_dim: int, dtype_bytes: int, heavy: int | float = 0.1,
    recent: int | float = 0.1,
) -> EvictionPlan:
    """H2O what-if: per (sequence, KV head) keep the ``recent`` newest tokens plus the ``heavy``
    tokens with the most received mass among the others; evict the rest.

    ``received``: ``[Hkv, Tk]`` or ``[B, Hkv, Tk]`` (from ``attention_stats``). ``heavy`` and
    ``recent`` are token counts (int) or fractions of Tk (float); the default 10% + 10% is the H2O
    paper's 20% budget.
    """
    mass = _mass_rows(received)
    B, H, T = mass.shape
    n_heavy, n_recent = _count(heavy, T, "heavy"), _count(recent, T, "recent")
    n_recent = min(n_recent, T)
    keep = np.zeros_like(mass, dtype=bool)
    if n_recent:
        keep[..., T - n_recent:] = True
    older = T - n_recent
    h = min(n_heavy, older)
    if h:
        # Top-h of the older tokens per row; argpartition is O(T) per row.
        idx = np.argpartition(-mass[..., :older], h - 1, axis=-1)[..., :h]
        np.put_along_axis(keep[..., :older], idx, True, axis=-1)
    return _plan("h2o", tokens=T, kept=n_recent + h, kv_heads=H, batch=B, head_dim=head_dim,
                 dtype_bytes=dtype_bytes, retained=_retained(mass, keep),
                 params={"heavy": n_heavy, "recent": n_recent})


def streaming_eviction(
    tokens: int | None = None, *, kv_heads: int | None = None, head_dim: int, dtype_bytes: int,
    sinks: int = 4, recent: int | float = 1020, batch: int = 1, received: Any | None = None,
) -> EvictionPlan:
    """StreamingLLM what-if: keep the first ``sinks`` tokens and the last ``recent`` tokens.

    Defaults (4 sinks + 1020 recent = a 1024-token cache) follow the StreamingLLM paper. With
    ``received`` (``[Hkv, Tk]`` or ``[B, Hkv, Tk]``), ``tokens``, ``kv_heads`` and ``batch`` come
    from its shape and the retained attention mass is reported.
    """
    retained = None
    if received is not None:
        mass = _mass_rows(received)
        batch, kv_heads, tokens = mass.shape
    if tokens is None or kv_heads is None:
        raise ValueError("give tokens and kv_heads, or received")
    T = int(tokens)
    n_recent = min(_count(recent, T, "recent"), T)
    n_sinks = min(int(sinks), T - n_recent)
    if received is not None:
        keep = np.zeros(T, dtype=bool)
        keep[:n_sinks] = True
        if n_recent:
            keep[T - n_recent:] = True
        retained = _retained(mass, keep)
    return _plan("streaming", tokens=T, kept=n_sinks + n_recent, kv_heads=int(kv_heads),
                 batch=int(batch), head_dim=head_dim, dtype_bytes=dtype_bytes, retained=retained,
                 params={"sinks": int(sinks), "recent": n_recent})


# ------------------------------------------------------------------------- tensor-level report


def attention_report(
    q: Any, k: Any, *, q_offset: int | None = None, q_positions: Sequence[int] | None = None,
    causal: bool = True, window: int | None = None, scale: float | None = None,
    dtype_bytes: int | None = None, head_dim: int | None = None, heavy: int | float = 0.1,
    recent: int | float = 0.1, sinks: int = 4, stream_recent: int | float = 1020,
    low: float = LOW_ENTROPY, high: float = HIGH_ENTROPY, backend: str = "auto",
) -> dict[str, Any]:
    """Entropy classes and eviction what-ifs for one layer from sampled queries and its keys.

    Returns ``{"entropy": EntropyHeads, "h2o": EvictionPlan, "streaming": EvictionPlan}``.
    ``dtype_bytes`` defaults to the element size of ``k``; ``head_dim`` (the cached V/K width used
    for bytes) to ``k``'s last dim. Uses the torch/Triton kernels when given torch tensors, the
    numpy implementation otherwise.
    """
    kw = dict(q_offset=q_offset, q_positions=q_positions, causal=causal, window=window, scale=scale)
    if hasattr(q, "detach"):
        from kvtrace.kernels.attention import attention_stats

        st = attention_stats(q, k, backend=backend, **kw)
        norm, n_vis, mass = st.norm_entropy, st.n_visible, st.received
        elem = k.element_size()
    else:
        from kvtrace.kernels.numpy_ref import attention_stats_numpy

        d = attention_stats_numpy(q, k, **kw)
        norm, n_vis, mass = d["norm_entropy"], d["n_visible"], d["received"]
        elem = np.asarray(k).dtype.itemsize
    mass_np = _np(mass)
    if mass_np.ndim == 2:
        mass_np = mass_np[None]
    kv_heads = mass_np.shape[1]
    hd = int(head_dim if head_dim is not None else k.shape[-1])
    nb = int(dtype_bytes if dtype_bytes is not None else elem)
    return {
        "entropy": classify_entropy(norm, n_visible=n_vis, kv_heads=kv_heads, low=low, high=high),
        "h2o": h2o_eviction(mass_np, head_dim=hd, dtype_bytes=nb, heavy=heavy, recent=recent),
        "streaming": streaming_eviction(head_dim=hd, dtype_bytes=nb, sinks=sinks, recent=stream_recent,
                                        received=mass_np),
    }
