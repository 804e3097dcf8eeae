"""The quantisation-error kernel of the what-if replay (kvtrace/kernels/whatif.py dispatches).
Imported lazily.

``_quant_kernel`` -- min-max (or fp8) quantise-dequantise of K or V in registers, returning per
(batch * head, program) the sum of squared errors and the sum and count of per-token cosines; the
dequantised tensor never reaches memory. Rounding and sums are float64 (numerics.py's formula):
the kernel is memory-bound, and fp32 would break the many rounding ties of bf16/fp16-grid data
differently from the reference.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvtrace.kernels._env import interpreting
from kvtrace.kernels._triton_whatif import INTERP_BLOCK_T

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


def quant_grid(Tn: int, mode: int, group: int, lanes: int = 1, sms: int = 1) -> tuple[int, int]:
    """(programs per head, tokens per program) for ``Tn`` quantised tokens of ``lanes`` heads
    (x batch): up to 256 tokens a program, fewer when that leaves under ~4 programs per SM (a
    4k-token layer of 8 heads at 256 gave 128 programs: one wave of long, latency-bound loops)."""
    if mode == MODE_TOKEN_GROUPS:
        return triton.cdiv(Tn, group), group
    if interpreting():
        chunk = INTERP_BLOCK_T
    else:
        chunk = max(32, min(256, triton.next_power_of_2(triton.cdiv(Tn * max(lanes, 1), 4 * max(sms, 1)))))
    return triton.cdiv(Tn, chunk), chunk


def run_quant(x, sse, cos, cnt, *, Tn, mode, group, chunk, bits, fp8=(3, -6, 448.0)) -> None:
    """Launch ``_quant_kernel`` over the first ``Tn`` tokens of x [B, H, T, D] (last dim
    contiguous); sse/cos/cnt float64 [B * H * programs] outputs."""
    B, H, _, D = x.shape
    n_prog = sse.numel() // (B * H)
    block_d = max(16, triton.next_power_of_2(D))
    # ~2k elements a tile: the float64 temporaries (x, its round trip, the difference) then take
    # ~16 registers each per thread instead of spilling.
    block_t = INTERP_BLOCK_T if interpreting() else max(1, min(64, 2048 // block_d))
    man, emin, top = fp8
    _quant_kernel[(n_prog, B * H)](
        x, sse, cos, cnt, H, Tn, D, max(1, int(group)), int(chunk),
        x.stride(0), x.stride(1), x.stride(2),
        LEVELS=float((1 << bits) - 1), MODE=mode, MAN=int(man), EMIN=int(emin), TOP=float(top), BLOCK_T=block_t, BLOCK_D=block_d,
        num_warps=4,
    )
