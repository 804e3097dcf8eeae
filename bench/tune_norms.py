"""Sweep launch shapes of the per-token norm kernel on one GPU (prints GB/s per configuration).

    python bench/tune_norms.py [--json out.json]

Two kernel shapes are compared, each over block sizes and warps, against a device-to-device copy
and torch.linalg.vector_norm measured in the same run:

  tile    one program per (BLOCK_T tokens, head): the shape kvtrace shipped first
  loop    a fixed grid of SEGMENTS programs per head; each loops over its tokens with software
          pipelining (num_stages) and writes one partial sum of norms, so the per-head mean is a
          reduction over SEGMENTS values instead of over T
The winner goes into kvtrace/kernels/_triton_norms.py; bench/bench_kernels.py measures that.
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
from triton.testing import do_bench


@triton.jit
def _tile_kernel(X, OUT, H, T, D, sb, sh, st, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    base = X + b.to(tl.int64) * sb + h.to(tl.int64) * sh
    mask = (offs_t[:, None] < T) & (offs_d[None, :] < D)
    x = tl.load(base + offs_t[:, None].to(tl.int64) * st + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    inv = tl.where(amax > 0, 1.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    xs = x * inv[:, None]
    norm = amax * tl.sqrt(tl.sum(xs * xs, axis=1))
    tl.store(OUT + pid_bh.to(tl.int64) * T + offs_t, norm, mask=offs_t < T)


@triton.jit
def _loop_kernel(X, OUT, PART, H, T, D, sb, sh, st, tiles_per_seg, SEGMENTS: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, STAGES: tl.constexpr):
    seg = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    base = X + b.to(tl.int64) * sb + h.to(tl.int64) * sh
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_T], dtype=tl.float32)
    first = seg * tiles_per_seg
    for i in tl.range(0, tiles_per_seg, num_stages=STAGES):
        offs_t = (first + i) * BLOCK_T + tl.arange(0, BLOCK_T)
        mask = (offs_t[:, None] < T) & (offs_d[None, :] < D)
        x = tl.load(base + offs_t[:, None].to(tl.int64) * st + offs_d[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        inv = tl.where(amax > 0, 1.0 / tl.where(amax > 0, amax, 1.0), 0.0)
        xs = x * inv[:, None]
        norm = amax * tl.sqrt(tl.sum(xs * xs, axis=1))
        tl.store(OUT + pid_bh.to(tl.int64) * T + offs_t, norm, mask=offs_t < T)
        acc += tl.where(offs_t < T, norm, 0.0)
    tl.store(PART + pid_bh * SEGMENTS + seg, tl.sum(acc, axis=0))


def run_tile(x: torch.Tensor, block_t: int, warps: int) -> torch.Tensor:
    B, H, T, D = x.shape
    out = torch.empty(B * H * T, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(T, block_t), B * H)
    _tile_kernel[grid](x, out, H, T, D, x.stride(0), x.stride(1), x.stride(2),
                       BLOCK_T=block_t, BLOCK_D=triton.next_power_of_2(D), num_warps=warps)
    return out.view(B, H, T).mean(-1)


def run_loop(x: torch.Tensor, block_t: int, warps: int, programs: int, stages: int) -> torch.Tensor:
    B, H, T, D = x.shape
    tiles = triton.cdiv(T, block_t)
    segments = max(1, min(tiles, programs // (B * H)))
    tiles_per_seg = triton.cdiv(tiles, segments)
    segments = triton.cdiv(tiles, tiles_per_seg)
    out = torch.empty(B * H * T, dtype=torch.float32, device=x.device)
    part = torch.empty(B * H * segments, dtype=torch.float32, device=x.device)
    _loop_kernel[(segments, B * H)](x, out, part, H, T, D, x.stride(0), x.stride(1), x.stride(2),
                                    tiles_per_seg, SEGMENTS=segments, BLOCK_T=block_t,
                                    BLOCK_D=triton.next_power_of_2(D), STAGES=stages, num_warps=warps)
    return part.view(B, H, segments).sum(-1) / T


def _copy_gbps(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / do_bench(lambda: dst.copy_(src), rep=200, return_mode="median") / 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", dest="json_path")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("tune_norms needs a CUDA device", file=sys.stderr)
        return 69
    dev = torch.cuda.get_device_name(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_gbps = _copy_gbps(2**30)
    print(f"{dev}: {sms} SMs, copy {copy_gbps:.0f} GB/s")
    results = {"device": dev, "copy_gbps": copy_gbps, "rows": []}
    for shape in [(1, 32, 32768, 128), (8, 8, 16384, 128), (1, 32, 131072, 128), (1, 8, 4096, 64)]:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        B, H, T, D = shape
        moved = x.numel() * 2 + B * H * T * 4
        ref = torch.linalg.vector_norm(x.float(), dim=-1).mean(-1)
        t_vn = do_bench(lambda x=x: torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32).mean(-1),
                        rep=100, return_mode="median")
        print(f"{shape}: vector_norm {moved / t_vn / 1e6:.0f} GB/s")
        configs = [("tile", bt, w, 0, 0) for bt, w in itertools.product((32, 64, 128, 256), (4, 8, 16))]
        configs += [("loop", bt, w, k * sms, s) for bt, w, k, s in
                    itertools.product((16, 32, 64), (4, 8), (2, 4, 8), (2, 3, 4))]
        for kind, bt, w, progs, stages in configs:
            fn = (lambda x=x, bt=bt, w=w: run_tile(x, bt, w)) if kind == "tile" else \
                 (lambda x=x, bt=bt, w=w, pr=progs, s=stages: run_loop(x, bt, w, pr, s))
            try:
                got = fn()
                ok = bool(torch.allclose(got, ref, rtol=1e-3, atol=1e-3))
                ms = do_bench(fn, rep=100, return_mode="median")
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is skipped
                print(f"  {kind} bt={bt} w={w} progs={progs} st={stages}: failed {type(exc).__name__}")
                continue
            gbps = moved / ms / 1e6
            row = {"shape": shape, "kind": kind, "block_t": bt, "warps": w, "programs": progs,
                   "stages": stages, "ms": ms, "gbps": gbps, "pct_copy": 100 * gbps / copy_gbps,
                   "x_vector_norm": t_vn / ms, "correct": ok}
            results["rows"].append(row)
        best = sorted([r for r in results["rows"] if r["shape"] == shape and r["correct"]],
                      key=lambda r: r["ms"])[:6]
        for r in best:
            print(f"  {r['kind']} bt={r['block_t']} w={r['warps']} progs={r['programs']} st={r['stages']}: "
                  f"{r['gbps']:.0f} GB/s = {r['pct_copy']:.1f}% of copy, {r['x_vector_norm']:.2f}x vector_norm")
        del x
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
