"""Triton kernel for the Gram matrix X^T X of MLA latents ([N, r] rows). Imported lazily.

Grid: (row tile i, column tile j, row split). Only tiles with i <= j do work (G is symmetric; the
wrapper mirrors the upper triangle). Each program reduces its split of the N rows in fp32 and
writes its own partial; partials are summed in torch, so the result does not depend on timing.
"""

from __future__ import annotations

from functools import cache

import triton
import triton.language as tl

from kvtrace.kernels._env import interpreting

MAX_BLOCK_K = 128


def split_unit() -> int:
    """Row splits must be a multiple of this (every BLOCK_K the launch may pick divides it)."""
    return 16 if interpreting() else MAX_BLOCK_K


@triton.jit(do_not_specialize=["N", "rows_per_split"])
def _gram_kernel(
    X, OUT, N, R, stride_n, rows_per_split,
    DOT_F32: tl.constexpr, PREC: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    ti = tl.program_id(0)
    tj = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_i = ti * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_j = tj * BLOCK_R + tl.arange(0, BLOCK_R)
    i_valid = offs_i < R
    j_valid = offs_j < R
    lo = pid_s * rows_per_split
    hi = tl.minimum(lo + rows_per_split, N)
    hi = tl.where(ti <= tj, hi, lo)  # lower-triangle tiles: empty loop, store zeros (ignored)
    acc = tl.zeros([BLOCK_R, BLOCK_R], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        k_valid = offs_k < hi
        rows = offs_k.to(tl.int64) * stride_n
        a = tl.load(X + rows[None, :] + offs_i[:, None], mask=k_valid[None, :] & i_valid[:, None],
                    other=0.0)
        b = tl.load(X + rows[:, None] + offs_j[None, :], mask=k_valid[:, None] & j_valid[None, :],
                    other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PREC)
    out = OUT + pid_s.to(tl.int64) * R * R + offs_i[:, None] * R + offs_j[None, :]
    tl.store(out, acc, mask=i_valid[:, None] & j_valid[None, :])


def _configs() -> list:
    cfg = triton.Config
    return [
        cfg({"BLOCK_R": 64, "BLOCK_K": 64}, num_warps=4, num_stages=3),
        cfg({"BLOCK_R": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
        cfg({"BLOCK_R": 128, "BLOCK_K": 32}, num_warps=8, num_stages=4),
        cfg({"BLOCK_R": 64, "BLOCK_K": 128}, num_warps=8, num_stages=2),  # 4 warps spill on sm_90
        cfg({"BLOCK_R": 32, "BLOCK_K": 32}, num_warps=4, num_stages=1),
    ]


@cache
def _tuned():
    return triton.autotune(configs=_configs(), key=["R"])(_gram_kernel)


def run_gram(x, out, *, rows_per_split: int, n_splits: int) -> None:
    """x: [N, r] with unit stride on r; out: zeroed fp32 [n_splits, r, r] partials."""
    import torch

    N, R = x.shape
    dot_f32 = interpreting() and x.dtype == torch.bfloat16  # interpreter bf16 dot is unreliable
    prec = "ieee" if (x.dtype == torch.float32 or dot_f32) else "tf32"
    args = (x, out, N, R, x.stride(0), rows_per_split)
    if interpreting():
        # Small tiles exercise the masks; 64-wide ones keep r = 512 affordable on the CPU.
        br = 16 if R <= 64 else 64
        nt = triton.cdiv(R, br)
        _gram_kernel[(nt, nt, n_splits)](*args, DOT_F32=dot_f32, PREC=prec, BLOCK_R=br, BLOCK_K=16)
        return
    _tuned()[lambda meta: (triton.cdiv(R, meta["BLOCK_R"]), triton.cdiv(R, meta["BLOCK_R"]), n_splits)](
        *args, DOT_F32=dot_f32, PREC=prec)
