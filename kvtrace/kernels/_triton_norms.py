"""Triton kernel for per-token L2 norms of a [B, H, T, D] tensor. Imported lazily (needs triton)."""

from __future__ import annotations

import triton
import triton.language as tl

from kvtrace.kernels._env import interpreting


@triton.jit(do_not_specialize=["T"])
def _token_norms_kernel(
    X, OUT,
    H, T, D,
    stride_b, stride_h, stride_t,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program: BLOCK_T consecutive tokens of one (batch, head). The last dim is unit-stride
    # (the wrapper guarantees it), so each row is one contiguous read.
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    base = X + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
    ptrs = base + offs_t[:, None].to(tl.int64) * stride_t + offs_d[None, :]
    mask = (offs_t[:, None] < T) & (offs_d[None, :] < D)
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    # Scale by the row's max |x| before squaring (as BLAS nrm2 does): bf16/fp32 values above
    # ~1.8e19 would overflow fp32 when squared; scaled squares are <= 1.
    amax = tl.max(tl.abs(x), axis=1)
    inv = tl.where(amax > 0, 1.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    xs = x * inv[:, None]
    ss = tl.sum(xs * xs, axis=1)
    norm = amax * tl.sqrt(ss)
    tl.store(OUT + pid_bh.to(tl.int64) * T + offs_t, norm, mask=offs_t < T)


def _block_t(block_d: int) -> int:
    # ~8K elements per program (16 KiB of bf16): enough bytes in flight per SM to stream at
    # full bandwidth, small enough to stay in registers for D up to 1024.
    return max(1, min(256, 8192 // block_d))


def token_norms(x, out) -> None:
    """Fill ``out`` [B*H*T] fp32 with the L2 norm of each token row of ``x`` [B, H, T, D]."""
    B, H, T, D = x.shape
    if B * H * T == 0:
        return
    block_d = triton.next_power_of_2(max(D, 1))
    block_t = _block_t(block_d)
    if interpreting():
        block_t = min(block_t, 16)  # the CPU interpreter is slow; tiny tiles keep tests fast
    block_t = min(block_t, triton.next_power_of_2(T))
    grid = (triton.cdiv(T, block_t), B * H)
    num_warps = 8 if block_t * block_d >= 8192 else 4
    _token_norms_kernel[grid](
        x, out, H, T, D,
        x.stride(0), x.stride(1), x.stride(2),
        BLOCK_T=block_t, BLOCK_D=block_d, num_warps=num_warps,
    )
