"""The keep-set kernels for fewer than 16 query rows per KV head (a decode step's samples; the
overview is kvtrace/kernels/_triton_whatif.py). Imported lazily.

* ``_keep_fma_kernel`` (``KernelConfig.exact_decode``, the default where K or V is fp32): fp32
  arithmetic on the CUDA cores for any input dtype, so exact whatever grid the values sit on -- no
  bf16-grid check pass over K/V and no host sync before the launch. The KV head's queries score
  each key block once (broadcast products summed over head-dim chunks); the scores are broadcast
  to the rows, (set, query) pairs set-major, each with its own running max; ``p @ V`` is one fp32
  FMA dot per block.
* ``_keep_packed_kernel`` (the same rows on the tensor cores, after the grid check: bf16 dots for
  bf16-grid values, 3xTF32 otherwise): rows are dense (set, query) pairs, each scoring the keys
  itself with its own running max (no padding rows). 16-bit K/V, and the exact kernel's fallback.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvtrace.kernels._triton_attention import _scaled
from kvtrace.kernels._triton_whatif import _key_range, _load_kv, _program, _pv, _rows, _softmax_step, _visible


@triton.jit(do_not_specialize=["Tq", "Tk", "S", "k_start", "window", "keys_per_split"])
def _keep_packed_kernel(
    Q, K, V, KEEP, QPOS, PM, PL, PACC,
    Hq, Tq, Tk, S, GROUP, D, DV, scale, k_start, window, keys_per_split, n_splits,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_F32: tl.constexpr, PREC_QK: tl.constexpr,
    PREC_PV: tl.constexpr, PV_SPLIT: tl.constexpr, CAST_Q: tl.constexpr, CAST_K: tl.constexpr,
    CAST_V: tl.constexpr, ROUNDED: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Few queries (a decode step): rows are dense (set, query head of the group, query) triples,
    each with its own score row and its own running max (scores recomputed per set; this case is
    memory-bound, and no padding rows)."""
    nvq = GROUP * Tq
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    valid = i < S * nvq
    row_s = i // nvq
    head, pos, out_row, q, k_base, v_base, lo, hi, offs_d, d_valid, offs_dv, dv_valid = _program(
        Q, K, V, QPOS, i % nvq, valid, Hq, Tq, Tk, GROUP, D, DV, k_start, window, keys_per_split, 0, CAUSAL,
        HAS_WINDOW, CAST_Q, DOT_F32, BLOCK_N, BLOCK_D, BLOCK_DV)
    # Set 0 keeps every key and has no row in KEEP (set s > 0 reads KEEP[s - 1]).
    keep_row = KEEP + ((row_s - 1).to(tl.int64) * tl.num_programs(1) + head) * Tk
    has_keep = valid & (row_s > 0)

    m_i = tl.zeros([ROWS], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_DV], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < Tk
        kt, v = _load_kv(k_base, v_base, offs_n, n_valid, D, DV, offs_d, d_valid, offs_dv, dv_valid, DOT_F32,
                         CAST_K, CAST_V)
        s = _scaled(tl.dot(q, kt, input_precision=PREC_QK), scale, ROUNDED)
        kept = tl.load(keep_row[:, None] + offs_n[None, :], mask=has_keep[:, None] & n_valid[None, :], other=1)
        use = (kept != 0) & _visible(offs_n, n_valid, pos, valid, window, CAUSAL, HAS_WINDOW)
        m_i, l_i, alpha, p = _softmax_step(m_i, l_i, tl.where(use, s, float("-inf")))
        acc = _pv(acc * alpha[:, None], p, v, PV_SPLIT, DOT_F32, PREC_PV)

    # Partial states, laid out [S, B * Hq, Tq, n_splits] (and x DV for acc).
    out = (row_s.to(tl.int64) * tl.num_programs(1) * GROUP * Tq + out_row) * n_splits + tl.program_id(2)
    tl.store(PM + out, m_i, mask=valid)
    tl.store(PL + out, l_i, mask=valid)
    tl.store(PACC + out[:, None] * DV + offs_dv[None, :], acc, mask=valid[:, None] & dv_valid[None, :])


POS_CLAMP = tl.constexpr(2**30)


@triton.jit
def _scores_fma(Q, q_row, q_ok, k_base, offs_n, n_valid, D, scale, ROUNDED: tl.constexpr, BLOCK_D: tl.constexpr,
                CHUNK_D: tl.constexpr):
    """[queries, BLOCK_N] scores of the queries at row offsets ``q_row`` against a key block, as
    broadcast products summed on the CUDA cores, CHUNK_D dimensions a step (fp32 products and
    sums: exact for any input grid). The query chunks are reloaded per block (a few hundred bytes,
    cached) so no [queries, keys, BLOCK_D] product is ever live."""
    for c in tl.static_range(0, BLOCK_D, CHUNK_D):
        offs_c = c + tl.arange(0, CHUNK_D)
        c_ok = offs_c < D
        k = tl.load(k_base + offs_n[:, None].to(tl.int64) * D + offs_c[None, :], mask=n_valid[:, None] & c_ok[None, :],
                    other=0.0).to(tl.float32)
        q = tl.load(Q + q_row[:, None] * D + offs_c[None, :], mask=q_ok[:, None] & c_ok[None, :],
                    other=0.0).to(tl.float32)
        part = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        if c == 0:
            s = part
        else:
            s += part
    return _scaled(s, scale, ROUNDED)


@triton.jit(do_not_specialize=["Tq", "Tk", "S", "k_start", "window", "keys_per_split"])
def _keep_fma_kernel(
    Q, K, V, KEEP, QPOS, PM, PL, PACC,
    Hq, Tq, Tk, S, GROUP, D, DV, scale, k_start, window, keys_per_split, n_splits,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, ROUNDED: tl.constexpr, PREC_PV: tl.constexpr, GP: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Few queries (a decode step), exact for any input dtype and grid: fp32 arithmetic on the
    CUDA cores (no tensor cores, so no bf16-grid check and no host sync before the launch). The
    KV head's ``GROUP * Tq`` queries (padded to GP) score each key block ONCE; the scores are
    broadcast to SETS = ROWS // GP keep-sets, rows (set, query) set-major, each row with its own
    running max (exact for sets far below the row max); ``p @ V`` is one fp32 FMA dot per block.
    Program: (block of SETS sets, batch * KV head, key split)."""
    SETS: tl.constexpr = ROWS // GP
    nvq = GROUP * Tq
    vq = tl.arange(0, GP)
    q_ok = vq < nvq
    Hk = Hq // GROUP
    b = tl.program_id(1) // Hk
    kvh = tl.program_id(1) % Hk
    _, qi, _, q_row = _rows(vq, kvh, b, Hq, Tq, GROUP, QPOS, k_start, q_ok)
    # Positions relative to the keys, clamped in int64 to +-2**30 before int32 arithmetic: every
    # visibility decision stays the same (Tk and the window are below 2**29), so any int64
    # position works and nothing is checked before or after the launch.
    pos = tl.load(QPOS + qi, mask=q_ok, other=0) - k_start
    pos = tl.minimum(tl.maximum(pos, -POS_CLAMP), POS_CLAMP).to(tl.int32)
    head = b.to(tl.int64) * Hk + kvh  # K/V/keep are contiguous [B, Hk, Tk, ...]
    k_base = K + head * Tk * D
    v_base = V + head * Tk * DV
    lo, hi = _key_range(tl.program_id(2), keys_per_split, Tk, pos, q_ok, window, CAUSAL, HAS_WINDOW, BLOCK_N)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV
    sets = tl.program_id(0) * SETS + tl.arange(0, SETS)
    s_ok = sets < S
    # Set 0 keeps every key and has no row in KEEP (set s > 0 reads KEEP[s - 1]).
    keep_base = KEEP + ((sets - 1).to(tl.int64) * tl.num_programs(1) + head) * Tk
    has_keep = s_ok & (sets > 0)

    m_i = tl.zeros([ROWS], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_DV], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):  # per block: scores once per query, then every set's row
        offs_n = start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < Tk
        sc = _scores_fma(Q, q_row, q_ok, k_base, offs_n, n_valid, D, scale, ROUNDED, BLOCK_D, CHUNK_D)
        sc = tl.where(_visible(offs_n, n_valid, pos, q_ok, window, CAUSAL, HAS_WINDOW), sc, float("-inf"))
        kept = tl.load(keep_base[:, None] + offs_n[None, :], mask=has_keep[:, None] & n_valid[None, :], other=1) != 0
        s = tl.reshape(tl.where(kept[:, None, :], sc[None, :, :], float("-inf")), (ROWS, BLOCK_N))
        m_i, l_i, alpha, p = _softmax_step(m_i, l_i, s)
        v = tl.load(v_base + offs_n[:, None].to(tl.int64) * DV + offs_dv[None, :],
                    mask=n_valid[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PREC_PV)

    # Partial states, laid out [S, B * Hq, Tq, n_splits] (and x DV for acc), as the packed kernel's.
    out = tl.reshape(sets[:, None].to(tl.int64) * tl.num_programs(1) * nvq + q_row[None, :], (ROWS,)) * n_splits \
        + tl.program_id(2)
    ok = tl.reshape(s_ok[:, None] & q_ok[None, :], (ROWS,))
    tl.store(PM + out, m_i, mask=ok)
    tl.store(PL + out, l_i, mask=ok)
    tl.store(PACC + out[:, None] * DV + offs_dv[None, :], acc, mask=ok[:, None] & dv_ok[None, :])


def _packed_configs() -> list:
    """(ROWS, BLOCK_N, warps, stages) for the few-query kernel (the best on an H200 at 32k keys:
    bf16 64 x 32 with 3 stages, fp32 16 x 64 with 2)."""
    specs = [(64, 32, 4, 3), (64, 32, 4, 2), (16, 64, 4, 2), (64, 128, 4, 1), (16, 64, 4, 3), (32, 128, 4, 1)]
    return [triton.Config({"ROWS": r, "BLOCK_N": bn}, num_warps=w, num_stages=st) for r, bn, w, st in specs]


def _fma_configs() -> list:
    """(ROWS, BLOCK_N, CHUNK_D, warps, stages) for the exact few-query kernel (``_keep_fma_kernel``)."""
    specs = FMA_SPECS
    return [triton.Config({"ROWS": r, "BLOCK_N": bn, "CHUNK_D": cd}, num_warps=w, num_stages=st)
            for r, bn, cd, w, st in specs]


# The best of 76 tiles on an H200 (32k keys, one query, 4 queries per KV head, 10 sets, fp32;
# tiles of 64 rows: 0.296-0.32 ms a launch, 32 rows >= 0.41, 16 rows >= 0.43, 2 warps or 1
# stage 1.1-10 ms): a whole block of sets per program (the scores, K/V loads and reductions are
# per program) and small head-dim chunks. Smaller row counts stay for more queries per KV head
# (fewer sets a program). p @ V as 3xTF32 on the tensor cores (FMA_PREC_PV) took 0.39-0.56 ms.
FMA_PREC_PV = "ieee"
FMA_SPECS: list[tuple[int, int, int, int, int]] = [
    (64, 32, 16, 4, 2), (64, 64, 16, 8, 3), (64, 32, 16, 4, 3), (64, 32, 8, 4, 2), (64, 64, 8, 8, 3),
    (32, 32, 16, 4, 3), (16, 32, 16, 4, 3),
]
