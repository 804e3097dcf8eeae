"""Keep-set measures for many query rows by key signature (the kernels and why:
kvtrace/kernels/_triton_whatif_pieces.py). kvtrace/kernels/whatif.py dispatches here when a KV
head has 16 or more query rows (``_triton_whatif.packed`` is false) and ``PIECES`` is on.

The plan, on the device but for one host sync: each key's signature (bit j: chunk set j keeps
it; -1: no query sees it), a stable sort of each head's keys by signature, the runs of one
signature cut into pieces of at most ``piece_keys`` keys. A chunk of sets whose keys fall into
too many short runs (segments averaging under ``MIN_SEGMENT_KEYS`` keys: many independent random
sets) is split in two and each half planned on its own; every chunk costs one attention pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# Off: the many-query rows run the shared-max kernel (_triton_whatif._keep_shared_kernel) as before.
PIECES = True
# A chunk of sets whose runs of one signature average fewer keys than this is split: a run costs a
# partly filled key block and a program of its own, so runs much shorter than a block would cost
# more than the passes the chunk saves.
MIN_SEGMENT_KEYS = 64
# Sets per chunk at most (signatures are int64; the fold kernel holds every set of a chunk).
MAX_CHUNK_SETS = 31


@dataclass
class PiecePlan:
    """Launch arguments of one call (``_triton_whatif_pieces.run_pieces`` / ``run_fold``)."""

    perm: torch.Tensor  # int32 [chunks * B * Hk, T]: each head's key indices sorted by signature
    work: torch.Tensor  # int32 [pieces, 4]: batch * KV head, perm row, first, end
    psig: torch.Tensor  # int64 [pieces]: the piece's signature
    poff: torch.Tensor  # int32 [chunks, B * Hk + 1]: first piece of each (chunk, head)
    csets: torch.Tensor  # int32 [chunks, slots]: 0, then the chunk's global sets (1-based), -1
    chunks: list[list[int]]


def _visible_any(g: Any, T: int, device: torch.device) -> torch.Tensor:
    """[T] bool: keys some query sees (the others join no piece)."""
    j = g.k_start + torch.arange(T, device=device)
    pos = g.positions.to(device)
    vis = torch.ones(T, dtype=torch.bool, device=device)
    if g.causal:
        vis &= j <= pos.max()
    if g.window:
        vis &= j > pos.min() - g.window
    return vis


def _signatures(keep8: torch.Tensor, sets: list[int], vis: torch.Tensor) -> torch.Tensor:
    """int64 [B * Hk, T]: bit j set where sets[j] keeps the key; -1 where no query sees it."""
    S, B, Hk, T = keep8.shape
    bits = (keep8[sets].ne(0).to(torch.int64) << torch.arange(len(sets), device=keep8.device)[:, None, None, None])
    sig = bits.sum(dim=0).view(B * Hk, T)
    return torch.where(vis[None, :], sig, torch.full_like(sig, -1))


def _sorted(sig: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted signatures, the permutation, run starts) of each head's keys; stable, so a run keeps
    its keys in position order (neighbouring loads)."""
    ss, perm = torch.sort(sig, dim=-1, stable=True)
    new = torch.ones_like(ss, dtype=torch.bool)
    new[:, 1:] = ss[:, 1:] != ss[:, :-1]
    return ss, perm, new


def _runs(new: torch.Tensor, ss: torch.Tensor) -> torch.Tensor:
    """Runs of one visible signature per head, the most of any head (a 0-d tensor)."""
    return (new & (ss >= 0)).sum(dim=-1).max()


def _halves(c: list[int]) -> list[list[int]]:
    return [c[: len(c) // 2], c[len(c) // 2:]]


def plan(keep8: torch.Tensor, g: Any, device: torch.device, *, piece_keys: int, unit: int,
         extra: torch.Tensor | None = None) -> tuple[PiecePlan | None, list[int]]:
    """The plan for keep-sets ``keep8`` [S, B, Hk, T] (int8) and geometry ``g``, or None when no
    query sees any key; and ``extra`` (an int tensor on the device, e.g. check flags) read in the
    same host sync, as a list."""
    S, B, Hk, T = keep8.shape
    HD = B * Hk
    vis = _visible_any(g, T, device)
    chunks = [list(range(i, min(i + MAX_CHUNK_SETS, S))) for i in range(0, S, MAX_CHUNK_SETS)]
    state: dict[int, tuple] = {}
    n_vis = vis.sum()
    todo = list(range(len(chunks)))
    extra_out: list[int] = []
    while True:
        for i in todo:
            ss, perm, new = _sorted(_signatures(keep8, chunks[i], vis))
            state[i] = (ss, perm, new)
        counts = torch.stack([n_vis, *(_runs(state[i][2], state[i][0]) for i in todo)])
        if extra is not None:
            counts = torch.cat([counts, extra.to(counts.dtype).reshape(-1)])
        got = counts.tolist()  # the host sync
        if extra is not None:
            extra_out, extra = got[1 + len(todo):], None
        n_visible, runs = got[0], got[1:1 + len(todo)]
        if n_visible == 0:
            return None, extra_out
        split = [i for i, n in zip(todo, runs, strict=True)
                 if len(chunks[i]) > 1 and n * MIN_SEGMENT_KEYS > n_visible]
        if not split:
            break
        order: list[list[int]] = []
        for i, c in enumerate(chunks):
            order.extend(_halves(c) if i in split else [c])
        old = {id(c): state[i] for i, c in enumerate(chunks) if i not in split}
        chunks = order
        state = {i: old[id(c)] for i, c in enumerate(chunks) if id(c) in old}
        todo = [i for i in range(len(chunks)) if i not in state]
    return _pieces(chunks, state, HD, T, piece_keys, unit, device), extra_out


def _pieces(chunks: list[list[int]], state: dict[int, tuple], HD: int, T: int, piece_keys: int, unit: int,
            device: torch.device) -> PiecePlan:
    C = len(chunks)
    ss = torch.stack([state[i][0] for i in range(C)])  # [C, HD, T]
    new = torch.stack([state[i][2] for i in range(C)])
    perm = torch.stack([state[i][1] for i in range(C)]).to(torch.int32).view(C * HD, T)
    at = new.nonzero()  # [runs, 3]: chunk, head, first index (row-major: sorted)
    info = torch.cat([at, ss[at[:, 0], at[:, 1], at[:, 2]][:, None]], dim=1).cpu().numpy()
    c, hd, first, sig = info[:, 0], info[:, 1], info[:, 2], info[:, 3]
    end = np.full(len(first), T, dtype=np.int64)
    same = (c[1:] == c[:-1]) & (hd[1:] == hd[:-1])
    end[:-1] = np.where(same, first[1:], T)
    seen = sig >= 0
    c, hd, first, end, sig = c[seen], hd[seen], first[seen], end[seen], sig[seen]
    per = max(unit, -(-piece_keys // unit) * unit)
    n = -(-(end - first) // per)
    seg = np.repeat(np.arange(len(first)), n)
    k = np.arange(len(seg)) - np.repeat(np.cumsum(n) - n, n)
    lo = first[seg] + k * per
    hi = np.minimum(lo + per, end[seg])
    work = np.stack([hd[seg], c[seg] * HD + hd[seg], lo, hi], axis=1).astype(np.int32)
    counts = np.bincount(c[seg] * HD + hd[seg], minlength=C * HD).reshape(C, HD)
    poff = np.zeros((C, HD + 1), dtype=np.int32)
    poff[:, 1:] = np.cumsum(counts, axis=1)
    poff += np.concatenate([[0], np.cumsum(counts.sum(axis=1))[:-1]]).astype(np.int32)[:, None]
    slots = max(2, 1 << (max(len(ch) for ch in chunks)).bit_length())
    csets = np.full((C, slots), -1, dtype=np.int32)
    csets[:, 0] = 0
    for i, ch in enumerate(chunks):
        csets[i, 1:1 + len(ch)] = np.asarray(ch) + 1
    host = torch.from_numpy(np.concatenate([work.ravel(), poff.ravel(), csets.ravel()]))
    dev = host.to(device, non_blocking=False)
    nw, npf = work.size, poff.size
    return PiecePlan(perm=perm, work=dev[:nw].view(-1, 4), psig=torch.from_numpy(sig[seg].astype(np.int64)).to(device),
                     poff=dev[nw:nw + npf].view(C, HD + 1), csets=dev[nw + npf:].view(C, slots), chunks=chunks)


def piece_keys_for(T: int, HD: int, rows_h: int, sms: int, unit: int, num_splits: int | None) -> int:
    """Keys per piece: ``T / num_splits`` when asked, else enough pieces for ~4 programs per SM
    (64-row blocks), at least 4 key blocks a piece."""
    if num_splits:
        return max(unit, -(-T // max(1, num_splits)))
    row_blocks = -(-rows_h // 64)
    target = max(1, -(-4 * sms // max(1, row_blocks)))
    return max(4 * unit, -(-HD * T // target))


def runner(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, g: Any,
           num_splits: int | None = None):
    """Checks, conversions, the plan and the output buffers of one call, and the launches as a
    callable returning (recall, error) ``[S, B, Hq, Tq]`` fp32. ``g``: whatif._geometry's."""
    from kvtrace.kernels import _triton_whatif as tw
    from kvtrace.kernels import _triton_whatif_pieces as tp
    from kvtrace.kernels import whatif as W

    if abs(g.k_start) >= W._LIMIT or g.T >= W._LIMIT:
        raise ValueError("positions and lengths must be below 2**29 for the Triton path")
    q, k, v = (x if x.is_contiguous() else x.contiguous() for x in (q, k, v))
    positions = g.positions.contiguous()
    shape = (keep.shape[0], g.B, g.Hq, g.Tq)
    if g.B * g.Hq * g.Tq == 0 or g.T == 0:  # nothing to see: recall 0, error NaN (||o|| = 0)
        recall = torch.zeros(shape, dtype=torch.float32, device=q.device)
        return lambda: (recall, torch.full_like(recall, float("nan")))
    fp32 = [x if x.dtype == torch.float32 else None for x in (q, k, v)]
    # The position bound and whether fp32 tensors hold bf16 values, read in the plan's one sync.
    flags = tw.run_grid_check(*fp32, positions, W._LIMIT, W._sms(q.device), sync=False)
    keep8 = W._keep_arg(keep)
    rows_h = g.group * g.Tq
    unit = tp.unit()
    pk = piece_keys_for(g.T, g.B * g.Hk, rows_h, W._sms(q.device), unit, num_splits)
    pl_, bits = plan(keep8, g, q.device, piece_keys=pk, unit=unit, extra=flags)
    got = 0
    for f in bits:
        got |= int(f)
    if got & 1:
        raise ValueError("positions and lengths must be below 2**29 for the Triton path")
    bf16 = [x.dtype == torch.bfloat16 or (x.dtype == torch.float32 and not got & bit)
            for x, bit in zip((q, k, v), (2, 4, 8), strict=True)]
    recall = torch.zeros(shape, dtype=torch.float32, device=q.device)
    err = torch.full_like(recall, float("nan"))
    if pl_ is None:  # no query sees a key: recall 0, error NaN (||o|| = 0)
        return lambda: (recall, err)
    dt = W._kernel_dtype(q, k)
    as_bf16 = dt == torch.float32 and bf16[0] and bf16[1]
    cast_q, cast_k = as_bf16 and q.dtype == torch.float32, as_bf16 and k.dtype == torch.float32
    if not as_bf16:
        q, k = q.to(dt), k.to(dt)
    vt = v.dtype if v.dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float32
    cast_v = v.dtype == torch.float32 and bf16[2]
    v = v.to(vt)
    n_pieces, dv = pl_.work.shape[0], v.shape[3]
    pm = torch.empty(n_pieces * rows_h, dtype=torch.float32, device=q.device)
    pls = torch.empty_like(pm)
    pacc = torch.empty(n_pieces * rows_h * dv, dtype=torch.float32, device=q.device)
    window = None if g.window is None else min(g.window, W._LIMIT)

    def launch() -> tuple[torch.Tensor, torch.Tensor]:
        tp.run_pieces(q, k, v, pl_.perm, pl_.work, positions, pm, pls, pacc, group=g.group, scale=g.scale,
                      k_start=g.k_start, window=window, causal=g.causal, rows_h=rows_h, cast_q=cast_q,
                      cast_k=cast_k, cast_v=cast_v)
        tp.run_fold(pm, pls, pacc, pl_.psig, pl_.poff, pl_.csets, recall, err, rows_h=rows_h,
                    n_heads=g.B * g.Hk, dv=dv)
        return recall, err

    return launch
