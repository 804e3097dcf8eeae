"""Analytical cache bytes == real transformers cache tensors, byte for byte (tiny random models, CPU)."""

from __future__ import annotations

import importlib.util
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvtrace import geometry as G  # noqa: E402
from tests.helpers.hfcache import cache_kwargs, output_cache, padded_layers  # noqa: E402
from tests.helpers.models import (  # noqa: E402
    TINY_MODEL_NAMES,
    TINY_WINDOW,
    cache_tensor_bytes,
    tiny_config,
    tiny_model,
    tiny_prompt,
)

ENC_DEC = {"t5", "bart"}
SLIDING = {"mistral", "gemma3_text", "gemma4_text", "gemma4_text_keqv", "gemma4_text_shared", "gpt_oss"}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        yield


def _generate(model, prompt_len, new_tokens, **kw):
    out = model.generate(
        tiny_prompt(prompt_len), min_new_tokens=new_tokens, max_new_tokens=new_tokens, do_sample=False,
        return_dict_in_generate=True, **kw,
    )
    return output_cache(out)


def _geometry(model):
    return G.model_geometry(model.config.to_dict())


def _predict(geom, prompt_len, new_tokens, **kw):
    seen = G.cache_tokens_after_generate(prompt_len, new_tokens, is_encoder_decoder=geom.is_encoder_decoder)
    # generate's last forward is the prefill when only one token is generated (decoder-only)
    q = prompt_len if (new_tokens == 1 and not geom.is_encoder_decoder) else 1
    return G.kv_bytes(geom, seen, 4, encoder_len=prompt_len, last_step_tokens=q, **kw)


# prompt < window, prompt > window with one new token (prefill storage), prompt > window then decode
SCENARIOS = [(5, 12), (12, 1), (12, 4)]


@pytest.mark.parametrize("name", TINY_MODEL_NAMES)
def test_dynamic_cache_bytes_match(name):
    model = tiny_model(name)
    geom = _geometry(model)
    for prompt_len, new_tokens in SCENARIOS:
        cache = _generate(model, prompt_len, new_tokens)
        pred = _predict(geom, prompt_len, new_tokens)
        assert padded_layers(cache_tensor_bytes(cache), len(pred.per_layer)) == list(pred.per_layer), (prompt_len, new_tokens)


@pytest.mark.parametrize("name", TINY_MODEL_NAMES)
def test_layer_shapes_match(name):
    model = tiny_model(name)
    geom = _geometry(model)
    cache = _generate(model, 5, 12)
    layers = list(cache.self_attention_cache.layers) + list(cache.cross_attention_cache.layers) \
        if geom.is_encoder_decoder else list(cache.layers)
    layers += [None] * (len(geom.layers) - len(layers))  # KV-sharing consumers 5.17 leaves out
    assert len(layers) == len(geom.layers)
    seen = G.cache_tokens_after_generate(5, 12, is_encoder_decoder=geom.is_encoder_decoder)
    for layer, g in zip(layers, geom.layers, strict=True):
        if not g.stores_kv:
            assert layer is None or getattr(layer, "keys", None) is None
            continue
        kept = G.kept_tokens(g, seen, encoder_len=5)
        assert tuple(layer.keys.shape) == (1, g.num_kv_heads, kept, g.k_head_dim)
        assert tuple(layer.values.shape) == (1, g.num_kv_heads, kept, g.v_head_dim)
        # K and V are always two storages here, gemma4 attention_k_eq_v included
        assert layer.keys.untyped_storage().data_ptr() != layer.values.untyped_storage().data_ptr()
        assert g.kv_same_tensor is False
        # get_seq_length counts every token seen, also on sliding layers
        assert layer.get_seq_length() == (5 if g.kind == "cross_attention" else seen)


def test_sliding_layers_keep_window_minus_one():
    for name in sorted(SLIDING):
        geom = G.model_geometry(tiny_config(name).to_dict())
        assert any(g.window == TINY_WINDOW for g in geom)
    cache = _generate(tiny_model("gpt_oss"), 5, 12)
    assert tuple(cache.layers[0].keys.shape)[2] == TINY_WINDOW - 1
    assert cache.layers[0].keys.untyped_storage().nbytes() == TINY_WINDOW * 2 * 16 * 4  # view of window tokens


@pytest.mark.parametrize("name", ["mistral", "gpt_oss", "gemma4_text_shared", "deepseek_v3"])
@pytest.mark.parametrize("prompt_len", [3, 12])
def test_step_by_step_prefill_then_decode(name, prompt_len):
    """Drive forward() by hand and compare after the prefill and after every decode step."""
    from transformers import DynamicCache

    model = tiny_model(name)
    geom = _geometry(model)
    cache = DynamicCache(config=model.config)
    ids = tiny_prompt(prompt_len)
    with torch.no_grad():
        out = model(ids, use_cache=True, **cache_kwargs(model, cache))
        seen, step = prompt_len, prompt_len
        for _ in range(2 * TINY_WINDOW):
            pred = G.kv_bytes(geom, seen, 4, last_step_tokens=step)
            assert padded_layers(cache_tensor_bytes(cache), len(pred.per_layer)) == list(pred.per_layer), (seen, step)
            assert cache.get_seq_length() == seen
            nxt = out.logits[:, -1:].argmax(-1)
            out = model(nxt, use_cache=True, **cache_kwargs(model, cache))
            seen, step = seen + 1, 1


@pytest.mark.parametrize("name", TINY_MODEL_NAMES)
def test_static_cache_bytes_match(name):
    model = tiny_model(name)
    geom = _geometry(model)
    prompt_len, new_tokens = 5, 12
    cache = _generate(model, prompt_len, new_tokens, cache_implementation="static", disable_compile=True)
    assert type(cache.self_attention_cache if geom.is_encoder_decoder else cache).__name__ == "StaticCache"
    mcl = G.generate_static_max_cache_len(prompt_len, new_tokens, is_encoder_decoder=geom.is_encoder_decoder)
    pred = _predict(geom, prompt_len, new_tokens, cache_kind="static", max_cache_len=mcl)
    assert padded_layers(cache_tensor_bytes(cache), len(pred.per_layer)) == list(pred.per_layer)
    # a later, shorter call on the same model reuses the larger max_cache_len
    cache = _generate(model, 3, 2, cache_implementation="static", disable_compile=True)
    pred = _predict(geom, 3, 2, cache_kind="static", max_cache_len=mcl)
    assert padded_layers(cache_tensor_bytes(cache), len(pred.per_layer)) == list(pred.per_layer)


def test_static_sliding_layer_preallocates_min_window_max_len():
    model = tiny_model("gpt_oss")
    cache = _generate(model, 5, 12, cache_implementation="static", disable_compile=True)
    assert type(cache.layers[0]).__name__ == "StaticSlidingWindowLayer"
    assert cache.layers[0].keys.shape[2] == TINY_WINDOW  # min(8, 16)
    assert cache.layers[1].keys.shape[2] == 16
    model = tiny_model("gpt_oss")
    cache = _generate(model, 2, 3, cache_implementation="static", disable_compile=True)
    assert cache.layers[0].keys.shape[2] == 4  # min(8, 4)


def test_hybrid_cache_implementation_becomes_dynamic():
    cache = _generate(tiny_model("gpt_oss"), 5, 3, cache_implementation="hybrid", disable_compile=True)
    assert type(cache).__name__ == "DynamicCache"


FP8_OK = ["llama", "qwen3", "gpt_neox", "glm4_moe", "deepseek_v3"]


@pytest.mark.parametrize("name", FP8_OK)
def test_quantized_fp8_cache_bytes_match(name):
    try:
        from transformers.cache_utils import QuantizedCache

        QuantizedCache(backend="fp8", config=tiny_config(name))
    except (ValueError, TypeError, ImportError) as exc:  # the fp8 backend arrived after 5.17
        pytest.skip(f"transformers {transformers.__version__} has no fp8 QuantizedCache backend: {exc}")
    model = tiny_model(name)
    geom = _geometry(model)
    for prompt_len, new_tokens in [(5, 12), (12, 1)]:
        cache = _generate(model, prompt_len, new_tokens, cache_implementation="quantized",
                          cache_config={"backend": "fp8"})
        assert type(cache).__name__ == "QuantizedCache"
        seen = G.cache_tokens_after_generate(prompt_len, new_tokens)
        pred = G.kv_bytes(geom, seen, 1, cache_kind="quantized_fp8")
        assert padded_layers(cache_tensor_bytes(cache), len(pred.per_layer)) == list(pred.per_layer)


def test_quantized_cache_refuses_sliding_and_encoder_decoder():
    with pytest.raises(ValueError):
        _generate(tiny_model("gpt_oss"), 5, 2, cache_implementation="quantized", cache_config={"backend": "fp8"})
    with pytest.raises(ValueError):
        _generate(tiny_model("t5"), 5, 2, cache_implementation="quantized", cache_config={"backend": "fp8"})


@pytest.mark.parametrize(("backend", "module"), [("quanto", "optimum.quanto"), ("hqq", "hqq")])
def test_group_wise_quantized_backends_need_extra_packages(backend, module):
    # Not modelled by kvtrace.geometry. Where optimum-quanto is installed (the test extra), the
    # recorder's quanto accounting is checked against its own analytic model in
    # tests/recorder/test_quanto_cache.py.
    try:
        installed = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package (optimum) is absent
        installed = False
    if installed:
        pytest.skip(f"{backend} is installed here; kvtrace.geometry does not model its layout")
    with pytest.raises(ImportError):
        _generate(tiny_model("llama"), 5, 2, cache_implementation="quantized", cache_config={"backend": backend})


def test_batch_and_bf16():
    model = tiny_model("gemma4_text_shared", dtype=torch.bfloat16)
    geom = _geometry(model)
    out = model.generate(tiny_prompt(6, batch=3), min_new_tokens=10, max_new_tokens=10, do_sample=False,
                         return_dict_in_generate=True)
    pred = G.kv_bytes(geom, G.cache_tokens_after_generate(6, 10), 2, batch=3)
    assert padded_layers(cache_tensor_bytes(output_cache(out)), len(pred.per_layer)) == list(pred.per_layer)


def test_tiny_models_are_deterministic():
    a, b = tiny_model("llama"), tiny_model("llama")
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    with pytest.raises(KeyError):
        tiny_config("nope")


def test_gemma3n_kv_sharing_matches():
    # gemma3n (not in the tiny matrix: slower to build) shares KV like gemma4
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "gemma3n_text", hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, vocab_size=256, vocab_size_per_layer_input=256,
        hidden_size_per_layer_input=8, sliding_window=TINY_WINDOW, num_kv_shared_layers=2, laurel_rank=8,
        layer_types=["sliding_attention", "full_attention"] * 2, activation_sparsity_pattern=[0.0] * 4,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    geom = G.model_geometry(cfg.to_dict())
    assert [g.shares_kv_with for g in geom] == [None, None, 0, 1]
    cache = _generate(model, 5, 12)
    pred = G.kv_bytes(geom, 16, 4)
    assert padded_layers(cache_tensor_bytes(cache), len(pred.per_layer)) == list(pred.per_layer)
    assert not G.param_count(cfg.to_dict()).exact  # AltUp / LAuReL are not in the formula
