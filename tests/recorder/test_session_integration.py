"""How the session drives the sampler and the query capture: RECORDER_OWN per device, the query
group size the capture saw, `mutable` only where the cache writes in place, and decoder
self-attention queries only for encoder-decoder models."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from rec_helpers import generate, model

import kvtrace
from kvtrace.format import PayloadKind
from kvtrace.format.reader import Trace
from kvtrace.format.schema import ReadingLabel
from kvtrace.recorder import submission
from kvtrace.recorder.sampling import PayloadSampler
from tests.helpers.models import tiny_model, tiny_prompt

FP8 = hasattr(__import__("transformers.cache_utils", fromlist=["x"]), "Fp8QuantizedLayer")


@pytest.fixture
def submits(monkeypatch):
    """Every PayloadSampler.submit call as (layer, kind, group_size, mutable); the call goes through."""
    calls: list[tuple[int, PayloadKind, object, object]] = []
    original = PayloadSampler.submit

    def spy(self, request, step, layer, kind, tensor, **kw):
        calls.append((layer, PayloadKind(kind), kw.get("group_size"), kw.get("mutable", "unset")))
        return original(self, request, step, layer, kind, tensor, **kw)

    monkeypatch.setattr(PayloadSampler, "submit", spy)
    return calls


def test_recorder_own_is_read_per_device(tmp_path, monkeypatch):
    """Two (stand-in) devices with different sampler staging peaks: each gets its own reading."""
    own = {0: 111 << 10, 1: 222 << 10}
    monkeypatch.setattr(PayloadSampler, "own_device_bytes_on", lambda self, d: own[d])
    m = model("llama")
    path = tmp_path / "own.kvt.h5"
    with kvtrace.record(m, path, sampling={"every_n_steps": 0}, reset_peak=False, empty_cache=False) as rec:
        rec.devices = [0, 1]  # no CUDA call is made with peak reset and empty_cache off
        generate(m, new=3)
    with Trace(path) as t:
        r = t.readings.where(request=0)
        r = r[r["label"] == int(ReadingLabel.RECORDER_OWN)]
        assert sorted(zip(r["device"].tolist(), r["allocated_bytes"].tolist(), strict=True)) == sorted(own.items())


def test_query_group_size_is_the_one_the_capture_saw(tmp_path, submits):
    m = model("llama")
    path = tmp_path / "q.kvt.h5"
    with kvtrace.record(m, path, sampling={"every_n_steps": 2, "queries": True, "heads": [1]}) as rec:
        generate(m, new=4)
        seen = dict(rec.qcapture.group_sizes)
    groups = {(layer, g) for layer, kind, g, _ in submits if kind == PayloadKind.QUERY}
    hq, hkv = m.config.num_attention_heads, m.config.num_key_value_heads
    assert groups == {(layer, hq // hkv) for layer in range(m.config.num_hidden_layers)}
    assert seen == {layer: hq // hkv for layer in range(m.config.num_hidden_layers)}
    with Trace(path) as t:  # KV head 1 serves query heads 2..3 (group of 2)
        idx = t.payload_index[:]
        qs = [t.payload(i) for i in range(len(idx)) if int(idx[i]["kind"]) == int(PayloadKind.QUERY)]
    assert qs and {(p.head_start, p.shape[1]) for p in qs} == {(hq // hkv, hq // hkv)}


@pytest.mark.parametrize("name,gen,expect", [
    ("llama", {}, False),  # DynamicLayer: tensors replaced by torch.cat, never written into
    ("gemma3_text", {}, False),  # DynamicSlidingWindowLayer + DynamicLayer
    ("llama", {"cache_implementation": "static", "disable_compile": True}, "unset"),  # written in place
    pytest.param("llama", {"cache_implementation": "quantized", "cache_config": {"backend": "fp8"}}, "unset",
                 marks=pytest.mark.skipif(not FP8, reason="this transformers has no fp8 QuantizedCache")),
])
def test_mutable_only_where_the_cache_writes_in_place(tmp_path, submits, name, gen, expect):
    m = model(name)
    with kvtrace.record(m, tmp_path / "m.kvt.h5", sampling={"every_n_steps": 1}) as rec:
        generate(m, new=3, **gen)
    assert rec.recorder_errors == 0
    kv = [mut for _, kind, _, mut in submits if kind in (PayloadKind.KEY, PayloadKind.VALUE)]
    assert kv and set(kv) == {None if expect == "unset" else expect}


def test_decoder_self_attention_modules():
    t5 = tiny_model("t5")
    expect = [block.layer[0].SelfAttention for block in t5.decoder.block]
    assert [id(x) for x in submission.decoder_self_attention(t5)] == [id(x) for x in expect]
    assert submission.decoder_self_attention(model("llama")) is None  # decoder-only: every layer


def test_decoder_self_attention_without_is_causal(monkeypatch):
    """Modules that do not say whether they are causal: the first attention module of each layer."""
    t5 = tiny_model("t5")
    for mod in t5.modules():
        if hasattr(mod, "is_causal"):
            monkeypatch.delattr(mod, "is_causal")
    expect = [block.layer[0].SelfAttention for block in t5.decoder.block]
    assert [id(x) for x in submission.decoder_self_attention(t5)] == [id(x) for x in expect]


def test_encoder_decoder_captures_decoder_self_attention_queries_only(tmp_path):
    """One query per (step, decoder layer), and it is the self-attention query (T5 has no RoPE:
    q = SelfAttention.q(hidden)), not the cross-attention one that shares its layer_idx."""
    m = tiny_model("t5")
    heads, d_kv = m.config.num_heads, m.config.d_kv
    expected: dict[tuple[int, int], torch.Tensor] = {}
    step = {"n": -1}

    def count_step(mod, args, kwargs):
        step["n"] += 1

    def grab(layer):
        def pre(mod, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            q = mod.q(hidden)
            expected[(step["n"], layer)] = q.view(q.shape[0], -1, heads, d_kv).transpose(1, 2).detach().clone()
        return pre

    handles = [m.register_forward_pre_hook(count_step, with_kwargs=True)]
    handles += [block.layer[0].SelfAttention.register_forward_pre_hook(grab(i), with_kwargs=True)
                for i, block in enumerate(m.decoder.block)]
    path = tmp_path / "t5.kvt.h5"
    try:
        with kvtrace.record(m, path, sampling={"every_n_steps": 2, "queries": True}) as rec:
            m.generate(tiny_prompt(6), max_new_tokens=5, min_new_tokens=5, do_sample=False)
    finally:
        for h in handles:
            h.remove()
    assert rec.recorder_errors == 0
    with Trace(path) as t:
        idx = t.payload_index[:]
        qs = [t.payload(i) for i in range(len(idx)) if int(idx[i]["kind"]) == int(PayloadKind.QUERY)]
    per = collections.Counter((p.step, p.layer) for p in qs)
    n_dec = m.config.num_decoder_layers
    assert per == {(s, layer): 1 for s in (0, 2, 4) for layer in range(n_dec)}
    for p in qs:
        np.testing.assert_array_equal(p.to_float32(), expected[(p.step, p.layer)].numpy())
