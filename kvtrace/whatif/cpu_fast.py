"""The exact CPU numerics of the what-if replay, fast: the same float64 definitions as numerics.py,
computed with torch's CPU kernels where torch is installed (its vectorised exp is ~3x numpy's on
float64, and batched matmuls replace numpy's einsum), arranged so that work is shared:

* grouped-query attention without copying K/V per query head (queries of a KV head's group are
  stacked into one matmul against that head's keys);
* causal blocks: a chunk of queries sorted by position reads only the keys some of them see;
* :func:`keep_measures_many`: the full softmax of a chunk once, then every keep-set's recall and
  output from two matmuls against all sets at once (``P @ keep`` and ``P @ (keep * V)``: the
  softmax restricted to the kept keys is ``p_j / sum_kept p`` -- the same quantity);
* :func:`column_sums`: the attention each key receives summed over many queries, in causal blocks.

Results equal numerics.py's up to float64 summation order (~1e-16 relative; tests compare both).
Without torch (``kvtrace whatif`` runs where only numpy is) :func:`available` is False and the
callers use numerics.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["available", "column_sums", "keep_measures_many", "output_error", "probs"]

# Elements of one [B, Hq, queries, keys] float64 block (8 MiB): blocks that stay in the CPU's
# caches run the matmul and softmax ~3x faster per element than 128 MiB ones (measured here).
BLOCK_ELEMENTS = 1 << 20
# A kept mass below this is recomputed directly (numerics.py): p / sum would lose the row's scale.
TINY_MASS = 1e-200

_torch: Any = None


def available() -> bool:
    """torch importable (imported once, lazily)."""
    global _torch
    if _torch is None:
        try:
            import torch
        except ImportError:
            _torch = False
        else:
            _torch = torch
    return _torch is not False


class _OneThread:
    """torch's intra-op threads set to one for the block: on cache-sized blocks a second thread
    costs more CPU time than it saves (measured on 2 cores: 3.1 s of CPU against 0.75 s for one
    unit's column sums at 8k tokens); restored after."""

    def __enter__(self) -> None:
        self.saved = _torch.get_num_threads()
        if self.saved != 1:
            _torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        if self.saved != 1:
            _torch.set_num_threads(self.saved)


def single_threaded(fn: Any) -> Any:
    import functools

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _OneThread():
            return fn(*args, **kwargs)

    return run


def _t(a: np.ndarray) -> Any:
    return _torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64))


def _vis(q_pos: np.ndarray, k_pos: np.ndarray, window: int | None) -> Any:
    qp = _torch.from_numpy(np.asarray(q_pos, dtype=np.int64))[:, None]
    kp = _torch.from_numpy(np.asarray(k_pos, dtype=np.int64))[None, :]
    vis = kp <= qp
    if window:
        vis &= kp > qp - window
    return vis


def _masked_softmax(q: Any, k: Any, vis: Any, scale: float) -> Any:
    """Softmax [B, Hk, G, Tq, T] of grouped queries ``q`` [B, Hk, G, Tq, D] over ``k`` [B, Hk, T, D]
    where ``vis`` [Tq, T]; all-zero rows where nothing is visible."""
    B, hk, g, tq, d = q.shape
    logits = (q.reshape(B, hk, g * tq, d) @ k.transpose(-1, -2)).reshape(B, hk, g, tq, -1) * scale
    logits.masked_fill_(~vis, float("-inf"))
    p = _torch.softmax(logits, dim=-1)
    return _torch.nan_to_num_(p, nan=0.0) if not bool(vis.any(dim=-1).all()) else p


def _grouped(q: np.ndarray, hk: int) -> Any:
    B, hq, tq, d = q.shape
    if hq % hk:
        raise ValueError(f"{hq} query heads do not divide into {hk} KV heads")
    return _t(q).reshape(B, hk, hq // hk, tq, d)


def _key_span(q_pos: np.ndarray, k_pos: np.ndarray, window: int | None) -> tuple[int, int]:
    """[lo, hi) of the (ascending, contiguous-or-not) keys some query of ``q_pos`` may see."""
    hi = int(np.searchsorted(k_pos, int(np.max(q_pos)), side="right"))
    lo = int(np.searchsorted(k_pos, int(np.min(q_pos)) - window, side="right")) if window else 0
    return lo, max(lo, hi)


def _block_rows(ps: np.ndarray, k_pos: np.ndarray, window: int | None, budget: int) -> int:
    """Queries (sorted positions ``ps``) of the next block: as many as keep rows x keys they read
    within ``budget`` (at least one)."""
    cand = ps[:max(1, budget)]
    hi = np.searchsorted(k_pos, cand, side="right")
    lo = int(np.searchsorted(k_pos, int(cand[0]) - window, side="right")) if window else 0
    ok = np.arange(1, len(cand) + 1) * np.maximum(hi - lo, 1) <= budget
    return max(1, int(np.argmin(ok)) if not ok.all() else len(cand))


def _rows_per_block(q: np.ndarray, T: int) -> int:
    return max(1, BLOCK_ELEMENTS // max(1, q.shape[0] * q.shape[1] * T))


@single_threaded
def probs(q: np.ndarray, k: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray, window: int | None,
          scale: float) -> tuple[np.ndarray, np.ndarray]:
    """numerics.attention_probs with its visibility: softmax [B, Hq, Tq, T] and vis [Tq, T]."""
    vis = _vis(q_pos, k_pos, window)
    p = _masked_softmax(_grouped(q, k.shape[1]), _t(k), vis, scale)
    B, hk, g, tq, T = p.shape
    return p.reshape(B, hk * g, tq, T).numpy(), vis.numpy()


@single_threaded
def column_sums(q: np.ndarray, k: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray, window: int | None,
                scale: float) -> tuple[np.ndarray, np.ndarray]:
    """numerics.column_sums: (softmax weights summed over the queries [B, Hq, T], queries that see
    each key [T]), in causal blocks of queries sorted by position: a block reads the keys some of
    its queries see, and masks only the keys not all of them see."""
    B, hq = q.shape[:2]
    hk, T = k.shape[1], k.shape[2]
    g = hq // hk
    total = _torch.zeros((B, hk, g, T), dtype=_torch.float64)
    count = np.zeros(T)
    if q.shape[2] == 0 or T == 0:
        return total.reshape(B, hq, T).numpy(), count
    k_pos = np.asarray(k_pos, dtype=np.int64)
    order = np.argsort(q_pos, kind="stable")
    ps = np.asarray(q_pos, dtype=np.int64)[order]
    qs = _grouped(q[:, :, order] * scale, hk)  # [B, Hk, G, Tq, D], the scale folded in
    kt = _t(k)
    i = 0
    while i < len(ps):
        n = _block_rows(ps[i:], k_pos, window, BLOCK_ELEMENTS // max(1, B * hq))
        blk = ps[i:i + n]
        lo, hi = _key_span(blk, k_pos, window)
        if hi > lo:
            # keys every query of the block sees: [a, b) -- only the rest needs the mask
            a = int(np.searchsorted(k_pos, int(blk[-1]) - window, side="right")) if window else lo
            b = int(np.searchsorted(k_pos, int(blk[0]), side="right"))
            a, b = max(a, lo), min(max(b, lo), hi)
            B_, h_, g_, m, d = qs[:, :, :, i:i + n].shape
            logits = (qs[:, :, :, i:i + n].reshape(B_, h_, g_ * m, d) @ kt[:, :, lo:hi].transpose(-1, -2))
            logits = logits.reshape(B_, h_, g_, m, hi - lo)
            seen = _torch.zeros(hi - lo, dtype=_torch.float64)
            if b > a:
                seen[a - lo:b - lo] = m
            for x, y in ((lo, a), (max(b, a), hi)):
                if y > x:
                    vis = _vis(blk, k_pos[x:y], window)
                    logits[..., x - lo:y - lo].masked_fill_(~vis, float("-inf"))
                    seen[x - lo:y - lo] = vis.sum(dim=0).to(_torch.float64)
            p = _torch.softmax(logits, dim=-1)
            if b <= a:  # a query may see none of these keys: its row is all -inf (NaN after softmax)
                _torch.nan_to_num_(p, nan=0.0)
            total[..., lo:hi] += p.sum(dim=3)
            count[lo:hi] += seen.numpy()
        i += len(blk)
    return total.reshape(B, hq, T).numpy(), count


def _by_rows(fn: Any, q: np.ndarray, q_pos: np.ndarray, T: int) -> Any:
    """``fn(q block, q_pos block)`` over blocks of queries of about BLOCK_ELEMENTS, its arrays
    (or lists of pairs of arrays) joined along the query axis (2)."""
    n = _rows_per_block(q, T)
    parts = [fn(q[:, :, i:i + n], q_pos[i:i + n]) for i in range(0, max(1, q.shape[2]), n)]
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts, axis=2)
    return [tuple(np.concatenate([p[s][j] for p in parts], axis=2) for j in range(2)) for s in range(len(parts[0]))]


@single_threaded
def keep_measures_many(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray,
                       window: int | None, scale: float, keeps: Sequence[np.ndarray]
                       ) -> list[tuple[np.ndarray, np.ndarray]]:
    """numerics.keep_measures of every keep-set [B, Hk, T]: (recall, output error) [B, Hq, Tq]
    each, from one softmax per block of queries."""
    if not len(keeps):
        return []
    q_pos = np.asarray(q_pos)
    return _by_rows(lambda qb, pb: _keep_block(qb, k, v, pb, k_pos, window, scale, keeps), q, q_pos, k.shape[2])


def _keep_block(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray,
                window: int | None, scale: float, keeps: Sequence[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    B, hq, tq, _ = q.shape
    hk, T, dv = k.shape[1], k.shape[2], v.shape[3]
    g = hq // hk
    S = len(keeps)
    p = _masked_softmax(_grouped(q, hk), _t(k), _vis(q_pos, k_pos, window), scale)  # [B, Hk, G, Tq, T]
    pf = p.reshape(B, hk, g * tq, T)
    vt = _t(v)
    o = (pf @ vt).reshape(B, hk, g, tq, dv)
    km = _torch.from_numpy(np.stack([np.asarray(x, dtype=np.float64) for x in keeps], axis=-1))  # [B, Hk, T, S]
    kv = (km[..., None] * vt[:, :, :, None, :]).reshape(B, hk, T, S * dv)
    both = pf @ _torch.cat([km, kv], dim=-1)  # [B, Hk, G*Tq, S + S*Dv]
    mass = both[..., :S].reshape(B, hk, g, tq, S)
    num = both[..., S:].reshape(B, hk, g, tq, S, dv)
    o2 = num / _torch.where(mass > 0, mass, 1.0)[..., None]
    den = _torch.linalg.vector_norm(o, dim=-1)[..., None]  # [B, Hk, G, Tq, 1]
    err = _torch.linalg.vector_norm(o2 - o[..., None, :], dim=-1)
    err = _torch.where(den > 0, err / _torch.where(den > 0, den, 1.0), float("nan"))
    rec = mass.reshape(B, hq, tq, S).numpy()
    err_np = err.reshape(B, hq, tq, S).numpy()
    out = [(rec[..., s], err_np[..., s]) for s in range(S)]
    tiny = ((mass > 0) & (mass <= TINY_MASS)).reshape(B, hq, tq, S).numpy()  # 0: nothing kept visible, o' = 0
    if tiny.any():  # a kept mass at the edge of float64's range: the direct definition
        from kvtrace.whatif import numerics as N

        vis = N.visible_mask(q_pos, k_pos, window)
        for s in np.flatnonzero(tiny.any(axis=(0, 1, 2))):
            r2, e2 = N.keep_measures(q, k, v, vis, scale, keeps[s])
            out[s] = (np.where(tiny[..., s], r2, out[s][0]), np.where(tiny[..., s], e2, out[s][1]))
    return out


@single_threaded
def output_error(q: np.ndarray, k: np.ndarray, v: np.ndarray, k2: np.ndarray, v2: np.ndarray, q_pos: np.ndarray,
                 k_pos: np.ndarray, window: int | None, scale: float) -> np.ndarray:
    """numerics.output_error: ||o' - o|| / ||o|| [B, Hq, Tq] with (k2, v2) against (k, v)."""
    q_pos = np.asarray(q_pos)
    return _by_rows(lambda qb, pb: _error_block(qb, k, v, k2, v2, pb, k_pos, window, scale), q, q_pos, k.shape[2])


def _error_block(q: np.ndarray, k: np.ndarray, v: np.ndarray, k2: np.ndarray, v2: np.ndarray, q_pos: np.ndarray,
                 k_pos: np.ndarray, window: int | None, scale: float) -> np.ndarray:
    B, hq, tq, _ = q.shape
    hk = k.shape[1]
    vis = _vis(q_pos, k_pos, window)
    qg = _grouped(q, hk)

    def out(kk: np.ndarray, vv: np.ndarray) -> Any:
        p = _masked_softmax(qg, _t(kk), vis, scale)
        b, h, g, n, T = p.shape
        return (p.reshape(b, h, g * n, T) @ _t(vv)).reshape(B, hq, tq, -1)

    o = _reference(q, k, v, q_pos, k_pos, window, scale, lambda: out(k, v))
    o2 = out(k2, v2)
    num = _torch.linalg.vector_norm(o2 - o, dim=-1)
    den = _torch.linalg.vector_norm(o, dim=-1)
    return _torch.where(den > 0, num / _torch.where(den > 0, den, 1.0), float("nan")).numpy()


# The last reference output (attention over the unchanged K/V), kept for the next quantiser of the
# same unit and block: (identity of the inputs, the arrays themselves -- held, so the identity
# cannot be reused by other data while cached --, the output).
_last_ref: list[Any] = [None, None, None]


def _ident(a: np.ndarray) -> tuple[Any, ...]:
    return (a.__array_interface__["data"][0], a.shape, a.strides, a.dtype.str)


def _reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray,
               window: int | None, scale: float, compute: Any) -> Any:
    key = (_ident(q), _ident(k), _ident(v), np.asarray(q_pos).tobytes(), np.asarray(k_pos).tobytes(), window, scale)
    if _last_ref[0] != key:
        _last_ref[:] = [key, (q, k, v), compute()]
    return _last_ref[2]
