"""The KV-sharing rule exists once (geometry.kv_sharing_map): the recorder, reading a live
transformers config, and geometry, reading its to_dict(), find the same consumer -> producer map."""

from __future__ import annotations

import pytest

from kvtrace import geometry as geo

S, F = "sliding_attention", "full_attention"


def test_tail_consumers_read_the_last_producer_of_their_type():
    types = [S, S, F, S, S, F]
    assert geo.kv_sharing_map(6, num_shared=3, types=types) == {3: 1, 4: 1, 5: 2}
    assert geo.kv_sharing_map(6, num_shared=0, types=types) == {}  # control: no sharing


def test_modes_mark_the_consumers_and_store_is_not_one():
    types = [S, F, S, F]
    modes = [None, None, "reuse", "reuse"]
    assert geo.kv_sharing_map(4, modes=modes, types=types) == {2: 0, 3: 1}
    # "store" marks a producer (gemma4 assistants read it); it consumes nothing
    assert geo.kv_sharing_map(4, modes=["store", "store", "reuse", "reuse"], types=types) == {2: 0, 3: 1}


def test_without_layer_types_the_previous_layer_produces():
    assert geo.kv_sharing_map(4, num_shared=2) == {2: 1, 3: 1}


def test_strict_refuses_layouts_without_producers():
    with pytest.raises(ValueError, match="leaves no producer"):
        geo.kv_sharing_map(2, num_shared=2, types=[F, F], strict=True)
    with pytest.raises(ValueError, match="no producer of the same type"):
        geo.kv_sharing_map(3, num_shared=1, types=[S, S, F], strict=True)
    assert geo.kv_sharing_map(3, num_shared=1, types=[S, S, F]) == {}  # lenient: left out


def test_recorder_and_config_dict_agree_on_a_real_gemma4_config():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from kvtrace.recorder.layouts import context_from_config

    cfg = transformers.AutoConfig.for_model(
        "gemma4_text", hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, global_head_dim=32, sliding_window=8, intermediate_size=64, vocab_size=128,
        layer_types=[S, S, F] * 2, num_kv_shared_layers=3)
    recorded = context_from_config(cfg).consumers
    model = geo.model_geometry(cfg.to_dict())
    from_dict = {g.index: g.shares_kv_with for g in model.layers if g.shares_kv_with is not None}
    assert recorded == from_dict == {3: 1, 4: 1, 5: 2}
