"""run_whatif on the committed sampled GPU traces (llama GQA, gemma3_text sliding hybrid)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtrace.format.reader import Trace
from kvtrace.whatif import PolicyError, parse_policy
from kvtrace.whatif.run import run_whatif

DATA = Path(__file__).parents[1] / "data" / "gpu_contents"
LLAMA, GEMMA = DATA / "llama.kvt.h5", DATA / "gemma3_text.kvt.h5"
EVICT = ["knorm", "keydiff", "random", "streaming_llm", "observed_attention", "tova", "snapkv:window_size=4",
         "expected_attention:n_sink=2"]


def _run(path, names, ratios=(0.5,)):
    return run_whatif(path, [parse_policy(n) for n in names], list(ratios))


def _result(doc, label_prefix, ratio=None):
    for p in doc["policies"]:
        if p["label"].startswith(label_prefix):
            return next(r for r in p["results"] if r["ratio"] == ratio)
    raise KeyError(label_prefix)


def test_ratio_zero_is_a_clean_control_and_half_keeps_half_the_bytes():
    doc = _run(LLAMA, EVICT, (0.0, 0.5))
    with Trace(LLAMA) as t:
        kv = t.kv[:]
    per_step = {}
    for r in kv:  # int(T / 2) tokens of each layer at each step, times bytes per token
        bpt = r["bytes_valid"] / r["tokens_kept"]
        per_step[(r["request"], r["step"])] = per_step.get((r["request"], r["step"]), 0) + int(r["tokens_kept"] * 0.5) * bpt
    for name in EVICT:
        zero = _result(doc, name, 0.0)
        assert zero["bytes"]["saved_peak"] == 0
        assert zero["overall"]["attention_mass_recall"]["worst"] == pytest.approx(1.0)
        assert zero["overall"]["attention_output_error"]["worst"] == pytest.approx(0.0, abs=1e-6)
        half = _result(doc, name, 0.5)
        assert half["bytes"]["kept_peak"] == max(per_step.values())
        if name.startswith("snapkv"):  # the fixture samples every 4 steps: no query in the last 4 positions
            assert half["units"] == {"measured": 0, "unsupported": 2, "not_pressed": 0}
            assert all("no sampled query in the observation window (positions 28..31)" in x["reason"]
                       for x in half["layers"])
            continue
        assert half["overall"]["attention_mass_recall"]["mean"] < 1.0
        assert half["overall"]["attention_output_error"]["mean"] > 0.0
        assert len(half["layers"]) == 2 and all(len(x["attention_mass_recall"]) == 2 for x in half["layers"])


def test_quantisation_error_falls_with_bits_and_fp8_halves_bf16():
    doc = _run(LLAMA, ["kivi:nbits=2,residual_length=0", "kivi:nbits=8,residual_length=0", "fp8", "fp8:fmt=e5m2"])
    k2, k8 = _result(doc, "kivi:nbits=2"), _result(doc, "kivi:nbits=8")
    assert k8["overall"]["key_mse"]["mean"] < k2["overall"]["key_mse"]["mean"] / 100
    assert k8["overall"]["attention_output_error"]["mean"] < k2["overall"]["attention_output_error"]["mean"]
    assert k2["bytes"]["kept_peak"] < k8["bytes"]["kept_peak"]
    assert _result(doc, "fp8:fmt=e4m3")["bytes"]["kept_peak"] == doc["baseline"]["valid_peak"] / 2  # bf16 -> 1 B
    e4, e5 = _result(doc, "fp8:fmt=e4m3"), _result(doc, "fp8:fmt=e5m2")
    assert e4["overall"]["key_mse"]["mean"] < e5["overall"]["key_mse"]["mean"]  # one more mantissa bit


def test_paging_waste_from_sizes():
    doc = _run(LLAMA, ["paging:page_size=16", "paging:page_size=256"])
    # llama fixture: 2 layers of 24/28/32 tokens, 128 B per token; pages of 16 hold 32/32/32
    small = _result(doc, "paging:page_size=16")["bytes"]
    assert small["kept_peak"] == 2 * 32 * 128 and small["waste_peak"] == 2 * 8 * 128
    big = _result(doc, "paging:page_size=256")["bytes"]
    assert big["kept_peak"] == 2 * 256 * 128 and big["saved_peak"] < 0


def test_ratio_zero_saves_exactly_nothing_and_layout_effects_are_their_own_line():
    # gemma3_text: a sliding layer's first view pins the prefill's whole storage (allocated 3072 B
    # for 896 B held): the old allocated baseline credited that to every policy, ratio 0 included
    doc = _run(GEMMA, EVICT + ["kivi:nbits=4", "paging:page_size=16"], (0.0, 0.5))
    with Trace(GEMMA) as t:
        kv = t.kv[:]
    b = doc["baseline"]
    assert b["bytes_peak"] == 5888 and b["recorded"]["allocated_peak"] == 9216
    assert b["recorded"]["layout_peak"] == 9216 - 5888
    assert doc["sliding"]["pressed"] and doc["sliding"]["layers"] == [0, 1]
    assert "gemma3_text" in doc["sliding"]["reason"]  # kvpress hooks every layer of Gemma3ForCausalLM
    for name in EVICT:
        zero = _result(doc, name, 0.0)
        assert zero["bytes"]["saved_peak"] == 0 and zero["bytes"]["saved_mean"] == 0
        assert zero["units"]["measured"] == 3
    half = _result(doc, "knorm", 0.5)["bytes"]  # 7 -> 3 sliding tokens, 24/28/32 -> 12/14/16 full
    per_step: dict = {}
    for r in kv:
        per_step[r["step"]] = per_step.get(r["step"], 0) + max(1, int(r["tokens_kept"] * 0.5)) * r["bytes_valid"] \
            / r["tokens_kept"]
    assert half["kept_peak"] == max(per_step.values()) and half["saved_peak"] == 5888 - half["kept_peak"]
    keep = run_whatif(GEMMA, [parse_policy("knorm")], [0.5], sliding="keep")
    assert not keep["sliding"]["pressed"]
    r = _result(keep, "knorm", 0.5)
    assert r["units"] == {"measured": 1, "unsupported": 0, "not_pressed": 2}
    slide = [x for x in r["layers"] if x["layer_type"] == "sliding"]
    assert all(x["status"] == "not_pressed" and "attention_mass_recall" not in x for x in slide)
    full_only = max(sum((max(1, int(x["tokens_kept"] * 0.5)) if x["layer_type"] == 1 else x["tokens_kept"])
                        * x["bytes_valid"] / x["tokens_kept"] for x in kv[kv["step"] == s]) for s in (0, 4, 8))
    assert r["bytes"]["kept_peak"] == full_only
    assert _result(doc, "streaming_llm", 0.5)["bytes"]["kept_peak"] > half["kept_peak"]  # 4 sinks of 7 > 3


def test_sliding_hybrid_measures_sliding_layers_over_the_window_they_hold():
    # a sliding layer holds window - 1 tokens after a step: its query's oldest window key is gone,
    # so it is measured over the keys held (before: skipped as "outside the sample")
    doc = _run(GEMMA, ["knorm", "snapkv:window_size=4"], (0.0, 0.5))
    snap = _result(doc, "snapkv", 0.5)
    assert snap["units"]["unsupported"] == 3 and not snap["overall"]  # no sampled query in the window
    r = _result(doc, "knorm", 0.5)
    sliding = [x for x in r["layers"] if x["layer_type"] == "sliding"]
    assert sliding and all("attention_mass_recall" in x for x in sliding)
    assert all(x["tokens"] == 7 for x in sliding)  # the fixture's window is 8
    assert not r["skipped"]
    zero = _result(doc, "knorm", 0.0)
    assert zero["overall"]["attention_mass_recall"]["worst"] == pytest.approx(1.0)


def test_trace_without_payloads_measures_bytes_only():
    doc = _run(DATA.parent / "gpu" / "gpu_clean.kvt.h5", ["knorm", "kivi:residual_length=0"])  # default residual 128 > its tokens
    assert doc["sampled_units"] == 0 and doc["baseline"]["bytes_peak"] > 0
    for p in doc["policies"]:
        r = p["results"][0]
        assert 0 < r["bytes"]["kept_peak"] < doc["baseline"]["bytes_peak"]
        assert r["overall"] == {} and "no sampled K/V" in r["skipped"][0]["reason"]


def test_query_chunks_give_the_same_numbers(monkeypatch):
    from kvtrace.whatif import run as run_mod

    names = ["knorm", "kivi:nbits=2,residual_length=0"]
    whole = _run(GEMMA, names)
    monkeypatch.setattr(run_mod, "CHUNK_ELEMENTS", 1)  # one query per pass
    chunked = _run(GEMMA, names)
    assert chunked["policies"] == whole["policies"]


def test_observed_attention_chunks_over_many_queries():
    import numpy as np

    from kvtrace.whatif.numerics import attention_probs, visible_mask
    from kvtrace.whatif.policies import Observed

    rng = np.random.default_rng(1)
    T, n = 150, 150  # a prefill: more queries than one chunk of 64
    q, k = rng.normal(size=(1, 4, n, 8)), rng.normal(size=(1, 2, T, 8))
    obs = Observed(q, np.arange(n), np.arange(T), None, 0.3)
    vis = visible_mask(np.arange(n), np.arange(T))
    p = attention_probs(q, k, vis, 0.3)
    want = (p.sum(axis=2) / vis.sum(axis=0)).reshape(1, 2, 2, T).mean(axis=2)
    np.testing.assert_allclose(parse_policy("observed_attention").score(k, obs), want, rtol=1e-12)


def test_a_long_prefill_is_evaluated_on_its_last_queries(monkeypatch, tmp_path):
    torch = pytest.importorskip("torch")
    import kvtrace
    from kvtrace.recorder.sampling import SamplingSettings
    from kvtrace.whatif import source
    from tests.helpers.models import tiny_model

    model, path = tiny_model("llama"), tmp_path / "p.kvt.h5"
    ids = torch.randint(3, 200, (1, 10), generator=torch.Generator().manual_seed(0))
    with kvtrace.record(model, path, sampling=SamplingSettings(every_n_steps=100, queries=True)):
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)  # the prefill only
    monkeypatch.setattr(source, "MAX_EVAL_QUERIES", 4)
    r = _result(_run(path, ["knorm"]), "knorm", 0.5)
    assert r["layers"] and all(x["notes"] == ["evaluated with the last 4 of the 10 queries sampled at step 0"]
                               for x in r["layers"])


def test_steps_all_measures_every_sampled_step():
    doc = run_whatif(LLAMA, [parse_policy("knorm"), parse_policy("snapkv:window_size=4")], [0.0, 0.5], steps="all")
    assert doc["steps"] == "all" and "up to 8 sampled steps" in doc["note"]
    knorm = _result(doc, "knorm", 0.5)
    assert sorted((x["layer"], x["step"]) for x in knorm["layers"]) == [(ly, s) for ly in (0, 1) for s in (0, 4, 8)]
    assert all("attention_mass_recall" in x for x in knorm["layers"])
    assert _result(doc, "knorm", 0.0)["overall"]["attention_mass_recall"]["worst"] == pytest.approx(1.0)
    snap = _result(doc, "snapkv", 0.5)  # the prefill (step 0) has no earlier queries to score with
    assert sorted(x["step"] for x in snap["layers"]) == [4, 4, 8, 8]
    assert {(s["layer"], "before step 0" in s["reason"]) for s in snap["skipped"]} == {(0, True), (1, True)}
    last = run_whatif(LLAMA, [parse_policy("knorm")], [0.5])
    assert [x["step"] for x in _result(last, "knorm", 0.5)["layers"]] == [8, 8]
    with pytest.raises(PolicyError):
        run_whatif(LLAMA, [parse_policy("knorm")], [0.5], steps="some")
