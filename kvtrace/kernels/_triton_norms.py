"""Triton kernel for per-token L2 norms of a [B, H, T, D] tensor. Imported lazily (needs triton).

Shape of the launch (bench/tune_norms.py and bench/ab_norm_variants.py measured the candidates on
an H200):

* grid ``(segments, B * H)``: each program owns ``tiles_per_segment`` consecutive tiles of
  ``BLOCK_T`` tokens of one head and loops over them, a fixed grid of 16 programs per SM streaming
  the whole tensor instead of one short-lived program per tile. The loads are marked
  ``evict_first``: every byte is read once, so L2 should not keep it;
* one fp32 sum of squares per row. The max-scaled form (two reductions per row) runs only for a
  tile holding a row whose sum overflowed or fell near fp32's normal range, i.e. never for
  ordinary activations. Dropping the second reduction per row was the larger of the two gains
  measured; the ``evict_first`` plain loop was the other;
* each program also reduces its tokens' norms to one partial mean (the sum of each norm / ``T``).
  With one segment per head that partial *is* the mean and nothing else runs. With several, each
  program stores its partial and draws a ticket from a per-head atomic counter; the program that
  draws the last ticket sums the head's partials in segment order (bitwise reproducible whatever
  the arrival order), writes the mean and resets the counter to zero. The mean thus costs no
  second launch, and the counters (see :func:`counters`) need no memset per call.

One segment per tile (``tiles_per_segment == 1``) is the original one-program-per-tile shape; the
planner picks it for short sequences, where there is nothing to loop over.
"""

from __future__ import annotations

from functools import cache, lru_cache
from typing import TYPE_CHECKING, NamedTuple

import triton
import triton.language as tl

from kvtrace.kernels._env import interpreting

if TYPE_CHECKING:
    import torch

# Launch heuristic (H200 sweeps, 2026-11-22): tiles of 8,192 elements (16 KiB in bf16/fp16, 32 KiB
# in fp32), 128 bytes per thread (4 warps, or 8 for fp32), 16 programs per SM, no software pipelining:
# with one sum per row a program's registers hold its tile and the many resident programs keep
# enough loads in flight; the cp.async pipeline of the previous two-reduction kernel was slower.
_TILE_ELEMENTS = 8192
_PROGRAMS_PER_SM = 16
_NUM_STAGES = 1
# Under the CPU interpreter every program runs in Python: tiny tiles and 8 programs keep tests
# fast while still producing several segments per head.
_INTERP_BLOCK_T = 8
_INTERP_PROGRAMS = 8
# Partials the last program of a head loads per step when it sums them (any power of two works).
_SEG_BLOCK = 128
# triton.jit picks the interpreter when a kernel is decorated, i.e. at import: so does this module.
_INTERPRETED = interpreting()


class LaunchPlan(NamedTuple):
    block_t: int  # tokens per tile
    block_d: int  # next power of two >= D
    segments: int  # programs per (batch, head); partial sums per head
    tiles_per_segment: int
    num_warps: int
    num_stages: int


@triton.jit
def scaled_row_norms(x):
    """L2 norm of each row of the fp32 tile ``x``, scaled by the row's max |x| as BLAS nrm2 does
    (``amax * sqrt(sum((x / amax)^2))``; the scaled squares are <= 1): exact near fp32's largest
    and smallest values, at the cost of two reductions per row."""
    amax = tl.max(tl.abs(x), axis=1)
    inv = tl.where(amax > 0, 1.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    xs = x * inv[:, None]
    return amax * tl.sqrt(tl.sum(xs * xs, axis=1))


@triton.jit
def row_norms(x):
    """L2 norm of each row of the fp32 tile ``x``: one sum of squares per row.

    A sum at or above 2^126 may have overflowed (bf16/fp32 values above ~1e19); one below 2^-90
    may have lost its small squares to fp32 underflow. Such rows (and zero rows) are redone with
    :func:`scaled_row_norms`, decided once per tile: ordinary activations never take that branch.
    """
    ss = tl.sum(x * x, axis=1)
    norm = tl.sqrt(ss)
    redo = (ss >= 8.5070592e37) | (ss < 8.0779356e-28)
    if tl.max(redo.to(tl.int32), axis=0) > 0:
        norm = tl.where(redo, scaled_row_norms(x), norm)
    return norm


@triton.jit(do_not_specialize=["T", "tiles_per_segment"])
def _token_norms_kernel(
    X, OUT, CNT,
    H, T, D,
    stride_b, stride_h, stride_t,
    tiles_per_segment,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, STAGES: tl.constexpr, SEG_BLOCK: tl.constexpr,
):
    # OUT: [B*H, T] token norms, [B*H] head means, then (segments > 1) [B*H, segments] partial
    # means; CNT: [>= B*H] int32 tickets, zero between launches. Grid (segments, B*H).
    # The last dim of X is unit-stride (the wrapper guarantees it): each row is one contiguous read.
    # STAGES = 1 is a plain loop; more stages software-pipeline the loads (a tuning option).
    seg = tl.program_id(0)
    n_seg = tl.num_programs(0)
    pid_bh = tl.program_id(1)
    n_bh = tl.num_programs(1)
    b = pid_bh // H
    h = pid_bh % H
    base = X + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
    out_row = OUT + pid_bh.to(tl.int64) * T
    offs_d = tl.arange(0, BLOCK_D)
    first = seg * tiles_per_segment
    last = tl.minimum(first + tiles_per_segment, tl.cdiv(T, BLOCK_T))
    acc = tl.zeros([BLOCK_T], dtype=tl.float32)
    # Each norm is divided by T before it is summed: norms near the fp32 maximum (fp32 inputs of
    # ~1e37) still give a finite mean.
    inv_t = 1.0 / T.to(tl.float32)
    for tile in tl.range(first, last, num_stages=STAGES):
        offs_t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = offs_t < T
        ptrs = base + offs_t[:, None].to(tl.int64) * stride_t + offs_d[None, :]
        x = tl.load(ptrs, mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        norm = row_norms(x)
        tl.store(out_row + offs_t, norm, mask=row_ok)
        acc += tl.where(row_ok, norm * inv_t, 0.0)
    partial = tl.sum(acc, axis=0)
    means = OUT + n_bh.to(tl.int64) * T
    if n_seg == 1:  # the partial is the mean: nothing to reduce
        tl.store(means + pid_bh, partial)
    else:
        parts = means + n_bh + pid_bh * n_seg
        tl.store(parts + seg, partial)
        # Every thread's store is ordered before the ticket (the barrier), and the acq_rel atomic
        # publishes them at GPU scope: the program that draws the last ticket sees all partials.
        tl.debug_barrier()
        ticket = tl.atomic_add(CNT + pid_bh, 1, sem="acq_rel", scope="gpu")
        if ticket == n_seg - 1:
            # Fixed summation order (by segment index, not by arrival): bitwise reproducible.
            # .cg loads read L2, never a stale L1 line of this SM.
            total = tl.zeros([SEG_BLOCK], dtype=tl.float32)
            for start in range(0, n_seg, SEG_BLOCK):
                offs = start + tl.arange(0, SEG_BLOCK)
                total += tl.load(parts + offs, mask=offs < n_seg, other=0.0, cache_modifier=".cg")
            tl.store(means + pid_bh, tl.sum(total, axis=0))
            tl.store(CNT + pid_bh, 0)  # ready for the next launch; no memset per call


@cache
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device ``device_index`` (queried once per device)."""
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@lru_cache(maxsize=4096)
def plan_launch(
    shape: tuple[int, int, int, int], itemsize: int, sms: int, *,
    block_t: int | None = None, programs: int | None = None,
) -> LaunchPlan:
    """Tile size, warps and segments per head for a ``[B, H, T, D]`` input with ``T > 0``.

    ``block_t`` / ``programs`` override the heuristic (tests use them to force many segments).
    Plain-int arithmetic and a cache: this runs on every call, inside the caller's launch latency.
    """
    B, H, T, D = shape
    block_d = _pow2_at_least(D)
    num_warps = 4 if itemsize <= 2 else 8  # 128 bytes of the tile per thread either way
    if block_t is None:
        block_t = max(1, _TILE_ELEMENTS // block_d)
    block_t = min(block_t, _pow2_at_least(T))
    if block_t * block_d < _TILE_ELEMENTS:  # short sequences, wide rows or a forced small tile
        num_warps = 4
    tiles = _cdiv(T, block_t)
    if programs is None:
        programs = _PROGRAMS_PER_SM * sms
    segments = max(1, min(tiles, programs // (B * H)))
    tiles_per_segment = _cdiv(tiles, segments)
    segments = _cdiv(tiles, tiles_per_segment)  # no segment is left without a tile
    return LaunchPlan(block_t, block_d, segments, tiles_per_segment, num_warps, _NUM_STAGES)


def default_plan(x: torch.Tensor) -> LaunchPlan:
    """The plan :func:`head_norms` uses for ``x`` (4-D, ``T > 0``) on its device."""
    if _INTERPRETED:
        return plan_launch(tuple(x.shape), x.element_size(), 1, block_t=_INTERP_BLOCK_T, programs=_INTERP_PROGRAMS)
    return plan_launch(tuple(x.shape), x.element_size(), sm_count(x.get_device()))


def aot_spec(dtype: str, plan: LaunchPlan) -> tuple[dict, dict, dict]:
    """(argument types, constexprs, options) of :func:`_token_norms_kernel` for ``triton.compile``.

    ``dtype`` is Triton's name of the input type (``"bf16"``, ``"fp16"``, ``"fp32"``). Kept next to
    the kernel so that ahead-of-time compiles follow its signature.
    """
    types = dict(X=f"*{dtype}", OUT="*fp32", CNT="*i32", H="i32", T="i32", D="i32", stride_b="i64",
                 stride_h="i64", stride_t="i32", tiles_per_segment="i32")
    consts = dict(BLOCK_T=plan.block_t, BLOCK_D=plan.block_d, STAGES=plan.num_stages, SEG_BLOCK=_SEG_BLOCK)
    return types, consts, dict(num_warps=plan.num_warps)


# Ticket counters, one int32 per (batch, head), keyed by (device, stream). Each launch leaves them
# at zero, so they are zeroed once, when allocated, not per call. Keyed by stream, not just by
# device: two launches on different streams may overlap and would otherwise draw each other's
# tickets (a silently wrong mean); launches on one stream run in order, so they can share.
_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}
_MIN_COUNTERS = 4096  # 16 KiB: enough for most B * H, so the buffer rarely regrows


def _stream_key(x: torch.Tensor) -> tuple[int, int]:
    import torch

    if _INTERPRETED:  # CPU tensors, programs run one after another
        return -1, 0
    dev = x.get_device()
    return dev, torch._C._cuda_getCurrentRawStream(dev)  # what Triton's launcher calls to pick its stream


def counters(x: torch.Tensor, n: int) -> torch.Tensor:
    """Zeroed int32 ticket counters (at least ``n``) for a launch on ``x``'s device and stream.

    Inside CUDA-graph capture a fresh zeroed buffer is captured instead: its memset replays with
    the graph, so replays never share tickets with eager calls or with another graph.
    """
    import torch

    if not _INTERPRETED and torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, dtype=torch.int32, device=x.device)
    key = _stream_key(x)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[key] = torch.zeros(max(n, _MIN_COUNTERS), dtype=torch.int32, device=x.device)
    return buf


def head_norms(x: torch.Tensor, plan: LaunchPlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_norms [B, H, T], head_mean [B, H]) fp32 of ``x`` [B, H, T, D] (unit-stride last dim).

    One launch, one allocation: token norms, then head means, then (several segments per head)
    the per-segment partial means that the last program of each head sums in a fixed order.
    """
    import torch

    B, H, T, D = x.shape
    if T == 0 or B * H == 0:  # nothing to launch; the mean over no tokens is NaN
        return x.new_empty((B, H, T), dtype=torch.float32), x.new_full((B, H), float("nan"), dtype=torch.float32)
    if plan is None:
        plan = default_plan(x)
    n_bh = B * H
    n_tok = n_bh * T
    segments = plan.segments
    buf = torch.empty(n_tok + n_bh * (1 if segments == 1 else 1 + segments), dtype=torch.float32, device=x.device)
    # With one segment the counters are never touched; an int32 view of the output keeps the
    # pointer's type, hence one compiled variant, and needs no counter buffer.
    cnt = buf.view(torch.int32) if segments == 1 else counters(x, n_bh)
    stride_b, stride_h, stride_t, _ = x.stride()
    _token_norms_kernel[(segments, n_bh)](
        x, buf, cnt, H, T, D, stride_b, stride_h, stride_t, plan.tiles_per_segment,
        BLOCK_T=plan.block_t, BLOCK_D=plan.block_d, STAGES=plan.num_stages, SEG_BLOCK=_SEG_BLOCK,
        num_warps=plan.num_warps,
    )
    # as_strided: one view op per output (a slice then a view would be two)
    return buf.as_strided((B, H, T), (H * T, T, 1)), buf.as_strided((B, H), (H, 1), n_tok)
