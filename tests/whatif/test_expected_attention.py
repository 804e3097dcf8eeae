"""expected_attention on hand-built tensors (no kvpress needed): the formula by loops, the sinks,
the value-norm rescaling, and the stand-in note in the output."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvtrace.whatif import parse_policy
from kvtrace.whatif.policies import Observed, PolicyError

RNG = np.random.default_rng(3)


def _obs(q, T, pos=None):
    pos = np.arange(q.shape[2]) if pos is None else np.asarray(pos)
    return Observed(q, pos, np.arange(T), None, 1.0)


def test_formula_by_loops():
    B, hk, g, T, D, sink = 1, 2, 2, 7, 3, 2
    q, k, v = RNG.normal(size=(B, hk * g, 9, D)), RNG.normal(size=(B, hk, T, D)), RNG.normal(size=(B, hk, T, D))
    got = parse_policy(f"expected_attention:n_sink={sink}").score(k, _obs(q, T), v)
    want = np.zeros((B, hk, T))
    for h in range(hk * g):
        qs = q[0, h, sink:]  # queries at positions >= n_sink
        mu = qs.mean(0)
        cov = sum(np.outer(x - mu, x - mu) for x in qs) / len(qs)
        lg = np.array([k[0, h // g, j] @ mu / math.sqrt(D) + k[0, h // g, j] @ cov @ k[0, h // g, j] / D / 2
                       for j in range(sink, T)])
        p = np.exp(lg - lg.max())
        want[0, h // g, sink:] += p / p.sum() / g
    want[..., sink:] *= np.linalg.norm(v[..., sink:, :], axis=-1)
    np.testing.assert_allclose(got[..., sink:], want[..., sink:], rtol=1e-12)
    assert np.isinf(got[..., :sink]).all()


def test_keeps_the_key_the_queries_point_at_and_the_sinks():
    T, D = 12, 4
    k = RNG.normal(scale=0.1, size=(1, 1, T, D))
    k[0, 0, 7] = [4.0, 0, 0, 0]  # aligned with the mean query
    v = np.ones((1, 1, T, D))
    q = np.zeros((1, 1, 6, D))
    q[..., 0] = 1.0
    keep = parse_policy("expected_attention:n_sink=2").plan(k, 0.75, _obs(q, T, pos=range(4, 10)), v)  # 3 kept
    assert np.flatnonzero(keep[0, 0]).tolist()[:2] == [0, 1] and keep[0, 0, 7] and keep.sum() == 3


def test_value_norm_decides_between_equal_keys():
    T, D = 8, 4
    k = np.zeros((1, 1, T, D))  # every key equally expected
    v = np.ones((1, 1, T, D))
    v[0, 0, 6] *= 10
    q = RNG.normal(size=(1, 1, 5, D))
    keep = parse_policy("expected_attention:n_sink=0").plan(k, 0.875, _obs(q, T), v)  # 1 kept
    assert np.flatnonzero(keep[0, 0]).tolist() == [6]
    keep = parse_policy("expected_attention:n_sink=0,use_vnorm=false").plan(k, 0.875, _obs(q, T), v)
    assert np.flatnonzero(keep[0, 0]).tolist() == [0]  # all tied: the older token wins


def test_refusals_and_params():
    k = RNG.normal(size=(1, 1, 4, 2))
    with pytest.raises(PolicyError):
        parse_policy("expected_attention:n_sink=4").score(k, _obs(RNG.normal(size=(1, 1, 6, 2)), 4), k)
    with pytest.raises(PolicyError):  # every sampled query sits on a sink position
        parse_policy("expected_attention:n_sink=2").score(k, _obs(RNG.normal(size=(1, 1, 2, 2)), 4), k)
    with pytest.raises(PolicyError):
        parse_policy("expected_attention:use_vnorm=maybe")
    assert parse_policy("expected_attention:epsilon=0.5,use_covariance=0").params()["use_covariance"] is False
    pol = parse_policy("expected_attention")
    assert pol.needs == "Q, K and V" and "post-RoPE" in pol.note
