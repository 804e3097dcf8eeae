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
from kvtrace.kernels import _triton_whatif_check as tc  # noqa: E402
from kvtrace.kernels import _triton_whatif_decode as td  # noqa: E402
from kvtrace.kernels import _triton_whatif_finish as tf  # noqa: E402
from kvtrace.kernels import _triton_whatif_pieces as tp  # noqa: E402
from kvtrace.kernels import _triton_whatif_quant as tq  # noqa: E402
from kvtrace.kernels import _triton_whatif_shared as ts  # noqa: E402


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


def _keep_types(dt: str) -> dict:
    return dict(Q=f"*{dt}", K=f"*{dt}", V=f"*{dt}", KEEP="*i8", QPOS="*i64", PM="*fp32", PL="*fp32", PACC="*fp32",
                Hq="i32", Tq="i32", Tk="i32", S="i32", GROUP="i32", D="i32", DV="i32", scale="fp32", k_start="i32",
                window="i32", keys_per_split="i32", n_splits="i32")


def whatif_jobs(all_configs: bool, smoke: bool = False):
    """The what-if kernels: keep-set attention (packed and shared-scores) and the quantisation error."""
    for dt in ("fp32", "bf16") if smoke else ("fp32", "bf16", "fp16"):
        for fn, cfgs in ((td._keep_packed_kernel, td._packed_configs()), (ts._keep_shared_kernel, ts._shared_configs())):
            for cfg in cfgs if all_configs else cfgs[:1]:
                packed = fn is td._keep_packed_kernel
                # cast: fp32 holding bf16 values, read as bf16 in registers (bf16 queries; the shared
                # kernel casts q only: it takes bf16 copies of K and V)
                for cast in [False, *([True] if dt == "bf16" else [])]:
                    c = dict(CAUSAL=True, HAS_WINDOW=True, DOT_F32=False,
                             PREC_QK="tf32x3" if dt == "fp32" else "tf32", PREC_PV="tf32x3", PV_SPLIT=dt == "bf16",
                             CAST_Q=cast, ROUNDED=True, BLOCK_D=128, BLOCK_DV=128,
                             **(dict(CAST_K=cast, CAST_V=cast) if packed else {}), **cfg.kwargs)
                    cast_types = dict(Q="*fp32", K="*fp32", V="*fp32") if packed else dict(Q="*fp32")
                    types = {**_keep_types(dt), **(cast_types if cast else {})}
                    yield (f"{fn.__name__} {dt}{' cast' if cast else ''} {cfg.kwargs} "
                           f"w{cfg.num_warps}", fn, types, c, dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        if smoke and dt != "fp32":
            continue
        if dt == "fp32":  # the split merge reads fp32 partial states (and, checking, the inputs)
            for check in (False, True):
                yield (f"keep finish check={check}", tf._keep_finish_kernel,
                       dict(PM="*fp32", PL="*fp32", PACC="*fp32", RECALL="*fp32", ERR="*fp32", R="i32", S1="i32",
                            DV="i32", n_splits="i32", Q="*fp32", K="*fp32", V="*fp32", KEEP="*i8", QPOS="*i64",
                            Hq="i32",
                            Tq="i32", Tk="i32", GROUP="i32", D="i32", scale="fp32", k_start="i32", window="i32"),
                       dict(CHECK=check, CAUSAL=True, HAS_WINDOW=True, ROUNDED=True, UNDER=tf.UNDERFLOW, BLOCK_S=32,
                            BLOCK_N=32, BLOCK_D=128, BLOCK_DV=128), dict(num_warps=4))
            yield ("grid check", tc._grid_check_kernel,
                   dict(Q="*i32", K="*i32", V="*i32", POS="*i64", FLAGS="*i32", nq="i32", nk="i32", nv="i32",
                        n_pos="i32", chunk="i32"), dict(LIMIT=2**29, BLOCK=1024), dict(num_warps=4))
        for mode in (tq.MODE_TOKEN_GROUPS,) if smoke else (tq.MODE_CHANNEL_GROUPS, tq.MODE_TOKEN_GROUPS, tq.MODE_FP8):
            yield (f"quant {dt} mode {mode}", tq._quant_kernel,
                   dict(X=f"*{dt}", SSE="*fp64", COS="*fp64", CNT="*fp64", Hn="i32", Tn="i32", D="i32", group="i32",
                        chunk="i32", sxb="i64", sxh="i64", sxt="i64"),
                   dict(LEVELS=3.0, MODE=mode, MAN=3, EMIN=-6, TOP=448.0, BLOCK_T=16, BLOCK_D=128), dict(num_warps=4))


def pieces_jobs(all_configs: bool, smoke: bool = False):
    """The signature-pieces kernels of the many-query keep-set measures."""
    ints = dict.fromkeys(("Hq", "Tq", "Tk", "GROUP", "D", "DV", "k_start", "window", "rows_h"), "i32")
    for dt in ("fp32", "bf16") if smoke else ("fp32", "bf16", "fp16"):
        cfgs = tp._piece_configs()
        for cfg in cfgs if all_configs else cfgs[:1]:
            for cast in (False, True) if dt == "bf16" else (False,):
                types = dict(Q=f"*{dt}", K=f"*{dt}", V=f"*{dt}", PERM="*i64", WORK="*i32", QPOS="*i64", PM="*fp32",
                             PL="*fp32", PACC="*fp32", scale="fp32", **ints)
                if cast:
                    types.update(Q="*fp32", K="*fp32", V="*fp32")
                c = dict(CAUSAL=True, HAS_WINDOW=True, DOT_F32=False, PREC_QK="tf32x3" if dt == "fp32" else "tf32",
                         PREC_PV="tf32x3", PV_SPLIT=dt == "bf16", CAST_Q=cast, CAST_K=cast, CAST_V=cast, ROUNDED=True,
                         BLOCK_D=128, BLOCK_DV=128, **cfg.kwargs)
                yield (f"_piece_kernel {dt}{' cast' if cast else ''} {cfg.kwargs} w{cfg.num_warps}", tp._piece_kernel,
                       types, c, dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    i32 = "i32"
    yield ("fold", tp._fold_kernel,
           dict(PM="*fp32", PL="*fp32", PACC="*fp32", PSIG="*i64", FIRST="*i32", CSETS="*i32", RECALL="*fp32",
                ERR="*fp32", R=i32, rows_h=i32, HD=i32, DV=i32),
           dict(SLOTS=16, BLOCK_P=16, BLOCK_DV=128, DOT_PREC="ieee"), dict(num_warps=4))
    yield ("signatures", tp._signature_kernel,
           dict(KEEP="*i8", QPOS="*i64", SIG="*i64", Tk=i32, n_pos=i32, k_start=i32, window=i32, first=i32, n_sets=i32),
           dict(CAUSAL=True, HAS_WINDOW=True, BLOCK=1024, BLOCK_Q=256), dict(num_warps=4))
    yield ("cuts", tp._cuts_kernel, dict(SS="*i64", CUT="*i8", RUNS="*i32", SEEN="*i32", TOTAL="*i32", Tk=i32, per=i32),
           dict(BLOCK=1024), dict(num_warps=4))
    yield ("piece rows", tp._piece_rows_kernel,
           dict(AT="*i64", SS="*i64", WORK="*i32", PSIG="*i64", FIRST="*i32", Tk=i32, HD=i32, n_pieces=i32),
           dict(BLOCK=256), dict(num_warps=4))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100/H200), 80")
    ap.add_argument("--all", action="store_true", help="every autotune config, not just the first")
    ap.add_argument("--smoke", action="store_true", help="bf16 only, few shapes (for the test suite)")
    args = ap.parse_args(argv)
    target = GPUTarget("cuda", args.arch, 32)
    failed = 0
    for label, fn, types, consts, opts in [*jobs(args.all, args.smoke), *whatif_jobs(args.all, args.smoke),
                                           *pieces_jobs(args.all, args.smoke)]:
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
