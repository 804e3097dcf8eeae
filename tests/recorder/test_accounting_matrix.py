"""Byte-exact accounting across the model x cache-implementation matrix.

For every tiny model (random weights, real config classes) and every recorded step, the per-layer
bytes the recorder wrote must equal kvtrace.geometry's analytical expectation computed from the
config alone (heads x head dim x tokens x dtype size x 2, with the window, latent, sharing,
static-preallocation and per-layer head-dim rules), and the step totals must be their sums.
The expected token counts per step are derived here from the prompt length and step index,
independently of what the recorder read.
"""

from __future__ import annotations

import pytest
import torch
from rec_helpers import NEW, PROMPT, model, record_run, text

from kvtrace import geometry
from kvtrace.format.reader import Trace
from kvtrace.format.schema import LayerType
from kvtrace.format.validate import validate

FP8 = hasattr(__import__("transformers.cache_utils", fromlist=["x"]), "Fp8QuantizedLayer")

DYNAMIC = [
    "gpt_neox", "llama", "mistral", "qwen3", "gemma3_text", "gemma4_text", "gemma4_text_keqv",
    "gemma4_text_shared", "gpt_oss", "glm4_moe", "deepseek_v3", "t5",
]
CASES = [(name, "dynamic", 1) for name in DYNAMIC] + [
    ("mistral", "dynamic", 2),  # batch 2
    ("llama", "static", 1),
    ("gemma3_text", "static", 1),  # StaticSlidingWindowLayer + StaticLayer
    ("gemma4_text_shared", "static", 1),  # static + KV-shared consumers
    pytest.param("llama", "quantized_fp8", 1,
                 marks=pytest.mark.skipif(not FP8, reason="this transformers has no fp8 QuantizedCache")),
]

_KIND_TYPES = {
    ("dynamic", "full"): LayerType.FULL,
    ("dynamic", "sliding"): LayerType.SLIDING,
    ("dynamic", "chunked"): LayerType.CHUNKED,
    ("dynamic", "latent"): LayerType.LATENT,
    ("static", "full"): LayerType.STATIC,
    ("static", "sliding"): LayerType.STATIC_SLIDING,
    ("quantized_fp8", "full"): LayerType.QUANTIZED,
}


def _expected_type(kind: str, cache_kind: str) -> LayerType:
    if kind == "shared_consumer":
        return LayerType.SHARED_CONSUMER
    if kind == "cross_attention":
        return LayerType.CROSS_ATTENTION
    return _KIND_TYPES[(cache_kind, kind)]


@pytest.mark.parametrize(("name", "cache_kind", "batch"), CASES)
def test_per_layer_bytes_match_geometry(tmp_path, name, cache_kind, batch):
    m = model(name)
    gen: dict = {"batch": batch}
    if cache_kind == "static":
        gen["cache_implementation"] = "static"
        gen["disable_compile"] = True
    elif cache_kind == "quantized_fp8":
        gen["cache_implementation"] = "quantized"
        gen["cache_config"] = {"backend": "fp8"}
    path, rec = record_run(tmp_path, name, record_kwargs={"structure_every": 1}, **gen)  # every step
    assert rec.recorder_errors == 0, dict(rec.errors)
    report = validate(path)
    assert report.valid, report.problems

    geo = geometry.model_geometry(m.config.to_dict())
    enc_dec = geo.is_encoder_decoder
    dtype_bytes = 1 if cache_kind == "quantized_fp8" else 4
    max_len = geometry.generate_static_max_cache_len(PROMPT, NEW, is_encoder_decoder=enc_dec)

    with Trace(path) as t:
        kv, steps, layers = t.kv[:], t.steps[:], t.layers[:]
        names = [text(t, r["module_off"], r["module_len"]) for r in layers]

    n_layers = len(geo.layers)
    assert len(layers) == n_layers
    assert sorted(set(steps["step"].tolist())) == list(range(NEW))  # one row per forward
    assert len(kv) == NEW * n_layers
    for i, g in enumerate(geo.layers):
        row = layers[layers["layer"] == i][0]
        assert row["layer_type"] == _expected_type(g.kind, cache_kind), (i, g.kind)
        assert row["shared_from"] == (g.shares_kv_with if g.shares_kv_with is not None else -1)
        assert row["num_kv_heads"] == g.num_kv_heads and row["k_head_dim"] == g.k_head_dim
        assert row["v_head_dim"] == g.v_head_dim
        assert names[i], f"layer {i} has no attention module name"
    if enc_dec:
        assert any("EncDec" in n for n in names[geo.num_hidden_layers:]), names

    for step in range(NEW):
        seen_self = (step + 1) if enc_dec else PROMPT + step
        last = 1 if (enc_dec or step > 0) else PROMPT
        rows = kv[kv["step"] == step]
        tot_alloc = tot_valid = 0
        for i, g in enumerate(geo.layers):
            r = rows[rows["layer"] == i]
            assert len(r) == 1, (step, i)
            r = r[0]
            seen = seen_self
            kw = dict(encoder_len=PROMPT if enc_dec else None, last_step_tokens=last)
            alloc, valid = geometry.layer_kv_bytes(g, seen, dtype_bytes, batch, cache_kind, max_len, **kw)
            kept = geometry.kept_tokens(g, seen, cache_kind, max_len, encoder_len=kw["encoder_len"])
            where = f"{name}/{cache_kind} step {step} layer {i} ({g.kind})"
            assert r["bytes_allocated"] == alloc, where
            assert r["bytes_valid"] == valid, where
            assert r["bytes_unique"] == alloc, where  # nothing aliases across layers here
            if g.kind == "cross_attention":
                assert r["tokens_kept"] == PROMPT, where
            else:
                assert r["tokens_seen"] == seen, where
                assert r["tokens_kept"] == kept, where
            if g.kind == "latent":
                mla = g.mla
                exp = batch * kept * mla.num_attention_heads * (mla.qk_head_dim + mla.v_head_dim) * 4
                assert r["expanded_bytes"] == exp, where
            else:
                assert r["expanded_bytes"] == 0, where
            if g.kind != "shared_consumer":
                assert r["k_shape"][0] == batch and r["k_shape"][1] == g.num_kv_heads, where
                assert r["k_shape"][3] == g.k_head_dim and r["v_shape"][3] == g.v_head_dim, where
                assert r["k_storage"] != 0 and r["v_storage"] != 0, where
            else:  # a consumer reports its producer's storage but owns none of it
                prod = rows[rows["layer"] == g.shares_kv_with][0]
                assert r["k_storage"] == prod["k_storage"], where
            tot_alloc += alloc
            tot_valid += valid
        srow = steps[steps["step"] == step][0]
        assert srow["kv_bytes_unique"] == tot_alloc
        assert srow["kv_bytes_naive"] == tot_alloc
        assert srow["kv_bytes_valid"] == tot_valid
        assert srow["tokens_seen"] == seen_self
        assert srow["phase"] == (0 if step == 0 else 1)


def test_sliding_storage_exceeds_view_after_prefill(tmp_path):
    """The honest detail a naive numel count misses: right after a prefill longer than the window,
    a DynamicSlidingWindowLayer keeps window-1 tokens as a view into the whole-prompt tensor."""
    path, _ = record_run(tmp_path, "mistral", new=2)
    with Trace(path) as t:
        r = t.kv[:][0]
    assert r["tokens_kept"] == 7 and r["k_shape"][2] == 7
    per_token = 2 * 16 * 4  # kv heads x head dim x fp32
    assert r["k_storage_bytes"] == PROMPT * per_token
    assert r["bytes_valid"] == 2 * 7 * per_token
    assert r["bytes_allocated"] == 2 * PROMPT * per_token


def test_dtype_and_device_columns(tmp_path):
    m = model("llama", torch.bfloat16)
    path = tmp_path / "bf16.kvt.h5"
    from rec_helpers import generate

    import kvtrace

    with kvtrace.record(m, path):
        generate(m, new=3)
    with Trace(path) as t:
        kv = t.kv[:]
    assert set(kv["k_dtype"].tolist()) == {3} and set(kv["v_dtype"].tolist()) == {3}  # BFLOAT16
    assert set(kv["device"].tolist()) == {-1}
    g = geometry.model_geometry(m.config.to_dict()).layers[0]
    assert kv[-1]["bytes_allocated"] == geometry.layer_kv_bytes(g, PROMPT + 2, 2)[0]
