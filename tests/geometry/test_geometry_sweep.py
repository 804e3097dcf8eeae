"""Every causal-LM architecture of the installed transformers: our layer plan (which layers hold KV,
with which window) equals the one transformers builds its DynamicCache from, or we refuse clearly."""

from __future__ import annotations

import warnings

import pytest

transformers = pytest.importorskip("transformers")

from kvtrace import geometry as G  # noqa: E402

_NO_KV = {"dummy", "linear_attention", "conv"}
_WINDOWED = {"sliding_attention", "chunked_attention", "hybrid_sliding"}


def _transformers_plan(cfg):
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, kwargs = get_layer_types_and_kwargs(cfg.get_text_config(decoder=True))
    plan = []
    for t, kw in zip(types, kwargs, strict=True):
        if t in _NO_KV:
            plan.append(("none", None))
        elif t in _WINDOWED:
            plan.append(("kv", kw["sliding_window"]))
        elif t in ("full_attention", "hybrid"):
            plan.append(("kv", None))
        else:
            return None  # a layer kind we do not model (checked to be refused below)
    return plan


def test_layer_plan_matches_transformers_for_all_causal_lms():
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    supported, refused, mismatched = [], [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        for mt in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
            try:
                cfg = AutoConfig.for_model(mt)
                expected = _transformers_plan(cfg)
            except Exception:  # noqa: BLE001 - configs that cannot be built bare are out of scope
                continue
            try:
                geom = G.model_geometry(cfg.to_dict())
            except ValueError:
                refused.append(mt)
                continue
            got = [("none", None) if not g.stores_kv else ("kv", g.window) for g in geom.decoder_layers]
            if expected is None or got != expected:
                mismatched.append(mt)
            else:
                supported.append(mt)
    assert not mismatched, mismatched
    assert len(supported) >= 120
    for must in ("llama", "mistral", "gpt_oss", "gemma3_text", "gemma4_text", "deepseek_v3", "qwen3"):
        assert must in supported
