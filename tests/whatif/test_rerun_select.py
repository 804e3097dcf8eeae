"""The rerun's eviction chooses by index (kvtrace.whatif.rerun_select): every KV head keeps the
same count whatever the scores -- ties, NaN and inf in half precision included -- on the CPU, the
way a GPU's bf16/fp16 keys can produce them."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtrace.whatif import parse_policy  # noqa: E402
from kvtrace.whatif.policies import keep_first, n_kept  # noqa: E402
from kvtrace.whatif.rerun import _Applied, _layer_class  # noqa: E402
from kvtrace.whatif.rerun_select import rank_mask, top_index  # noqa: E402

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_top_index_keeps_n_per_row_older_first_nan_last(dtype):
    s = torch.tensor([[[1.0, 1.0, NAN, INF, 1.0, -INF],     # ties: the older 1.0s first; inf first of all
                       [NAN, NAN, NAN, NAN, NAN, NAN],      # all NaN: the oldest
                       [2.0, -INF, 2.0, NAN, -INF, INF]]], dtype=dtype)
    for n in range(7):
        idx = top_index(s, n)
        assert idx.shape == (1, 3, n)
        assert (idx.diff(dim=-1) > 0).all()  # ascending, no repeats
    assert top_index(s, 3).tolist() == [[[0, 1, 3], [0, 1, 2], [0, 2, 5]]]
    assert top_index(s, 5).tolist() == [[[0, 1, 3, 4, 5], [0, 1, 2, 3, 4], [0, 1, 2, 4, 5]]]  # -inf before NaN
    finite = torch.tensor([[[3.0, 1.0, 3.0, 2.0, 1.0]]], dtype=dtype)  # offline keep_first agrees where no NaN
    for n in range(6):
        want = keep_first(finite.double().numpy(), n)[0, 0].nonzero()[0].tolist()
        assert top_index(finite, n)[0, 0].tolist() == want


def test_candidates_come_first_even_against_inf_and_nan():
    s = torch.tensor([[[INF, NAN, -INF, 0.5, NAN]]], dtype=torch.float16)
    cand = torch.tensor([[[False, False, True, True, True]]])
    assert top_index(s, 2, cand).tolist() == [[[2, 3]]]  # a candidate's -inf before a non-candidate's inf
    assert top_index(s, 3, cand).tolist() == [[[2, 3, 4]]]
    assert top_index(s, 4, cand).tolist() == [[[0, 2, 3, 4]]]


def test_rank_mask_fills_short_rows_with_their_newest_candidates():
    keep = torch.tensor([[[True, False, False, True], [True, False, False, False]]])
    pos = torch.tensor([[[0, 5, 6, 7], [0, 2, 6, 7]]])
    scores, m = rank_mask(keep, pos)
    assert m == 2 and top_index(scores, m).tolist() == [[[0, 3], [0, 3]]]


def _layer(policy: str, ratio: float | None, window: int | None = None):
    return _layer_class()(_Applied(parse_policy(policy), ratio), window, 1 / math.sqrt(4))


def _feed(layer, keys):
    for t in range(keys.shape[2]):
        layer.update(keys[:, :, t:t + 1], keys[:, :, t:t + 1].clone())
        layer.after_attention()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("torch_scoring", [True, False])
def test_half_precision_ties_and_non_finite_keys_keep_equal_counts(dtype, torch_scoring, monkeypatch):
    from kvtrace.whatif import rerun

    monkeypatch.setattr(rerun, "TORCH_SCORING", torch_scoring)
    T = 16
    keys = torch.ones((1, 2, T, 4), dtype=dtype)  # every norm equal: every step a tie
    keys[0, 0, 3] = INF       # norm inf: score -inf
    keys[0, 1, 5] = NAN       # norm NaN: ranked after every number
    keys[0, 1, 9] = 65504.0 if dtype is torch.float16 else 3e38  # the format's largest: norm overflows to inf
    for name in ("knorm", "keydiff"):
        layer = _layer(name, 0.5)
        _feed(layer, keys)
        assert layer.keys.shape[2] == n_kept(T, 0.5)
        assert (layer.pos.diff(dim=-1) > 0).all()
        if name == "knorm":  # older first among equals; the inf / NaN keys go first
            assert 3 not in layer.pos[0, 0].tolist() and 5 not in layer.pos[0, 1].tolist()


def test_streaming_sinks_on_heads_holding_different_windows_keep_equal_counts():
    # A constructed state (streaming_llm alone keeps the same positions on every head): a pressed
    # sliding layer whose heads hold different positions and a budget below n_sink. The policy's
    # mask keeps min(candidates, n_sink) per head -- 4 and 3 -- which one tensor cannot hold; the
    # layer keeps 3 per head (no key that left the window), the first by position.
    layer = _layer("streaming_llm", 0.9, window=8)
    keys = torch.randn((1, 2, 6, 4), dtype=torch.bfloat16)
    layer.update(keys[:, :, :1], keys[:, :, :1].clone())
    layer.keys, layer.values = keys, keys.clone()
    layer.pos = torch.tensor([[[3, 4, 5, 6, 8, 9], [0, 1, 2, 3, 8, 9]]])
    layer.seen = 10
    cand = layer.pos > layer.seen - layer.window  # head 0: 6 in the window, head 1: 3
    layer._evict(2, cand)
    assert layer.pos.tolist() == [[[3, 4, 5], [3, 8, 9]]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_model_with_tied_key_norms_keeps_the_budget_on_every_head(dtype):
    # gemma3's keys are RMS-normed: in half precision many key norms are exactly equal, on sliding
    # and full layers alike (the H200 failure's setting, on the CPU)
    from kvtrace.whatif.rerun import _kept, teacher_forced_logprobs
    from tests.helpers.models import TINY_WINDOW, tiny_model, tiny_prompt

    model, ids = tiny_model("gemma3_text", dtype=dtype, attn_implementation="eager"), tiny_prompt(24)
    for name in ("knorm", "snapkv:window_size=2", "streaming_llm:n_sink=2", "tova"):
        for mode in ("one_pass", "per_token"):
            got, layers = teacher_forced_logprobs(model, ids, parse_policy(name), 0.5, mode=mode)
            assert np.isfinite(got).all(), (name, mode)
            assert [x.kept_log[-1] for x in layers] == [n_kept(TINY_WINDOW - 1, 0.5)] * 2 + [n_kept(24, 0.5)]
            for x in layers:
                assert x.pos.shape[:2] == x.keys.shape[:2] and (x.pos.diff(dim=-1) > 0).all()
            if name == "knorm":
                assert _kept(layers)["steps_near_tie"] > 0


@pytest.mark.parametrize("name", ["knorm", "snapkv:window_size=4", "tova", "observed_attention",
                                  "expected_attention:n_sink=2"])
def test_scores_are_made_on_the_layer_device(name):
    # On a GPU every tensor the torch scorers make must be on the cache's device. On the CPU the
    # same mistake is caught by making factory calls without a device default to "meta": mixing
    # a meta tensor with the layer's CPU tensors raises.
    from kvtrace.whatif import rerun

    layer = _layer(name, 0.5)
    keys = torch.randn((1, 2, 10, 4))
    for t in range(10):
        layer.update(keys[:, :, t:t + 1], keys[:, :, t:t + 1].clone())
        layer.add_queries(torch.randn((1, 4, 1, 4)))
    with torch.device("meta"):
        scores = rerun._torch_scores(layer, parse_policy(name))
    assert scores.device.type == "cpu" and scores.shape == (1, 2, 10)
