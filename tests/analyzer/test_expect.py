"""The analyser's vectorised expectation agrees with kvtrace.geometry's scalar rules."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvtrace import geometry as geo
from kvtrace.analyzer.expect import build_expectation
from kvtrace.format import schema
from tests.helpers.synth import GEMMA4_SHARED, GPT_OSS_LIKE, LLAMA_LIKE, MISTRAL_LIKE

LT = schema.LayerType
EMPTY_LAYERS = np.zeros(0, dtype=schema.LAYERS)


@given(
    cfg=st.sampled_from([GPT_OSS_LIKE, LLAMA_LIKE, MISTRAL_LIKE, GEMMA4_SHARED]),
    seen=st.integers(1, 600), last=st.integers(1, 80), item=st.sampled_from([1, 2, 4]),
    batch=st.integers(1, 3), static=st.booleans(), cap=st.integers(1, 700),
)
def test_vectorised_rules_match_geometry(cfg, seen, last, item, batch, static, cap):
    exp = build_expectation(cfg, EMPTY_LAYERS)
    assert exp.source == "config"
    last = min(last, seen)
    for g in exp.model.decoder_layers:
        rtype = (LT.STATIC_SLIDING if g.window else LT.STATIC) if static else LT.FULL
        a, v = exp.expected(g.index, np.array([seen]), np.array([last]), np.array([int(rtype)]),
                            np.array([item]), np.array([item]), np.array([batch]), np.array([cap]))
        kind = "static" if static else "dynamic"
        if static and g.window is None and seen > cap:
            assert a[0] == -1 and v[0] == -1  # impossible state: no expectation, not a guess
            continue
        want = geo.layer_kv_bytes(g, seen, item, batch, kind, cap if static else None, last_step_tokens=last)
        assert (int(a[0]), int(v[0])) == want


def test_fallback_to_layers_table_says_so():
    rows = np.array([(0, int(LT.SLIDING), 2, 16, 16, 8, -1, 0, 0), (1, int(LT.FULL), 2, 16, 16, -1, -1, 0, 0)],
                    dtype=schema.LAYERS)
    exp = build_expectation({}, rows)
    assert exp.source == "layers table" and exp.notes
    assert exp.get(0).window == 8 and exp.get(1).window is None
    bad = build_expectation({"model_type": "llama"}, rows)  # no layer count: not understood
    assert bad.source == "layers table" and "not understood" in bad.notes[0]


def test_mla_layout_is_taken_from_the_recorded_shapes():
    cfg = {"model_type": "deepseek_v3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
           "v_head_dim": 16, "vocab_size": 256}
    kv = np.zeros(2, dtype=schema.KV)
    kv["k_shape"] = [1, 1, 5, 32]
    assert build_expectation(cfg, EMPTY_LAYERS, kv).get(0).kind == "latent"
    kv["k_shape"] = [1, 4, 5, 24]
    assert build_expectation(cfg, EMPTY_LAYERS, kv).get(0).num_kv_heads == 4
