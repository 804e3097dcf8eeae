"""The per-head mean fused into the norm kernel's one launch (ticket counters, fixed-order sum).

CPU tests run the kernel in Triton's interpreter with forced plans (tiny tiles, several segments
per head, more segments than one reduction step loads). The ``gpu`` tests check what only real
concurrency can break: bitwise determinism while programs race for tickets, CUDA-graph replays,
and two streams at once. ``test_ptx_*`` compiles for sm_90 without a GPU and checks the memory
ordering the fused reduction relies on. Tolerances as in test_norms.py (GPU: rtol 2e-5).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")
torch = pytest.importorskip("torch")

from kvtrace.kernels import _triton_norms as tn  # noqa: E402
from kvtrace.kernels import norms  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
ROOT = Path(__file__).resolve().parents[2]
needs_gpu = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available(),
    reason="needs a CUDA device (compiled kernels, not the interpreter)",
)


@pytest.fixture
def fresh_counters(monkeypatch):
    """An empty counter cache for this test (the module's cache is left as it was)."""
    monkeypatch.setattr(tn, "_COUNTERS", {})
    return tn._COUNTERS


def _x(shape, dtype=torch.float32, device="cpu", seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def _run(x, block_t: int, programs: int, segments: int):
    plan = tn.plan_launch(tuple(x.shape), x.element_size(), sms=1, block_t=block_t, programs=programs)
    assert plan.segments == segments  # the plan really forces the case under test
    return tn.head_norms(x, plan)


@pytest.mark.parametrize(
    "shape,block_t,programs,segments",
    [
        ((2, 3, 37, 16), 4, 18, 3),  # 6 heads x 3 segments of 4, 4 and 2 tiles (ragged T)
        ((1, 1, 300, 4), 1, 300, 300),  # more partials than one reduction step loads (_SEG_BLOCK)
        ((2, 2, 64, 32), 8, 8, 2),
        ((1, 2, 5, 8), 8, 64, 1),  # T shorter than one tile: one segment, no reduction
        ((1, 3, 9, 8), 8, 3, 1),  # one program per head: one segment of two tiles
    ],
)
def test_fused_mean_matches_reference(tri_device, fresh_counters, shape, block_t, programs, segments):
    x = _x(shape, device=tri_device, seed=sum(shape))
    token, mean = _run(x, block_t, programs, segments)
    ref = norms.head_norms_reference(x.cpu())
    torch.testing.assert_close(token.cpu(), ref.token_norms, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(mean.cpu(), ref.head_mean, rtol=RTOL, atol=ATOL)


def test_repeated_calls_are_bitwise_identical(tri_device):
    x = _x((2, 2, 45, 16), torch.bfloat16, tri_device, seed=3)
    first = _run(x, 4, 12, 3)
    for _ in range(3):
        again = _run(x, 4, 12, 3)
        assert again[1].data_ptr() != first[1].data_ptr()  # a fresh output, not the same memory
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


def test_counters_are_zero_after_a_call(tri_device, fresh_counters):
    x = _x((2, 3, 40, 8), device=tri_device, seed=5)
    _run(x, 4, 24, 4)
    (cnt,) = fresh_counters.values()  # one buffer, for this device and stream
    assert cnt.dtype == torch.int32 and cnt.numel() >= 6
    assert int(torch.count_nonzero(cnt)) == 0
    _, mean = _run(x, 4, 24, 4)  # the next call reuses it
    assert list(fresh_counters.values()) == [cnt]
    torch.testing.assert_close(mean.cpu(), norms.head_norms_reference(x.cpu()).head_mean, rtol=RTOL, atol=ATOL)


def test_one_segment_uses_no_counters(tri_device, fresh_counters):
    x = _x((2, 2, 16, 8), device=tri_device, seed=6)
    token, mean = _run(x, 8, 1, 1)
    assert fresh_counters == {}
    assert mean.data_ptr() == token.data_ptr() + token.numel() * 4  # the mean sits after the norms
    torch.testing.assert_close(mean.cpu(), token.cpu().mean(-1), rtol=RTOL, atol=ATOL)


def test_tickets_elect_the_reducer(tri_device, fresh_counters):
    # A counter that does not start at zero shows the tickets are what the kernel reads: head 0's
    # three programs draw 1, 2 (the last ticket: reduce, reset to 0) and 0, leaving it at 1.
    if tri_device != "cpu":
        pytest.skip("on a GPU the reset races with the third ticket; the interpreter runs programs in turn")
    x = _x((1, 2, 24, 8), seed=7)
    cnt = tn.counters(x, 2)
    cnt[0] = 1
    _, mean = _run(x, 4, 6, 3)
    assert cnt.tolist()[:2] == [1, 0]
    ref = norms.head_norms_reference(x).head_mean
    torch.testing.assert_close(mean[:, 1], ref[:, 1], rtol=RTOL, atol=ATOL)  # head 1 is unaffected
    cnt.zero_()


def test_counter_buffer_grows_with_heads(tri_device, fresh_counters, monkeypatch):
    monkeypatch.setattr(tn, "_MIN_COUNTERS", 2)
    small, large = _x((1, 2, 16, 8), device=tri_device, seed=8), _x((2, 3, 16, 8), device=tri_device, seed=9)
    _run(small, 4, 4, 2)
    (first,) = fresh_counters.values()
    assert first.numel() == 2
    _, mean = _run(large, 4, 12, 2)
    (grown,) = fresh_counters.values()
    assert grown.numel() == 6 and int(torch.count_nonzero(grown)) == 0
    torch.testing.assert_close(mean.cpu(), norms.head_norms_reference(large.cpu()).head_mean, rtol=RTOL, atol=ATOL)


def test_empty_inputs_launch_nothing(tri_device, fresh_counters):
    token, mean = tn.head_norms(torch.zeros(1, 2, 0, 8, device=tri_device))
    assert token.shape == (1, 2, 0) and torch.isnan(mean.cpu()).all() and fresh_counters == {}


def _nvidia_backend() -> bool:
    try:
        from triton.backends import backends
    except Exception:
        return False
    return "nvidia" in backends


_PTX_SCRIPT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kvtrace.kernels import _triton_norms as tn

    plan = tn.plan_launch((1, 32, 32768, 128), 2, sms=132)
    types, consts, opts = tn.aot_spec("bf16", plan)
    fn = tn._token_norms_kernel
    sig = {n: "constexpr" if n in consts else types[n] for n in fn.arg_names}
    # 16-byte alignment, as Triton's launcher specialises on for these arguments of a bf16 x
    aligned = {"X", "OUT", "CNT", "H", "D", "stride_b", "stride_h", "stride_t"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in aligned}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=opts)
    print(k.asm["ptx"])
""")


@pytest.mark.slow
@pytest.mark.skipif(not _nvidia_backend(), reason="triton with its NVIDIA backend (ptxas) is not installed")
def test_ptx_orders_partials_before_the_ticket():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    res = subprocess.run([sys.executable, "-c", _PTX_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    lines = [ln.strip() for ln in res.stdout.splitlines()]
    atoms = [i for i, ln in enumerate(lines) if "atom." in ln]
    assert len(atoms) == 1 and "atom.global.gpu.acq_rel.add" in lines[atoms[0]]
    store = max(i for i in range(atoms[0]) if "st.global" in lines[i])  # the partial
    assert any(ln.startswith("bar.sync") for ln in lines[store:atoms[0]])  # all threads' stores first
    # the input is streamed in 16-byte vector loads that tell L1 and L2 not to keep the lines
    reads = [ln for ln in lines[:atoms[0]] if "ld.global" in ln]
    assert reads and all("evict_first" in ln and ".v4." in ln for ln in reads)
    after = lines[atoms[0]:]
    assert any("ld.global.cg" in ln for ln in after)  # partials read from L2, not a stale L1
    assert not any("ld.global" in ln and ".cg" not in ln for ln in after)


# ------------------------------------------------------------------------------------ GPU


def _check_counters_zero(counters: dict) -> None:
    torch.cuda.synchronize()
    assert counters and all(int(torch.count_nonzero(c)) == 0 for c in counters.values())


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", [(1, 32, 32768, 128), (8, 8, 16384, 128)])
@pytest.mark.parametrize("forced", [None, (16, 4096)])
def test_gpu_bitwise_deterministic_over_20_calls(fresh_counters, shape, forced):
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)  # 256 MiB
    if forced is None:  # the shipped plan: 32 and 4 segments per head on an H200
        plan = tn.default_plan(x)
    else:  # thousands of programs per head racing for one counter
        block_t, per_head = forced
        plan = tn.plan_launch(shape, 2, tn.sm_count(0), block_t=block_t, programs=per_head * shape[0] * shape[1])
    assert plan.segments > 1
    token0, mean0 = tn.head_norms(x, plan)
    for _ in range(19):
        token, mean = tn.head_norms(x, plan)
        assert torch.equal(mean, mean0) and torch.equal(token, token0)
    ref = norms.head_norms_reference(x)
    torch.testing.assert_close(token0, ref.token_norms, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(mean0, ref.head_mean, rtol=2e-5, atol=1e-6)
    _check_counters_zero(fresh_counters)


@pytest.mark.gpu
@needs_gpu
def test_gpu_fused_mean_in_cuda_graph(fresh_counters):
    x = torch.randn(2, 8, 20000, 128, device="cuda", dtype=torch.bfloat16)
    plan = tn.default_plan(x)
    assert plan.segments > 1
    tn.head_norms(x, plan)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        token, mean = tn.head_norms(x, plan)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        g.replay()
        first = mean.clone()
        g.replay()  # the captured counters were reset by the first replay (and are memset again)
        assert torch.equal(mean, first)
        eager_token, eager_mean = tn.head_norms(x, plan)
        assert torch.equal(mean, eager_mean) and torch.equal(token, eager_token)
        ref = norms.head_norms_reference(x)
        torch.testing.assert_close(mean, ref.head_mean, rtol=2e-5, atol=1e-6)
    _check_counters_zero(fresh_counters)


@pytest.mark.gpu
@needs_gpu
def test_gpu_two_streams_draw_from_separate_counters(fresh_counters):
    xs = [torch.randn(1, 32, 32768, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    assert streams[0].cuda_stream != streams[1].cuda_stream
    outs: list[list] = [[], []]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for _ in range(10):  # launches on the two streams overlap
        for i, (s, x) in enumerate(zip(streams, xs, strict=True)):
            with torch.cuda.stream(s):
                outs[i].append(tn.head_norms(x, tn.default_plan(x))[1])
    torch.cuda.synchronize()
    assert len(fresh_counters) == 2
    for x, means in zip(xs, outs, strict=True):
        assert all(torch.equal(m, means[0]) for m in means)
        torch.testing.assert_close(means[0], norms.head_norms_reference(x).head_mean, rtol=2e-5, atol=1e-6)
    _check_counters_zero(fresh_counters)
