"""The signature-pieces path of the keep-set measures (kvtrace/kernels/whatif_pieces.py and
_triton_whatif_pieces.py): 16+ query rows per KV head. Triton (CUDA, else the interpreter) ==
numerics.py (float64) at the tolerances of test_whatif_kernels.py; the plan's pieces cover each
visible key exactly once per chunk of sets, with the signature they carry."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvtrace.kernels import whatif as W  # noqa: E402
from kvtrace.kernels import whatif_pieces as P  # noqa: E402
from kvtrace.kernels.whatif_config import KernelConfig, KernelFallbacks  # noqa: E402
from tests.kernels.test_whatif_kernels import _numpy_sets, _t  # noqa: E402

# This path for every many-query call here ("auto" leaves test-sized calls to the shared-max
# kernel, whose fixed costs are lower).
PIECES_ON = KernelConfig(pieces=True)
RECALL = dict(atol=1e-5, rtol=0)
ERROR = dict(atol=1e-5, rtol=1e-4)


def _nested_and_random(rng, B, Hk, T, S):
    """Keep-sets as the replay makes them: per policy, top-k of one score at several ratios
    (nested), plus independent random ones, an empty one and one keeping everything."""
    score = rng.standard_normal((B, Hk, T))
    order = np.argsort(-score, axis=-1)
    sets = []
    for n in (T * 3 // 4, T // 2, T // 4):
        keep = np.zeros((B, Hk, T), bool)
        np.put_along_axis(keep, order[..., :n], True, axis=-1)
        sets.append(keep)
    while len(sets) < S - 2:
        sets.append(rng.random((B, Hk, T)) < 0.5)
    sets += [np.zeros((B, Hk, T), bool), np.ones((B, Hk, T), bool)]
    return np.stack(sets[:S])


def _spy_pieces(monkeypatch):
    from kvtrace.kernels import _triton_whatif_pieces as tp

    calls = []
    real = tp.run_pieces

    def spy(*a, **kw):
        calls.append(kw)
        return real(*a, **kw)

    monkeypatch.setattr(tp, "run_pieces", spy)
    return calls


CASES = [
    # GQA group 2, 8 queries (16 rows), causal; 7 sets: 3 nested, 2 random, empty, all
    dict(seed=0, B=1, Hq=4, Hk=2, Tq=8, T=44, D=16, Dv=8, S=7, window=None, k_start=0, q_pos=None),
    # group 4, batch 2, sliding window 9, keys from position 50, sampled positions incl. one before
    # the first key (nothing visible: recall 0, error NaN); ragged head dims
    dict(seed=1, B=2, Hq=4, Hk=1, Tq=5, T=37, D=12, Dv=20, S=5, window=9, k_start=50,
         q_pos=[49, 60, 70, 80, 86]),
    # not causal (an encoder's or cross attention's keys): every query sees every key
    dict(seed=2, B=1, Hq=2, Hk=1, Tq=8, T=30, D=16, Dv=16, S=5, window=None, k_start=0, q_pos=[0, 3, 5, 9, 11, 2, 7, 1],
         causal=False),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("grid", ["fp32", "bf16", "bf16-tensors"])
def test_pieces_agree_with_numerics(case, grid, tri_device, monkeypatch):
    c = dict(CASES[case])
    rng = np.random.default_rng(c["seed"])
    B, Hq, Hk, Tq, T, D, Dv, S = (c[x] for x in ("B", "Hq", "Hk", "Tq", "T", "D", "Dv", "S"))
    q = rng.standard_normal((B, Hq, Tq, D)).astype(np.float32)
    k = rng.standard_normal((B, Hk, T, D)).astype(np.float32)
    v = rng.standard_normal((B, Hk, T, Dv)).astype(np.float32)
    if grid != "fp32":  # a bf16 model's recorded values, upcast: read as bf16 in registers
        q, k, v = (torch.from_numpy(x).to(torch.bfloat16).float().numpy() for x in (q, k, v))
    keep = _nested_and_random(rng, B, Hk, T, S)
    pos = np.asarray(c["q_pos"] if c["q_pos"] is not None else c["k_start"] + T - Tq + np.arange(Tq))
    causal = c.get("causal", True)
    if causal:
        want_r, want_e = _numpy_sets(q, k, v, keep, pos, c["k_start"], c["window"], D ** -0.5)
    else:  # numerics' visibility is causal: the reference over every key is the torch one in float64
        want_r, want_e = (x.numpy() for x in W.keep_measures_reference(
            *(torch.from_numpy(x) for x in (q, k, v, keep)), q_positions=pos, causal=False))
    calls = _spy_pieces(monkeypatch)
    args = [_t(x, tri_device) for x in (q, k, v, keep)]
    if grid == "bf16-tensors":  # what the replay passes (whatif.as_bf16_if_exact): nothing to cast
        args[:3] = [x.to(torch.bfloat16) for x in args[:3]]
    fb = KernelFallbacks()
    r, e = W.keep_measures_triton(*args, q_positions=pos, k_start=c["k_start"], window=c["window"], causal=causal,
                                  config=PIECES_ON, fallbacks=fb)
    assert len(calls) == 1 and not fb.notes  # the path ran, no silent fallback
    assert all(calls[0][f"cast_{x}"] == (grid == "bf16") for x in "qkv")
    np.testing.assert_allclose(r.cpu().numpy(), want_r, equal_nan=True, **RECALL)
    np.testing.assert_allclose(e.cpu().numpy(), want_e, equal_nan=True, **ERROR)
    assert np.all(r.cpu().numpy()[S - 1][~np.isnan(want_e[S - 1])] > 1 - 1e-5)  # keeps everything: recall 1


def test_chunks_and_piece_lengths_give_the_same_answer(tri_device, monkeypatch):
    """Independent random sets fall into many short runs: the plan splits the chunk (here forced
    down to one set a chunk, and separately to short pieces); every variant gives the same numbers."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 2, 8, 16)).astype(np.float32)
    k = rng.standard_normal((1, 1, 40, 16)).astype(np.float32)
    v = rng.standard_normal((1, 1, 40, 8)).astype(np.float32)
    keep = rng.random((4, 1, 1, 40)) < 0.5
    pos = np.arange(32, 40)
    want_r, want_e = _numpy_sets(q, k, v, keep, pos, 0, None, 0.25)
    args = [_t(x, tri_device) for x in (q, k, v, keep)]
    calls = _spy_pieces(monkeypatch)
    for min_run, splits in ((1, None), (10**6, None), (1, 3)):
        monkeypatch.setattr(P, "MIN_SEGMENT_KEYS", min_run)
        fb = KernelFallbacks()
        r, e = W.keep_measures_triton(*args, q_positions=pos, num_splits=splits, config=PIECES_ON, fallbacks=fb)
        np.testing.assert_allclose(r.cpu().numpy(), want_r, **RECALL)
        np.testing.assert_allclose(e.cpu().numpy(), want_e, **ERROR)
        assert not fb.notes  # the path ran, no silent fallback
    assert len(calls) == 3


def _plan(dev, keep, T, pos, window=None, k_start=0, piece_keys=1 << 20, unit=1):
    q = torch.zeros(1, keep.shape[2], len(pos), 4, device=dev)
    k = torch.zeros(1, keep.shape[2], T, 4, device=dev)
    g = W._geometry(q, k, k, pos, k_start, window, None, True)
    return P.plan(W._keep_arg(_t(keep, dev)), g, torch.device(dev), piece_keys=piece_keys, unit=unit)[0]


def _pieces_of(plan):
    work, sig = plan.work.cpu().numpy(), plan.psig.cpu().numpy()
    perm = plan.perm.cpu().numpy()
    return [(int(hd), int(row), perm[row, lo:hi], int(s)) for (hd, row, lo, hi), s in zip(work, sig, strict=True)]


def test_plan_covers_each_visible_key_once_per_chunk_with_its_signature(monkeypatch, tri_device):
    """Nested sets (one policy at three ratios) make 4 runs a head and one chunk; the pieces of a
    chunk partition the keys some query sees, each carrying the bits of the sets that keep it."""
    monkeypatch.setattr(P, "MIN_SEGMENT_KEYS", 16)  # 4 runs of 16 keys: one chunk
    rng = np.random.default_rng(7)
    T, Hk = 64, 2
    score = rng.standard_normal((1, Hk, T))
    order = np.argsort(-score, axis=-1)
    keep = np.zeros((3, 1, Hk, T), bool)
    for s, n in enumerate((48, 32, 16)):
        np.put_along_axis(keep[s], order[..., :n], True, axis=-1)
    plan = _plan(tri_device, keep, T, pos=np.arange(48, 64))
    assert plan.chunks == [[0, 1, 2]]
    assert plan.csets.tolist() == [[0, 1, 2, 3] + [-1] * 12]  # padded to the fold's 16 slots
    pieces = _pieces_of(plan)
    assert len(pieces) == 4 * Hk  # one run per band of the nested sets, per head
    for hd in range(Hk):
        mine = [(keys, s) for h, _, keys, s in pieces if h == hd]
        keys = np.concatenate([x for x, _ in mine])
        assert sorted(keys.tolist()) == list(range(T))
        for ks, s in mine:
            want = sum(int(b) << j for j, b in enumerate(keep[:, 0, hd, ks[0]]))
            assert s == want and all(sum(int(b) << j for j, b in enumerate(keep[:, 0, hd, x])) == s for x in ks)
    assert plan.first.tolist() == [0, 4, 8]


def test_plan_drops_keys_no_query_sees_and_splits_long_runs(tri_device):
    """A window of 8 behind queries at 40..47 and keys from position 10: only keys at 33..47 are
    seen by any query; runs longer than the piece length are cut; random sets with many short runs
    are split into chunks."""
    keep = np.ones((1, 1, 1, 40), bool)
    plan = _plan(tri_device, keep, 40, pos=np.arange(40, 48), window=8, k_start=10, piece_keys=4, unit=2)
    pieces = _pieces_of(plan)
    keys = np.concatenate([x for _, _, x, _ in pieces])
    assert sorted(keys.tolist()) == list(range(23, 38))  # positions 33..47 minus k_start 10
    assert all(len(x) <= 4 for _, _, x, _ in pieces) and len(pieces) == 4
    rng = np.random.default_rng(3)
    many = rng.random((6, 1, 1, 256)) < 0.5  # 64 signatures x ~4 keys: under MIN_SEGMENT_KEYS
    plan = _plan(tri_device, many, 256, pos=np.arange(240, 256))
    assert len(plan.chunks) > 1 and sorted(sum(plan.chunks, [])) == list(range(6))
    for i, c in enumerate(plan.chunks):  # a chunk of 2+ sets averages MIN_SEGMENT_KEYS keys a run or more
        runs = {s for _, row, _, s in _pieces_of(plan) if row == i}
        assert len(c) == 1 or len(runs) * P.MIN_SEGMENT_KEYS <= 256
    nothing = _plan(tri_device, keep, 40, pos=np.array([5, 6]), k_start=10)  # every query before the first key
    assert nothing is None


def test_auto_takes_the_path_where_the_probe_measured_it_faster(tri_device, monkeypatch):
    """The cost model against the H200 probe it was fitted on (9 sets + the full one, Llama-3-8B
    heads): pieces at 32k keys x 64 and 256 queries, the shared-max kernel at 32k x 16 and 4k x 64
    (there the plan's fixed cost outweighs it); a test-sized call in "auto" runs the shared kernel."""
    assert P.pays(32 * 64, 32768, 10) and P.pays(32 * 256, 32768, 10)
    assert not P.pays(32 * 16, 32768, 10) and not P.pays(32 * 64, 4096, 10)
    assert not P.pays(32 * 64, 32768, 2) or P.pays(32 * 64, 32768, 10)  # more sets only help this path
    calls = _spy_pieces(monkeypatch)
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((1, 2, 8, 16), (1, 1, 40, 16), (1, 1, 40, 8)))
    keep = rng.random((3, 1, 1, 40)) < 0.5
    pos = np.arange(32, 40)
    want_r, want_e = _numpy_sets(q, k, v, keep, pos, 0, None, 0.25)
    r, e = W.keep_measures_triton(*(_t(x, tri_device) for x in (q, k, v, keep)), q_positions=pos,
                                  config=KernelConfig(pieces="auto"))
    assert calls == []
    np.testing.assert_allclose(r.cpu().numpy(), want_r, **RECALL)
    np.testing.assert_allclose(e.cpu().numpy(), want_e, **ERROR)


def test_piece_states_over_the_memory_cap_go_to_the_shared_kernel(tri_device, monkeypatch):
    """Piece states above PIECES_MAX_BYTES: the shared-max kernel answers, with the same numbers."""
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((1, 2, 8, 16), (1, 1, 40, 16), (1, 1, 40, 8)))
    keep = rng.random((3, 1, 1, 40)) < 0.5
    pos = np.arange(32, 40)
    want_r, want_e = _numpy_sets(q, k, v, keep, pos, 0, None, 0.25)
    monkeypatch.setattr(P, "PIECES_MAX_BYTES", 1024)
    calls = _spy_pieces(monkeypatch)
    r, e = W.keep_measures_triton(*(_t(x, tri_device) for x in (q, k, v, keep)), q_positions=pos, config=PIECES_ON)
    assert calls == []
    np.testing.assert_allclose(r.cpu().numpy(), want_r, **RECALL)
    np.testing.assert_allclose(e.cpu().numpy(), want_e, **ERROR)
