"""Triton kernels of the keep-set measures by key signature (kvtrace/kernels/whatif_pieces.py plans
them). Imported lazily.

Every keep-set is a mask over the keys of a KV head, the same for all of that head's query rows.
Keys with the same *signature* (which of the sets keep them) therefore contribute to exactly the
same sets: the plan sorts each head's keys by signature and cuts the sorted order into *pieces*
(runs of one signature, at most a few thousand keys each). Then:

* ``_piece_kernel`` -- one program per (piece, block of query rows): a flash-attention pass over
  the piece's keys (gathered through the sort permutation), ONE online-softmax state per row
  (max ``m``, ``l = sum exp(s - m)``, ``acc = sum exp(s - m) v``) over the keys it sees. The
  attention is computed once for all sets, not once per set.
* ``_fold_kernel`` -- one program per (output row, chunk of sets): merges the row's piece states
  into every set's state at once (a piece joins the sets its signature names; slot 0 of a chunk
  is "every key"), then recall ``exp(m_s - m_0) l_s / l_0`` and error ``||o_s - o_0|| / ||o_0||``.

Each piece has its own running max, so no set's terms are measured against another set's max:
nothing underflows that the per-set softmax would keep (the shared-max kernel's concern). Work:
one attention pass over the visible keys per chunk of sets, against one per set before; memory
O(rows x pieces). Precision as in _triton_whatif (exact products for 16-bit values, ``p @ V`` as
three bf16 parts against bf16 V, 3xTF32 for fp32).
"""

from __future__ import annotations

from functools import cache

import triton
import triton.language as tl

from kvtrace.kernels._env import interpreting
from kvtrace.kernels._triton_attention import _scaled
from kvtrace.kernels._triton_whatif import _load_kv, _load_q, _pv, _rows, _softmax_step, _visible
from kvtrace.kernels._triton_whatif_launch import Launcher

INTERP_BLOCK_M = 16
INTERP_BLOCK_N = 16


@triton.jit(do_not_specialize=["Tk", "n_pos", "k_start", "window", "first"])
def _signature_kernel(KEEP, QPOS, SIG, Tk, n_pos, k_start, window, first, n_sets,
                      CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK: tl.constexpr, BLOCK_Q: tl.constexpr):
    """SIG [heads, Tk] int64 of keys ``program_id(1) * BLOCK ..`` of head ``program_id(0)``: bit j
    where set ``first + j`` (of KEEP [S, heads, Tk], nonzero = kept) keeps the key, -1 where no
    query (QPOS, int64) sees it. One launch instead of a dozen torch ops."""
    head = tl.program_id(0).to(tl.int64)
    offs_q = tl.arange(0, BLOCK_Q)
    top = tl.full([BLOCK_Q], -(2**31) + 1, tl.int64)
    bottom = tl.full([BLOCK_Q], 2**31 - 1, tl.int64)
    for q0 in range(0, n_pos, BLOCK_Q):
        at = q0 + offs_q
        p = tl.load(QPOS + at, mask=at < n_pos, other=0)
        top = tl.maximum(top, tl.where(at < n_pos, p, -(2**31) + 1))
        bottom = tl.minimum(bottom, tl.where(at < n_pos, p, 2**31 - 1))
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = j < Tk
    kpos = j.to(tl.int64) + k_start
    seen = ok
    if CAUSAL:
        seen = seen & (kpos <= tl.max(top, axis=0))
    if HAS_WINDOW:
        seen = seen & (kpos > tl.min(bottom, axis=0) - window)
    sig = tl.zeros([BLOCK], dtype=tl.int64)
    heads = tl.num_programs(0)
    for b in range(0, n_sets):
        kept = tl.load(KEEP + ((first + b) * heads + head) * Tk + j, mask=ok, other=0)
        sig = sig | tl.where(kept != 0, tl.full([BLOCK], 1, tl.int64) << b, 0)
    tl.store(SIG + head * Tk + j, tl.where(seen, sig, -1), mask=ok)


@triton.jit(do_not_specialize=["Tk", "per"])
def _cuts_kernel(SS, CUT, RUNS, SEEN, TOTAL, Tk, per, BLOCK: tl.constexpr):
    """Over the sorted signatures SS [rows, Tk] (-1 first: keys no query sees): CUT where a piece
    starts (the signature changes, or every ``per`` keys) among seen keys; per row the runs of one
    seen signature (RUNS) and the seen keys (SEEN); TOTAL[0] the cuts of all rows."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = j < Tk
    s = tl.load(SS + row * Tk + j, mask=ok, other=-1)
    prev = tl.load(SS + row * Tk + j - 1, mask=ok & (j > 0), other=-2)
    seen = ok & (s >= 0)
    new = seen & (s != prev)
    cut = new | (seen & (j % per == 0))
    tl.store(CUT + row * Tk + j, cut.to(tl.int8), mask=ok)
    tl.atomic_add(RUNS + row, tl.sum(new.to(tl.int32), axis=0))
    tl.atomic_add(SEEN + row, tl.sum(seen.to(tl.int32), axis=0))
    tl.atomic_add(TOTAL, tl.sum(cut.to(tl.int32), axis=0))


@triton.jit(do_not_specialize=["Tk", "n_pieces"])
def _piece_rows_kernel(AT, SS, WORK, PSIG, FIRST, Tk, HD, n_pieces, BLOCK: tl.constexpr):
    """Pieces from the cut positions AT (flat indices into [rows, Tk], ascending): WORK rows
    (batch * KV head, row, first, end), the signature, and FIRST[row] = the row's first piece
    (FIRST[rows] = n_pieces; every row has a piece)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n_pieces
    a = tl.load(AT + i, mask=ok, other=0)
    nxt = tl.load(AT + i + 1, mask=ok & (i + 1 < n_pieces), other=-1)
    prv = tl.load(AT + i - 1, mask=ok & (i > 0), other=-1)
    row = a // Tk
    lo = a % Tk
    hi = tl.where((nxt >= 0) & (nxt // Tk == row), nxt % Tk, Tk)
    tl.store(WORK + i * 4, (row % HD).to(tl.int32), mask=ok)
    tl.store(WORK + i * 4 + 1, row.to(tl.int32), mask=ok)
    tl.store(WORK + i * 4 + 2, lo.to(tl.int32), mask=ok)
    tl.store(WORK + i * 4 + 3, hi.to(tl.int32), mask=ok)
    tl.store(PSIG + i, tl.load(SS + a, mask=ok, other=0), mask=ok)
    tl.store(FIRST + row, i.to(tl.int32), mask=ok & ((prv < 0) | (prv // Tk != row)))
    tl.store(FIRST + row + 1, (i * 0 + n_pieces).to(tl.int32), mask=ok & (i == n_pieces - 1))


@triton.jit(do_not_specialize=["Tq", "Tk", "k_start", "window", "rows_h"])
def _piece_kernel(
    Q, K, V, PERM, WORK, QPOS, PM, PL, PACC,
    Hq, Tq, Tk, GROUP, D, DV, scale, k_start, window, rows_h,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_F32: tl.constexpr, PREC_QK: tl.constexpr,
    PREC_PV: tl.constexpr, PV_SPLIT: tl.constexpr, CAST_Q: tl.constexpr, CAST_K: tl.constexpr,
    CAST_V: tl.constexpr, ROUNDED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Piece ``program_id(0)`` (WORK row: batch * KV head, permutation row, first and end index in
    it), query rows ``program_id(1) * BLOCK_M ..`` of that head: (m, l, acc) at [piece, row]."""
    piece = tl.program_id(0).to(tl.int64)
    hd = tl.load(WORK + piece * 4)
    prow = tl.load(WORK + piece * 4 + 1)
    lo = tl.load(WORK + piece * 4 + 2)
    hi = tl.load(WORK + piece * 4 + 3)
    Hk = Hq // GROUP
    vq = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = vq < rows_h
    _, _, pos, out_row = _rows(vq, hd % Hk, hd // Hk, Hq, Tq, GROUP, QPOS, k_start, valid)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_valid = offs_d < D
    dv_valid = offs_dv < DV
    q = _load_q(Q, out_row, D, offs_d, valid, d_valid, CAST_Q, DOT_F32)
    k_base = K + hd.to(tl.int64) * Tk * D
    v_base = V + hd.to(tl.int64) * Tk * DV
    perm = PERM + prow.to(tl.int64) * Tk

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        in_piece = offs < hi
        idx = tl.load(perm + offs, mask=in_piece, other=0)  # the keys' own indices (positions - k_start)
        kt, v = _load_kv(k_base, v_base, idx, in_piece, D, DV, offs_d, d_valid, offs_dv, dv_valid, DOT_F32,
                         CAST_K, CAST_V)
        s = _scaled(tl.dot(q, kt, input_precision=PREC_QK), scale, ROUNDED)
        s = tl.where(_visible(idx, in_piece, pos, valid, window, CAUSAL, HAS_WINDOW), s, float("-inf"))
        m_i, l_i, alpha, p = _softmax_step(m_i, l_i, s)
        acc = _pv(acc * alpha[:, None], p, v, PV_SPLIT, DOT_F32, PREC_PV)

    out = piece * rows_h + vq
    tl.store(PM + out, m_i, mask=valid)
    tl.store(PL + out, l_i, mask=valid)
    tl.store(PACC + out[:, None] * DV + offs_dv[None, :], acc, mask=valid[:, None] & dv_valid[None, :])


@triton.jit
def _fold_kernel(PM, PL, PACC, PSIG, FIRST, CSETS, RECALL, ERR, R, rows_h, HD, DV,
                 SLOTS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_PREC: tl.constexpr):
    """Output row ``program_id(0)`` (rows of one batch * KV head are contiguous: row = hd * rows_h +
    r), set chunk ``program_id(1)``: pieces FIRST[c * HD + hd] .. FIRST[c * HD + hd + 1] merged, BLOCK_P at a
    time, into each slot's state. Slot 0 keeps every key; slot j >= 1 is global set CSETS[c, j]
    (>= 1; -1: unused) and reads bit j - 1 of a piece's signature."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    hd = row // rows_h
    r = row % rows_h
    p0 = tl.load(FIRST + c * HD + hd)
    p1 = tl.load(FIRST + c * HD + hd + 1)
    slots = tl.arange(0, SLOTS)
    gset = tl.load(CSETS + c * SLOTS + slots)
    bit = tl.maximum(slots - 1, 0).to(tl.int64)
    offs_p = tl.arange(0, BLOCK_P)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV

    m = tl.zeros([SLOTS], dtype=tl.float32) - float("inf")
    lsum = tl.zeros([SLOTS], dtype=tl.float32)
    acc = tl.zeros([SLOTS, BLOCK_DV], dtype=tl.float32)
    for b0 in range(p0, p1, BLOCK_P):
        pp = b0 + offs_p
        ok = pp < p1
        at = pp.to(tl.int64) * rows_h + r
        mj = tl.load(PM + at, mask=ok, other=float("-inf"))
        lj = tl.load(PL + at, mask=ok, other=0.0)
        aj = tl.load(PACC + at[:, None] * DV + offs_dv[None, :], mask=ok[:, None] & dv_ok[None, :], other=0.0)
        sig = tl.load(PSIG + pp, mask=ok, other=0)
        in_set = (slots[:, None] == 0) | ((sig[None, :] >> bit[:, None]) % 2 == 1)  # signatures are >= 0
        member = in_set & (gset >= 0)[:, None] & (ok & (lj > 0))[None, :]  # lj 0: the piece saw no key
        m_new = tl.maximum(m, tl.max(tl.where(member, mj[None, :], float("-inf")), axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp(m - m_use)
        w = tl.where(member, tl.exp(mj[None, :] - m_use[:, None]), 0.0)  # [SLOTS, BLOCK_P]
        lsum = a * lsum + tl.sum(w * lj[None, :], axis=1)
        acc = tl.dot(w, aj, a[:, None] * acc, input_precision=DOT_PREC)
        m = m_new

    first = slots == 0
    m0 = tl.max(tl.where(first, m, float("-inf")), axis=0)
    l0 = tl.sum(tl.where(first, lsum, 0.0), axis=0) + tl.zeros([SLOTS], dtype=tl.float32)  # as a vector
    o = acc / tl.where(lsum > 0, lsum, 1.0)[:, None]  # 0 where the set kept no key this row sees
    o0 = tl.sum(tl.where(first[:, None], o, 0.0), axis=0)
    den = tl.sqrt(tl.sum(o0 * o0, axis=0)) + tl.zeros([SLOTS], dtype=tl.float32)
    both = (lsum > 0) & (l0 > 0)
    recall = tl.where(both, tl.exp(tl.where(both, m - m0, 0.0)) * lsum / tl.where(l0 > 0, l0, 1.0), 0.0)
    d = o - o0[None, :]
    err = tl.where(den > 0, tl.sqrt(tl.sum(d * d, axis=1)) / tl.where(den > 0, den, 1.0), float("nan"))
    out = (gset.to(tl.int64) - 1) * R + row
    keep = (slots > 0) & (gset > 0)
    tl.store(RECALL + out, recall, mask=keep)
    tl.store(ERR + out, err, mask=keep)


def _piece_configs() -> list:
    """(BLOCK_M, BLOCK_N, warps, stages): flash-attention-like tiles; small ones for fp32 inputs,
    whose 3xTF32 operand splits take the most shared memory (the autotuner skips what does not fit)."""
    specs = [(64, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 2), (128, 32, 8, 3), (64, 32, 4, 3),
             (32, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2), (16, 64, 4, 2), (64, 64, 4, 1)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st) for bm, bn, w, st in specs]


_TUNE_KEY = ["BLOCK_D", "BLOCK_DV", "CAST_Q", "CAST_K", "CAST_V", "PV_SPLIT", "PREC_QK"]


@cache
def _tuned():
    return triton.autotune(configs=_piece_configs(), key=_TUNE_KEY)(_piece_kernel)


def run_pieces(q, k, v, perm, work, qpos, pm, pl, pacc, *, group: int, scale: float, k_start: int,
               window: int | None, causal: bool, rows_h: int, cast_q: bool, cast_k: bool, cast_v: bool,
               launch: Launcher | None = None) -> None:
    """Launch ``_piece_kernel`` over the ``work`` rows (int32 [pieces, 4]); q [B, Hq, Tq, D], k/v
    [B, Hk, T, D/Dv] contiguous, perm int32 [rows, T] (sorted key indices), qpos int64 [Tq];
    pm/pl fp32 [pieces * rows_h], pacc fp32 [... * Dv] outputs."""
    import torch

    _, Hq, Tq, D = q.shape
    Tk, DV = k.shape[2], v.shape[3]
    n_pieces = work.shape[0]
    v_bf16 = v.dtype == torch.bfloat16 or cast_v
    q_bf16 = q.dtype == torch.bfloat16 or cast_q
    dot_f32 = interpreting() and (q_bf16 or v_bf16)  # the interpreter mis-computes bf16 dots: upcast there
    prec_qk = "ieee" if interpreting() else ("tf32x3" if q.dtype == torch.float32 and not cast_q else "tf32")
    args = (q, k, v, perm, work, qpos, pm, pl, pacc, Hq, Tq, Tk, group, D, DV, float(scale), int(k_start),
            int(window or 0), rows_h)
    flags = dict(CAUSAL=bool(causal), HAS_WINDOW=window is not None, DOT_F32=dot_f32, PREC_QK=prec_qk,
                 PREC_PV="ieee" if interpreting() else "tf32x3", PV_SPLIT=v_bf16, CAST_Q=bool(cast_q),
                 CAST_K=bool(cast_k), CAST_V=bool(cast_v), ROUNDED=not interpreting(),
                 BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_DV=max(16, triton.next_power_of_2(DV)))
    if interpreting():
        grid = (n_pieces, triton.cdiv(rows_h, INTERP_BLOCK_M))
        _piece_kernel[grid](*args, **flags, BLOCK_M=INTERP_BLOCK_M, BLOCK_N=INTERP_BLOCK_N)
        return
    (launch or Launcher())("pieces", _tuned(), lambda meta: (n_pieces, triton.cdiv(rows_h, meta["BLOCK_M"])), args, flags)


def run_fold(pm, pl, pacc, psig, first, csets, recall, err, *, rows_h: int, n_heads: int, dv: int,
             launch: Launcher | None = None) -> None:
    """Launch ``_fold_kernel``: recall and err [S, R] fp32 (R = n_heads * rows_h) from the piece
    states; first int32 [chunks * n_heads + 1] (the first piece of each (chunk, head), then the
    piece count), csets int32 [chunks, slots], psig int64 [pieces]."""
    R = n_heads * rows_h
    n_chunks, slots = csets.shape
    # The weights x piece outputs product in fp32 (FMA: "ieee"); slots padded to a dot's 16 rows.
    (launch or Launcher())("fold", _fold_kernel, (R, n_chunks),
                           (pm, pl, pacc, psig, first, csets, recall, err, R, rows_h, n_heads, dv),
                           dict(SLOTS=slots, BLOCK_P=16, BLOCK_DV=max(16, triton.next_power_of_2(dv)),
                                DOT_PREC="ieee", num_warps=4))


def run_cuts(ss, cut, runs, seen, total, *, per: int, launch: Launcher | None = None) -> None:
    """Launch ``_cuts_kernel`` over ss [rows, T] int64 (sorted); cut int8 [rows, T]; runs, seen
    int32 [rows] and total int32 [1] zeroed counters."""
    rows, T = ss.shape
    block = INTERP_BLOCK_N if interpreting() else 1024
    (launch or Launcher())("cuts", _cuts_kernel, (rows, triton.cdiv(T, block)),
                           (ss, cut, runs, seen, total, T, int(per)), dict(BLOCK=block, num_warps=4))


def run_piece_rows(at, ss, work, psig, first, *, heads: int, launch: Launcher | None = None) -> None:
    """Launch ``_piece_rows_kernel``: work int32 [pieces, 4], psig int64 [pieces], first int32
    [rows + 1] from the cut positions ``at`` (int64, ascending flat indices into ss [rows, T])."""
    n = at.numel()
    block = INTERP_BLOCK_N if interpreting() else 256
    (launch or Launcher())("piece_rows", _piece_rows_kernel, (triton.cdiv(n, block),),
                           (at, ss, work, psig, first, ss.shape[1], heads, n), dict(BLOCK=block, num_warps=4))


def run_signatures(keep8, qpos, sig, *, first: int, n_sets: int, k_start: int, window: int | None,
                   causal: bool, launch: Launcher | None = None) -> None:
    """Launch ``_signature_kernel``: sig [heads, T] int64 of sets first .. first + n_sets of keep8
    [S, heads, T] int8 (contiguous)."""
    heads, T = keep8.shape[1] * keep8.shape[2], keep8.shape[3]
    block = INTERP_BLOCK_N if interpreting() else 1024
    (launch or Launcher())("signatures", _signature_kernel, (heads, triton.cdiv(T, block)),
                           (keep8, qpos, sig, T, qpos.numel(), int(k_start), int(window or 0), int(first),
                            int(n_sets)),
                           dict(CAUSAL=bool(causal), HAS_WINDOW=window is not None, BLOCK=block,
                                BLOCK_Q=16 if interpreting() else 256, num_warps=4))


def unit() -> int:
    """Pieces are cut at multiples of this (the largest BLOCK_N a tile may use)."""
    return INTERP_BLOCK_N if interpreting() else 128
