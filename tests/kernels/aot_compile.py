"""Compile the Triton kernels ahead of time for an NVIDIA target, without a GPU.

Catches what the CPU interpreter cannot: type errors of the compiled language, unsupported ops,
and (with ``--ptxas-v``) register spills. Needs triton with its bundled NVIDIA backend (ptxas);
must run without TRITON_INTERPRET (the interpreter replaces ``triton.jit``).

    PYTHONPATH=. python3 tests/kernels/aot_compile.py            # one config per kernel/dtype
    PYTHONPATH=. python3 tests/kernels/aot_compile.py --all      # every autotune config (minutes)
    PYTHONPATH=. python3 tests/kernels/aot_compile.py --arch 80  # A100 instead of H100/H200
    PYTHONPATH=. python3 tests/kernels/aot_compile.py --smoke    # bf16 subset (test suite)
"""

from __future__ import annotations

import argparse
import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("aot_compile: unset TRITON_INTERPRET (the interpreter does not compile)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvtrace.kernels import _triton_attention as ta  # noqa: E402
from kvtrace.kernels import _triton_mla as tm  # noqa: E402
from kvtrace.kernels import _triton_norms as tn  # noqa: E402


def _compile(fn, types: dict, consts: dict, cfg_opts: dict, target: GPUTarget):
    sig = {name: ("constexpr" if name in consts else types[name]) for name in fn.arg_names}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target, options=cfg_opts)


def _stats_types(dt: str) -> dict:
    return dict(Q=f"*{dt}", K=f"*{dt}", POS="*i32", PM="*fp32", PZ="*fp32", PS="*fp32", Hq="i32",
                Tq="i32", Tk="i32", GROUP="i32", D="i32", scale="fp32", window="i32",
                keys_per_split="i32", n_splits="i32", sqb="i64", sqh="i64", sqt="i32", skb="i64",
                skh="i64", skt="i32")


def _mass_types(dt: str) -> dict:
    return dict(Q=f"*{dt}", K=f"*{dt}", POS="*i32", SHIFT="*fp32", LOGZ="*fp32", MASS="*fp32",
                Hq="i32", Hkv="i32", Tq="i32", Tk="i32", GROUP="i32", D="i32", scale="fp32",
                window="i32", q_offset="i32", sqb="i64", sqh="i64", sqt="i32", skb="i64", skh="i64",
                skt="i32")


def jobs(all_configs: bool, smoke: bool = False):
    """Yield (label, fn, types, constexprs, options). ``smoke``: bf16 only, D=128 and 80."""
    for dt in ("bf16",) if smoke else ("bf16", "fp16", "fp32"):
        for d in (80, 128) if smoke else (64, 80, 128, 512):
            elem = 4 if dt == "fp32" else 2
            for t in (32768, 131072):  # the <= 512 MiB and the large-input launch plans
                p = tn.plan_launch((1, 32, t, d), elem, sms=132)
                yield (f"norms {dt} D={d} T={t} BLOCK_T={p.block_t} w{p.num_warps}", tn._token_norms_kernel,
                       *tn.aot_spec(dt, p))
    cases = [("bf16", 128), ("fp16", 128), ("fp32", 128), ("bf16", 64), ("bf16", 256), ("bf16", 512)]
    if smoke:
        cases = [("bf16", 128)]
    for dt, d in cases:
        elem = 4 if dt == "fp32" else 2
        prec = "ieee" if dt == "fp32" else "tf32"
        cfgs = ta._configs(d, elem)
        for cfg in cfgs if all_configs else cfgs[:1]:
            opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            for causal, window in ((True, False), (True, True), (False, False)):
                c = dict(CAUSAL=causal, HAS_WINDOW=window, DOT_F32=False, PREC=prec, ROUNDED=True, BLOCK_D=d,
                         **cfg.kwargs)
                tag = f"{dt} D={d} {cfg.kwargs} w{cfg.num_warps} causal={causal} window={window}"
                yield f"stats {tag}", ta._stats_kernel, _stats_types(dt), c, opts
                for contig in (True, False):
                    yield (f"mass {tag} contig={contig}", ta._mass_kernel, _mass_types(dt),
                           dict(c, CONTIG=contig), opts)
            if not all_configs:
                break
    for dt in ("bf16",) if smoke else ("bf16", "fp16", "fp32"):
        cfgs = tm._configs()
        for cfg in cfgs if all_configs else cfgs[:1]:
            yield (f"gram {dt} {cfg.kwargs}", tm._gram_kernel,
                   dict(X=f"*{dt}", OUT="*fp32", N="i32", R="i32", stride_n="i32", rows_per_split="i32"),
                   dict(DOT_F32=False, PREC="ieee" if dt == "fp32" else "tf32", **cfg.kwargs),
                   dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100/H200), 80")
    ap.add_argument("--all", action="store_true", help="every autotune config, not just the first")
    ap.add_argument("--smoke", action="store_true", help="bf16 only, few shapes (for the test suite)")
    args = ap.parse_args(argv)
    target = GPUTarget("cuda", args.arch, 32)
    failed = 0
    for label, fn, types, consts, opts in jobs(args.all, args.smoke):
        try:
            k = _compile(fn, types, consts, opts, target)
            print(f"ok   {label} (shared {k.metadata.shared} B)")
        except Exception as exc:
            failed += 1
            print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[:500]}")
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
