"""Sweep launch shapes of kvtrace's per-token norm kernel on one GPU (prints GB/s per configuration).

    python bench/tune_norms.py [--json out.json]

Runs the shipped kernel (kvtrace/kernels/_triton_norms.py) with explicit launch plans, over block
sizes, warps, programs per SM and pipeline stages, against a device-to-device copy and
torch.linalg.vector_norm measured in the same run. Two plan shapes:

  tile    one program per (BLOCK_T tokens, head): tiles_per_segment = 1, nothing to loop over
  loop    a fixed grid of programs per head, each looping over its tiles (software-pipelined
          when num_stages > 1) and writing one partial sum of norms; tiles of 4,096 to 16,384
          elements
Either way the head mean is summed inside the same launch, by the last program of each head (the
tile shape has one segment per tile, so that program sums up to T / BLOCK_T partials).
The best plans feed the heuristic in ``plan_launch``; bench/bench_kernels.py measures that.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
from bench_kernels import copy_bandwidth  # bench/ is this script's directory (sys.path[0])
from triton.testing import do_bench

from kvtrace.kernels._triton_norms import LaunchPlan, head_norms, plan_launch


def tile_plan(x: torch.Tensor, block_t: int, warps: int) -> LaunchPlan:
    _, _, T, D = x.shape
    block_d = 1 << max(D - 1, 0).bit_length()
    return LaunchPlan(block_t, block_d, -(-T // block_t), 1, warps, 1)


def loop_plan(x: torch.Tensor, sms: int, block_t: int, warps: int, per_sm: int, stages: int) -> LaunchPlan:
    plan = plan_launch(tuple(x.shape), x.element_size(), sms, block_t=block_t, programs=per_sm * sms)
    return plan._replace(num_warps=warps, num_stages=stages)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", dest="json_path")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("tune_norms needs a CUDA device", file=sys.stderr)
        return 69
    dev = torch.cuda.get_device_name(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_gbps = copy_bandwidth(2**30)["gbps"]
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
        configs = [("tile", tile_plan(x, bt, w), 0) for bt, w in itertools.product((32, 64, 128, 256), (4, 8, 16))]
        row_elems = 1 << max(D - 1, 0).bit_length()
        configs += [("loop", loop_plan(x, sms, max(1, el // row_elems), w, k, st), k) for el, w, k, st in
                    itertools.product((4096, 8192, 16384), (4, 8), (8, 16, 32), (1, 2, 3))]
        for kind, plan, per_sm in configs:
            bt, w, progs, stages = plan.block_t, plan.num_warps, per_sm * sms, plan.num_stages

            def fn(x=x, plan=plan):
                return head_norms(x, plan)[1]

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
