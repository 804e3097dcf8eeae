"""What-if kernels (kvtrace/kernels/whatif.py): Triton == plain torch == numerics.py (float64).

The Triton kernels run on CUDA when there is a GPU, else in Triton's CPU interpreter (tiny
shapes; tests/conftest.py sets TRITON_INTERPRET). The torch references compute in float64 and must
match numerics.py to 1e-12 (same formulas, different summation order). Triton tolerances, from
fp32 arithmetic:
  recall   atol 1e-5: a softmax sum over <= 100 keys in fp32 (each term ~1e-7 relative), values in [0, 1];
  error    atol 1e-5, rtol 1e-4: a ratio of norms of fp32 outputs (each ~1e-6 relative with
           3xTF32 or IEEE dots); errors of interest are >= 1e-3;
  MSE, cosine  rtol 1e-9 / atol 1e-9: the quantisation kernel rounds and sums in float64 with
           numerics.py's formula (recorded values sit on coarse grids where fp32 would break
           rounding ties differently); only the summation order differs.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvtrace.kernels import whatif as W  # noqa: E402
from kvtrace.kernels.whatif_config import KernelConfig, KernelFallbacks  # noqa: E402
from kvtrace.whatif import numerics as N  # noqa: E402
from kvtrace.whatif.policies import FP8, HQQ, KIVI, Quanto  # noqa: E402

EXACT = dict(atol=1e-12, rtol=1e-10)
RECALL = dict(atol=1e-5, rtol=0)
ERROR = dict(atol=1e-5, rtol=1e-4)
QUANT_TOL = dict(atol=1e-9, rtol=1e-9)


def _case(seed: int, B=1, Hq=4, Hk=2, Tq=5, T=40, D=16, Dv=8, S=3, q_pos=None, k_start=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, Tq, D)).astype(np.float32)
    k = rng.standard_normal((B, Hk, T, D)).astype(np.float32)
    v = rng.standard_normal((B, Hk, T, Dv)).astype(np.float32)
    keep = rng.random((S, B, Hk, T)) < 0.5
    pos = np.asarray(q_pos if q_pos is not None else k_start + T - Tq + np.arange(Tq))
    return q, k, v, keep, pos


def _numpy_sets(q, k, v, keep, pos, k_start, window, scale):
    vis = N.visible_mask(pos, k_start + np.arange(k.shape[2]), window)
    out = [N.keep_measures(q, k, v, vis, scale, keep[s]) for s in range(keep.shape[0])]
    return np.stack([r for r, _ in out]), np.stack([e for _, e in out])


def _t(x, dev):
    return torch.from_numpy(np.ascontiguousarray(x)).to(dev)


def _close(got, want, tol):
    np.testing.assert_allclose(got, want, equal_nan=True, **tol)


# Kernels: "packed" when group x Tq < 16 (cases 0 and 2), "shared" scores otherwise (cases 1, 3).
CASES = [
    # GQA group 2, causal, queries at the last positions
    dict(seed=0),
    # group 4 (MQA-like), sliding window 8, keys starting at position 100, sampled query positions
    # including one before the first key (nothing visible: recall 0, error NaN)
    # (4 sets + the full one: the last block of 2 sets holds one)
    dict(seed=1, B=2, Hq=4, Hk=1, q_pos=[99, 103, 110, 120, 139], k_start=100, window=8, S=4),
    # no GQA, batch 2, head dims not powers of two, 37 keys (ragged last tile), 5 sets
    dict(seed=2, B=2, Hq=2, Hk=2, T=37, D=12, Dv=20, S=5, window=16),
    # shared scores with 24 value columns: in the interpreter split over two programs (16 + 8)
    dict(seed=19, Hq=4, Hk=1, T=45, Dv=24, S=3),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_keep_measures_triton_torch_numpy_agree(case, tri_device):
    case = dict(case)
    window = case.pop("window", None)
    q, k, v, keep, pos = _case(**case)
    ks, scale = case.get("k_start", 0), q.shape[-1] ** -0.5
    want_r, want_e = _numpy_sets(q, k, v, keep, pos, ks, window, scale)
    kw = dict(q_positions=pos, k_start=ks, window=window)
    ref_r, ref_e = W.keep_measures_reference(*(torch.from_numpy(x) for x in (q, k, v, keep)), **kw)
    _close(ref_r.numpy(), want_r, EXACT)
    _close(ref_e.numpy(), want_e, EXACT)
    got_r, got_e = W.keep_measures_triton(*(_t(x, tri_device) for x in (q, k, v, keep)), **kw)
    assert got_r.shape == want_r.shape and got_r.dtype == torch.float32
    _close(got_r.cpu().numpy(), want_r, RECALL)
    _close(got_e.cpu().numpy(), want_e, ERROR)
    if "q_pos" in case:  # the query before the first key sees nothing
        assert np.all(got_r.cpu().numpy()[..., 0] == 0) and np.all(np.isnan(got_e.cpu().numpy()[..., 0]))


@pytest.mark.parametrize("case", [CASES[0], CASES[1]])
def test_fp32_inputs_on_the_bf16_grid_take_the_bf16_path_and_agree(case, tri_device):
    """Recorded bf16 K/V/Q arrive as fp32: the kernels run them as bf16 (exact) with p @ V as three
    bf16 dots; the numbers must not move."""
    case = dict(case)
    window = case.pop("window", None)
    q, k, v, keep, pos = _case(**case)
    q, k, v = (torch.from_numpy(x).to(torch.bfloat16).float().numpy() for x in (q, k, v))
    ks = case.get("k_start", 0)
    want_r, want_e = _numpy_sets(q, k, v, keep, pos, ks, window, q.shape[-1] ** -0.5)
    assert W._bf16_exact(torch.from_numpy(v))
    got_r, got_e = W.keep_measures_triton(*(_t(x, tri_device) for x in (q, k, v, keep)), q_positions=pos, k_start=ks,
                                          window=window)
    _close(got_r.cpu().numpy(), want_r, RECALL)
    _close(got_e.cpu().numpy(), want_e, ERROR)


@pytest.mark.parametrize("tq", [3, 9])  # 2 x 3 query rows per KV head: packed kernel; 2 x 9: shared-scores kernel
def test_key_splits_merge_to_the_same_answer(tq, tri_device):
    q, k, v, keep, pos = _case(3, T=70, Tq=tq)
    want_r, want_e = _numpy_sets(q, k, v, keep, pos, 0, None, q.shape[-1] ** -0.5)
    args = [_t(x, tri_device) for x in (q, k, v, keep)]
    r, e = W.keep_measures_triton(*args, q_positions=pos, num_splits=3)
    _close(r.cpu().numpy(), want_r, RECALL)
    _close(e.cpu().numpy(), want_e, ERROR)


def test_planted_heavy_hitter_and_far_below_max_keep_sets(tri_device):
    """Key 3 takes almost all the mass. Set 0 keeps everything (recall 1, error 0); set 1 drops
    key 3; set 2 keeps only keys whose scores are ~120 nats below it, where exp underflows fp32
    against the full row's max: a per-set running max still gives the exact renormalised output."""
    T, D = 32, 16
    q = np.zeros((1, 1, 1, D), np.float32)
    q[..., 0] = 1.0
    k = np.zeros((1, 1, T, D), np.float32)
    k[0, 0, :, 1] = 1.0
    k[0, 0, 3, 0] = 480.0  # score 480 / 4 = 120 above every other key
    v = np.random.default_rng(4).standard_normal((1, 1, T, 8)).astype(np.float32)
    keep = np.ones((3, 1, 1, T), bool)
    keep[1, 0, 0, 3] = False
    keep[2] = False
    keep[2, 0, 0, [5, 9]] = True
    pos = np.array([T - 1])
    want_r, want_e = _numpy_sets(q, k, v, keep, pos, 0, None, 0.25)
    r, e = W.keep_measures_triton(*(_t(x, tri_device) for x in (q, k, v, keep)), q_positions=pos)
    r, e = r.cpu().numpy(), e.cpu().numpy()
    assert r[0, 0, 0, 0] == pytest.approx(1.0, abs=1e-6) and e[0, 0, 0, 0] == pytest.approx(0.0, abs=1e-6)
    assert r[1, 0, 0, 0] < 1e-40 + 1e-6 and r[2, 0, 0, 0] < 1e-6
    o_full = v[0, 0, 3]
    o_kept = v[0, 0, [5, 9]].mean(axis=0)
    assert e[2, 0, 0, 0] == pytest.approx(np.linalg.norm(o_kept - o_full) / np.linalg.norm(o_full), rel=1e-5)
    _close(e, want_e, ERROR)


@pytest.mark.parametrize("tq", [1, 16])  # 1 x 1 rows: packed kernel (own max per set); 1 x 16: shared max
def test_keep_sets_far_below_the_row_max_are_recomputed_exactly(tq, tri_device):
    """The shared-max kernel takes one running max per row (the full attention's). A set keeping
    only keys ~120 nats below it underflows to zero mass there; the finish kernel sees that and
    recomputes the row with the set's own max, so its renormalised output stays exact. A set
    ~20 nats below (no underflow) and one keeping no visible key (error 1) are checked too."""
    T, D = 48, 16
    rng = np.random.default_rng(14)
    q = np.zeros((1, 1, tq, D), np.float32)
    q[..., 0] = 1.0
    q[..., 2:] = rng.standard_normal((tq, D - 2)) * 0.1
    k = rng.standard_normal((1, 1, T, D)).astype(np.float32) * 0.3
    k[0, 0, :, 0] = 0.0
    k[0, 0, 3, 0] = 480.0  # score ~120 above every other key
    k[0, 0, 7, 0] = 400.0  # ~100 above the rest, ~20 below key 3
    v = rng.standard_normal((1, 1, T, 8)).astype(np.float32)
    keep = np.zeros((4, 1, 1, T), bool)
    keep[0] = True
    keep[0, 0, 0, 3] = False  # only key 7 near the top: ~20 nats below the max
    keep[1, 0, 0, [5, 9, 30]] = True  # ~120 nats below the max: underflows against it
    keep[2, 0, 0, T - 1] = True  # one key, visible only to the last query
    keep[3, 0, 0, [3, 40]] = True  # the top key and one far below
    pos = np.arange(T - tq, T)
    want_r, want_e = _numpy_sets(q, k, v, keep, pos, 0, None, 0.25)
    r, e = W.keep_measures_triton(*(_t(x, tri_device) for x in (q, k, v, keep)), q_positions=pos, scale=0.25)
    r, e = r.cpu().numpy(), e.cpu().numpy()
    assert np.all(r[1] < 1e-6) and np.all(want_e[1] > 0.1)  # the underflowing set matters to the error
    if tq > 1:
        assert np.all(e[2, 0, 0, :-1] == 1.0)  # keeps no key these queries see: o' = 0
    _close(r, want_r, RECALL)
    _close(e, want_e, ERROR)


def test_bf16_inputs_match_the_reference_on_the_same_values(tri_device):
    q, k, v, keep, pos = _case(5, T=33, Tq=12)
    qb, kb, vb = (torch.from_numpy(x).to(torch.bfloat16) for x in (q, k, v))
    ref_r, ref_e = W.keep_measures_reference(qb, kb, vb, torch.from_numpy(keep), q_positions=pos)
    got_r, got_e = W.keep_measures_triton(qb.to(tri_device), kb.to(tri_device), vb.to(tri_device),
                                          _t(keep, tri_device), q_positions=pos)
    _close(got_r.cpu().numpy(), ref_r.numpy(), RECALL)
    _close(got_e.cpu().numpy(), ref_e.numpy(), ERROR)


def test_output_error_of_dequantised_kv(tri_device):
    q, k, v, _, pos = _case(6, Hq=4, Hk=2, T=36)
    pol = KIVI(nbits=2, group_size=8, residual_length=4)
    k2, v2 = pol.roundtrip(k, "key"), pol.roundtrip(v, "value")
    vis = N.visible_mask(pos, np.arange(k.shape[2]), 12)
    want = N.output_error(q, k, v, k2, v2, vis, q.shape[-1] ** -0.5)
    assert np.nanmin(want) > 1e-3  # 2-bit error is visible, so the comparison is meaningful
    ref = W.output_error(*(torch.from_numpy(x) for x in (q, k, v, k2, v2)), q_positions=pos, window=12, backend="torch")
    _close(ref.numpy(), want, EXACT)
    got = W.output_error(*(_t(x.astype(np.float32), tri_device) for x in (q, k, v, k2, v2)), q_positions=pos,
                         window=12, backend="triton")
    _close(got.cpu().numpy(), want, ERROR)


QUANT = [
    (KIVI(nbits=2, group_size=8, residual_length=7), "key", W.QuantSpec(bits=2, axis="token", group=8, residual=7)),
    (KIVI(nbits=4, group_size=6, residual_length=7), "value", W.QuantSpec(bits=4, axis="channel", group=6, residual=7)),
    (KIVI(nbits=8, group_size=32, residual_length=0), "key", W.QuantSpec(bits=8, axis="token", group=32)),
    (Quanto(nbits=4, q_group_size=16, residual_length=10), "key", W.QuantSpec(bits=4, group=16, residual=10)),
    (HQQ(nbits=1, q_group_size=64, residual_length=0), "value", W.QuantSpec(bits=1, group=64)),
    (FP8(fmt="e4m3"), "key", W.QuantSpec(kind="fp8", man=3, emin=-6, top=448.0)),
    (FP8(fmt="e5m2"), "value", W.QuantSpec(kind="fp8", man=2, emin=-14, top=57344.0)),
]


@pytest.mark.parametrize("pol,which,spec", QUANT, ids=lambda x: getattr(x, "name", str(x)))
def test_quant_error_triton_torch_numpy_agree(pol, which, spec, tri_device):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3, 50, 20)).astype(np.float32)
    x[0, 1, :, 4] *= 40.0  # an outlier channel
    x[1, 2, 3] = 0.0  # an all-zero token: no cosine
    x[0, 0, 0, 0] = 1e3  # saturates e4m3 (448)
    x2 = pol.roundtrip(x, which)
    per = [N.reconstruction(x[:, h], x2[:, h]) for h in range(x.shape[1])]
    want_m, want_c = np.array([m for m, _ in per]), np.array([c for _, c in per])
    np.testing.assert_allclose(W.quant_roundtrip(torch.from_numpy(x), spec).numpy(), x2, **EXACT)
    ref_m, ref_c = W.quant_error_reference(torch.from_numpy(x), spec)
    _close(ref_m.numpy(), want_m, EXACT)
    _close(ref_c.numpy(), want_c, EXACT)
    got_m, got_c = W.quant_error_triton(_t(x, tri_device), spec)
    _close(got_m.cpu().numpy(), want_m, QUANT_TOL)
    _close(got_c.cpu().numpy(), want_c, QUANT_TOL)


def test_quant_error_outlier_channel_costs_per_token_more_than_per_channel(tri_device):
    """The KIVI argument: a key channel with a large offset ruins per-token groups (one scale per
    token spans it: ~5.4 in float64) but not per-channel groups (~0.16)."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((1, 1, 64, 32)).astype(np.float32)
    x[..., 5] += 100.0
    t = _t(x, tri_device)
    per_token = W.quant_error_triton(t, W.QuantSpec(bits=2, axis="channel", group=32))[0]
    per_channel = W.quant_error_triton(t, W.QuantSpec(bits=2, axis="token", group=32))[0]
    assert float(per_token[0]) > 20 * float(per_channel[0])


def test_dispatch_and_bad_input():
    q, k, v, keep, pos = _case(9)
    args = [torch.from_numpy(x) for x in (q, k, v, keep)]
    r, _ = W.keep_measures(*args, q_positions=pos, backend="torch")
    assert r.dtype == torch.float64 and r.shape == (3, 1, 4, 5)
    with pytest.raises(ValueError, match="keep must be"):
        W.keep_measures(*args[:3], args[3][:, :, :1], q_positions=pos, backend="torch")
    with pytest.raises(ValueError, match="do not divide"):
        W.keep_measures(args[0][:, :3], *args[1:], q_positions=pos, backend="torch")
    with pytest.raises(ValueError, match="kind"):
        W.QuantSpec(kind="int3")


def test_bf16_grid_fp32_kv_is_read_as_bf16_in_registers(tri_device, monkeypatch):
    """fp32 Q/K/V holding bf16 values are cast in the kernel (no converted copy); full fp32 values
    are not. Both agree with numerics.py."""
    from kvtrace.kernels import _triton_whatif_keep as tk

    packed_after_check = KernelConfig(exact_decode=False)  # the packed kernel after the grid check
    seen = []
    real = tk.run_keep

    def spy(*a, **kw):
        seen.append((kw["cast_q"], kw["cast_k"], kw["cast_v"], a[0].dtype, a[1].dtype))
        return real(*a, **kw)

    monkeypatch.setattr(tk, "run_keep", spy)
    q, k, v, keep, pos = _case(11, Tq=3)
    grid = [torch.from_numpy(x).to(torch.bfloat16).float().numpy() for x in (q, k, v)]
    for arrays in (grid, (q, k, v)):
        want_r, want_e = _numpy_sets(*arrays, keep, pos, 0, None, q.shape[-1] ** -0.5)
        r, e = W.keep_measures_triton(*(_t(x, tri_device) for x in (*arrays, keep)), q_positions=pos,
                                      config=packed_after_check)
        _close(r.cpu().numpy(), want_r, RECALL)
        _close(e.cpu().numpy(), want_e, ERROR)
    assert seen[0] == (True, True, True, torch.float32, torch.float32)
    assert seen[1] == (False, False, False, torch.float32, torch.float32)
    # 2 x 9 query rows on the shared-max kernel (the signature-pieces path off; it reads each key
    # block many times): bf16 copies of K and V instead of casts; the same numbers.
    q, k, v, keep, pos = _case(11, Tq=9)
    grid = [torch.from_numpy(x).to(torch.bfloat16).float().numpy() for x in (q, k, v)]
    want_r, want_e = _numpy_sets(*grid, keep, pos, 0, None, q.shape[-1] ** -0.5)
    r, e = W.keep_measures_triton(*(_t(x, tri_device) for x in (*grid, keep)), q_positions=pos,
                                  config=KernelConfig(pieces=False))
    _close(r.cpu().numpy(), want_r, RECALL)
    _close(e.cpu().numpy(), want_e, ERROR)
    assert seen[2] == (True, False, False, torch.float32, torch.bfloat16)


def test_mixed_dtypes_agree(tri_device):
    """bf16 queries with fp32 K/V, on the bf16 grid (read as bf16) or not (q upcast, 3xTF32)."""
    q, k, v, keep, pos = _case(16, Tq=3)
    for kv in ([torch.from_numpy(x).to(torch.bfloat16).float().numpy() for x in (k, v)], (k, v)):
        qb = torch.from_numpy(q).to(torch.bfloat16)
        want_r, want_e = _numpy_sets(qb.float().numpy(), *kv, keep, pos, 0, None, q.shape[-1] ** -0.5)
        r, e = W.keep_measures_triton(qb.to(tri_device), *(_t(x, tri_device) for x in (*kv, keep)), q_positions=pos)
        _close(r.cpu().numpy(), want_r, RECALL)
        _close(e.cpu().numpy(), want_e, ERROR)


def test_keep_set_dtypes_and_no_sets(tri_device):
    """int8 keep-sets with any nonzero value mean kept, as bool ones; zero sets give empty results."""
    q, k, v, keep, pos = _case(12)
    args = [_t(x, tri_device) for x in (q, k, v)]
    r_b, e_b = W.keep_measures_triton(*args, _t(keep, tri_device), q_positions=pos)
    r_i, e_i = W.keep_measures_triton(*args, _t(keep.astype(np.int8) * 3, tri_device), q_positions=pos)
    _close(r_i.cpu().numpy(), r_b.cpu().numpy(), EXACT)
    _close(e_i.cpu().numpy(), e_b.cpu().numpy(), EXACT)
    r0, e0 = W.keep_measures_triton(*args, _t(keep[:0], tri_device), q_positions=pos)
    assert r0.shape == e0.shape == (0, 1, 4, 5)


def test_quant_error_all_zero_head_and_residual_tokens(tri_device):
    """A head with no nonzero token has no cosine (NaN) and MSE 0; residual tokens count as exact."""
    rng = np.random.default_rng(13)
    x = rng.standard_normal((1, 2, 40, 16)).astype(np.float32)
    x[0, 1] = 0.0
    x[0, 0, 35] = 0.0  # an all-zero residual token: not counted
    spec = W.QuantSpec(bits=2, axis="channel", group=8, residual=9)
    ref_m, ref_c = W.quant_error_reference(torch.from_numpy(x), spec)
    got_m, got_c = W.quant_error_triton(_t(x, tri_device), spec)
    assert np.isnan(got_c[1].item()) and got_m[1].item() == 0.0
    _close(got_m.cpu().numpy(), ref_m.numpy(), QUANT_TOL)
    _close(got_c.cpu().numpy(), ref_c.numpy(), QUANT_TOL)


def test_direct_launch_repeats_the_triton_launch(tri_device, monkeypatch):
    """After a kernel's first call (through Triton), later calls of the same specialisation go
    through its compiled launcher (_triton_whatif._launch): same numbers as Triton's own call path,
    for both keep kernels, the grid check and the split merge. On CUDA only (the interpreter
    always takes Triton's path)."""
    if tri_device != "cuda":
        pytest.skip("direct launches exist on CUDA only")
    from kvtrace.kernels import _triton_whatif_launch as tl_

    # pieces on: "auto" would leave this small call to the shared kernel
    direct, triton_path = KernelConfig(pieces=True), KernelConfig(pieces=True, direct_launch=False)
    monkeypatch.setattr(tl_, "_COMPILED", {})
    for tq in (1, 9):  # exact few-query and signature-pieces kernels
        q, k, v, keep, pos = _case(17, Tq=tq, T=300)
        grid = [torch.from_numpy(x).to(torch.bfloat16).float().numpy() for x in (q, k, v)]
        for arrays in ((q, k, v), grid):
            args = [_t(x, tri_device) for x in (*arrays, keep)]
            want = W.keep_measures_triton(*args, q_positions=pos, config=triton_path)
            tl_._COMPILED.clear()
            first = W.keep_measures_triton(*args, q_positions=pos, config=direct)  # Triton's path, fills the cache
            assert {key[0] for key in tl_._COMPILED} >= ({"finish", "fma"} if tq == 1
                                                         else {"grid", "pieces", "fold"})
            again = W.keep_measures_triton(*args, q_positions=pos, config=direct)  # the compiled launchers
            for got in (first, again):
                for a, b in zip(got, want, strict=True):
                    _close(a.cpu().numpy(), b.cpu().numpy(), EXACT)


def test_launch_cache_keys_and_fallback(monkeypatch):
    """Launcher's bookkeeping, against a stand-in Triton (runs anywhere): the first call of a
    specialisation goes through Triton, a repeat through the compiled launcher with the runtime
    arguments then the constexprs in signature order and the grid from them; another int class
    (16 is divisible by 16, 5 is not) is a new specialisation; a launcher that rejects the call
    turns direct launches off for the run, says so in its fallbacks record and launches through
    Triton; direct launches configured off always take Triton's path."""
    from types import SimpleNamespace

    from kvtrace.kernels import _triton_whatif_launch as tl_

    calls = []

    class Compiled:
        packed_metadata, function = "meta", "fn"

        def __init__(self, fail=False):
            self.fail = fail

        def launch_metadata(self, grid, stream, *args):
            return None

        def run(self, *a):
            if self.fail:
                raise TypeError("the launcher takes other arguments")
            calls.append(("direct", a[:4], a[9:]))

    class Fn:
        arg_names = ["X", "n", "BLOCK"]

        def __init__(self, compiled):
            self.compiled = compiled

        def __getitem__(self, grid):
            def go(*args, **consts):
                calls.append(("triton", grid(consts), args))
                return self.compiled
            return go

    active = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda dev: 7)
    fake = SimpleNamespace(knobs=SimpleNamespace(runtime=SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)),
                           runtime=SimpleNamespace(Autotuner=type("Autotuner", (), {}),
                                                   driver=SimpleNamespace(active=active)))
    for name, value in (("triton", fake), ("interpreting", lambda: False), ("_COMPILED", {})):
        monkeypatch.setattr(tl_, name, value)
    x = torch.zeros(4)
    grid = lambda meta: (meta["BLOCK"] // 2,)  # noqa: E731
    fn = Fn(Compiled())
    launch = tl_.Launcher(True, KernelFallbacks())
    for n in (5, 5, 16, 16):
        launch("t", fn, grid, (x, n), dict(BLOCK=8))
    assert [c[0] for c in calls] == ["triton", "direct", "triton", "direct"]
    assert calls[1][1] == (4, 1, 1, 7) and calls[1][2] == (x, 5, 8)
    calls.clear()
    tl_.Launcher(False, KernelFallbacks())("t", fn, grid, (x, 5), dict(BLOCK=8))  # cached, but configured off
    assert [c[0] for c in calls] == ["triton"]
    calls.clear()
    bad = Fn(Compiled(fail=True))
    fb = KernelFallbacks()
    for _ in range(3):
        tl_.Launcher(True, fb)("u", bad, grid, (x, 3), dict(BLOCK=4))
    assert [c[0] for c in calls] == ["triton", "triton", "triton"]
    assert fb.off(fb.DIRECT_LAUNCH) and len(fb.notes) == 1 and "direct launches unavailable" in fb.notes[0]
    calls.clear()
    launch("t", fn, grid, (x, 5), dict(BLOCK=8))  # another run's record: still direct
    assert [c[0] for c in calls] == ["direct"]


def _bf16_grid(*xs):
    return [torch.from_numpy(x).to(torch.bfloat16).float().numpy() for x in xs]


class _KernelSpy:
    """Which keep kernels a call launched and which tensors the grid check read: on CUDA through
    the launcher's tags, in the interpreter through the kernels themselves (launched there
    directly)."""

    def __init__(self, monkeypatch, tri_device):
        from kvtrace.kernels import _triton_whatif_check as tc
        from kvtrace.kernels import _triton_whatif_keep as tk
        from kvtrace.kernels._triton_whatif_launch import Launcher

        self.ran: list[str] = []
        self.grid_reads: list[tuple[bool, bool, bool]] = []
        real_launch, real_check = Launcher.__call__, tc.run_grid_check

        def launch(launcher, tag, *a, **kw):
            self.ran.append(tag)
            return real_launch(launcher, tag, *a, **kw)

        def check(q, k, v, *a, **kw):
            self.grid_reads.append((q is not None, k is not None, v is not None))
            return real_check(q, k, v, *a, **kw)

        monkeypatch.setattr(tc, "run_grid_check", check)
        if tri_device == "cuda":
            monkeypatch.setattr(Launcher, "__call__", launch)
            return
        for tag, name in (("fma", "_keep_fma_kernel"), ("packed", "_keep_packed_kernel")):
            monkeypatch.setattr(tk, name, self._wrap(tag, getattr(tk, name)))

    def _wrap(self, tag, kernel):
        spy = self

        class Wrapped:
            def __getitem__(self, grid):
                spy.ran.append(tag)
                return kernel[grid]

        return Wrapped()


# The exact few-query kernel (fewer than 16 query rows per KV head): causal GQA, a window with
# sampled positions (one before the first key: nothing visible) and keys from position 100, no GQA
# with ragged head dims (12: chunks of the head dim 8 + 4 in the interpreter; 20 value columns).
EXACT_CASES = [
    dict(seed=30, Tq=1, T=70),
    dict(seed=31, B=2, Hq=4, Hk=1, Tq=3, q_pos=[99, 120, 139], k_start=100, T=40, window=8, S=4),
    dict(seed=32, B=2, Hq=2, Hk=2, Tq=2, T=37, D=12, Dv=20, S=5, window=16),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", EXACT_CASES)
@pytest.mark.parametrize("values", ["fp32", "bf16 grid", "bf16 tensors", "bf16 q, fp32 k/v"])
def test_exact_decode_kernel_agrees_without_a_grid_check(case, values, tri_device, monkeypatch):
    """A decode step's few query rows with fp32 K/V take the exact fp32 CUDA-core kernel, on the
    bf16 grid or not: it agrees with numerics.py, nothing is checked before it (no grid, and it
    clamps positions itself) and the packed kernel does not run. 16-bit K/V take the packed
    kernel (tensor cores), with no grid to check either: the position bound only, read after the
    launches."""
    fb = KernelFallbacks()
    spy = _KernelSpy(monkeypatch, tri_device)
    case = dict(case)
    window = case.pop("window", None)
    q, k, v, keep, pos = _case(**case)
    if values != "fp32":
        q, k, v = _bf16_grid(q, k, v)
    if values == "bf16 grid" and case["Tq"] == 1:
        keep[:] = True  # every set keeps every key: recall 1, error 0 exactly (per-row max, same sums)
    ks = case.get("k_start", 0)
    want_r, want_e = _numpy_sets(q, k, v, keep, pos, ks, window, q.shape[-1] ** -0.5)
    args = [_t(x, tri_device) for x in (q, k, v)]
    if values == "bf16 tensors":
        args = [x.to(torch.bfloat16) for x in args]
    elif values == "bf16 q, fp32 k/v":
        args[0] = args[0].to(torch.bfloat16)
    r, e = W.keep_measures_triton(*args, _t(keep, tri_device), q_positions=pos, k_start=ks, window=window,
                                  config=KernelConfig(exact_decode=True), fallbacks=fb)
    _close(r.cpu().numpy(), want_r, RECALL)
    _close(e.cpu().numpy(), want_e, ERROR)
    kernels = [t for t in spy.ran if t in ("fma", "packed")]
    assert kernels == (["packed"] if values == "bf16 tensors" else ["fma"]) and not fb.notes
    assert spy.grid_reads == ([(False, False, False)] if values == "bf16 tensors" else [])
    if "q_pos" in case:  # the query before the first key sees nothing
        assert np.all(r.cpu().numpy()[..., 0] == 0) and np.all(np.isnan(e.cpu().numpy()[..., 0]))


@pytest.mark.parametrize("split", [None, 3])
def test_exact_decode_kernel_planted_sets_far_below_the_max(split, tri_device, monkeypatch):
    """Sets keeping only keys ~120 and ~20 nats below the row max, one keeping a single key and one
    keeping the top key plus one far below: each (set, query) row has its own running max in the
    exact kernel, so no set underflows (key splits too: the merge rescales per split)."""
    fb = KernelFallbacks()
    spy = _KernelSpy(monkeypatch, tri_device)
    T, D, tq = 48, 16, 3
    rng = np.random.default_rng(33)
    q = np.zeros((1, 2, tq, D), np.float32)
    q[..., 0] = 1.0
    q[..., 2:] = rng.standard_normal((2, tq, D - 2)) * 0.1
    k = rng.standard_normal((1, 1, T, D)).astype(np.float32) * 0.3
    k[0, 0, :, 0] = 0.0
    k[0, 0, 3, 0] = 480.0  # score ~120 above every other key
    k[0, 0, 7, 0] = 400.0  # ~20 below key 3
    v = rng.standard_normal((1, 1, T, 8)).astype(np.float32)
    keep = np.zeros((4, 1, 1, T), bool)
    keep[0] = True
    keep[0, 0, 0, 3] = False
    keep[1, 0, 0, [5, 9, 30]] = True
    keep[2, 0, 0, T - 1] = True
    keep[3, 0, 0, [3, 40]] = True
    pos = np.arange(T - tq, T)
    want_r, want_e = _numpy_sets(q, k, v, keep, pos, 0, None, 0.25)
    r, e = W.keep_measures_triton(*(_t(x, tri_device) for x in (q, k, v, keep)), q_positions=pos, scale=0.25,
                                  num_splits=split, config=KernelConfig(exact_decode=True), fallbacks=fb)
    r, e = r.cpu().numpy(), e.cpu().numpy()
    assert np.all(r[1] < 1e-6) and np.all(want_e[1] > 0.1)  # the far-below set matters to the error
    _close(r, want_r, RECALL)
    _close(e, want_e, ERROR)
    assert "fma" in spy.ran and "packed" not in spy.ran and not fb.notes


def test_exact_decode_kernel_takes_any_position_and_its_fallback_checks_them(tri_device, monkeypatch):
    """The exact kernel clamps positions itself (int64 -> +-2**30 relative to the keys, the same
    visibility): queries far beyond 2**29 agree with numerics.py, causal (every key visible) and
    windowed (none), with no check launched. Where the compiler rejected it (the run's fallbacks)
    the packed kernel runs instead, bf16 queries with fp32 K/V promoted for its score dot, with
    the same numbers; it takes int32 positions, so there the bound raises."""
    exact = KernelConfig(exact_decode=True)
    q, k, v, keep, pos = _case(34, Tq=2, T=50)
    q = _bf16_grid(q)[0]
    args = [_t(x, tri_device) for x in (q, k, v, keep)]
    args[0] = args[0].to(torch.bfloat16)
    far = np.array([2**33, 2**29 + 5])
    for positions, window in ((pos, None), (far, None), (far, 8), (np.array([-(2**40), 30]), 8)):
        spy = _KernelSpy(monkeypatch, tri_device)
        want_r, want_e = _numpy_sets(q, k, v, keep, positions, 0, window, q.shape[-1] ** -0.5)
        r, e = W.keep_measures_triton(*args, q_positions=positions, window=window, config=exact)
        _close(r.cpu().numpy(), want_r, RECALL)
        _close(e.cpu().numpy(), want_e, ERROR)
        assert [t for t in spy.ran if t in ("fma", "packed")] == ["fma"] and spy.grid_reads == []
    rejected = KernelFallbacks()
    rejected.turn_off(rejected.exact_decode(4), "exact decode kernel rejected (test)")
    spy = _KernelSpy(monkeypatch, tri_device)
    want_r, want_e = _numpy_sets(q, k, v, keep, pos, 0, None, q.shape[-1] ** -0.5)
    r, e = W.keep_measures_triton(*args, q_positions=pos, config=exact, fallbacks=rejected)
    _close(r.cpu().numpy(), want_r, RECALL)
    _close(e.cpu().numpy(), want_e, ERROR)
    assert [t for t in spy.ran if t in ("fma", "packed")] == ["packed"]
    with pytest.raises(ValueError, match="below 2"):
        W.keep_measures_triton(*args, q_positions=far, config=exact, fallbacks=rejected)
