"""Triton kernels of the what-if replay: the overview, the tile constants and the device helpers
the keep-set kernels share. kvtrace/kernels/whatif.py dispatches; every module is imported lazily.

Keep-set attention: many candidate keep-sets in one pass over the keys. One program per (block
of rows, batch * KV head, key split): its rows are queries of all the query heads that read this
KV head (GQA: K and V are loaded once for the group), times keep-sets. Per row it keeps an
online-softmax state over the keys that are visible AND kept by the row's set: running max ``m``,
``l = sum exp(s - m)`` and ``acc = sum exp(s - m) v``; the finish kernel merges the key splits'
partial states. Set 0 is "keep every key" (the full attention), so mass recall
``exp(m_s - m_0) l_s / l_0`` and the output error follow from the merged states alone. Nothing of
size rows x keys x sets is formed: memory O(rows * sets * splits * Dv).

The modules, by job:

* ``_triton_whatif_decode`` -- fewer than 16 query rows per KV head (a decode step's samples):
  ``_keep_fma_kernel``, exact fp32 on the CUDA cores for any input dtype (no bf16-grid check, no
  host sync; ``KernelConfig.exact_decode``), and ``_keep_packed_kernel``, the same rows on the
  tensor cores after the grid check (bf16 dots for bf16-grid values, 3xTF32 otherwise; 16-bit K/V
  and the exact kernel's fallback).
* ``_triton_whatif_shared`` -- more queries, where the signature-pieces path
  (kvtrace/kernels/whatif_pieces.py) does not pay for its plan: ``_keep_shared_kernel``, BLOCK_M
  query rows sharing ONE running max per row, the full attention's, across SETS keep-sets.
* ``_triton_whatif_keep`` -- ``run_keep``: which keep kernel runs, its tiles (autotuned), and the
  fallbacks when a compiler rejects one (recorded in the caller's ``KernelFallbacks``).
* ``_triton_whatif_finish`` -- ``run_keep_finish``: the split merge into recall and error, with the
  exact recomputation of a (row, set) that underflowed against the shared max.
* ``_triton_whatif_check`` -- ``run_grid_check``: one pass over fp32 q, k, v (whether they hold
  bf16 values: then the tensor-core kernels read them as bf16) and the query positions (the int32
  bound), one launch and at most one host sync per call.
* ``_triton_whatif_quant`` -- min-max (or fp8) quantise-dequantise error of K or V in registers.
* ``_triton_whatif_launch`` -- ``Launcher``: direct launches through the compiled kernels.

Precision: the exact kernel computes in fp32 throughout (IEEE products and sums). Elsewhere
scores are fp32 dots (16-bit inputs: exact products, fp32 accumulation; fp32 inputs:
``tf32x3``, about fp32 accuracy, on the GPU); ``p @ V`` takes fp32 ``p`` and fp32 ``V`` with
``tf32x3`` on the GPU, so outputs carry ~1e-6 relative error, far below the errors being measured.
The interpreter computes in numpy fp32 throughout.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvtrace.kernels._env import interpreting

# The interpreter runs small tiles (fast on CPU, and exercises the masking paths).
INTERP_ROWS = 16
INTERP_BLOCK_M = 16
INTERP_SETS = 2
INTERP_BLOCK_N = 16
INTERP_BLOCK_T = 16
# Key splits are a multiple of the largest BLOCK_N an autotuned config may use.
MAX_BLOCK_N = 128
# Query positions (relative to the keys) the int32 kernels take: |p| below this (whatif._LIMIT).
POSITION_LIMIT = 2**29


@triton.jit
def _key_range(pid_split, keys_per_split, Tk, pos, valid, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Keys of this split, clipped to what some valid row (at ``pos``) can see."""
    lo = pid_split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, Tk)
    if CAUSAL:
        hi = tl.minimum(hi, tl.max(tl.where(valid, pos, -1), axis=0) + 1)
    if HAS_WINDOW:
        first = tl.min(tl.where(valid, pos, Tk + window), axis=0) - window + 1
        lo = tl.maximum(lo, (tl.maximum(first, 0) // BLOCK_N) * BLOCK_N)
    return lo, hi


@triton.jit
def _visible(offs_n, n_valid, pos, valid, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """[rows, keys] visibility of key offsets ``offs_n`` to rows at ``pos`` (relative positions)."""
    vis = valid[:, None] & n_valid[None, :]
    if CAUSAL:
        vis = vis & (offs_n[None, :] <= pos[:, None])
    if HAS_WINDOW:
        vis = vis & (offs_n[None, :] > pos[:, None] - window)
    return vis


@triton.jit
def _rows(vq, kvh, b, Hq, Tq, GROUP, QPOS, k_start, valid):
    """Virtual query ``vq`` of KV head ``kvh`` -> (query head, query index, relative position,
    row offset of its outputs in [B * Hq, Tq])."""
    h = kvh * GROUP + vq // Tq
    qi = vq % Tq
    pos = tl.load(QPOS + qi, mask=valid, other=0).to(tl.int32) - k_start  # int64 positions, < 2**29
    return h, qi, pos, (b * Hq + h).to(tl.int64) * Tq + qi


@triton.jit
def _load_q(Q, qrow, D, offs_d, valid, d_valid, CAST_Q: tl.constexpr, DOT_F32: tl.constexpr):
    """Query rows [rows, BLOCK_D] at row offsets ``qrow`` of the contiguous Q (a gather); ``CAST_Q``:
    fp32 holding bf16 values, cast to bf16 (exact)."""
    q = tl.load(Q + qrow[:, None] * D + offs_d[None, :], mask=valid[:, None] & d_valid[None, :], other=0.0)
    if CAST_Q:
        q = q.to(tl.bfloat16)
    if DOT_F32:
        q = q.to(tl.float32)
    return q


@triton.jit
def _load_kv(k_base, v_base, offs_n, n_valid, D, DV, offs_d, d_valid, offs_dv, dv_valid, DOT_F32: tl.constexpr,
             CAST_K: tl.constexpr, CAST_V: tl.constexpr):
    """A key block transposed [BLOCK_D, BLOCK_N] (dot operand dtype) and its values [BLOCK_N, BLOCK_DV]
    (as stored, or bf16) of contiguous K/V rows. ``CAST_K``/``CAST_V``: fp32 memory holding bf16
    values (recorded bf16 upcast), cast to bf16 in registers -- exact, and no converted copy of K/V
    in memory."""
    kt = tl.load(k_base + offs_n[None, :].to(tl.int64) * D + offs_d[:, None],
                 mask=n_valid[None, :] & d_valid[:, None], other=0.0)
    if CAST_K:
        kt = kt.to(tl.bfloat16)
    if DOT_F32:
        kt = kt.to(tl.float32)
    v = tl.load(v_base + offs_n[:, None].to(tl.int64) * DV + offs_dv[None, :],
                mask=n_valid[:, None] & dv_valid[None, :], other=0.0)
    if CAST_V:
        v = v.to(tl.bfloat16)
    return kt, v


@triton.jit
def _pv(acc, p, v, PV_SPLIT: tl.constexpr, DOT_F32: tl.constexpr, PREC_PV: tl.constexpr):
    """acc + p @ v to about fp32 accuracy. ``PV_SPLIT`` (bf16 V): p = hi + mid + lo, three bf16
    parts holding its 24 bits, each a bf16 tensor-core dot against the exact V (half the cost of
    3xTF32). Else V in fp32 and a ``PREC_PV`` dot."""
    if PV_SPLIT:
        hi = p.to(tl.bfloat16)
        r = p - hi.to(tl.float32)  # exact: hi is p's leading 8 bits
        mid = r.to(tl.bfloat16)
        lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
        if DOT_F32:  # the interpreter: same parts, fp32 products (it mis-computes bf16 dots)
            vf = v.to(tl.float32)
            acc = tl.dot(lo.to(tl.float32), vf, acc, input_precision="ieee")
            acc = tl.dot(mid.to(tl.float32), vf, acc, input_precision="ieee")
            acc = tl.dot(hi.to(tl.float32), vf, acc, input_precision="ieee")
        else:
            acc = tl.dot(lo, v, acc)
            acc = tl.dot(mid, v, acc)
            acc = tl.dot(hi, v, acc)
        return acc
    else:
        return tl.dot(p, v.to(tl.float32), acc, input_precision=PREC_PV)


@triton.jit
def _softmax_step(m_i, l_i, s):
    """One key block of a row-wise online softmax over scores ``s`` [rows, keys] (-inf where not
    used): (new max, new sum, the old state's rescale factor, p = exp(s - new max))."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # Rows that have used no key yet keep m = -inf; shift by 0 there so no inf - inf.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_use)
    p = tl.exp(s - m_use[:, None])  # 0 where not used (s = -inf)
    return m_new, alpha * l_i + tl.sum(p, axis=1), alpha, p


@triton.jit
def _program(Q, K, V, QPOS, vq, valid, Hq, Tq, Tk, GROUP, D, DV, k_start, window, keys_per_split,
             dv_off, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, CAST_Q: tl.constexpr, DOT_F32: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """The prologue both keep kernels share: this program's (batch, KV head), its rows' positions
    and output rows, their queries, the K/V bases and the key range of its split; value columns
    ``dv_off .. dv_off + BLOCK_DV``."""
    Hk = Hq // GROUP
    b = tl.program_id(1) // Hk
    kvh = tl.program_id(1) % Hk
    _, _, pos, out_row = _rows(vq, kvh, b, Hq, Tq, GROUP, QPOS, k_start, valid)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = dv_off + tl.arange(0, BLOCK_DV)
    d_valid = offs_d < D
    dv_valid = offs_dv < DV
    q = _load_q(Q, out_row, D, offs_d, valid, d_valid, CAST_Q, DOT_F32)
    head = b.to(tl.int64) * Hk + kvh  # K/V/keep are contiguous [B, Hk, Tk, ...]
    k_base = K + head * Tk * D
    v_base = V + head * Tk * DV
    lo, hi = _key_range(tl.program_id(2), keys_per_split, Tk, pos, valid, window, CAUSAL, HAS_WINDOW, BLOCK_N)
    return head, pos, out_row, q, k_base, v_base, lo, hi, offs_d, d_valid, offs_dv, dv_valid


def packed(group: int, Tq: int) -> bool:
    """The few-query kernel when the KV head's queries (group x Tq) fill less than 16 rows."""
    return group * Tq < 16


def split_unit() -> int:
    """Key splits must be a multiple of this (every BLOCK_N a launch may pick divides it)."""
    return INTERP_BLOCK_N if interpreting() else MAX_BLOCK_N


