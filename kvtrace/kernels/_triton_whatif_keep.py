"""``run_keep``: which keep-set kernel runs for a call, with which tiles, and what answers when a
compiler rejects one (the overview is kvtrace/kernels/_triton_whatif.py). Imported lazily.

Few query rows per KV head (``packed``): the exact kernel when asked (``exact``), else the packed
kernel; more rows: the shared-max kernel. A kernel the compiler rejects is recorded in the
launcher's ``KernelFallbacks`` and not tried again with that record; the packed kernel, which
computes the same, answers instead.
"""

from __future__ import annotations

from functools import cache

import triton

from kvtrace.kernels import _triton_whatif_check as tc
from kvtrace.kernels._env import interpreting
from kvtrace.kernels._triton_whatif import (
    INTERP_BLOCK_M,
    INTERP_BLOCK_N,
    INTERP_ROWS,
    INTERP_SETS,
    POSITION_LIMIT,
    packed,
)
from kvtrace.kernels._triton_whatif_decode import (
    FMA_PREC_PV,
    _fma_configs,
    _keep_fma_kernel,
    _keep_packed_kernel,
    _packed_configs,
)
from kvtrace.kernels._triton_whatif_launch import Launcher
from kvtrace.kernels._triton_whatif_shared import _keep_shared_kernel, _shared_configs

# Tuned once per head dims and path (the tensors' dtypes, which the autotuner adds to the key, do
# not tell an fp32 tensor read as bf16 from one read as fp32): lengths hardly change the best tile.
_TUNE_KEY = ["BLOCK_D", "BLOCK_DV", "CAST_Q", "CAST_K", "CAST_V", "PV_SPLIT", "PREC_QK"]
# The shared-max kernel reads K and V as stored (bf16 copies where fp32 holds bf16 values).
_SHARED_TUNE_KEY = [k for k in _TUNE_KEY if k not in ("CAST_K", "CAST_V")]


@cache
def _tuned(kind: str):
    if kind == "packed":
        return triton.autotune(configs=_packed_configs(), key=_TUNE_KEY)(_keep_packed_kernel)
    if kind == "fma":  # the tensors' dtypes join the key; GP (queries per KV head) sets the rows' shape
        return triton.autotune(configs=_fma_configs(), key=["BLOCK_D", "BLOCK_DV", "GP"])(_keep_fma_kernel)
    return triton.autotune(configs=_shared_configs(), key=_SHARED_TUNE_KEY)(_keep_shared_kernel)


def run_keep(q, k, v, keep, qpos, pm, pl, pacc, *, group, scale, k_start, window, causal,
             keys_per_split, n_splits, n_sets, launch: Launcher, cast_q=False, cast_k=False, cast_v=False,
             exact=False) -> bool:
    """Launch a keep-set kernel for ``n_sets`` sets: set 0 keeps every key, set s > 0 the keys of
    keep[s - 1]. q [B, Hq, Tq, D], k [B, Hk, T, D], v [B, Hk, T, Dv], keep int8 [n_sets - 1, B,
    Hk, T] (all contiguous), qpos int64 [Tq] (|positions| < 2**29); pm/pl fp32 [n_sets * B * Hq *
    Tq * n_splits], pacc fp32 [... * Dv] outputs. ``cast_*``: fp32 tensors holding bf16 values,
    read as bf16 (the few-query kernels only: the shared-max kernel takes bf16 copies). Returns
    whether the shared-max kernel ran (its partial states need the finish kernel's underflow
    check). ``exact`` (fewer than 16 query rows per KV head): ``_keep_fma_kernel``, fp32 on the
    CUDA cores for any input dtype (casts ignored) and any int64 positions; a compiler that
    rejects it falls back to the packed kernel (3xTF32, as uncast fp32; positions checked against
    the int32 bound first, with a host sync) and says so in ``launch.fallbacks``."""
    import torch

    B, Hq, Tq, D = q.shape
    Hk, Tk, DV = k.shape[1], k.shape[2], v.shape[3]
    S = n_sets
    block_d = max(16, triton.next_power_of_2(D))
    block_dv = max(16, triton.next_power_of_2(DV))
    # The interpreter computes bf16 dots on raw bits: upcast there. On the GPU 16-bit inputs feed
    # the tensor cores (exact products, fp32 sums); fp32 inputs and p @ V use 3xTF32.
    v_bf16 = v.dtype == torch.bfloat16 or cast_v
    q_bf16 = q.dtype == torch.bfloat16 or cast_q
    dot_f32 = interpreting() and (q_bf16 or v_bf16)
    prec_qk = "ieee" if interpreting() else ("tf32x3" if q.dtype == torch.float32 and not cast_q else "tf32")
    prec_pv = "ieee" if interpreting() else "tf32x3"
    args = (q, k, v, keep, qpos, pm, pl, pacc, Hq, Tq, Tk, S, group, D, DV, float(scale), int(k_start),
            int(window or 0), keys_per_split, n_splits)
    flags = dict(CAUSAL=bool(causal), HAS_WINDOW=window is not None, DOT_F32=dot_f32, PREC_QK=prec_qk,
                 PREC_PV=prec_pv, PV_SPLIT=v_bf16, CAST_Q=bool(cast_q), CAST_K=bool(cast_k), CAST_V=bool(cast_v),
                 ROUNDED=not interpreting(), BLOCK_D=block_d, BLOCK_DV=block_dv)
    nvq = group * Tq
    if exact and packed(group, Tq):
        if _run_fma(args, causal, window, nvq, block_d, block_dv, (B * Hk, n_splits), launch):
            return False
        if tc.run_grid_check(None, None, None, qpos, POSITION_LIMIT, 1, launch)[0]:  # its positions are int32
            raise ValueError("positions and lengths must be below 2**29 for the Triton path")
        dt = torch.promote_types(q.dtype, k.dtype)  # the packed kernel's score dot takes one dtype
        return run_keep(q.to(dt), k.to(dt), v, keep, qpos, pm, pl, pacc, group=group, scale=scale, k_start=k_start,
                        window=window, causal=causal, keys_per_split=keys_per_split, n_splits=n_splits,
                        n_sets=n_sets, launch=launch)
    if packed(group, Tq):
        if interpreting():
            grid = (triton.cdiv(S * nvq, INTERP_ROWS), B * Hk, n_splits)
            _keep_packed_kernel[grid](*args, **flags, ROWS=INTERP_ROWS, BLOCK_N=INTERP_BLOCK_N)
            return False
        launch("packed", _tuned("packed"), lambda meta: (triton.cdiv(S * nvq, meta["ROWS"]), B * Hk, n_splits),
               args, flags)
        return False
    assert not (cast_k or cast_v), "the shared-max kernel reads K and V as stored"
    shared = {n: x for n, x in flags.items() if n not in ("CAST_K", "CAST_V")}
    if interpreting():
        # Two value-column parts when there are columns for both (exercises the offsets).
        parts = 2 if DV > block_dv // 2 else 1
        grid = (triton.cdiv(nvq, INTERP_BLOCK_M) * triton.cdiv(S, INTERP_SETS) * parts, B * Hk, n_splits)
        _keep_shared_kernel[grid](*args, **shared, BLOCK_M=INTERP_BLOCK_M, SETS=INTERP_SETS, BLOCK_N=INTERP_BLOCK_N,
                                  DV_PARTS=parts)
        return True
    fb = launch.fallbacks
    if not fb.off(fb.SHARED):
        try:
            launch("shared", _tuned("shared"),
                   lambda meta: (triton.cdiv(nvq, meta["BLOCK_M"]) * triton.cdiv(S, meta["SETS"]) * meta["DV_PARTS"],
                                 B * Hk, n_splits),
                   args, shared)
            return True
        except Exception as exc:  # a compiler that rejects the 3-D tile: the packed kernel computes the same
            if "out of memory" in str(exc).lower():
                raise
            fb.turn_off(fb.SHARED, f"shared-scores kernel unavailable ({type(exc).__name__}: {str(exc)[:200]}); "
                                   "using the packed kernel for every query count")
    launch("packed", _tuned("packed"), lambda meta: (triton.cdiv(S * nvq, meta["ROWS"]), B * Hk, n_splits), args,
           flags)
    return False


def _run_fma(args: tuple, causal: bool, window, nvq: int, block_d: int, block_dv: int, grid_tail: tuple,
             launch: Launcher) -> bool:
    """Launch ``_keep_fma_kernel`` on ``run_keep``'s arguments; False (with the reason in
    ``launch.fallbacks``) when the compiler rejects it, so the caller runs the packed kernel instead."""
    gp = triton.next_power_of_2(nvq)
    consts = dict(CAUSAL=bool(causal), HAS_WINDOW=window is not None, ROUNDED=not interpreting(),
                  PREC_PV="ieee" if interpreting() else FMA_PREC_PV, GP=gp, BLOCK_D=block_d, BLOCK_DV=block_dv)
    S = args[11]
    fb = launch.fallbacks
    if fb.off(fb.exact_decode(gp)):
        return False
    if interpreting():
        # Small chunks of the head dim (the test sizes get several, the last one ragged).
        grid = (triton.cdiv(S, INTERP_ROWS // gp), *grid_tail)
        _keep_fma_kernel[grid](*args, **consts, ROWS=INTERP_ROWS, BLOCK_N=INTERP_BLOCK_N, CHUNK_D=8)
        return True
    try:
        launch("fma", _tuned("fma"), lambda meta: (triton.cdiv(S, meta["ROWS"] // gp), *grid_tail), args, consts)
        return True
    except Exception as exc:
        if "out of memory" in str(exc).lower():
            raise
        fb.turn_off(fb.exact_decode(gp), f"exact few-query kernel unavailable (GP {gp}) ({type(exc).__name__}: "
                                         f"{str(exc)[:200]}); the packed kernel with 3xTF32")
        return False
