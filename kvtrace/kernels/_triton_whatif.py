"""Triton kernels of the what-if replay (kvtrace/kernels/whatif.py dispatches). Imported lazily.

``_keep_kernel`` -- attention restricted to many candidate keep-sets in one pass over the keys.
One program per (query block x set block, batch * query head, key split). Its ``SETS * BLOCK_M``
rows are ``BLOCK_M`` queries repeated for ``SETS`` keep-sets, so every per-set quantity is a plain
2-D tile and ``p @ V`` is one tensor-core dot for all the sets. Per row it keeps an online-softmax
state over the keys that are visible AND kept by the row's set: running max ``m``, ``l = sum
exp(s - m)`` and ``acc = sum exp(s - m) v``; the partial states of the key splits are merged in
torch (a few floats per row). Set 0 is "keep every key" (the full attention), so mass recall
``exp(m_s - m_0) l_s / l_0`` and the output error follow from the merged states alone. Nothing of
size rows x keys x sets is formed: memory O(rows * sets * splits * Dv).

``_quant_kernel`` -- min-max (or fp8) quantise-dequantise of K or V in registers, returning per
(batch * head, program) the sum of squared errors and the sum and count of per-token cosines; the
dequantised tensor never reaches memory. Rounding and sums are float64 (numerics.py's formula):
the kernel is memory-bound, and fp32 would break the many rounding ties of bf16/fp16-grid data
differently from the reference.

Precision: scores are fp32 dots (16-bit inputs: exact products, fp32 accumulation; fp32 inputs:
``tf32x3``, about fp32 accuracy, on the GPU); ``p @ V`` takes fp32 ``p`` and fp32 ``V`` with
``tf32x3`` on the GPU, so outputs carry ~1e-6 relative error, far below the errors being measured.
The interpreter computes in numpy fp32 throughout.
"""

from __future__ import annotations

from functools import cache

import triton
import triton.language as tl

from kvtrace.kernels._env import interpreting
from kvtrace.kernels._triton_attention import _scaled

# The interpreter runs small tiles (fast on CPU, and exercises the masking paths).
INTERP_BLOCK_M = 16
INTERP_BLOCK_N = 16
INTERP_SETS = 2
INTERP_BLOCK_T = 16
# Key splits are a multiple of the largest BLOCK_N an autotuned config may use.
MAX_BLOCK_N = 64


@triton.jit(do_not_specialize=["Tq", "Tk", "S", "k_start", "window", "keys_per_split"])
def _keep_kernel(
    Q, K, V, KEEP, QPOS, PM, PL, PACC,
    Hq, Tq, Tk, S, GROUP, D, DV, scale, k_start, window, keys_per_split, n_splits,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, kps, kpb, kph,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_F32: tl.constexpr, PREC_QK: tl.constexpr,
    PREC_PV: tl.constexpr, ROUNDED: tl.constexpr, BLOCK_M: tl.constexpr, SETS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    ROWS: tl.constexpr = SETS * BLOCK_M
    pid_qs = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_split = tl.program_id(2)
    n_qblocks = tl.cdiv(Tq, BLOCK_M)
    qb = pid_qs % n_qblocks
    sb = pid_qs // n_qblocks
    b = pid_bh // Hq
    h = pid_bh % Hq
    kvh = h // GROUP

    offs_r = tl.arange(0, ROWS)
    row_q = qb * BLOCK_M + offs_r % BLOCK_M
    row_s = sb * SETS + offs_r // BLOCK_M
    r_valid = (row_q < Tq) & (row_s < S)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_valid = offs_d < D
    dv_valid = offs_dv < DV
    # Query positions relative to the first key, so key j sits at j.
    pos = tl.load(QPOS + row_q, mask=r_valid, other=0) - k_start

    q = tl.load(Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + row_q[:, None].to(tl.int64) * sqt
                + offs_d[None, :], mask=r_valid[:, None] & d_valid[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    k_base = K + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh
    v_base = V + b.to(tl.int64) * svb + kvh.to(tl.int64) * svh
    keep_row = KEEP + row_s.to(tl.int64) * kps + b.to(tl.int64) * kpb + kvh.to(tl.int64) * kph

    # Keys of this split, clipped to what some row of the block can see.
    lo = pid_split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, Tk)
    if CAUSAL:
        hi = tl.minimum(hi, tl.max(tl.where(r_valid, pos, -1), axis=0) + 1)
    if HAS_WINDOW:
        first = tl.min(tl.where(r_valid, pos, Tk + window), axis=0) - window + 1
        lo = tl.maximum(lo, (tl.maximum(first, 0) // BLOCK_N) * BLOCK_N)

    m_i = tl.zeros([ROWS], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_DV], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < Tk
        kt = tl.load(k_base + offs_n[None, :].to(tl.int64) * skt + offs_d[:, None],
                     mask=n_valid[None, :] & d_valid[:, None], other=0.0)
        if DOT_F32:
            kt = kt.to(tl.float32)
        s = _scaled(tl.dot(q, kt, input_precision=PREC_QK), scale, ROUNDED)
        kept = tl.load(keep_row[:, None] + offs_n[None, :], mask=r_valid[:, None] & n_valid[None, :], other=0)
        use = (kept != 0) & r_valid[:, None] & n_valid[None, :]
        if CAUSAL:
            use = use & (offs_n[None, :] <= pos[:, None])
        if HAS_WINDOW:
            use = use & (offs_n[None, :] > pos[:, None] - window)
        s = tl.where(use, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows that have used no key yet keep m = -inf; shift by 0 there so no inf - inf.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])  # 0 where not used (s = -inf)
        v = tl.load(v_base + offs_n[:, None].to(tl.int64) * svt + offs_dv[None, :],
                    mask=n_valid[:, None] & dv_valid[None, :], other=0.0).to(tl.float32)
        l_i = alpha * l_i + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PREC_PV)
        m_i = m_new

    # Partial states, laid out [S, B * Hq, Tq, n_splits] (and x DV for acc).
    out = ((row_s.to(tl.int64) * (tl.num_programs(1)) + pid_bh) * Tq + row_q) * n_splits + pid_split
    tl.store(PM + out, m_i, mask=r_valid)
    tl.store(PL + out, l_i, mask=r_valid)
    tl.store(PACC + out[:, None] * DV + offs_dv[None, :], acc, mask=r_valid[:, None] & dv_valid[None, :])


def _keep_configs(block_m: int | None = None) -> list:
    """Configs (BLOCK_M, SETS, BLOCK_N, warps, stages): 16-128 rows of fp32 state against 32-64 keys
    a step. fp32 inputs (the replay's) take 3xTF32 dots, whose operand splits need ~70-200 KiB of
    shared memory at D = 128 (AOT-compiled for sm_90): smaller tiles and one stage are offered
    too, and the autotuner skips what does not fit. With few queries (``block_m`` 1-8: decode
    steps sample one query per sequence) the rows are mostly keep-sets."""
    if block_m is None:
        specs = [(16, 4, 64, 4, 2), (16, 4, 32, 4, 1), (16, 8, 32, 8, 1), (32, 2, 64, 4, 2), (16, 2, 32, 4, 2),
                 (16, 1, 32, 4, 1)]
    else:
        bm = block_m
        specs = [(bm, 16 // bm, 64, 4, 2), (bm, 16 // bm, 32, 4, 1), (bm, 32 // bm, 64, 4, 2),
                 (bm, 32 // bm, 32, 4, 1), (bm, 64 // bm, 32, 8, 1)]
    return [triton.Config({"BLOCK_M": bm, "SETS": sets, "BLOCK_N": bn}, num_warps=w, num_stages=st)
            for bm, sets, bn, w, st in specs]


def small_block_m(Tq: int) -> int | None:
    """BLOCK_M for few queries (1, 2, 4 or 8), None for the general configs."""
    return triton.next_power_of_2(max(Tq, 1)) if Tq <= 8 else None


@cache
def _tuned_keep(block_m: int | None):
    # Tuned per head dims (and dtype, which the autotuner adds to the key); lengths hardly matter.
    return triton.autotune(configs=_keep_configs(block_m), key=["BLOCK_D", "BLOCK_DV"])(_keep_kernel)


def split_unit() -> int:
    """Key splits must be a multiple of this (every BLOCK_N a launch may pick divides it)."""
    return INTERP_BLOCK_N if interpreting() else MAX_BLOCK_N


def run_keep(q, k, v, keep, qpos, pm, pl, pacc, *, group, scale, k_start, window, causal,
             keys_per_split, n_splits) -> None:
    """Launch ``_keep_kernel``. q [B, Hq, Tq, D], k [B, Hk, T, D], v [B, Hk, T, Dv] (last dim
    contiguous), keep int8 [S, B, Hk, T] contiguous, qpos int32 [Tq]; pm/pl fp32
    [S * B * Hq * Tq * n_splits], pacc fp32 [... * Dv] outputs."""
    import torch

    B, Hq, Tq, D = q.shape
    Tk, DV = k.shape[2], v.shape[3]
    S = keep.shape[0]
    block_d = max(16, triton.next_power_of_2(D))
    block_dv = max(16, triton.next_power_of_2(DV))
    # The interpreter computes bf16 dots on raw bits: upcast there. On the GPU 16-bit inputs feed
    # the tensor cores (exact products, fp32 sums); fp32 inputs and p @ V use 3xTF32.
    dot_f32 = interpreting() and q.dtype == torch.bfloat16
    prec_qk = "ieee" if interpreting() else ("tf32x3" if q.dtype == torch.float32 else "tf32")
    prec_pv = "ieee" if interpreting() else "tf32x3"

    def args() -> tuple:
        return (q, k, v, keep, qpos, pm, pl, pacc, Hq, Tq, Tk, S, group, D, DV, float(scale), int(k_start),
                int(window or 0), keys_per_split, n_splits,
                q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2), keep.stride(0), keep.stride(1), keep.stride(2))

    flags = dict(CAUSAL=bool(causal), HAS_WINDOW=window is not None, DOT_F32=dot_f32, PREC_QK=prec_qk,
                 PREC_PV=prec_pv, ROUNDED=not interpreting(), BLOCK_D=block_d, BLOCK_DV=block_dv)
    if interpreting():
        bm = min(INTERP_BLOCK_M, triton.next_power_of_2(max(Tq, 1)))
        sets = max(INTERP_SETS, 16 // bm)
        grid = (triton.cdiv(Tq, bm) * triton.cdiv(S, sets), B * Hq, n_splits)
        _keep_kernel[grid](*args(), **flags, BLOCK_M=bm, SETS=sets, BLOCK_N=INTERP_BLOCK_N)
        return
    kernel = _tuned_keep(small_block_m(Tq))
    kernel[lambda meta: (triton.cdiv(Tq, meta["BLOCK_M"]) * triton.cdiv(S, meta["SETS"]), B * Hq, n_splits)](
        *args(), **flags)


# ------------------------------------------------------------------------------ quantisation

MODE_CHANNEL_GROUPS = 0  # groups of `group` channels per token (KIVI values, quanto/HQQ K and V)
MODE_TOKEN_GROUPS = 1  # groups of `group` tokens per channel (KIVI keys)
MODE_FP8 = 2


@triton.jit
def _rint(y):
    """Round half to even (numpy's np.round) from floor, exact in fp32 and in the interpreter."""
    f = tl.floor(y)
    d = y - f
    odd = f - 2.0 * tl.floor(f * 0.5)
    return f + tl.where(d > 0.5, 1.0, tl.where(d == 0.5, odd, 0.0))


@triton.jit
def _dequant(x, lo, hi, levels):
    """numerics.quantize_minmax's formula, in the precision of its inputs."""
    scale = (hi - lo) / levels
    safe = tl.where(scale > 0, scale, 1.0)
    qv = tl.minimum(tl.maximum(_rint((x - lo) / safe), 0.0), levels)
    return qv * scale + lo


@triton.jit
def _fp8(x, MAN: tl.constexpr, EMIN: tl.constexpr, TOP: tl.constexpr):
    """Nearest fp8 value (ties to even), saturating at +-TOP: exponent read from the fp32 bits, so
    no log2 approximation; scaling by powers of two is exact."""
    x = tl.minimum(tl.maximum(x, -TOP), TOP)
    bits = tl.abs(x).to(tl.int32, bitcast=True)
    e = tl.maximum((bits >> 23) - 127, EMIN)
    up = ((MAN - e + 127) << 23).to(tl.float32, bitcast=True)  # 2^(MAN - e)
    down = ((e - MAN + 127) << 23).to(tl.float32, bitcast=True)  # the quantum 2^(e - MAN)
    r = _rint(x * up) * down
    return tl.minimum(tl.maximum(r, -TOP), TOP)


@triton.jit(do_not_specialize=["Tn", "group", "chunk"])
def _quant_kernel(
    X, SSE, COS, CNT, Hn, Tn, D, group, chunk, sxb, sxh, sxt,
    LEVELS: tl.constexpr, MODE: tl.constexpr, MAN: tl.constexpr, EMIN: tl.constexpr, TOP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hn
    h = pid_bh % Hn
    base = X + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < D
    t0 = pid * chunk
    t1 = tl.minimum(t0 + chunk, Tn)

    # KIVI keys: per-channel min and max over this program's token group (first pass).
    c_lo = tl.zeros([BLOCK_D], dtype=tl.float32) + float("inf")
    c_hi = tl.zeros([BLOCK_D], dtype=tl.float32) - float("inf")
    if MODE == 1:
        for start in range(t0, t1, BLOCK_T):
            offs_t = start + tl.arange(0, BLOCK_T)
            ok = (offs_t < t1)[:, None] & d_valid[None, :]
            x = tl.load(base + offs_t[:, None].to(tl.int64) * sxt + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
            c_lo = tl.minimum(c_lo, tl.min(tl.where(ok, x, float("inf")), axis=0))
            c_hi = tl.maximum(c_hi, tl.max(tl.where(ok, x, float("-inf")), axis=0))

    # Errors are taken in float64, as numerics.py does: recorded K/V sit on a coarse (bf16/fp16)
    # grid where (x - lo) / scale often lands near a rounding tie, which fp32 and float64 break
    # differently (a whole quantum apart: first order in the cosine).
    sse = tl.zeros([BLOCK_T], dtype=tl.float64)
    cos = tl.zeros([BLOCK_T], dtype=tl.float64)
    cnt = tl.zeros([BLOCK_T], dtype=tl.float64)
    for start in range(t0, t1, BLOCK_T):
        offs_t = start + tl.arange(0, BLOCK_T)
        t_valid = offs_t < t1
        ok = t_valid[:, None] & d_valid[None, :]
        x = tl.load(base + offs_t[:, None].to(tl.int64) * sxt + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
        if MODE == 0:
            lo = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
            hi = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
            for g0 in range(0, D, group):
                in_g = (offs_d >= g0) & (offs_d < g0 + group) & d_valid
                g_lo = tl.min(tl.where(in_g[None, :], x, float("inf")), axis=1)
                g_hi = tl.max(tl.where(in_g[None, :], x, float("-inf")), axis=1)
                lo = tl.where(in_g[None, :], g_lo[:, None], lo)
                hi = tl.where(in_g[None, :], g_hi[:, None], hi)
            xq = _dequant(x.to(tl.float64), lo.to(tl.float64), hi.to(tl.float64), LEVELS)
        elif MODE == 1:
            xq = _dequant(x.to(tl.float64), c_lo.to(tl.float64)[None, :], c_hi.to(tl.float64)[None, :], LEVELS)
        else:
            xq = _fp8(x, MAN, EMIN, TOP).to(tl.float64)  # exact in fp32 (scaling by powers of two)
        x64 = x.to(tl.float64)
        xq = tl.where(ok, xq, 0.0)
        diff = x64 - xq
        sse += tl.sum(diff * diff, axis=1)
        na = tl.sum(x64 * x64, axis=1)
        nb = tl.sum(xq * xq, axis=1)
        good = t_valid & (na > 0) & (nb > 0)
        c = tl.sum(x64 * xq, axis=1) / (tl.sqrt(tl.where(good, na, 1.0)) * tl.sqrt(tl.where(good, nb, 1.0)))
        cos += tl.where(good, c, 0.0)
        cnt += tl.where(good, 1.0, 0.0)
    out = pid_bh.to(tl.int64) * tl.num_programs(0) + pid
    tl.store(SSE + out, tl.sum(sse, axis=0))
    tl.store(COS + out, tl.sum(cos, axis=0))
    tl.store(CNT + out, tl.sum(cnt, axis=0))


def quant_grid(Tn: int, mode: int, group: int) -> tuple[int, int]:
    """(programs per head, tokens per program) for ``Tn`` quantised tokens."""
    if mode == MODE_TOKEN_GROUPS:
        return triton.cdiv(Tn, group), group
    chunk = INTERP_BLOCK_T if interpreting() else 256
    return triton.cdiv(Tn, chunk), chunk


def run_quant(x, sse, cos, cnt, *, Tn, mode, group, chunk, bits, fp8=(3, -6, 448.0)) -> None:
    """Launch ``_quant_kernel`` over the first ``Tn`` tokens of x [B, H, T, D] (last dim
    contiguous); sse/cos/cnt float64 [B * H * programs] outputs."""
    B, H, _, D = x.shape
    n_prog = sse.numel() // (B * H)
    block_d = max(16, triton.next_power_of_2(D))
    block_t = INTERP_BLOCK_T if interpreting() else max(1, min(64, 8192 // block_d))
    man, emin, top = fp8
    _quant_kernel[(n_prog, B * H)](
        x, sse, cos, cnt, H, Tn, D, max(1, int(group)), int(chunk),
        x.stride(0), x.stride(1), x.stride(2),
        LEVELS=float((1 << bits) - 1), MODE=mode, MAN=int(man), EMIN=int(emin), TOP=float(top), BLOCK_T=block_t, BLOCK_D=block_d,
        num_warps=4,
    )
