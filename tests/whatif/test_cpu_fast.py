"""The fast CPU numerics (kvtrace/whatif/cpu_fast.py, torch float64) against the definitions
(kvtrace/whatif/numerics.py, numpy float64), and the replay's per-layer prefix sums against
summing every step's queries afresh: the same numbers up to float64 summation order.

Mechanisms varied: GQA (2 query heads per KV head), sliding windows, query positions out of
order and queries that see none of the keys, keep-sets that keep nothing a query sees, a kept
mass at the edge of float64's range, blocks smaller than one query's keys."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtrace.whatif import numerics as N
from kvtrace.whatif import parse_policy, run

torch = pytest.importorskip("torch")

from kvtrace.whatif import cpu_fast  # noqa: E402

DATA = Path(__file__).parents[1] / "data" / "gpu_contents"
RNG = np.random.default_rng(3)


@pytest.fixture(params=[1 << 20, 97], ids=["one-block", "tiny-blocks"])
def blocks(request, monkeypatch):
    assert cpu_fast.available()
    monkeypatch.setattr(cpu_fast, "BLOCK_ELEMENTS", request.param)


@pytest.mark.parametrize("window", [None, 6, 40])
def test_column_sums_equal_the_definition(blocks, window):
    T, nq = 90, 70
    q, k = RNG.normal(size=(2, 4, nq, 8)), RNG.normal(size=(2, 2, T, 8))
    k_pos = np.arange(20, 20 + T)
    q_pos = RNG.permutation(np.arange(5, 5 + nq) * 2)  # out of order; the first ones see no key
    got = cpu_fast.column_sums(q, k, q_pos, k_pos, window, 0.4)
    want = N.column_sums(q, k, q_pos, k_pos, window, 0.4)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("window", [None, 5])
def test_keep_measures_of_many_sets_equal_one_set_at_a_time(blocks, window):
    T, nq = 60, 9
    q, k, v = RNG.normal(size=(1, 4, nq, 8)), RNG.normal(size=(1, 2, T, 8)), RNG.normal(size=(1, 2, T, 6))
    k_pos = np.arange(T)
    q_pos = np.array([3, 10, 59, 59, 40, 0, 33, 20, 58])
    keeps = [RNG.random((1, 2, T)) < f for f in (0.2, 0.5, 0.9)]
    keeps.append(np.zeros((1, 2, T), bool))
    keeps[-1][..., 55:] = True  # a query before position 55 sees nothing kept: recall 0, error 1
    got = cpu_fast.keep_measures_many(q, k, v, q_pos, k_pos, window, 0.3, keeps)
    vis = N.visible_mask(q_pos, k_pos, window)
    for (r, e), keep in zip(got, keeps, strict=True):
        r0, e0 = N.keep_measures(q, k, v, vis, 0.3, keep)
        np.testing.assert_allclose(r, r0, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(e, e0, rtol=1e-11, atol=1e-14)
    assert (got[-1][0][..., 0] == 0).all() and (got[-1][1][..., 0] == 1).all()


def test_a_kept_mass_below_float64s_scale_is_the_direct_definition():
    T = 4
    k = np.zeros((1, 1, T, 2))
    k[0, 0, 0, 0] = 600.0  # key 0 takes everything: exp(-600) ~ 1e-261 is left for the others
    q = np.zeros((1, 1, 1, 2))
    q[..., 0] = 1.0
    v = RNG.normal(size=(1, 1, T, 3))
    keep = np.array([[[False, True, True, False]]])
    (r, e), = cpu_fast.keep_measures_many(q, k, v, np.array([3]), np.arange(T), None, 1.0, [keep])
    r0, e0 = N.keep_measures(q, k, v, N.visible_mask([3], np.arange(T)), 1.0, keep)
    assert 0 < r0.item() < 1e-200
    np.testing.assert_allclose(r, r0, rtol=1e-12)
    np.testing.assert_allclose(e, e0, rtol=1e-12)


def test_output_error_equals_the_definition_and_reuses_the_reference(blocks):
    T = 50
    q, k, v = RNG.normal(size=(1, 4, 7, 8)), RNG.normal(size=(1, 2, T, 8)), RNG.normal(size=(1, 2, T, 8))
    q_pos, k_pos = np.arange(43, 50), np.arange(T)
    for bits in (2, 4):
        k2, v2 = np.round(k * bits) / bits, np.round(v * bits) / bits
        got = cpu_fast.output_error(q, k, v, k2, v2, q_pos, k_pos, 9, 0.5)
        np.testing.assert_allclose(got, N.output_error(q, k, v, k2, v2, N.visible_mask(q_pos, k_pos, 9), 0.5),
                                   rtol=1e-11, atol=1e-14)


def _numbers(doc):
    out = {}
    for p in doc["policies"]:
        for r in p["results"]:
            for i, row in enumerate(r["layers"]):
                for key, val in row.items():
                    if isinstance(val, list) and val and isinstance(val[0], float):
                        out[(p["label"], r["ratio"], i, key)] = val
                    elif key not in ("notes",):
                        out[(p["label"], r["ratio"], i, key)] = val
    return out


POLICIES = ["knorm", "observed_attention", "tova", "snapkv:window_size=2", "streaming_llm:n_sink=2",
            "expected_attention:n_sink=2", "kivi:nbits=2,residual_length=4", "fp8"]


@pytest.mark.parametrize("name", ["llama", "gemma3_text"])
def test_the_document_is_the_numpy_one(monkeypatch, name):
    path = DATA / f"{name}.kvt.h5"
    pols = [parse_policy(p) for p in POLICIES]
    fast = run.run_whatif(path, pols, [0.0, 0.5], steps="all")
    monkeypatch.setenv("KVTRACE_WHATIF_NUMPY", "1")
    slow = run.run_whatif(path, pols, [0.0, 0.5], steps="all")
    a, b = _numbers(fast), _numbers(slow)
    assert a.keys() == b.keys() and any(k[3] == "attention_mass_recall" for k in a)
    for key, want in b.items():
        if isinstance(want, list) and want and isinstance(want[0], float):
            np.testing.assert_allclose(a[key], want, rtol=1e-10, atol=1e-13, err_msg=str(key))
        else:
            assert a[key] == want, key


def test_prefix_sums_carry_across_steps_exactly(monkeypatch, tmp_path):
    import kvtrace
    from kvtrace.recorder.sampling import SamplingSettings
    from tests.helpers.models import tiny_model, tiny_prompt

    model, path = tiny_model("llama"), tmp_path / "d.kvt.h5"
    with kvtrace.record(model, path, sampling=SamplingSettings(every_n_steps=3, queries=True)):
        model.generate(tiny_prompt(30), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    pol = [parse_policy("observed_attention")]
    starts: list[int] = []
    fill = run._PrefixSums.fill

    def spy(self, u, obs):
        starts.append(len(self.q_pos) if self._extends(u) else 0)
        return fill(self, u, obs)

    monkeypatch.setattr(run._PrefixSums, "fill", spy)
    carried = run.run_whatif(path, pol, [0.5], steps="all")
    assert sum(s > 0 for s in starts) >= 8  # later steps summed only their new queries
    monkeypatch.setattr(run._PrefixSums, "_extends", lambda self, u: False)
    afresh = run.run_whatif(path, pol, [0.5], steps="all")
    a, b = _numbers(carried), _numbers(afresh)
    assert a.keys() == b.keys()
    for key, want in b.items():
        if isinstance(want, list) and want and isinstance(want[0], float):
            np.testing.assert_allclose(a[key], want, rtol=1e-12, atol=1e-14)
        else:
            assert a[key] == want, key
