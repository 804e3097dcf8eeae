"""Keep-set measures for many query rows by key signature (the kernels and why:
kvtrace/kernels/_triton_whatif_pieces.py). kvtrace/kernels/whatif.py dispatches here when a KV
head has 16 or more query rows (``_triton_whatif.packed`` is false) and ``KernelConfig.pieces``
asks for it (True: always; "auto": where :func:`pays` says it beats the shared-max kernel).

The plan, on the device but for one host sync: each key's signature (bit j: chunk set j keeps
it; -1: no query sees it), a stable sort of each head's keys by signature, the runs of one
signature cut into pieces of at most ``piece_keys`` keys. A chunk of sets whose keys fall into
too many short runs (segments averaging under ``MIN_SEGMENT_KEYS`` keys: many independent random
sets) is split in two and each half planned on its own; every chunk costs one attention pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# Per-call cost model, from the H200 probe at 55eada5 (bench/results/whatif_pieces_probe_h200_55eada5.json,
# whole calls, host glue included, 9 sets + the full one): the shared-max kernel ~0.4 ms + 4.5 ps per
# (set x query row x key) -- 3.87 ms at 32k keys x 64 queries, 1.25 at 32k x 16, 0.84 at 4k x 64 --; this
# path ~1.0 ms (its plan: a sort, a sync, six launches) + 17 ps per (query row x key) -- 2.17, 1.62, 1.07.
SHARED_PS_PER_SET_ROW_KEY = 4.5
PIECES_PS_PER_ROW_KEY = 17.0
PIECES_EXTRA_US = 600.0
# A chunk of sets whose runs of one signature average fewer keys than this is split: a run costs a
# partly filled key block and a program of its own, so runs much shorter than a block would cost
# more than the passes the chunk saves.
MIN_SEGMENT_KEYS = 64
# Sets per chunk at most (signatures are int64; the fold kernel holds every set of a chunk).
MAX_CHUNK_SETS = 31
# The piece states (pieces x query rows of a head x (Dv + 2) fp32) above this: the shared-max kernel
# answers instead (memory O(rows x sets)). Many independent sets split into many chunks, each with
# its own pieces; the replay's query chunks keep real calls far below it.
PIECES_MAX_BYTES = 1 << 30


@dataclass
class PiecePlan:
    """Launch arguments of one call (``_triton_whatif_pieces.run_pieces`` / ``run_fold``)."""

    perm: torch.Tensor  # int64 [chunks * B * Hk, T]: each head's key indices sorted by signature
    work: torch.Tensor  # int32 [pieces, 4]: batch * KV head, perm row, first, end
    psig: torch.Tensor  # int64 [pieces]: the piece's signature
    first: torch.Tensor  # int32 [chunks * B * Hk + 1]: first piece of each (chunk, head), then the count
    csets: torch.Tensor  # int32 [chunks, slots]: 0, then the chunk's global sets (1-based), -1
    chunks: list[list[int]]


def _halves(c: list[int]) -> list[list[int]]:
    return [c[: len(c) // 2], c[len(c) // 2:]]


_CACHE: dict[tuple, torch.Tensor] = {}


def _cached(key: tuple, make) -> torch.Tensor:
    """Small constant device tensors (chunk tables, piece-boundary masks), made once: creating
    them from host data each call would be a host-to-device copy that waits for the stream."""
    hit = _CACHE.get(key)
    if hit is None:
        if len(_CACHE) > 256:
            _CACHE.clear()
        hit = _CACHE[key] = make()
    return hit


def plan(keep8: torch.Tensor, g: Any, device: torch.device, *, piece_keys: int, unit: int,
         extra: torch.Tensor | None = None, launch: Any = None) -> tuple[PiecePlan | None, list[int]]:
    """The plan for keep-sets ``keep8`` [S, B, Hk, T] (int8, contiguous) and geometry ``g``, or
    None when no query sees any key; and ``extra`` (an int tensor on the device, e.g. check
    flags) read in the same host sync, as a list. One host sync unless a chunk must be split.
    ``launch``: the call's ``_triton_whatif_launch.Launcher`` (None: a default one)."""
    from kvtrace.kernels import _triton_whatif_pieces as tp

    S, B, Hk, T = keep8.shape
    HD = B * Hk
    per = max(unit, -(-piece_keys // unit) * unit)
    chunks = [list(range(i, min(i + MAX_CHUNK_SETS, S))) for i in range(0, S, MAX_CHUNK_SETS)]
    extra_out: list[int] = []
    while True:
        rows = len(chunks) * HD
        sig = torch.empty(rows, T, dtype=torch.int64, device=device)
        for i, c in enumerate(chunks):
            tp.run_signatures(keep8, g.positions, sig[i * HD:(i + 1) * HD], first=c[0], n_sets=len(c),
                              k_start=g.k_start, window=g.window, causal=g.causal, launch=launch)
        ss, perm = torch.sort(sig, dim=-1, stable=True)  # stable: a run keeps its keys in position order
        cut = torch.empty(rows, T, dtype=torch.int8, device=device)
        counters = torch.zeros(2 * rows + 1, dtype=torch.int32, device=device)  # runs, seen keys, cuts
        tp.run_cuts(ss, cut, counters[:rows], counters[rows:2 * rows], counters[2 * rows:], per=per, launch=launch)
        parts = [counters[rows:rows + 1], counters[2 * rows:], counters[:rows].view(len(chunks), HD).amax(dim=1)]
        if extra is not None:
            parts.append(extra.to(torch.int32).reshape(-1))
        got = torch.cat(parts).tolist()  # the host sync
        n_visible, n_pieces, runs_of = got[0], got[1], got[2:2 + len(chunks)]
        if extra is not None:
            extra_out, extra = got[2 + len(chunks):], None
        if n_visible == 0:
            return None, extra_out
        split = [i for i, n in enumerate(runs_of) if len(chunks[i]) > 1 and n * MIN_SEGMENT_KEYS > n_visible]
        if not split:
            break
        chunks = [h for i, c in enumerate(chunks) for h in (_halves(c) if i in split else [c])]
    return _pieces(chunks, ss, perm, cut, n_pieces, HD, device, launch), extra_out


def _pieces(chunks: list[list[int]], ss: torch.Tensor, perm: torch.Tensor, cut: torch.Tensor, n_pieces: int,
            HD: int, device: torch.device, launch: Any) -> PiecePlan:
    """Pieces from the cut flags of the sorted keys [chunks * HD, T], on the device (no sync)."""
    from kvtrace.kernels import _triton_whatif_pieces as tp

    C = len(chunks)
    at = torch.nonzero_static(cut.view(-1), size=n_pieces)[:, 0]  # ascending: (chunk, head, first)
    work = torch.empty(n_pieces, 4, dtype=torch.int32, device=device)
    psig = torch.empty(n_pieces, dtype=torch.int64, device=device)
    first = torch.empty(C * HD + 1, dtype=torch.int32, device=device)
    tp.run_piece_rows(at, ss, work, psig, first, heads=HD, launch=launch)
    slots = max(16, 1 << (max(len(ch) for ch in chunks)).bit_length())  # the fold's dot: 16 rows at least

    def table() -> torch.Tensor:
        t = torch.full((C, slots), -1, dtype=torch.int32)
        t[:, 0] = 0
        for i, ch in enumerate(chunks):
            t[i, 1:1 + len(ch)] = torch.tensor(ch, dtype=torch.int32) + 1
        return t.to(device)

    csets = _cached(("sets", tuple(map(tuple, chunks)), slots, device), table)
    return PiecePlan(perm=perm, work=work, psig=psig, first=first, csets=csets, chunks=chunks)


def piece_keys_for(T: int, HD: int, rows_h: int, sms: int, unit: int, num_splits: int | None) -> int:
    """Keys per piece: ``T / num_splits`` when asked, else enough pieces for ~4 programs per SM
    (64-row blocks), at least 4 key blocks a piece."""
    if num_splits:
        return max(unit, -(-T // max(1, num_splits)))
    row_blocks = -(-rows_h // 64)
    target = max(1, -(-4 * sms // max(1, row_blocks)))
    return max(4 * unit, -(-HD * T // target))


def pays(rows: int, keys: int, sets: int) -> bool:
    """Whether this path beats the shared-max kernel for ``rows`` query rows (all heads), ``keys``
    keys and ``sets`` keep-sets (the full one included), by the cost model above."""
    work = float(rows) * keys
    return work * (SHARED_PS_PER_SET_ROW_KEY * sets - PIECES_PS_PER_ROW_KEY) > PIECES_EXTRA_US * 1e6


def runner(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, g: Any,
           num_splits: int | None = None, *, pieces: bool | str = "auto", launch: Any = None):
    """Checks, conversions, the plan and the output buffers of one call, and the launches as a
    callable returning (recall, error) ``[S, B, Hq, Tq]`` fp32; None where ``pieces`` is "auto"
    and the shared-max kernel would be faster. ``g``: whatif._geometry's; ``launch``: the call's
    ``_triton_whatif_launch.Launcher``."""
    from kvtrace.kernels import _triton_whatif_check as tc
    from kvtrace.kernels import _triton_whatif_pieces as tp
    from kvtrace.kernels import whatif as W

    if pieces == "auto" and not pays(g.B * g.Hq * g.Tq, g.T, keep.shape[0] + 1):
        return None
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
    flags = tc.run_grid_check(*fp32, positions, W._LIMIT, W._sms(q.device), launch, sync=False)
    keep8 = W._keep_arg(keep)
    rows_h = g.group * g.Tq
    unit = tp.unit()
    pk = piece_keys_for(g.T, g.B * g.Hk, rows_h, W._sms(q.device), unit, num_splits)
    pl_, bits = plan(keep8, g, q.device, piece_keys=pk, unit=unit, extra=flags, launch=launch)
    big, *off = tc.grid_flags(bits)
    if big:
        raise ValueError("positions and lengths must be below 2**29 for the Triton path")
    recall = torch.zeros(shape, dtype=torch.float32, device=q.device)
    err = torch.full_like(recall, float("nan"))
    if pl_ is None:  # no query sees a key: recall 0, error NaN (||o|| = 0)
        return lambda: (recall, err)
    if pl_.work.shape[0] * rows_h * (v.shape[3] + 2) * 4 > PIECES_MAX_BYTES:
        return None
    q, k, v, cast_q, cast_k, cast_v = W._operands(q, k, v, off)
    n_pieces, dv = pl_.work.shape[0], v.shape[3]
    pm, pls, pacc = W._partial_buffers(n_pieces * rows_h, dv, q.device)
    window = None if g.window is None else min(g.window, W._LIMIT)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        tp.run_pieces(q, k, v, pl_.perm, pl_.work, positions, pm, pls, pacc, group=g.group, scale=g.scale,
                      k_start=g.k_start, window=window, causal=g.causal, rows_h=rows_h, cast_q=cast_q,
                      cast_k=cast_k, cast_v=cast_v, launch=launch)
        tp.run_fold(pm, pls, pacc, pl_.psig, pl_.first, pl_.csets, recall, err, rows_h=rows_h,
                    n_heads=g.B * g.Hk, dv=dv, launch=launch)
        return recall, err

    return run
