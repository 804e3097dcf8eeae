"""One expected-KV rule: the report's KV check, the analyser's expectation and the scalar geometry
calls answer from the same place, including the MLA layout a recording used."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtrace import geometry as geo
from kvtrace.analyzer.expect import build_expectation
from kvtrace.format.reader import open_trace
from kvtrace.report.kvcheck import check_kv
from tests.helpers.synth import Req, SynthTrace

DEEPSEEK = {
    "model_type": "deepseek_v3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
    "v_head_dim": 16, "vocab_size": 256,
}


def _mla_trace(path: Path, mode: str) -> Path:
    s = SynthTrace(path, DEEPSEEK)
    s.model = geo.model_geometry(DEEPSEEK, mla_cache=mode)  # rows shaped like this layout's cache
    s.request(Req(prompt=5, new=4))
    return s.close()


@pytest.mark.parametrize("mode", ["latent", "expanded"])
def test_kv_check_reads_the_mla_layout_like_the_analyser(tmp_path, mode):
    path = _mla_trace(tmp_path / f"{mode}.kvt.h5", mode)
    with open_trace(path) as t:
        check = check_kv(t)
        exp = build_expectation(t.meta.model_config, t.layers[:], t.kv[:][:64])
    # Both layouts predicted exactly (before the KV check used the latent layout only, and the
    # expanded recording mismatched on every step); the analyser picks the same layout.
    assert check.checked == 4 and check.equal == 4, check.first_mismatch
    assert exp.model is not None and exp.model.mla_cache == mode


def test_mla_mode_defaults_to_latent():
    assert geo.mla_cache_mode(DEEPSEEK) == "latent"
    assert geo.mla_cache_mode(DEEPSEEK, np.array([0, 0])) == "latent"  # nothing recorded
    assert geo.mla_cache_mode(DEEPSEEK, np.array([4, 4, 1])) == "expanded"
    assert geo.mla_cache_mode({"model_type": "llama"}, np.array([4, 4])) == "latent"  # not MLA


def test_array_rule_equals_scalar_calls_elementwise():
    """geometry.layer_bytes over a column equals layer_kv_bytes called once per element."""
    cfg = {"model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8, "vocab_size": 256}
    g = geo.model_geometry(cfg).layers[0]
    seen = np.arange(0, 40)
    last = np.where(seen > 20, 1, np.maximum(seen, 1))
    static = seen % 3 == 0
    alloc, valid, overflow = geo.layer_bytes(g, seen, 2, 2, 3, static=static, capacity=30, last_step_tokens=last)
    assert not overflow.any()  # a sliding static layer never overflows: it keeps the window
    for i, s in enumerate(seen):
        kind = "static" if static[i] else "dynamic"
        want = geo.layer_kv_bytes(g, int(s), 2, 3, kind, 30 if static[i] else None, last_step_tokens=int(last[i]))
        assert (int(alloc[i]), int(valid[i])) == want
    # the sliding rule is really exercised: storage beyond the kept window during a long prefill
    assert int(alloc[20]) > int(valid[20]) > 0


def test_static_full_layer_past_capacity_has_no_size():
    g = geo.model_geometry({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1,
                            "num_attention_heads": 4, "vocab_size": 8}).layers[0]
    _, _, overflow = geo.layer_bytes(g, np.array([10, 11]), 2, 2, static=True, capacity=10)
    assert overflow.tolist() == [False, True]
    with pytest.raises(ValueError, match="do not fit"):
        geo.layer_kv_bytes(g, 11, 2, 1, "static", 10)

