"""A/B of per-token norm kernel designs, each timed pipelined against a pipelined copy, same run.

    python bench/ab_norm_variants.py [--json out.json]      (CUDA GPU only; exits 69 without)

Why the shipped kernel looks as it does. Every variant writes token norms and per-segment partial
means (the shipped kernel also sums the partials into head means, in the same launch):

  shipped    kvtrace's kernel and launch plan
  previous   the design before 2026-11-22: every row max-scaled (two reductions per row),
             cp.async-pipelined loop (3 stages), 8 KiB tiles on 4 warps, 8 programs per SM
             (16 KiB on 8 warps, 4 per SM, above 512 MiB)
  onepass    one sum of squares per row (the max-scaled pass only for tiles with a row whose sum
             overflowed or underflowed), normal loads, pipelined or plain loop
  evict      the shipped kernel (onepass, evict_first loads, plain loop) at several grids
  tma        onepass, tiles loaded through a host-built TMA tensor descriptor (sm_90 only)

Three interleaved rounds; each row reports the median of its three percentages of the copy
measured in the same round, and the maximum relative error of its token norms.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from bench_kernels import _bench_pipelined  # bench/ is this script's directory (sys.path[0])

from kvtrace.kernels._triton_norms import LaunchPlan, head_norms, plan_launch, row_norms, scaled_row_norms


@triton.jit
def _row_norms(x, ONEPASS: tl.constexpr):
    # The shipped row reductions: one sum per row (ONEPASS), or every row max-scaled (previous).
    if ONEPASS:
        norm = row_norms(x)
    else:
        norm = scaled_row_norms(x)
    return norm


@triton.jit(do_not_specialize=["T", "tiles_per_segment"])
def _norms_ptr(X, OUT, PART, H, T, D, stride_b, stride_h, stride_t, tiles_per_segment,
               BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, STAGES: tl.constexpr,
               ONEPASS: tl.constexpr):
    seg = tl.program_id(0)
    n_seg = tl.num_programs(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    base = X + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
    out_row = OUT + pid_bh.to(tl.int64) * T
    offs_d = tl.arange(0, BLOCK_D)
    first = seg * tiles_per_segment
    last = tl.minimum(first + tiles_per_segment, tl.cdiv(T, BLOCK_T))
    acc = tl.zeros([BLOCK_T], dtype=tl.float32)
    for tile in tl.range(first, last, num_stages=STAGES):
        offs_t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = offs_t < T
        ptrs = base + offs_t[:, None].to(tl.int64) * stride_t + offs_d[None, :]
        mask = row_ok[:, None] & (offs_d[None, :] < D)
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        norm = _row_norms(x, ONEPASS)
        tl.store(out_row + offs_t, norm, mask=row_ok)
        acc += tl.where(row_ok, norm, 0.0)
    tl.store(PART + pid_bh * n_seg + seg, tl.sum(acc, axis=0) / T.to(tl.float32))


@triton.jit(do_not_specialize=["T", "tiles_per_segment"])
def _norms_tma(desc, OUT, PART, T, tiles_per_segment,
               BLOCK_T: tl.constexpr, STAGES: tl.constexpr, ONEPASS: tl.constexpr):
    seg = tl.program_id(0)
    n_seg = tl.num_programs(0)
    pid_bh = tl.program_id(1)
    row0 = pid_bh * T
    out_row = OUT + pid_bh.to(tl.int64) * T
    first = seg * tiles_per_segment
    last = tl.minimum(first + tiles_per_segment, tl.cdiv(T, BLOCK_T))
    acc = tl.zeros([BLOCK_T], dtype=tl.float32)
    for tile in tl.range(first, last, num_stages=STAGES):
        offs_t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = offs_t < T
        x = desc.load([row0 + tile * BLOCK_T, 0]).to(tl.float32)
        norm = _row_norms(x, ONEPASS)
        tl.store(out_row + offs_t, norm, mask=row_ok)
        acc += tl.where(row_ok, norm, 0.0)
    tl.store(PART + pid_bh * n_seg + seg, tl.sum(acc, axis=0) / T.to(tl.float32))


def make_ptr_fn(x, plan, onepass):
    B, H, T, D = x.shape
    out = torch.empty(B * H * T, device=x.device, dtype=torch.float32)
    part = torch.empty(B * H * plan.segments, device=x.device, dtype=torch.float32)
    sb, sh, st, _ = x.stride()

    def fn():
        _norms_ptr[(plan.segments, B * H)](
            x, out, part, H, T, D, sb, sh, st, plan.tiles_per_segment,
            BLOCK_T=plan.block_t, BLOCK_D=plan.block_d, STAGES=plan.num_stages,
            ONEPASS=onepass, num_warps=plan.num_warps)
        return out, part
    return fn


def make_tma_fn(x, plan, onepass):
    from triton.tools.tensor_descriptor import TensorDescriptor

    B, H, T, D = x.shape
    out = torch.empty(B * H * T, device=x.device, dtype=torch.float32)
    part = torch.empty(B * H * plan.segments, device=x.device, dtype=torch.float32)
    desc = TensorDescriptor.from_tensor(x.view(B * H * T, D), [plan.block_t, D])

    def fn():
        _norms_tma[(plan.segments, B * H)](
            desc, out, part, T, plan.tiles_per_segment,
            BLOCK_T=plan.block_t, STAGES=plan.num_stages, ONEPASS=onepass, num_warps=plan.num_warps)
        return out, part
    return fn


def variants(x: torch.Tensor, sms: int):
    """(name, plan or None, fn) for every variant on input ``x``."""
    def plan(bt: int, warps: int, per_sm: int, stages: int) -> LaunchPlan:
        return plan_launch(tuple(x.shape), x.element_size(), sms, block_t=bt, programs=per_sm * sms)._replace(
            num_warps=warps, num_stages=stages)

    row_bytes = x.element_size() * (1 << max(x.shape[3] - 1, 0).bit_length())
    large = x.numel() * x.element_size() > 512 * 2**20
    yield "shipped", None, lambda: head_norms(x)
    prev = plan(16384 // row_bytes, 8, 4, 3) if large else plan(8192 // row_bytes, 4, 8, 3)
    yield "previous", prev, make_ptr_fn(x, prev, False)
    bt = 16384 // row_bytes
    for per_sm, stages in itertools.product((8, 16), (1, 3)):
        p = plan(bt, 4, per_sm, stages)
        yield "onepass", p, make_ptr_fn(x, p, True)
    for per_sm in (8, 16, 32):  # the shipped kernel at other grids
        p = plan(bt, 4, per_sm, 1)
        yield "evict", p, lambda p=p: head_norms(x, p)
    if torch.cuda.get_device_capability()[0] >= 9 and x.is_contiguous():
        for tma_bt, per_sm in itertools.product((bt, 2 * bt), (4, 8)):
            p = plan(tma_bt, 4, per_sm, 3)
            yield "tma", p, make_tma_fn(x, p, True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("ab_norm_variants needs a CUDA device", file=sys.stderr)
        return 69
    dev = torch.cuda.get_device_name(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    shapes = [((1, 32, 32768, 128), torch.bfloat16), ((1, 32, 131072, 128), torch.bfloat16),
              ((8, 8, 16384, 128), torch.bfloat16), ((1, 32, 8192, 128), torch.bfloat16),
              ((1, 8, 32768, 256), torch.float16), ((1, 32, 16384, 128), torch.float32)]
    cases = {}
    for shape, dtype in shapes:
        x = torch.randn(shape, device="cuda", dtype=dtype)
        ref = torch.linalg.vector_norm(x.float(), dim=-1)
        B, H, T, _ = shape
        for name, p, fn in variants(x, sms):
            key = (shape, str(dtype).removeprefix("torch."), name,
                   None if p is None else (p.block_t, p.num_warps, p.segments, p.num_stages))
            try:
                tok = fn()[0].view(ref.shape)
                err = float(((tok - ref).abs() / ref).max())
            except Exception as exc:  # noqa: BLE001 - a variant this GPU or triton cannot run
                print(f"{key}: failed {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            cases[key] = {"fn": fn, "err": err, "pct": [], "moved": x.numel() * x.element_size() + B * H * T * 4}
    copies = []
    for rnd in range(3):
        copy_gbps = 2 * 2**30 / _bench_pipelined(lambda: dst.copy_(src)) / 1e6
        copies.append(copy_gbps)
        for case in cases.values():
            case["pct"].append(100 * case["moved"] / _bench_pipelined(case["fn"]) / 1e6 / copy_gbps)
        print(f"round {rnd}: copy {copy_gbps:.0f} GB/s", flush=True)
    rows = [{"shape": k[0], "dtype": k[1], "variant": k[2], "plan_bt_warps_segments_stages": k[3],
             "median_pct_of_copy": sorted(c["pct"])[1], "pcts": c["pct"], "max_rel_err": c["err"]}
            for k, c in cases.items()]
    print(f"{dev}: {sms} SMs; % of the pipelined 1 GiB copy (median of 3 rounds)")
    for shape, dtype in shapes:
        print(f"== {shape} {str(dtype).removeprefix('torch.')}")
        for r in [r for r in rows if r["shape"] == shape]:
            print(f"  {r['variant']:9s} {r['plan_bt_warps_segments_stages']}: {r['median_pct_of_copy']:5.1f}%  "
                  f"err {r['max_rel_err']:.1e}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"device": dev, "sms": sms, "copies_gbps": copies, "rows": rows},
                                                   indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
