"""The checks a keep-set call depends on, in one launch (the overview is
kvtrace/kernels/_triton_whatif.py). Imported lazily.

``_grid_check_kernel`` -- one pass over fp32 q, k, v (whether they hold bf16 values: then the
tensor-core kernels read them as bf16) and the query positions (the int32 bound), one launch and
one host sync per call. Before the exact kernel nothing runs; before the packed kernel on 16-bit
K/V it reads the positions only, and the bound is read after the launches.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvtrace.kernels._env import interpreting
from kvtrace.kernels._triton_whatif_launch import Launcher


@triton.jit
def _grid_check_kernel(Q, K, V, POS, FLAGS, nq, nk, nv, n_pos, chunk, LIMIT: tl.constexpr, BLOCK: tl.constexpr):
    """One pass over q, k, v (fp32 viewed as int32; n 0 for a tensor not checked) and the query
    positions (int64): per program a bitmask -- 1: a position's magnitude >= LIMIT, 2/4/8: q/k/v
    has a value off the bf16 grid (low 16 bits not zero). One launch for every check the Triton
    path's choice depends on (they were ~8 torch ops)."""
    pid = tl.program_id(0)
    lo = pid.to(tl.int64) * chunk
    offs = tl.arange(0, BLOCK)
    bad_q = tl.zeros([BLOCK], dtype=tl.int32)
    bad_k = tl.zeros([BLOCK], dtype=tl.int32)
    bad_v = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, chunk, BLOCK):
        i = lo + start + offs
        bad_q = bad_q | (tl.load(Q + i, mask=i < nq, other=0) & 0xFFFF)
        bad_k = bad_k | (tl.load(K + i, mask=i < nk, other=0) & 0xFFFF)
        bad_v = bad_v | (tl.load(V + i, mask=i < nv, other=0) & 0xFFFF)
    flag = tl.where(tl.max(bad_q, axis=0) != 0, 2, 0) | tl.where(tl.max(bad_k, axis=0) != 0, 4, 0) \
        | tl.where(tl.max(bad_v, axis=0) != 0, 8, 0)
    if pid == 0:
        big = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, n_pos, BLOCK):
            i = start + offs
            p = tl.load(POS + i, mask=i < n_pos, other=0)
            big = big | ((p >= LIMIT) | (p <= -LIMIT)).to(tl.int32)
        flag = flag | tl.where(tl.max(big, axis=0) != 0, 1, 0)
    tl.store(FLAGS + pid, flag)


def run_grid_check(q, k, v, positions, limit: int, sms: int, launch: Launcher | None = None, sync: bool = True):
    """(a position's magnitude >= limit, q / k / v off the bf16 grid) from one launch and one
    device-to-host copy. q, k, v: contiguous, or None (not checked: not fp32); positions int64.
    ``sync`` False: the flags on the device instead (int32, OR them: bit 0 the position bound)."""
    import torch

    views = [None if x is None or x.numel() == 0 else x.view(torch.int32) for x in (q, k, v)]
    ns = [0 if x is None else x.numel() for x in views]
    block = 16 if interpreting() else 1024
    biggest = max(*ns, 1)
    # ~4 programs per SM over the largest tensor, whole blocks each.
    chunk = max(block, triton.cdiv(triton.cdiv(biggest, 4 * max(sms, 1)), block) * block)
    n_prog = triton.cdiv(biggest, chunk)
    flags = torch.empty(n_prog, dtype=torch.int32, device=positions.device)
    (launch or Launcher())("grid", _grid_check_kernel, (n_prog,),
                           (*(flags if x is None else x for x in views), positions, flags, *ns, positions.numel(),
                            chunk),
                           dict(LIMIT=limit, BLOCK=block, num_warps=4))
    if not sync:
        return flags
    return grid_flags(flags.tolist())  # the one host sync of a keep-set call


def grid_flags(values) -> tuple[bool, bool, bool, bool]:
    """(a position's magnitude >= limit, q / k / v off the bf16 grid) from the per-program flags
    of ``run_grid_check`` read to the host (ints)."""
    bits = 0
    for f in values:
        bits |= int(f)
    return bool(bits & 1), bool(bits & 2), bool(bits & 4), bool(bits & 8)
