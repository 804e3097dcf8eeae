"""Policy semantics from the definitions, not from the sampling: windows in token
positions scored with the queries the trace holds for them; where a unit cannot support the
definition the policy says so (Unsupported) instead of letting a tie-break pick the keep-set.

Mechanisms varied: a decode-heavy trace (a 100-token prompt with every query, 300 generated tokens
with a query sampled every 8), a sliding-window layer, GQA (2 query heads per KV head), sparse
sampling, and streaming_llm's sinks against small budgets."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvtrace.whatif.numerics import attention_probs, visible_mask
from kvtrace.whatif.policies import Observed, Unsupported, n_kept, parse_policy
from kvtrace.whatif.run import _kept_tokens

PROMPT, GEN, EVERY, HK, G, D = 100, 300, 8, 2, 2, 8
T = PROMPT + GEN


def _decode_heavy(every=EVERY, seed=0):
    """Keys at 0..T-1; queries at every prompt position and every ``every``-th generated one, the
    last step's query (T - 1) held out for evaluation as the replay does."""
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(1, HK, T, D))
    q_pos = np.concatenate([np.arange(PROMPT), np.arange(PROMPT - 1 + every, T - 1, every)])
    q = rng.normal(size=(1, HK * G, len(q_pos), D))
    return k, Observed(q, q_pos, np.arange(T), None, 1 / math.sqrt(D))


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75])
def test_snapkv_window_is_positions_and_depends_on_scores_on_a_decode_heavy_trace(ratio):
    k, obs = _decode_heavy()
    keep, info = parse_policy("snapkv").plan_info(k, ratio, obs)
    n = n_kept(T, ratio)
    start = T - 64
    in_window = (obs.q_pos >= start) & (obs.q_pos < T)
    assert info == {"forced_keep": 64, "window_queries": int(in_window.sum()), "window_positions": [start, T - 1]}
    assert info["window_queries"] == 8  # positions 339, 347, ..., 395: the sampled ones of the window
    assert keep[..., start:].all()  # the window (the newest keys, the current query's own) is kept
    assert not keep[..., :n].all()  # not "the first N positions"
    # the prefix keys kept are the top of kvpress's formula over the sampled window queries
    vis = visible_mask(obs.q_pos[in_window], np.arange(T))
    p = attention_probs(obs.q[:, :, in_window], k, vis, obs.scale)[..., :start].mean(axis=2)
    pooled = np.stack([np.convolve(np.pad(x, 2), np.ones(5) / 5, mode="valid") for x in p.reshape(-1, start)])
    s = pooled.reshape(1, HK, G, start).mean(axis=2)
    for h in range(HK):
        want = np.sort(np.argsort(-s[0, h], kind="stable")[:n - 64])
        np.testing.assert_array_equal(np.flatnonzero(keep[0, h, :start]), want)


def test_snapkv_refuses_what_the_trace_cannot_support():
    k, obs = _decode_heavy()
    with pytest.raises(Unsupported, match="128 keys in the observation window .* budget of 100"):
        parse_policy("snapkv:window_size=128").plan(k, 0.75, obs)  # window larger than the budget
    sparse = obs.subset(np.flatnonzero(obs.q_pos < T - 64))
    with pytest.raises(Unsupported, match=r"no sampled query in the observation window \(positions 336..399\)"):
        parse_policy("snapkv").plan(k, 0.5, sparse)
    # a sliding-window layer holding window - 1 = 7 keys: the 64-position window covers them all
    slide = Observed(obs.q, obs.q_pos, np.arange(T - 7, T), 8, obs.scale)
    with pytest.raises(Unsupported, match="7 keys in the observation window"):
        parse_policy("snapkv").plan(k[:, :, -7:], 0.5, slide)
    keep, info = parse_policy("snapkv:window_size=5,kernel_size=1").plan_info(k[:, :, -7:], 0.1, slide)
    assert info["window_queries"] == 1 and keep[..., -5:].all() and keep.sum(axis=-1).tolist() == [[6, 6]]


def test_observed_attention_and_tova_keep_unseen_keys_only_within_the_budget():
    k, obs = _decode_heavy()
    newest = int(obs.q_pos.max())
    keep, info = parse_policy("observed_attention").plan_info(k, 0.5, obs)
    assert info["forced_keep"] == T - 1 - newest and keep[..., newest + 1:].all()
    assert not keep[..., :n_kept(T, 0.5)].all()
    keep, info = parse_policy("tova").plan_info(k, 0.5, obs)
    assert info == {"forced_keep": T - newest, "query_position": newest}
    k2, sparse = _decode_heavy(every=64)  # a query every 64 generated tokens: 63 keys nobody sees
    with pytest.raises(Unsupported, match="keys no sampled query sees"):
        parse_policy("observed_attention").plan(k2, 0.9, sparse)  # budget 40
    with pytest.raises(Unsupported, match="at or after the last sampled query"):
        parse_policy("tova").plan(k2, 0.9, sparse)


def test_streaming_llm_keeps_its_sinks_and_counts_them():
    k = np.zeros((1, 2, 4, 2))
    keep, info = parse_policy("streaming_llm").plan_info(k, 0.99)  # budget max(1, int(4 * 0.01)) = 1
    assert keep.all() and info["over_budget"] == 3
    keep = parse_policy("streaming_llm:n_sink=0").plan(np.zeros((1, 1, 10, 2)), 0.99)
    assert np.flatnonzero(keep[0, 0]).tolist() == [9]  # no sinks: kvpress's floor of one, the newest
    tokens = np.array([4, 100, 7])
    assert _kept_tokens(parse_policy("streaming_llm"), 0.99, tokens).tolist() == [4, 4, 4]  # bytes of what is kept
    assert _kept_tokens(parse_policy("streaming_llm"), 0.5, tokens).tolist() == [4, 50, 4]
    assert _kept_tokens(parse_policy("knorm"), 0.99, tokens).tolist() == [1, 1, 1]
    big = np.zeros((1, 1, 20, 2))
    with pytest.raises(Unsupported, match="start at position 5"):  # a full layer's sample without the sinks
        parse_policy("streaming_llm").plan(big, 0.5, k_pos=np.arange(5, 25), window=None)
    keep = parse_policy("streaming_llm").plan(big, 0.5, k_pos=np.arange(5, 25), window=32)  # sliding: oldest held
    assert np.flatnonzero(keep[0, 0]).tolist() == [0, 1, 2, 3] + list(range(14, 20))
