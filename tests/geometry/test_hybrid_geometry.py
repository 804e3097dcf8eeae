"""kvtrace.geometry.hybrid against transformers: which layers hold state, and how many bytes.

Three references, none of them kvtrace's own reader:

* the plan: for every causal-LM model type of the installed transformers whose ``DynamicCache``
  (built from its default config) holds linear-attention layers (``LinearAttentionCacheLayerMixin``,
  by type), the layers kvtrace says hold state are exactly those, or kvtrace refuses with a reason;
* the shapes: where the full-size default model runs one forward on the meta device (no memory),
  every state tensor's shape equals the prediction;
* the bytes: every tiny hybrid of tests.helpers.models, generated in bfloat16 on the CPU, holds
  exactly the predicted state (recurrent states in float32) and KV, layer by layer.
"""

from __future__ import annotations

import inspect
import math
import warnings

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from kvtrace import geometry as G  # noqa: E402
from kvtrace.geometry.hybrid import state_geometry  # noqa: E402
from tests.helpers.models import TINY_HYBRID_NAMES, tiny_model, tiny_prompt  # noqa: E402

cu = pytest.importorskip("transformers.cache_utils")
MIXIN = getattr(cu, "LinearAttentionCacheLayerMixin", None)
pytestmark = pytest.mark.skipif(MIXIN is None, reason="this transformers has no linear-attention cache layers")


def _hybrid_types() -> dict[str, object]:
    """model_type -> default config, for the causal LMs whose DynamicCache holds linear-attention layers."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        for mt in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
            try:
                cfg = AutoConfig.for_model(mt)
                cache = cu.DynamicCache(config=cfg.get_text_config(decoder=True))
            except Exception:  # noqa: BLE001 - configs that cannot be built bare are out of scope
                continue
            if any(isinstance(layer, MIXIN) for layer in cache.layers):
                out[mt] = cfg
    return out


@pytest.fixture(scope="module")
def hybrids() -> dict[str, object]:
    return _hybrid_types()


def test_state_layers_are_the_linear_attention_layers(hybrids):
    supported, refused = [], {}
    for mt, cfg in hybrids.items():
        text = cfg.get_text_config(decoder=True)
        cache = cu.DynamicCache(config=text)
        # 5.17 builds a (never filled) linear-attention layer for Nemotron-H's MLP / MoE layers too:
        # the config class's own layer types say which layers are mixers
        own = list(getattr(text, "layer_types", None) or [])
        expected = [i for i, layer in enumerate(cache.layers) if isinstance(layer, MIXIN)
                    and not (i < len(own) and own[i] in ("mlp", "moe"))]
        try:
            sg = state_geometry(cfg.to_dict())
        except ValueError as exc:
            refused[mt] = str(exc)
            continue
        assert sg is not None, mt
        assert [s.layer for s in sg.layers] == expected, mt
        supported.append(mt)
    assert len(supported) >= 20, (supported, refused)
    for must in ("qwen3_next", "falcon_h1", "jamba", "bamba", "zamba2", "nemotron_h", "granitemoehybrid", "kimi_linear",
                 "minimax", "mamba2"):
        assert must in supported, (must, refused.get(must))
    for mt, reason in refused.items():
        assert len(reason) > 40 and mt in reason, (mt, reason)  # a sentence naming the model and why


def test_attention_only_models_hold_no_state():
    from transformers import AutoConfig

    for mt in ("llama", "gpt_oss", "deepseek_v3", "gemma3_text"):
        assert state_geometry(AutoConfig.for_model(mt).to_dict()) is None


def _meta_states(cfg) -> dict[int, list[tuple[int, ...]]] | None:
    """layer -> state tensor shapes (batch dropped) after one meta-device forward of the full-size
    default model; None when that model cannot run on the meta device (data-dependent MoE routing)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, experts_implementation="eager")
        cache = cu.DynamicCache(config=cfg.get_text_config(decoder=True))
        ids = torch.zeros((1, 5), dtype=torch.long, device="meta")
        # the argument's name: cache (5.24), else cache_params (5.17 Mamba models) or past_key_values
        params = inspect.signature(model.forward).parameters
        name = next(n for n in ("cache", "cache_params", "past_key_values") if n in params)
        model(input_ids=ids, use_cache=True, **{name: cache})
    except Exception:  # noqa: BLE001 - not every model runs on meta tensors
        return None
    out: dict[int, list[tuple[int, ...]]] = {}
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, MIXIN):
            for states in (layer.conv_states, layer.recurrent_states):
                out.setdefault(i, []).extend(tuple(t.shape[1:]) for t in states.values() if t is not None)
    return out


@pytest.mark.slow
def test_state_shapes_at_full_size_on_the_meta_device(hybrids):
    compared = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mt, cfg in hybrids.items():
            try:
                sg = state_geometry(cfg.to_dict())
            except ValueError:
                continue
            got = _meta_states(cfg)
            if got is None or not any(got.values()):
                continue
            predicted = {s.layer: sorted(t.shape for t in s.tensors) for s in sg.layers}
            assert {k: sorted(v) for k, v in got.items()} == predicted, mt
            compared.append(mt)
    # qwen3_5, olmo_hybrid, zamba, zamba2, falcon_h1, mamba, mamba2, falcon_mamba... (5.24: 9, 5.17: 7)
    assert len(compared) >= 5, compared


@pytest.mark.parametrize("name", TINY_HYBRID_NAMES)
def test_tiny_hybrid_state_and_kv_bytes_in_bf16(name):
    """Generated in bfloat16 (batch 2): state bytes per layer = batch x prediction (conv in bf16,
    recurrent in float32), KV bytes per attention layer = kvtrace.geometry's."""
    prompt, new, batch = 7, 3, 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_model(name, dtype=torch.bfloat16)
        out = model.generate(tiny_prompt(prompt, batch=batch), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, return_dict_in_generate=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    config = model.config.to_dict()
    sg = state_geometry(config)
    held: dict[int, int] = {}
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, MIXIN):
            for states in (layer.conv_states, layer.recurrent_states):
                for t in states.values():
                    if t is not None:
                        held[i] = held.get(i, 0) + t.nbytes
    for i, t in enumerate(getattr(cache, "linear_cache", None) or ()):  # MiniMaxCache
        if isinstance(t, torch.Tensor):
            held[i] = held.get(i, 0) + t.nbytes
    assert held == {k: batch * v for k, v in sg.per_layer(2).items()}
    kinds = {t.kind for s in sg.layers for t in s.tensors}
    assert kinds <= {"conv", "recurrent", "other"} and math.prod(sg.layers[0].tensors[0].shape) > 0
    geom = G.model_geometry(config)
    predicted = G.kv_bytes(geom, G.cache_tokens_after_generate(prompt, new), 2, batch=batch).per_layer
    for i, layer in enumerate(cache.layers):
        keys = getattr(layer, "keys", None)
        kv = keys.nbytes + layer.values.nbytes if isinstance(keys, torch.Tensor) and keys.numel() else 0
        assert kv == predicted[i][0], (name, i)
