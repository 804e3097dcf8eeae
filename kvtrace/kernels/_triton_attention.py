"""Triton kernels for attention statistics (entropy, LSE, received mass). Imported lazily.

Pass 1 (``_stats_kernel``): one program per (query block, batch*query head, key split). It streams
the key blocks its rows can see and keeps, per query row, an online-softmax state:
    m  running max of the scores s,
    Z  = sum exp(s - m),
    S' = sum exp(s - m) * (s - m)            (<= 0, relative to the running max),
from which entropy H = ln Z - S'/Z and LSE = m + ln Z. Writing S' relative to m (instead of
S = sum e^(s-m) s and H = m + ln Z - S/Z) keeps both terms of H non-negative, so no cancellation
when scores are large. Key splits (flash-decoding style) give the GPU enough programs when only a
few queries are sampled; the per-split states are merged in torch (a few floats per row).

Pass 2 (``_mass_kernel``): one program per (key block, batch*KV head). It keeps its key tile in
registers and loops over the query heads of its GQA group and the query blocks that can see it,
summing p = exp((s - m) - ln Z) over rows (the saved LSE, kept as its two parts m and ln Z). No
atomics: each key is owned by one program, so the result is deterministic. Both passes round
``dot * scale`` on its own (``_scaled``), so pass 2 recomputes the very scores pass 1 took the max of.

Neither pass forms a T x T matrix: memory is O(rows).
"""

from __future__ import annotations

from functools import cache

import triton
import triton.language as tl
from triton.language.extra import libdevice

from kvtrace.kernels._env import interpreting

# Every key split is a multiple of the largest BLOCK_N an autotuned config may use.
MAX_BLOCK_N = 128
# The interpreter always runs 16 x 16 tiles (fast on CPU, and exercises the masking paths).
INTERP_BLOCK = 16


@triton.jit
def _scaled(raw, scale, ROUNDED: tl.constexpr):
    """``raw * scale`` rounded to fp32 on its own (``mul.rn``), never fused into a later add.

    Both passes subtract the row max from scores they compute themselves. If the compiler fused
    ``raw * scale - max`` into one FMA, the unrounded product would leave a score that is the max
    a rounding error away from it: at |s| ~ 1e10 (fp16 inputs near 6e4) that is thousands of
    nats, and exp() of it is 0 or inf. The interpreter (numpy) never fuses and has no libdevice.
    """
    if ROUNDED:
        return libdevice.mul_rn(raw, scale)
    else:
        return raw * scale


def split_unit() -> int:
    """Key splits must be a multiple of this (every BLOCK_N the launch may pick divides it)."""
    return INTERP_BLOCK if interpreting() else MAX_BLOCK_N


@triton.jit(do_not_specialize=["Tq", "Tk", "window", "keys_per_split", "n_splits"])
def _stats_kernel(
    Q, K, POS, PM, PZ, PS,
    Hq, Tq, Tk, GROUP, D, scale, window, keys_per_split, n_splits,
    sqb, sqh, sqt, skb, skh, skt,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
    ROUNDED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // Hq
    h = pid_bh % Hq
    kvh = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < Tq
    d_valid = offs_d < D
    pos = tl.load(POS + offs_m, mask=m_valid, other=0)

    q_ptrs = (Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
              + offs_m[:, None].to(tl.int64) * sqt + offs_d[None, :])
    q = tl.load(q_ptrs, mask=m_valid[:, None] & d_valid[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    k_base = K + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh

    # Key range of this split, clipped to what any row of this block can see.
    lo = pid_s * keys_per_split
    hi = tl.minimum(lo + keys_per_split, Tk)
    if CAUSAL:
        hi = tl.minimum(hi, tl.max(tl.where(m_valid, pos, -1), axis=0) + 1)
    if HAS_WINDOW:
        first = tl.min(tl.where(m_valid, pos, Tk + window), axis=0) - window + 1
        lo = tl.maximum(lo, (tl.maximum(first, 0) // BLOCK_N) * BLOCK_N)

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    z_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    s_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < Tk
        kt_ptrs = k_base + offs_n[None, :].to(tl.int64) * skt + offs_d[:, None]
        kt = tl.load(kt_ptrs, mask=n_valid[None, :] & d_valid[:, None], other=0.0)
        if DOT_F32:
            kt = kt.to(tl.float32)
        s = _scaled(tl.dot(q, kt, input_precision=PREC), scale, ROUNDED)
        vis = m_valid[:, None] & n_valid[None, :]
        if CAUSAL:
            vis = vis & (offs_n[None, :] <= pos[:, None])
        if HAS_WINDOW:
            vis = vis & (offs_n[None, :] > pos[:, None] - window)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows that have seen nothing yet keep m = -inf; use 0 as the shift so no inf - inf.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_use)
        shift = tl.where(z_i > 0, m_i - m_use, 0.0)
        d = s - m_use[:, None]
        p = tl.exp(d)  # 0 where masked (d = -inf)
        pd = p * tl.where(vis, d, 0.0)
        s_i = alpha * (s_i + shift * z_i) + tl.sum(pd, axis=1)
        z_i = alpha * z_i + tl.sum(p, axis=1)
        m_i = m_new

    out = (pid_bh.to(tl.int64) * Tq + offs_m) * n_splits + pid_s
    tl.store(PM + out, m_i, mask=m_valid)
    tl.store(PZ + out, z_i, mask=m_valid)
    tl.store(PS + out, s_i, mask=m_valid)


@triton.jit(do_not_specialize=["Tq", "Tk", "window", "q_offset"])
def _mass_kernel(
    Q, K, POS, SHIFT, LOGZ, MASS,
    Hq, Hkv, Tq, Tk, GROUP, D, scale, window, q_offset,
    sqb, sqh, sqt, skb, skh, skt,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, CONTIG: tl.constexpr,
    DOT_F32: tl.constexpr, PREC: tl.constexpr, ROUNDED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bk = tl.program_id(1)
    b = pid_bk // Hkv
    kvh = pid_bk % Hkv
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_valid = offs_n < Tk
    d_valid = offs_d < D
    kt_ptrs = (K + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh
               + offs_n[None, :].to(tl.int64) * skt + offs_d[:, None])
    kt = tl.load(kt_ptrs, mask=n_valid[None, :] & d_valid[:, None], other=0.0)
    if DOT_F32:
        kt = kt.to(tl.float32)

    # Query rows that can see this key block. With contiguous positions (pos = q_offset + i) the
    # range is exact; with arbitrary sampled positions every block is visited and masked.
    m_lo = 0
    m_hi = Tq
    if CONTIG:
        n_first = pid_n * BLOCK_N
        n_last = tl.minimum(n_first + BLOCK_N, Tk) - 1
        if CAUSAL:
            m_lo = (tl.maximum(n_first - q_offset, 0) // BLOCK_M) * BLOCK_M
        if HAS_WINDOW:
            m_hi = tl.minimum(n_last + window - q_offset, Tq)

    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for g in range(0, GROUP):
        h = kvh * GROUP + g
        q_base = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
        row_base = (b.to(tl.int64) * Hq + h) * Tq
        for m_start in range(m_lo, m_hi, BLOCK_M):
            offs_m = m_start + tl.arange(0, BLOCK_M)
            m_valid = offs_m < Tq
            pos = tl.load(POS + offs_m, mask=m_valid, other=0)
            q = tl.load(q_base + offs_m[:, None].to(tl.int64) * sqt + offs_d[None, :],
                        mask=m_valid[:, None] & d_valid[None, :], other=0.0)
            if DOT_F32:
                q = q.to(tl.float32)
            shift = tl.load(SHIFT + row_base + offs_m, mask=m_valid, other=0.0)
            log_z = tl.load(LOGZ + row_base + offs_m, mask=m_valid, other=0.0)
            s = _scaled(tl.dot(q, kt, input_precision=PREC), scale, ROUNDED)
            vis = m_valid[:, None] & n_valid[None, :]
            if CAUSAL:
                vis = vis & (offs_n[None, :] <= pos[:, None])
            if HAS_WINDOW:
                vis = vis & (offs_n[None, :] > pos[:, None] - window)
            # (s - row max) first, then - ln Z: exact even when |s| ~ 1e10 (fp16 inputs near 6e4)
            p = tl.exp(tl.where(vis, (s - shift[:, None]) - log_z[:, None], float("-inf")))
            acc += tl.sum(p, axis=0)

    tl.store(MASS + pid_bk.to(tl.int64) * Tk + offs_n, acc, mask=n_valid)


def _tile_budget(block_d: int, elem: int) -> int:
    """Rows of a [rows, BLOCK_D] operand tile that fit in ~32 KiB (one pipeline stage)."""
    return max(16, 32768 // (block_d * elem))


def _configs(block_d: int, elem: int) -> list:
    if elem == 4:
        # fp32 inputs take the IEEE FMA path (no tensor cores), whose operands live in registers:
        # larger tiles spill on sm_90 (checked with ptxas -v), so only small ones are offered.
        pairs = [(16, 32, 4), (32, 32, 8), (16, 64, 8), (16, 16, 4)]
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=2) for bm, bn, w in pairs]
    cap = _tile_budget(block_d, elem)
    pairs = [(64, 64), (128, 64), (64, 128), (128, 32), (32, 64), (32, 32), (16, 32)]
    out = []
    for bm, bn in pairs:
        if bm > cap or bn > cap:
            continue
        big = max(bm, bn) * block_d * elem >= 16384
        stages = 2 if big else 3
        warps = 8 if bm * bn >= 8192 else 4
        out.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages))
        if len(out) == 4:
            break
    # Always keep a small config: the autotuner drops configs that run out of resources.
    out.append(triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1))
    return out


@cache
def _tuned(kind: str, block_d: int, elem: int):
    fn = _stats_kernel if kind == "stats" else _mass_kernel
    # Tuned once per head dim (and dtype, which the autotuner adds to the key itself): tile
    # shapes depend on D and element size, hardly on lengths or mask flags.
    return triton.autotune(configs=_configs(block_d, elem), key=["BLOCK_D"])(fn)


def _launch_args(q, k):
    block_d = max(16, triton.next_power_of_2(q.shape[-1]))
    # The interpreter computes bf16 dots on raw bits; upcast there. On GPU bf16/fp16 feed the
    # tensor cores with fp32 accumulation (products of 16-bit floats are exact in fp32).
    import torch

    dot_f32 = interpreting() and q.dtype == torch.bfloat16
    prec = "ieee" if (q.dtype == torch.float32 or dot_f32) else "tf32"
    return block_d, dot_f32, prec


def run_stats(q, k, pos, pm, pz, ps, *, group, scale, window, keys_per_split, n_splits, causal) -> None:
    """Launch pass 1. pm/pz/ps: fp32 [B*Hq*Tq*n_splits] outputs."""
    B, Hq, Tq, D = q.shape
    Tk = k.shape[2]
    block_d, dot_f32, prec = _launch_args(q, k)
    args = (q, k, pos, pm, pz, ps, Hq, Tq, Tk, group, D, float(scale), int(window or 0),
            keys_per_split, n_splits,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2))
    flags = dict(CAUSAL=bool(causal), HAS_WINDOW=window is not None, DOT_F32=dot_f32, PREC=prec,
                 ROUNDED=not interpreting(), BLOCK_D=block_d)
    if interpreting():
        grid = (triton.cdiv(Tq, INTERP_BLOCK), B * Hq, n_splits)
        _stats_kernel[grid](*args, **flags, BLOCK_M=INTERP_BLOCK, BLOCK_N=INTERP_BLOCK)
        return
    kernel = _tuned("stats", block_d, q.element_size())
    kernel[lambda meta: (triton.cdiv(Tq, meta["BLOCK_M"]), B * Hq, n_splits)](*args, **flags)


def run_mass(q, k, pos, shift, log_z, mass, *, group, scale, window, q_offset, causal, contig) -> None:
    """Launch pass 2. shift, log_z: fp32 [B*Hq*Tq] (p = exp((s - shift) - log_z)); mass: fp32
    [B*Hkv*Tk] output."""
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    block_d, dot_f32, prec = _launch_args(q, k)
    args = (q, k, pos, shift, log_z, mass, Hq, Hkv, Tq, Tk, group, D, float(scale), int(window or 0),
            int(q_offset),
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2))
    flags = dict(CAUSAL=bool(causal), HAS_WINDOW=window is not None, CONTIG=bool(contig),
                 DOT_F32=dot_f32, PREC=prec, ROUNDED=not interpreting(), BLOCK_D=block_d)
    if interpreting():
        grid = (triton.cdiv(Tk, INTERP_BLOCK), B * Hkv)
        _mass_kernel[grid](*args, **flags, BLOCK_M=INTERP_BLOCK, BLOCK_N=INTERP_BLOCK)
        return
    kernel = _tuned("mass", block_d, q.element_size())
    kernel[lambda meta: (triton.cdiv(Tk, meta["BLOCK_N"]), B * Hkv)](*args, **flags)
