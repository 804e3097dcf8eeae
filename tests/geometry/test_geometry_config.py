"""Geometry from config dicts alone: no torch, no transformers."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrace import geometry as G

SWA, FULL = "sliding_attention", "full_attention"


def _gpt_oss_120b() -> dict:
    return {
        "model_type": "gpt_oss", "num_hidden_layers": 36, "hidden_size": 2880, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128, "vocab_size": 201088,
        "layer_types": [SWA, FULL] * 18,
    }


def test_module_does_not_import_torch():
    # The analyser imports geometry in environments without torch.
    import importlib
    import subprocess

    code = "import sys, kvtrace.geometry, kvtrace.presets, kvtrace.calc; sys.exit('torch' in sys.modules or 'transformers' in sys.modules)"
    root = importlib.util.find_spec("kvtrace.geometry").origin.rsplit("/kvtrace/", 1)[0]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env={"PYTHONPATH": root}, capture_output=True)
    assert r.returncode == 0, r.stderr.decode()


def test_gpt_oss_alternates_and_matches_measured_h200_facts():
    geom = G.model_geometry(_gpt_oss_120b())
    assert [g.kind for g in geom.layers[:4]] == ["sliding", "full", "sliding", "full"]
    assert geom.kind_counts() == {"sliding": 18, "full": 18}
    sliding, full = geom.layers[0], geom.layers[1]
    assert (sliding.num_kv_heads, sliding.k_head_dim, sliding.window) == (8, 64, 128)
    assert full.window is None
    # DESIGN.md: 64-token prompt + 4032 new tokens, bf16 -> sliding 127 tokens = 260,096 B,
    # full 4,095 tokens = 8,386,560 B.
    seen = G.cache_tokens_after_generate(64, 4032)
    assert seen == 4095
    assert G.layer_kv_bytes(sliding, seen, 2)[1] == 260_096
    assert G.layer_kv_bytes(full, seen, 2) == (8_386_560, 8_386_560)
    # the storage behind a saturated sliding view spans the full window
    assert G.layer_kv_bytes(sliding, seen, 2)[0] == 128 * 8 * 64 * 2 * 2


def test_mistral_sliding_window_applies_to_every_layer():
    cfg = {"model_type": "mistral", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8}
    assert {g.kind for g in G.model_geometry(cfg)} == {"sliding"}
    cfg["sliding_window"] = None
    assert {g.kind for g in G.model_geometry(cfg)} == {"full"}


def test_qwen_hub_config_max_window_layers():
    cfg = {"model_type": "qwen2", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}
    assert [g.kind for g in G.model_geometry(cfg)] == ["full", "full", "sliding", "sliding"]
    cfg["use_sliding_window"] = False
    assert {g.kind for g in G.model_geometry(cfg)} == {"full"}


def test_head_dim_defaults_to_hidden_over_heads():
    cfg = {"model_type": "gpt_neox", "num_hidden_layers": 2, "hidden_size": 2048, "num_attention_heads": 16}
    g = G.model_geometry(cfg).layers[0]
    assert (g.num_kv_heads, g.k_head_dim, g.v_head_dim) == (16, 128, 128)


def _gemma4(**kw) -> dict:
    cfg = {"model_type": "gemma4_text", "num_hidden_layers": 6, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8,
           "layer_types": [SWA, SWA, FULL, SWA, SWA, FULL]}
    cfg.update(kw)
    return cfg


def test_gemma4_hub_style_and_to_dict_style_agree():
    hub = _gemma4(global_head_dim=32, attention_k_eq_v=True, num_global_key_value_heads=1)
    to_dict = _gemma4(attention_k_eq_v=True,
                      per_layer_config={"2": {"head_dim": 32, "num_key_value_heads": 1},
                                        "5": {"head_dim": 32, "num_key_value_heads": 1}})
    assert G.model_geometry(hub) == G.model_geometry(to_dict)
    full = G.model_geometry(hub).layers[2]
    assert (full.num_kv_heads, full.k_head_dim, full.k_eq_v, full.kv_same_tensor) == (1, 32, True, False)
    assert G.model_geometry(hub).layers[0].k_eq_v is False  # k_eq_v only on non-sliding layers


def test_gemma4_global_head_dim_defaults_to_512_and_global_kv_heads_need_k_eq_v():
    geom = G.model_geometry(_gemma4(num_global_key_value_heads=1))  # no k_eq_v: ignored
    assert (geom.layers[2].k_head_dim, geom.layers[2].num_kv_heads) == (512, 2)
    assert geom.layers[0].k_head_dim == 16


def test_gemma4_kv_sharing_producers():
    geom = G.model_geometry(_gemma4(global_head_dim=32, num_kv_shared_layers=3))
    kinds = [g.kind for g in geom]
    assert kinds == ["sliding", "sliding", "full", "shared_consumer", "shared_consumer", "shared_consumer"]
    assert [g.shares_kv_with for g in geom.layers[3:]] == [1, 1, 2]
    assert geom.layers[5].k_head_dim == 32 and geom.layers[3].window == 8
    assert G.layer_kv_bytes(geom.layers[4], 100, 2) == (0, 0)
    with pytest.raises(ValueError):  # a consumer type without a producer
        G.model_geometry(_gemma4(layer_types=[SWA, SWA, SWA, SWA, SWA, FULL], num_kv_shared_layers=1))


def test_gemma_bidirectional_window_is_halved():
    geom = G.model_geometry(_gemma4(use_bidirectional_attention="all", sliding_window=16))
    assert geom.layers[0].window == 9


def test_multimodal_text_config_is_used():
    cfg = {"model_type": "gemma3", "text_config": {
        "model_type": "gemma3_text", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 32, "sliding_window": 4, "layer_types": [SWA, FULL]},
        "vision_config": {"hidden_size": 1152}}
    geom = G.model_geometry(cfg)
    assert geom.model_type == "gemma3_text" and [g.kind for g in geom] == ["sliding", "full"]


def _dsv3(**kw) -> dict:
    cfg = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168,
           "num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536,
           "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "head_dim": 64}
    cfg.update(kw)
    return cfg


def test_mla_latent_and_expanded_modes():
    lat = G.model_geometry(_dsv3())
    g = lat.layers[0]
    assert (g.kind, g.num_kv_heads, g.k_head_dim, g.v_head_dim) == ("latent", 1, 512, 64)
    assert G.bytes_per_token(lat, 2)["total"] == 61 * (512 + 64) * 2  # 70,272 B/token in bf16
    exp = G.model_geometry(_dsv3(), mla_cache="expanded")
    e = exp.layers[0]
    assert (e.kind, e.num_kv_heads, e.k_head_dim, e.v_head_dim) == ("full", 128, 192, 128)
    # MHA-equivalent is the expanded layout in both modes
    assert G.mha_equivalent_bytes_per_token(lat, 2) == G.bytes_per_token(exp, 2)["total"]
    with pytest.raises(ValueError):
        G.model_geometry(_dsv3(), mla_cache="compressed")


def test_encoder_decoder_cross_layers():
    cfg = {"model_type": "t5", "d_model": 512, "d_kv": 64, "num_heads": 8, "num_layers": 6,
           "num_decoder_layers": 4, "is_encoder_decoder": True, "vocab_size": 32128}
    geom = G.model_geometry(cfg)
    assert geom.kind_counts() == {"full": 4, "cross_attention": 4}
    cross = geom.cross_layers[0]
    assert G.kept_tokens(cross, 10, encoder_len=37) == 37
    with pytest.raises(ValueError):
        G.kept_tokens(cross, 10)


def test_no_kv_layer_types():
    cfg = {"model_type": "x", "num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4,
           "layer_types": ["linear_attention", FULL, "linear_attention"]}
    geom = G.model_geometry(cfg)
    assert [g.kind for g in geom] == ["no_kv", "full", "no_kv"]
    assert G.kv_bytes(geom, 10, 2).valid == 10 * 4 * 16 * 2 * 2
    with pytest.raises(ValueError):
        G.model_geometry({**cfg, "layer_types": ["weird", FULL, FULL]})


def test_static_rules():
    geom = G.model_geometry(_gpt_oss_120b())
    s, f = geom.layers[0], geom.layers[1]
    assert G.kept_tokens(s, 200, "static", 1000) == 128  # static sliding keeps `window`, not window - 1
    assert G.allocated_tokens(s, 1, "static", 1000) == 128
    assert G.allocated_tokens(s, 1, "static", 50) == 50  # min(window, max_cache_len)
    assert G.allocated_tokens(f, 1, "static", 1000) == 1000
    assert G.layer_kv_bytes(f, 0, 2, cache_kind="static", max_cache_len=1000) == (0, 0)  # lazy init
    with pytest.raises(ValueError):
        G.kept_tokens(f, 1001, "static", 1000)
    with pytest.raises(ValueError):
        G.kept_tokens(f, 10, "static")


def test_quantized_fp8_rules():
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16}
    geom = G.model_geometry(cfg)
    assert G.layer_kv_bytes(geom.layers[0], 10, 1, cache_kind="quantized_fp8") == (10 * 64 + 8, 10 * 64)
    with pytest.raises(ValueError):  # QuantizedCache refuses sliding layers
        G.layer_kv_bytes(G.model_geometry(_gpt_oss_120b()).layers[0], 10, 1, cache_kind="quantized_fp8")


def test_bytes_per_token_by_kind():
    bpt = G.bytes_per_token(G.model_geometry(_gpt_oss_120b()), 2)
    assert bpt == {"sliding": 18 * 2048, "full": 18 * 2048, "total": 36 * 2048}
    assert G.mha_equivalent_bytes_per_token(G.model_geometry(_gpt_oss_120b()), 2) == 36 * 64 * 64 * 2 * 2


@settings(max_examples=200, deadline=None)
@given(window=st.integers(2, 64), seen=st.integers(0, 300), q=st.integers(1, 300))
def test_sliding_dynamic_invariants(window, seen, q):
    g = G.LayerGeometry(0, "sliding", "sliding", 2, 16, 16, window, 4)
    kept = G.kept_tokens(g, seen)
    alloc = G.allocated_tokens(g, seen, last_step_tokens=q)
    assert kept == min(seen, window - 1)
    assert kept <= alloc <= max(seen, 0)
    if seen > 0:
        assert alloc - kept <= min(q, seen)
    if seen >= window and q == 1:
        assert alloc == window  # steady decode: window - 1 kept + the new token


@settings(max_examples=100, deadline=None)
@given(seen=st.integers(0, 500), batch=st.integers(1, 8), dtype=st.sampled_from([1, 2, 4]))
def test_bytes_scale_linearly_with_batch_and_dtype(seen, batch, dtype):
    geom = G.model_geometry(_gpt_oss_120b())
    one = G.kv_bytes(geom, seen, 1)
    many = G.kv_bytes(geom, seen, dtype, batch)
    assert (many.allocated, many.valid) == (one.allocated * batch * dtype, one.valid * batch * dtype)


def test_cache_tokens_after_generate():
    assert G.cache_tokens_after_generate(5, 12) == 16
    assert G.cache_tokens_after_generate(5, 12, is_encoder_decoder=True) == 12
    assert G.generate_static_max_cache_len(5, 12) == 16
    with pytest.raises(ValueError):
        G.cache_tokens_after_generate(5, 0)
