"""Presets: real geometry, exact parameter counts, shrinking that keeps KV geometry, CPU generation."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from kvtrace import geometry as G
from kvtrace import presets as P
from kvtrace.geometry.hybrid import state_geometry
from tests.helpers.hfcache import output_cache  # noqa: E402

REQUIRED = {"pythia-1.4b", "llama-3.1-8b", "gemma-3-4b", "gpt-oss-20b", "gpt-oss-120b", "glm-4.5-air",
            "deepseek-v3", "deepseek-v2-lite", "qwen3-8b", "gemma-4-e2b", "gemma-4-26b-a4b", "mistral-7b-v0.1"}

# Published totals (text tower; transformers does not instantiate MTP layers) — also what the
# meta-device model gives, see test_param_count_matches_transformers.
KNOWN_PARAMS = {
    "pythia-1.4b": 1_414_647_808,
    "llama-3.1-8b": 8_030_261_248,
    "gpt-oss-120b": 116_829_156_672,
    "deepseek-v3": 671_026_404_352,
}


def test_listing_and_lookup():
    assert REQUIRED <= set(P.list_presets())
    assert P.get_preset("GPT-OSS-120B").name == "gpt-oss-120b"
    assert P.get_preset("glm-4.5").name == "glm-4.5-air"
    with pytest.raises(KeyError):
        P.get_preset("llama-9000")
    for name in P.list_presets():
        p = P.get_preset(name)
        assert p.description and p.source and p.model_type
        d = p.config_dict()
        d["num_hidden_layers"] = -1  # a copy: the preset itself is untouched
        assert P.get_preset(name).overrides["num_hidden_layers"] > 0


def test_real_geometry_facts():
    oss = P.preset_geometry("gpt-oss-120b")
    assert oss.kind_counts() == {"sliding": 18, "full": 18}
    assert {(g.num_kv_heads, g.k_head_dim, g.window) for g in oss} == {(8, 64, 128), (8, 64, None)}
    assert G.bytes_per_token(oss, 2)["total"] == 36 * 2 * 8 * 64 * 2
    assert G.bytes_per_token(P.preset_geometry("pythia-1.4b"), 2)["total"] == 192 * 1024
    assert G.bytes_per_token(P.preset_geometry("llama-3.1-8b"), 2)["total"] == 128 * 1024
    ds = P.preset_geometry("deepseek-v3")
    assert ds.layers[0].kind == "latent" and G.bytes_per_token(ds, 2)["total"] == 61 * 576 * 2
    e2b = P.preset_geometry("gemma-4-e2b")
    assert e2b.kind_counts() == {"sliding": 12, "full": 3, "shared_consumer": 20}
    assert {g.shares_kv_with for g in e2b if g.kind == "shared_consumer"} == {13, 14}
    a4b = P.preset_geometry("gemma-4-26b-a4b")
    full = [g for g in a4b if g.kind == "full"]
    assert {(g.num_kv_heads, g.k_head_dim, g.k_eq_v) for g in full} == {(2, 512, True)}
    assert P.preset_geometry("mistral-7b-v0.1").kind_counts() == {"sliding": 32}


@pytest.mark.parametrize("name", sorted(P.list_presets()))
def test_overrides_alone_give_the_transformers_geometry(name):
    # geometry and param count from the bare overrides == from the full transformers config
    pytest.importorskip("transformers")
    td = P.preset_config(name).to_dict()
    d = P.get_preset(name).config_dict()
    assert G.model_geometry(d) == G.model_geometry(td)
    if P.get_preset(name).params is None:  # hybrid presets state transformers' own count instead
        assert G.param_count(d) == G.param_count(td)
    assert state_geometry(d) == state_geometry(td)


@pytest.mark.parametrize("name", sorted(P.list_presets()))
def test_param_count_matches_transformers(name):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):  # full size, no memory
            model = AutoModelForCausalLM.from_config(P.preset_config(name))
    real = sum(p.numel() for p in model.parameters())
    stated = P.get_preset(name).params
    if stated is not None:  # hybrid presets: no exact formula for their state mixers; the stated count is checked
        assert stated == real
        return
    pc = G.param_count(P.get_preset(name).config_dict())
    assert pc.exact and pc.total == real
    if name in KNOWN_PARAMS:
        assert real == KNOWN_PARAMS[name]


def _kv_signature(g: G.LayerGeometry):
    d = dataclasses.asdict(g)
    d.pop("index")
    return d


@pytest.mark.parametrize("name", sorted(P.list_presets()))
@pytest.mark.parametrize("layers", [1, 2, 7])
def test_shrinking_keeps_kv_geometry(name, layers):
    full = P.preset_geometry(name)
    small = P.preset_geometry(name, layers=layers, width_scale=0.05, vocab=512)
    assert small.num_hidden_layers == layers
    d = P.preset_config_dict(name, layers=layers, width_scale=0.05, vocab=512)
    assert d["hidden_size"] <= P.get_preset(name).overrides["hidden_size"] and d["vocab_size"] == 512
    for g in small.layers:
        ref = full.layers[g.index]
        if g.kind == "shared_consumer" or ref.kind == "shared_consumer":
            continue  # sharing is re-derived for the shorter stack (checked below)
        if P.get_preset(name).model_type == "gemma4_text" and g.index == layers - 1:
            ref = next(r for r in full.layers if r.kind == "full")  # the last layer is forced to full
        assert _kv_signature(g) == _kv_signature(ref), (name, g.index)


def test_shrinking_kv_sharing_and_dense_prefix():
    small = P.preset_geometry("gemma-4-e2b", layers=10)
    assert [g.kind for g in small] == ["sliding"] * 4 + ["full"] + ["shared_consumer"] * 5
    assert [g.shares_kv_with for g in small.layers[5:]] == [3, 3, 3, 3, 4]
    assert P.preset_config_dict("gemma-4-e2b", layers=3)["num_kv_shared_layers"] == 0  # no producer pair
    assert P.preset_config_dict("deepseek-v3", layers=2)["first_k_dense_replace"] == 1
    assert P.preset_config_dict("deepseek-v3", width_scale=0.05)["n_group"] == 1  # 13 experts, ungrouped
    oss = P.preset_geometry("gpt-oss-120b", layers=5)
    assert [g.kind for g in oss] == ["sliding", "full", "sliding", "full", "sliding"]
    with pytest.raises(ValueError):
        P.preset_config_dict("llama-3.1-8b", layers=0)
    with pytest.raises(ValueError):
        P.preset_config_dict("llama-3.1-8b", width_scale=1.5)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(P.list_presets()))
def test_shrunk_preset_generates_on_cpu_and_cache_matches(name):
    torch = pytest.importorskip("torch")
    from tests.helpers.models import cache_tensor_bytes

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = P.preset_model(name)
        prompt = torch.randint(3, 500, (1, 6), generator=torch.Generator().manual_seed(0))
        out = model.generate(prompt, min_new_tokens=4, max_new_tokens=4, do_sample=False,
                             return_dict_in_generate=True)
    assert out.sequences.shape == (1, 10)
    geom = G.model_geometry(model.config.to_dict())
    # the shrunk model keeps the preset's KV geometry layer by layer
    ref = P.preset_geometry(name, **P.tiny_shrink_args(name))
    assert geom == ref
    pred = G.kv_bytes(geom, G.cache_tokens_after_generate(6, 4), 4)
    cache = output_cache(out)
    sg = state_geometry(model.config.to_dict())
    if sg is None:
        assert cache_tensor_bytes(cache) == list(pred.per_layer)
        return
    # hybrid presets: KV of the attention layers and state of the others, layer by layer
    kv = [layer.keys.nbytes + layer.values.nbytes if getattr(layer, "keys", None) is not None else 0
          for layer in cache.layers]
    assert kv == [allocated for allocated, _ in pred.per_layer][:len(kv)]
    held = {}
    for i, layer in enumerate(cache.layers):
        for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
            for t in states.values():
                if t is not None:
                    held[i] = held.get(i, 0) + t.nbytes
    assert held == sg.per_layer(4)
