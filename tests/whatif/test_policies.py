"""What-if policies and numerics on hand-built tensors with known answers (numpy only)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvtrace.format.numeric import _fp8_table
from kvtrace.whatif.numerics import keep_measures, quantize_minmax, reconstruction, round_fp8, visible_mask
from kvtrace.whatif.policies import (
    FP8,
    KIVI,
    Observed,
    Paging,
    PolicyError,
    Quanto,
    SnapKV,
    Unsupported,
    keep_top,
    parse_policy,
)

RNG = np.random.default_rng(0)


def _keys(T=10, H=1, D=4):
    return RNG.normal(size=(1, H, T, D))


def test_parse_and_checks():
    assert parse_policy("snapkv:window_size=8,kernel_size=3").params() == {"window_size": 8, "kernel_size": 3}
    for bad in ("nope", "knorm:x=1", "snapkv:kernel_size=4", "kivi:nbits=3", "paging:page_size=24",
                "fp8:fmt=e3m4", "snapkv:window_size=a"):
        with pytest.raises(PolicyError):
            parse_policy(bad)


def test_keep_top_counts_and_ties():
    s = np.array([[[1.0, 1.0, 1.0, 0.0]]])
    keep = keep_top(s, 0.5)  # int(4 * 0.5) = 2 kept; ties go to the older tokens
    assert keep.tolist() == [[[True, True, False, False]]]


def test_knorm_keeps_small_norm_keys():
    k = np.ones((1, 1, 6, 4))
    k[0, 0, 2] *= 10  # planted large-norm key: knorm drops it first
    keep = parse_policy("knorm").plan(k, 0.1)  # keep int(6 * 0.9) = 5
    assert keep.sum() == 5 and not keep[0, 0, 2]


def test_keydiff_keeps_the_outlier_direction():
    k = np.tile([1.0, 0.0, 0.0, 0.0], (1, 1, 8, 1)) + RNG.normal(scale=0.01, size=(1, 1, 8, 4))
    k[0, 0, 5] = [0.0, 1.0, 0.0, 0.0]
    keep = parse_policy("keydiff").plan(k, 0.875)  # keep int(8 * 0.125) = 1
    assert np.flatnonzero(keep[0, 0]).tolist() == [5]


def test_streaming_llm_sinks_and_window():
    k = _keys(T=20)
    keep = parse_policy("streaming_llm:n_sink=2").plan(k, 0.5)  # 10 kept: 2 sinks + 8 recent
    assert np.flatnonzero(keep[0, 0]).tolist() == [0, 1] + list(range(12, 20))
    keep = parse_policy("streaming_llm:n_sink=4,window=3").plan(k, 0.1)  # fixed cache: ratio ignored
    assert np.flatnonzero(keep[0, 0]).tolist() == [0, 1, 2, 3, 17, 18, 19]


def test_random_is_seeded():
    k = _keys(T=50)
    a = parse_policy("random:seed=1").plan(k, 0.5)
    assert a.sum() == 25 and (a == parse_policy("random:seed=1").plan(k, 0.5)).all()
    assert (a != parse_policy("random:seed=2").plan(k, 0.5)).any()


def _obs(q, k, pos=None, window=None, scale=1.0):
    T = k.shape[2]
    q_pos = np.arange(T) if pos is None else np.asarray(pos)
    return Observed(q, q_pos, np.arange(T), window, scale)


def test_observed_attention_is_kvpress_formula_on_a_causal_prefill():
    # 2 KV heads x 2 query heads each; queries at every position (a prefill): kvpress divides the
    # summed attention by T - i and averages the group.
    B, hk, g, T, D = 1, 2, 2, 6, 4
    q, k = RNG.normal(size=(B, hk * g, T, D)), RNG.normal(size=(B, hk, T, D))
    pol = parse_policy("observed_attention")
    got = pol.score(k, _obs(q, k, scale=0.5))
    want = np.zeros((B, hk, T))
    for h in range(hk * g):
        for i in range(T):  # query i
            lg = [0.5 * q[0, h, i] @ k[0, h // g, j] for j in range(i + 1)]
            w = np.exp(lg - np.max(lg))
            w /= w.sum()
            for j in range(i + 1):
                want[0, h // g, j] += w[j] / (T - j) / g
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_observed_attention_keeps_a_planted_heavy_hitter():
    T, D = 16, 8
    k = RNG.normal(scale=0.1, size=(1, 1, T, D))
    k[0, 0, 5] = 0.0
    k[0, 0, 5, 0] = 5.0
    q = np.zeros((1, 1, T, D))
    q[..., 0] = 1.0  # every query looks at key 5
    keep = parse_policy("observed_attention").plan(k, 0.9, _obs(q, k))  # keep int(1.6) = 1
    assert np.flatnonzero(keep[0, 0]).tolist() == [5]


def test_tova_uses_the_last_query_and_keeps_unseen_keys():
    T, D = 8, 4
    k = RNG.normal(scale=0.1, size=(1, 2, T, D))
    k[0, 1, 2, 0] = 6.0  # KV head 1 key 2 is hot for query head 1 ...
    q = np.zeros((1, 2, 3, D))
    q[0, :, :, 0] = 1.0
    # keys 5..7 (the last query's own and newer) are always kept: 3 of them do not fit a budget of
    # 2, so the keep-set would be a tie-break -- unsupported, said, instead of "the first of them"
    with pytest.raises(Unsupported, match="3 keys at or after the last sampled query's position 5"):
        parse_policy("tova").plan(k, 0.75, _obs(q, k, pos=[3, 4, 5]))
    keep, info = parse_policy("tova").plan_info(k, 0.5, _obs(q, k, pos=[3, 4, 5]))
    # ... and TOVA averages all heads, so both KV heads keep key 2
    assert keep[0, 0, 2] and keep[0, 1, 2] and keep[0, :, 5:].all()
    assert info == {"forced_keep": 3, "query_position": 5}


def test_snapkv_window_mean_and_pooling():
    T, D = 8, 2
    k = np.zeros((1, 1, T, D))  # equal logits: a query spreads 1 / (pos + 1) on every visible key
    q = np.zeros((1, 1, 2, D))
    pol = SnapKV(window_size=2, kernel_size=3)
    s = pol.score(k, _obs(q, k, pos=[6, 7]))
    base = (np.full(6, 1 / 7) + np.full(6, 1 / 8)) / 2  # keys 0..5, before the window start 6
    pooled = np.convolve(np.pad(base, 1), np.ones(3) / 3, mode="valid")  # zero padding counted
    np.testing.assert_allclose(s[0, 0, :6], pooled, rtol=1e-12)
    assert np.isinf(s[0, 0, 6:]).all()


def test_query_policies_without_queries_refuse():
    with pytest.raises(PolicyError):
        parse_policy("snapkv").plan(_keys(), 0.5, None)


def test_keep_measures_full_keep_is_exact_and_dropping_the_hot_key_costs_its_mass():
    T, D = 6, 4
    k = np.zeros((1, 1, T, D))
    k[0, 0, 3, 0] = 2.0
    v = RNG.normal(size=(1, 1, T, D))
    q = np.zeros((1, 1, 1, D))
    q[..., 0] = 1.0
    vis = visible_mask([5], np.arange(T))
    rec, err = keep_measures(q, k, v, vis, 1.0, np.ones((1, 1, T), bool))
    assert rec.item() == pytest.approx(1.0) and err.item() == pytest.approx(0.0, abs=1e-12)
    keep = np.ones((1, 1, T), bool)
    keep[0, 0, 3] = False
    rec, err = keep_measures(q, k, v, vis, 1.0, keep)
    hot = math.exp(2) / (math.exp(2) + 5)
    assert rec.item() == pytest.approx(1 - hot)
    assert err.item() > 0.05


def test_visible_mask_window():
    m = visible_mask([4], np.arange(6), window=3)
    assert m[0].tolist() == [False, False, True, True, True, False]


def test_quantize_constant_group_exact_and_int8_close():
    x = np.full((1, 1, 4, 8), 3.25)
    assert (quantize_minmax(x, 2, axis=3, group=4) == x).all()
    y = RNG.normal(size=(1, 2, 64, 32))
    err8 = np.abs(quantize_minmax(y, 8, axis=3, group=32) - y).max()
    rng = y.max(axis=3).max() - y.min(axis=3).min()
    assert err8 <= rng / 255 / 2 + 1e-12  # round-to-nearest: at most half a step


def test_kivi_per_channel_keys_beat_per_token_on_an_outlier_channel():
    k = RNG.normal(size=(1, 1, 64, 16))
    k[..., 3] += 40.0  # outlier channel: per-token groups waste their range on it
    kivi = KIVI(nbits=2, group_size=32, residual_length=0)
    per_channel = reconstruction(k, kivi.roundtrip(k, "key"))[0]
    per_token = reconstruction(k, quantize_minmax(k, 2, axis=3, group=32))[0]
    assert per_channel < per_token / 10


def test_residual_window_stays_exact_and_bytes():
    x = RNG.normal(size=(1, 1, 10, 8))
    q = KIVI(nbits=4, group_size=4, residual_length=3).roundtrip(x, "value")
    assert (q[:, :, 7:] == x[:, :, 7:]).all() and (q[:, :, :7] != x[:, :, :7]).any()
    # 7 quantised tokens x 8 channels x 4 bits = 28 B; values grouped per token: 7 x 2 groups x 4 B
    # of scale+zero = 56 B; 3 residual tokens x 8 x 2 B = 48 B
    assert KIVI(nbits=4, group_size=4, residual_length=3).stored_bytes(10, 8, 2, "value") == 28 + 56 + 48
    # quanto: 128 tokens x 64 ch at 4 bits = 4096 B + 128 groups x 4 B; no residual past 128
    assert Quanto().stored_bytes(256, 64, 2, "key") == 4096 + 512 + 128 * 64 * 2


@pytest.mark.parametrize("fmt,table", [("e4m3", _fp8_table(4, 3, 7, False)), ("e5m2", _fp8_table(5, 2, 15, True))])
def test_fp8_rounding_matches_the_decode_table(fmt, table):
    vals = np.sort(np.unique(table[np.isfinite(table)].astype(np.float64)))
    x = np.concatenate([RNG.normal(scale=s, size=2000) for s in (1e-3, 1.0, 100.0)])
    x = x[np.abs(x) < vals.max()]
    got = round_fp8(x, fmt)
    idx = np.clip(np.searchsorted(vals, x), 1, len(vals) - 1)
    lo, hi = vals[idx - 1], vals[idx]
    nearest = np.where(np.abs(x - lo) <= np.abs(hi - x), lo, hi)
    ties = np.isclose(np.abs(x - lo), np.abs(hi - x))
    assert np.isin(got, vals).all()
    assert (got[~ties] == nearest[~ties]).all()
    assert round_fp8(np.array([1e6]), fmt)[0] == vals.max()
    assert FP8(fmt=fmt).stored_bytes(5, 4, 2, "key") == 20


def test_paging_rounds_up_to_pages():
    assert Paging(page_size=16).tokens_allocated(np.array([0, 1, 16, 24])).tolist() == [0, 16, 16, 32]
