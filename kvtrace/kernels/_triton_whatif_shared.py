"""The keep-set kernel for 16+ query rows per KV head where the signature-pieces path
(kvtrace/kernels/whatif_pieces.py) does not pay for its plan (the overview is
kvtrace/kernels/_triton_whatif.py). Imported lazily.

``_keep_shared_kernel``: BLOCK_M query rows score a key block once and take ONE running max per
row, the full attention's, which every set shares (a set is a subset of the keys): the
exponentials and the bf16 split of p are computed once, then SETS keep-sets mask p into one
[SETS * BLOCK_M, BLOCK_N] @ V dot per part. A set whose kept keys all sit >= ~27 nats below the row
max would lose precision or underflow there: the finish kernel sees its small mass (``UNDERFLOW``)
and recomputes that (row, set) exactly with its own max (``_exact_row``). It reads each key block
once per block of rows and sets (~20-40 times at 64 queries), so fp32 K/V holding bf16 values come
as bf16 copies (whatif.py makes them: 4.15 vs 4.61 ms a call at 32k keys x 64 queries against
casting in registers, for 128 MiB more memory); only q is cast in registers (``CAST_Q``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvtrace.kernels._triton_attention import _scaled
from kvtrace.kernels._triton_whatif import _load_kv, _program, _visible


@triton.jit
def _masked_rows(x, kept, SETS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[SETS * BLOCK_M, BLOCK_N]: the rows of x [BLOCK_M, BLOCK_N] once per set, zero at the keys
    the set drops (exact for any dtype)."""
    x3 = tl.where(kept[:, None, :], x[None, :, :], tl.zeros_like(x)[None, :, :])
    return tl.reshape(x3, (SETS * BLOCK_M, BLOCK_N))


@triton.jit
def _pv_sets(acc, p, kept, v, SETS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             PV_SPLIT: tl.constexpr, DOT_F32: tl.constexpr, PREC_PV: tl.constexpr):
    """acc [SETS * BLOCK_M, DV] + every set's masked p @ v in one stacked dot per part. p is split
    (bf16 V: hi + mid + lo, see ``_pv``) once for all sets; masking a part is exact."""
    if PV_SPLIT:
        hi = p.to(tl.bfloat16)
        r = p - hi.to(tl.float32)
        mid = r.to(tl.bfloat16)
        lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
        if DOT_F32:  # the interpreter: same parts, fp32 products
            vf = v.to(tl.float32)
            acc = tl.dot(_masked_rows(lo.to(tl.float32), kept, SETS, BLOCK_M, BLOCK_N), vf, acc, input_precision="ieee")
            acc = tl.dot(_masked_rows(mid.to(tl.float32), kept, SETS, BLOCK_M, BLOCK_N), vf, acc,
                         input_precision="ieee")
            acc = tl.dot(_masked_rows(hi.to(tl.float32), kept, SETS, BLOCK_M, BLOCK_N), vf, acc, input_precision="ieee")
        else:
            acc = tl.dot(_masked_rows(lo, kept, SETS, BLOCK_M, BLOCK_N), v, acc)
            acc = tl.dot(_masked_rows(mid, kept, SETS, BLOCK_M, BLOCK_N), v, acc)
            acc = tl.dot(_masked_rows(hi, kept, SETS, BLOCK_M, BLOCK_N), v, acc)
        return acc
    else:
        return tl.dot(_masked_rows(p, kept, SETS, BLOCK_M, BLOCK_N), v.to(tl.float32), acc, input_precision=PREC_PV)


@triton.jit(do_not_specialize=["Tq", "Tk", "S", "k_start", "window", "keys_per_split"])
def _keep_shared_kernel(
    Q, K, V, KEEP, QPOS, PM, PL, PACC,
    Hq, Tq, Tk, S, GROUP, D, DV, scale, k_start, window, keys_per_split, n_splits,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_F32: tl.constexpr, PREC_QK: tl.constexpr,
    PREC_PV: tl.constexpr, PV_SPLIT: tl.constexpr, CAST_Q: tl.constexpr, ROUNDED: tl.constexpr, BLOCK_M: tl.constexpr, SETS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, DV_PARTS: tl.constexpr,
):
    """Many queries: BLOCK_M query rows (of the KV head's query heads) score a key block once and
    take one running max per row -- the full attention's, which every keep-set (a subset of the
    keys) shares -- so the exponentials and the split of p are computed once for all sets; SETS
    keep-sets then mask p ([SETS, BLOCK_M, BLOCK_N]) into one [SETS * BLOCK_M, BLOCK_N] @ V dot
    per part. A set whose kept keys all sit far below the row max underflows here; the finish
    kernel detects it (l below ``UNDERFLOW``) and recomputes that row exactly. ``DV_PARTS``: the
    value columns split over that many programs (each recomputes the scores): fewer accumulator
    registers per program."""
    nvq = GROUP * Tq
    n_mblocks = tl.cdiv(nvq, BLOCK_M)
    n_sblocks = tl.cdiv(S, SETS)
    pid0 = tl.program_id(0)
    vq = (pid0 % n_mblocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = vq < nvq
    head, pos, out_row, q, k_base, v_base, lo, hi, offs_d, d_valid, offs_dv, dv_valid = _program(
        Q, K, V, QPOS, vq, valid, Hq, Tq, Tk, GROUP, D, DV, k_start, window, keys_per_split,
        (pid0 // (n_mblocks * n_sblocks)) * (BLOCK_DV // DV_PARTS), CAUSAL, HAS_WINDOW, CAST_Q, DOT_F32, BLOCK_N,
        BLOCK_D, BLOCK_DV // DV_PARTS)
    sets = ((pid0 // n_mblocks) % n_sblocks) * SETS + tl.arange(0, SETS)
    s_valid = sets < S
    keep_base = KEEP + ((sets - 1).to(tl.int64) * tl.num_programs(1) + head) * Tk
    has_keep = s_valid & (sets > 0)  # set 0: every key

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([SETS, BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([SETS * BLOCK_M, BLOCK_DV // DV_PARTS], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < Tk
        kt, v = _load_kv(k_base, v_base, offs_n, n_valid, D, DV, offs_d, d_valid, offs_dv, dv_valid, DOT_F32,
                         False, False)
        s = _scaled(tl.dot(q, kt, input_precision=PREC_QK), scale, ROUNDED)
        s = tl.where(_visible(offs_n, n_valid, pos, valid, window, CAUSAL, HAS_WINDOW), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])  # [BLOCK_M, BLOCK_N], 0 where not visible
        kept = tl.load(keep_base[:, None] + offs_n[None, :], mask=has_keep[:, None] & n_valid[None, :], other=1) != 0
        l_i = alpha[None, :] * l_i + tl.sum(tl.where(kept[:, None, :], p[None, :, :], 0.0), axis=2)
        a_rows = tl.reshape(tl.broadcast_to(alpha[None, :], (SETS, BLOCK_M)), (SETS * BLOCK_M,))
        acc = _pv_sets(acc * a_rows[:, None], p, kept, v, SETS, BLOCK_M, BLOCK_N, PV_SPLIT, DOT_F32, PREC_PV)
        m_i = m_new

    out = (sets[:, None].to(tl.int64) * tl.num_programs(1) * GROUP * Tq + out_row[None, :]) * n_splits \
        + tl.program_id(2)
    ok = s_valid[:, None] & valid[None, :]
    tl.store(PM + out, tl.broadcast_to(m_i[None, :], (SETS, BLOCK_M)), mask=ok)
    tl.store(PL + out, l_i, mask=ok)
    out1 = tl.reshape(out, (SETS * BLOCK_M,))
    ok1 = tl.reshape(ok, (SETS * BLOCK_M,))
    tl.store(PACC + out1[:, None] * DV + offs_dv[None, :], acc, mask=ok1[:, None] & dv_valid[None, :])


def _shared_configs() -> list:
    """(BLOCK_M, SETS, BLOCK_N, warps, stages) for the many-query kernel: 64-128 stacked rows of
    fp32 state against 64 keys a step (the best of 13 on an H200 at 32k keys, 64 queries). fp32 inputs (the replay's) take 3xTF32 dots, whose
    operand splits need up to ~200 KiB of shared memory at D = 128 (AOT-compiled for sm_90): small
    tiles and one stage are offered too, and the autotuner skips what does not fit."""
    specs = [(32, 2, 64, 4, 2), (128, 1, 64, 8, 2), (16, 4, 64, 4, 2), (32, 4, 64, 8, 2), (64, 2, 64, 8, 2),
             (16, 8, 64, 8, 2), (64, 2, 64, 4, 3), (128, 1, 64, 8, 3)]
    specs = [(*s, 1) for s in specs] + [(*s, 2) for s in SHARED_SPLIT_DV]
    return [triton.Config({"BLOCK_M": bm, "SETS": sets, "BLOCK_N": bn, "DV_PARTS": parts}, num_warps=w, num_stages=st)
            for bm, sets, bn, w, st, parts in specs]


# Tiles whose value columns are split over two programs (DV_PARTS = 2): none offered. On the H200
# (32k keys, 64 queries, bf16) the five tried took 4.47-6.38 ms against 3.29 ms for the best
# unsplit tile: the recomputed scores cost more than the registers saved. The interpreter still
# runs the split (tests), so the path stays correct for a GPU where it pays.
SHARED_SPLIT_DV: list[tuple[int, int, int, int, int]] = []
