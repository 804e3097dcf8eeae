"""Benchmark the kvtrace Triton kernels against torch on one CUDA GPU; prints a table.

    PYTHONPATH=. python3 bench/bench_kernels.py [--json results.json] [--quick]

Rows (each with its target):
  norms      effective bandwidth (bytes read + written / time) vs a device-to-device copy_ measured
             in the same run (target >= 90%), and speed vs torch.linalg.vector_norm (target >= 3x).
             Timed three ways: "eager" (do_bench: one Python call per timed run, L2 flushed), "graph"
             (do_bench_cudagraph: many calls replayed from one CUDA graph, so host launch overhead is
             excluded) and "pipelined" (N back-to-back Python calls between two CUDA events, no sync
             and no L2 flush between them, the way a caller streams layers through the kernel; host
             overhead is hidden wherever it is below the GPU time per call). Eager and graph are
             compared with the eager copy_ (the device's copy bandwidth): a copy_ captured in a graph
             becomes a copy-engine memcpy node (measured ~2.7 TB/s on an H200 against ~4.2 TB/s for
             the eager SM copy kernel), so it is no baseline; its number is printed only to show that.
             Pipelined is compared with the copy_ timed the same way in the same run, both the 1 GiB
             device figure and a copy of as many bytes as the norm input.
  attention  entropy + LSE + H2O mass (both Triton passes) vs the eager torch reference that
             materialises the softmax, at 32k keys (target >= 10x); peak memory at 128k keys
  mla        Gram of MLA latents: GB/s of latent read
Exits with code 69 (EX_UNAVAILABLE) and one line on stderr when there is no CUDA device or triton.
Timings: triton.testing.do_bench, median of repeated runs, L2 flushed between runs; for norms and
the copy also triton.testing.do_bench_cudagraph and the pipelined timing (median of 5 batches of
back-to-back calls; no L2 flush between calls: the full-size inputs, >= 256 MiB, are >= 4x the L2
(50-60 MB on an H100/H200; each row records the ratio), so a call finds little of the previous
one's data there).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

EX_UNAVAILABLE = 69

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# Problem sizes. "full" is what the issue asks for; "quick" is a smoke run on a GPU.
SIZES = {
    "full": {
        "copy_bytes": 2**30,
        # one layer's K at 32k and 128k tokens (256 MiB, 1 GiB), and a batch of 8 sequences
        "norm_shapes": [(1, 32, 32768, 128), (1, 32, 131072, 128), (8, 8, 16384, 128)],
        "attn_heads": (32, 8, 128), "attn_tq": 1024, "attn_tk": 32768, "attn_window": 4096,
        "mem_tk": 131072,
        "mla_shapes": [(32768, 512), (131072, 512)],
    },
    "quick": {
        "copy_bytes": 2**28,
        "norm_shapes": [(1, 32, 8192, 128)],
        "attn_heads": (32, 8, 128), "attn_tq": 1024, "attn_tk": 8192, "attn_window": 4096,
        "mem_tk": 32768,
        "mla_shapes": [(32768, 512)],
    },
}


def _require_gpu() -> None:
    try:
        import torch
    except Exception as exc:
        print(f"bench_kernels: torch is not importable ({exc}); needs a CUDA GPU", file=sys.stderr)
        sys.exit(EX_UNAVAILABLE)
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device visible; this benchmark runs on a GPU only", file=sys.stderr)
        sys.exit(EX_UNAVAILABLE)
    try:
        import triton  # noqa: F401
    except Exception as exc:
        print(f"bench_kernels: triton is not importable ({exc}); install kvtrace[gpu]", file=sys.stderr)
        sys.exit(EX_UNAVAILABLE)


def _bench(fn, rep_ms: int = 200) -> float:
    """Median milliseconds per call (triton.testing.do_bench flushes L2 between calls)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def _bench_graph(fn, rep_ms: int = 200) -> float:
    """Median milliseconds per call when the calls are replayed back to back from a CUDA graph."""
    from triton.testing import do_bench_cudagraph

    return float(do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))


def _bench_pipelined(fn, calls: int = 100, batches: int = 5) -> float:
    """Median over ``batches`` of ms per call for ``calls`` back-to-back calls between two events.

    No sync and no L2 flush between calls, so the GPU runs the calls one after another while the
    host queues the next ones; the GPU time per call includes the host's only where the host is
    slower. One untimed call is queued first so that the GPU is busy when the start event is
    reached (the host's first enqueue is not counted as idle GPU time).
    """
    import torch

    fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        per_call.append(start.elapsed_time(end) / calls)
    return sorted(per_call)[len(per_call) // 2]


def _host_us(fn, calls: int = 200) -> float:
    """Microseconds of host (Python + launch) time per call, GPU not awaited inside the loop.

    If this is below the GPU time per call, do_bench's queue runs ahead and host overhead is hidden.
    """
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e6 * host / calls


def _bench_clean_l2(fn, runs: int = 100) -> float:
    """Median ms per call with L2 flushed by a *read* (do_bench flushes with a write, which leaves
    ~L2-size dirty lines that the timed call then has to write back to memory)."""
    import torch

    scratch = torch.ones(2**26, device="cuda")  # 256 MiB, larger than any L2
    fn()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
    for start, end in pairs:
        scratch.sum()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in pairs)
    return float(times[len(times) // 2])


def _gib(n: float) -> float:
    return n / 2**30


def _peak(fn) -> tuple[bool, int]:
    """(finished without OOM, peak bytes allocated during fn beyond what was allocated before).

    The result is dropped inside, and an OOM is reduced to False, so that no tensor (nor a
    traceback frame holding one) outlives the measurement.
    """
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ok = True
    try:
        fn()
        torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError:
        ok = False
    peak = torch.cuda.max_memory_allocated() - base
    torch.cuda.empty_cache()
    return ok, peak


def _copy_pair(nbytes: int):
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src.random_(0, 255)
    return src, torch.empty_like(src)


def pipelined_copy_gbps(nbytes: int) -> float:
    """Device-to-device copy_ bandwidth (read + write) timed like the pipelined kernel."""
    src, dst = _copy_pair(nbytes)
    return 2 * nbytes / _bench_pipelined(lambda: dst.copy_(src)) / 1e6


def copy_bandwidth(nbytes: int) -> dict:
    src, dst = _copy_pair(nbytes)
    ms = _bench(lambda: dst.copy_(src))
    graph_ms = _bench_graph(lambda: dst.copy_(src))
    pipe_ms = _bench_pipelined(lambda: dst.copy_(src))
    return {"bytes": nbytes, "ms": ms, "gbps": 2 * nbytes / ms / 1e6,
            "graph_ms": graph_ms, "graph_gbps": 2 * nbytes / graph_ms / 1e6,
            "pipelined_ms": pipe_ms, "pipelined_gbps": 2 * nbytes / pipe_ms / 1e6,
            "host_us_per_call": _host_us(lambda: dst.copy_(src))}


def _norm_errors(x) -> float:
    """Max relative error of the Triton token norms and head means vs the fp32 reference."""
    from kvtrace.kernels import norms

    got, ref = norms.head_norms_triton(x), norms.head_norms_reference(x)
    return max(float(((g - r).abs() / r.abs().clamp_min(1e-30)).max())
               for g, r in ((got.token_norms, ref.token_norms), (got.head_mean, ref.head_mean)))


def _pipelined_norms(tri, bytes_read: int, bytes_moved: int, copy: dict) -> dict:
    """Pipelined timing of the norm kernel, against the pipelined copy_ of the device (1 GiB) and
    a pipelined copy_ of as many bytes as the input, both measured here in the same run."""
    import torch

    ms = _bench_pipelined(tri)
    gbps = bytes_moved / ms / 1e6
    same = pipelined_copy_gbps(bytes_read)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0)
    return {
        "bytes_read": bytes_read, "input_over_l2": bytes_read / l2 if l2 else None,
        "pipelined_triton_ms": ms, "pipelined_gbps": gbps,
        "pipelined_pct_of_copy": 100 * gbps / copy["pipelined_gbps"],
        "pipelined_copy_same_bytes_gbps": same, "pipelined_pct_of_same_bytes_copy": 100 * gbps / same,
    }


def bench_norms(copy: dict, sz: dict) -> list[dict]:
    import torch

    from kvtrace.kernels import _triton_norms, norms

    rows = []
    for shape in sz["norm_shapes"]:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        B, H, T, D = shape
        bytes_read = x.numel() * x.element_size()
        bytes_moved = bytes_read + B * H * T * 4 + B * H * 4
        tri = lambda x=x: norms.head_norms_triton(x)  # noqa: E731
        vn = lambda x=x: torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32).mean(-1)  # noqa: E731
        t_tri, t_vn = _bench(tri), _bench(vn)
        t_ref = _bench(lambda x=x: norms.head_norms_reference(x))
        g_tri, g_vn = _bench_graph(tri), _bench_graph(vn)
        gbps, graph_gbps = bytes_moved / t_tri / 1e6, bytes_moved / g_tri / 1e6
        rows.append({
            "kernel": "norms", "shape": list(shape), "dtype": "bf16", "bytes_moved": bytes_moved,
            "plan": _triton_norms.default_plan(x)._asdict(),
            # eager: triton.testing.do_bench, one Python call per timed run (as in earlier runs)
            "triton_ms": t_tri, "vector_norm_ms": t_vn, "reference_ms": t_ref, "gbps": gbps,
            "pct_of_copy": 100 * gbps / copy["gbps"], "speedup_vs_vector_norm": t_vn / t_tri,
            "speedup_vs_reference": t_ref / t_tri,
            # graph: do_bench_cudagraph for the kernel, vector_norm and the copy (host overhead excluded)
            "graph_triton_ms": g_tri, "graph_vector_norm_ms": g_vn, "graph_gbps": graph_gbps,
            "graph_pct_of_copy": 100 * graph_gbps / copy["gbps"],  # vs the eager copy: see the docstring
            "graph_speedup_vs_vector_norm": g_vn / g_tri,
            # diagnostics for where eager time goes: host time per call; eager with a clean-L2 flush
            "host_us_per_call": _host_us(tri), "clean_l2_triton_ms": _bench_clean_l2(tri),
            "max_rel_err": _norm_errors(x),
            **_pipelined_norms(tri, bytes_read, bytes_moved, copy),
        })
        del x
    return rows


def bench_attention(sz: dict) -> list[dict]:
    import torch

    from kvtrace.kernels import attention as A

    rows = []
    Hq, Hkv, D = sz["attn_heads"]
    tk, tq = sz["attn_tk"], sz["attn_tq"]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, Hq, tq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, Hkv, tk, D, device="cuda", dtype=torch.bfloat16, generator=g)
    for label, kw in (("causal", {}), (f"sliding {sz['attn_window']}", {"window": sz["attn_window"]})):
        tri = lambda kw=kw, q=q, k=k: A.attention_stats_triton(q, k, **kw)  # noqa: E731
        ref = lambda kw=kw, q=q, k=k: A.attention_stats_reference(q, k, **kw)  # noqa: E731
        t_tri = _bench(tri, rep_ms=300)
        t_ref = _bench(ref, rep_ms=300)
        # agreement at full size, as a sanity check on what is being timed
        a, r = tri(), ref()
        err_h = float((a.entropy - r.entropy).abs().max())
        err_m = float((a.received - r.received).abs().max() / r.received.abs().max())
        del a, r
        _, peak_tri = _peak(tri)
        _, peak_ref = _peak(ref)
        rows.append({
            "kernel": "attention", "case": f"{label}, Tq={tq} sampled, Tk={tk}", "Hq": Hq, "Hkv": Hkv,
            "D": D, "dtype": "bf16", "triton_ms": t_tri, "reference_ms": t_ref, "speedup": t_ref / t_tri,
            "triton_peak_gib": _gib(peak_tri), "reference_peak_gib": _gib(peak_ref),
            "max_abs_entropy_err": err_h, "max_rel_mass_err": err_m,
        })
    del q, k

    # 128k keys: Triton peak memory; the reference is attempted and reported as it goes.
    tk = sz["mem_tk"]
    for label, tq in (("sampled", sz["attn_tq"]), ("full causal prefill", tk)):
        q = torch.randn(1, Hq, tq, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(1, Hkv, tk, D, device="cuda", dtype=torch.bfloat16, generator=g)
        t0 = time.perf_counter()
        ok, peak_tri = _peak(lambda q=q, k=k: A.attention_stats_triton(q, k))
        wall = time.perf_counter() - t0
        one_matrix = Hq * tq * tk * 4
        ref_ok, peak_ref = _peak(lambda q=q, k=k: A.attention_stats_reference(q, k))
        ref_note = (f"fit, peak {_gib(peak_ref):.1f} GiB" if ref_ok
                    else f"OOM (after reaching {_gib(peak_ref):.1f} GiB)")
        rows.append({
            "kernel": "attention-memory", "case": f"{label}, Tq={tq}, Tk={tk}", "Hq": Hq, "Hkv": Hkv, "D": D,
            "triton_ok": ok, "triton_wall_s": wall, "triton_peak_gib": _gib(peak_tri),
            "inputs_gib": _gib((q.numel() + k.numel()) * 2),
            "reference_one_fp32_matrix_gib": _gib(one_matrix), "reference": ref_note,
            "device_total_gib": _gib(torch.cuda.get_device_properties(0).total_memory),
        })
        del q, k
        torch.cuda.empty_cache()
    return rows


def bench_mla(sz: dict) -> list[dict]:
    import torch

    from kvtrace.kernels import mla

    rows = []
    for n, r in sz["mla_shapes"]:
        x = torch.randn(n, r, device="cuda", dtype=torch.bfloat16)
        t_tri = _bench(lambda x=x: mla.latent_gram_triton(x))
        t_ref = _bench(lambda x=x: mla.latent_gram_reference(x))
        t_spec = _bench(lambda x=x: mla.mla_spectrum(x, num_heads=128, head_dim=128, rope_dim=64))
        err = float((mla.latent_gram_triton(x) - mla.latent_gram_reference(x)).abs().max()
                    / mla.latent_gram_reference(x).abs().max())
        nbytes = x.numel() * x.element_size()
        rows.append({
            "kernel": "mla", "shape": [n, r], "dtype": "bf16", "gram_triton_ms": t_tri,
            "gram_reference_ms": t_ref, "gbps_latent_read": nbytes / t_tri / 1e6,
            "speedup_vs_reference": t_ref / t_tri, "mla_spectrum_ms": t_spec, "max_rel_err": err,
        })
        del x
    return rows


def _print_norms(r: dict) -> None:
    case = f"{r['shape']} {r['dtype']}"
    p = r["plan"]
    eager = (f"eager: {r['gbps']:.0f} GB/s = {r['pct_of_copy']:.0f}% of eager copy; "
             f"vs vector_norm {r['speedup_vs_vector_norm']:.2f}x; vs reference {r['speedup_vs_reference']:.2f}x; "
             f"host {r['host_us_per_call']:.0f} us/call, clean-L2 eager {r['clean_l2_triton_ms']:.3f} ms")
    graph = (f"graph: {r['graph_gbps']:.0f} GB/s = {r['graph_pct_of_copy']:.0f}% of eager copy (target >= 90%); "
             f"vs vector_norm {r['graph_speedup_vs_vector_norm']:.2f}x (target >= 3x); "
             f"BLOCK_T={p['block_t']} w{p['num_warps']} {p['segments']} segments/head; "
             f"max rel err {r['max_rel_err']:.1e}")
    print(f"{'norms (eager)':<19}{case:<44}{r['triton_ms']:>8.3f}ms{r['vector_norm_ms']:>8.3f}ms"
          f"{r['speedup_vs_vector_norm']:>7.2f}x  {eager}")
    print(f"{'norms (graph)':<19}{case:<44}{r['graph_triton_ms']:>8.3f}ms{r['graph_vector_norm_ms']:>8.3f}ms"
          f"{r['graph_speedup_vs_vector_norm']:>7.2f}x  {graph}")
    # host slower than the GPU: the queue drains and the pipelined time is the host's, say so
    host_bound = "; HOST-BOUND (host us/call > GPU time/call)" if r["host_us_per_call"] > 1e3 * r["pipelined_triton_ms"] else ""
    pipe = (f"pipelined: {r['pipelined_gbps']:.0f} GB/s = {r['pipelined_pct_of_copy']:.0f}% of pipelined copy "
            f"(target >= 90%), {r['pipelined_pct_of_same_bytes_copy']:.0f}% of a same-size pipelined copy; "
            f"input {r['input_over_l2'] or float('nan'):.0f}x L2{host_bound}")
    print(f"{'norms (pipelined)':<19}{case:<44}{r['pipelined_triton_ms']:>8.3f}ms{'':>10}{'':>8}  {pipe}")


def _print(device: str, copy: dict, rows: list[dict]) -> None:
    print(f"kvtrace kernels benchmark on {device}")
    print(f"device-to-device copy_: {copy['gbps']:.0f} GB/s eager, {copy['pipelined_gbps']:.0f} GB/s pipelined, "
          f"{copy['graph_gbps']:.0f} GB/s in a CUDA graph (a copy-engine memcpy node, no baseline) "
          f"(read+write of {_gib(copy['bytes']):.1f} GiB; host {copy['host_us_per_call']:.0f} us/call)")
    print()
    print(f"{'kernel':<19}{'case':<44}{'triton':>10}{'torch':>10}{'ratio':>8}  notes")
    for r in rows:
        k = r["kernel"]
        if k == "norms":
            _print_norms(r)
        elif k == "attention":
            note = (f"target >= 10x; peak {r['triton_peak_gib']:.2f} vs {r['reference_peak_gib']:.2f} GiB; "
                    f"|dH| {r['max_abs_entropy_err']:.1e}, mass rel {r['max_rel_mass_err']:.1e}")
            print(f"{k:<19}{r['case']:<44}{r['triton_ms']:>8.2f}ms{r['reference_ms']:>8.2f}ms"
                  f"{r['speedup']:>7.1f}x  {note}")
        elif k == "attention-memory":
            note = (("" if r["triton_ok"] else "TRITON PATH FAILED (OOM); ")
                    + f"triton peak {r['triton_peak_gib']:.2f} GiB beyond inputs ({r['inputs_gib']:.2f} GiB), "
                    f"{r['triton_wall_s']:.2f} s; reference: {r['reference']} "
                    f"(one fp32 score matrix = {r['reference_one_fp32_matrix_gib']:.0f} GiB, "
                    f"device {r['device_total_gib']:.0f} GiB)")
            print(f"{k:<19}{r['case']:<44}{'':>10}{'':>10}{'':>8}  {note}")
        elif k == "mla":
            case = f"{r['shape']} {r['dtype']}"
            note = (f"{r['gbps_latent_read']:.0f} GB/s of latent read; full mla_spectrum "
                    f"{r['mla_spectrum_ms']:.2f} ms; rel err {r['max_rel_err']:.1e}")
            print(f"{k:<19}{case:<44}{r['gram_triton_ms']:>8.3f}ms{r['gram_reference_ms']:>8.3f}ms"
                  f"{r['speedup_vs_reference']:>7.2f}x  {note}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="also write the results to this JSON file")
    ap.add_argument("--quick", action="store_true", help="smaller shapes (smoke test)")
    args = ap.parse_args(argv)
    _require_gpu()
    import torch
    import triton

    torch.backends.cuda.matmul.allow_tf32 = False  # the reference is fp32; keep it honest
    t0 = time.perf_counter()
    device = torch.cuda.get_device_name()
    sz = SIZES["quick" if args.quick else "full"]
    copy = copy_bandwidth(sz["copy_bytes"])
    rows = bench_norms(copy, sz)
    rows += bench_attention(sz)
    rows += bench_mla(sz)
    _print(device, copy, rows)
    total = time.perf_counter() - t0
    print(f"\n(total {total:.0f} s; torch {torch.__version__}, triton {triton.__version__})")
    if args.json:
        payload = {"device": device, "torch": torch.__version__, "triton": triton.__version__,
                   "copy": copy, "rows": rows, "total_s": total}
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
