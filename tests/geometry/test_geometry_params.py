"""param_count(config) == sum(p.numel() for p in model.parameters()), exactly, for supported families."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvtrace import geometry as G  # noqa: E402
from tests.helpers.models import TINY_MODEL_NAMES, tiny_config  # noqa: E402

SWA, FULL = "sliding_attention", "full_attention"

# Variants the tiny matrix does not cover: MoE gemma4 with k_eq_v, double-wide MLP on shared layers,
# MLA without q_lora, qwen2 qkv biases, glm4 qk-norm + biases, llama biases, gated untied t5.
EXTRA = {
    "gemma4_moe": ("gemma4_text", dict(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, intermediate_size=48,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24, vocab_size=256,
        vocab_size_per_layer_input=256, hidden_size_per_layer_input=0, sliding_window=8,
        layer_types=[SWA, SWA, FULL])),
    "gemma4_double_wide": ("gemma4_text", dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        global_head_dim=32, intermediate_size=48, use_double_wide_mlp=True, num_kv_shared_layers=2,
        vocab_size=256, vocab_size_per_layer_input=128, hidden_size_per_layer_input=8, sliding_window=8,
        layer_types=[SWA, FULL, SWA, FULL])),
    "deepseek_v2_lite_like": ("deepseek_v2", dict(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128,
        moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=2, num_experts_per_tok=2,
        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, vocab_size=256, n_group=1, topk_group=1)),
    "qwen2": ("qwen2", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=96, vocab_size=256, tie_word_embeddings=True)),
    "glm4_moe_qknorm_bias": ("glm4_moe", dict(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, use_qk_norm=True, attention_bias=True, vocab_size=256)),
    "llama_biases": ("llama", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=1, intermediate_size=96, vocab_size=256,
                                   attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    "t5_gated_untied": ("t5", dict(d_model=64, d_kv=8, d_ff=96, num_layers=3, num_decoder_layers=2, num_heads=4,
                                   vocab_size=256, feed_forward_proj="gated-gelu", tie_word_embeddings=False)),
}


def _count(cfg) -> int:
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    auto = AutoModelForSeq2SeqLM if cfg.is_encoder_decoder else AutoModelForCausalLM
    with torch.device("meta"):  # shapes only: no memory, no init time
        model = auto.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        yield


@pytest.mark.parametrize("name", TINY_MODEL_NAMES)
def test_tiny_models_exact(name):
    cfg = tiny_config(name)
    pc = G.param_count(cfg.to_dict())
    assert pc.exact
    assert pc.total == _count(cfg)


@pytest.mark.parametrize("name", sorted(EXTRA))
def test_variants_exact(name):
    from transformers import AutoConfig

    model_type, kw = EXTRA[name]
    cfg = AutoConfig.for_model(model_type, **kw)
    pc = G.param_count(cfg.to_dict())
    assert pc.exact and pc.total == _count(cfg)


def test_unknown_family_is_an_estimate_within_a_few_percent():
    # olmo2 (not in the exact list): llama-like, q/k norms over the whole projection -> small error.
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("olmo2", hidden_size=512, num_hidden_layers=2, num_attention_heads=8,
                               num_key_value_heads=8, intermediate_size=1024, vocab_size=1024)
    pc = G.param_count(cfg.to_dict())
    assert not pc.exact
    assert abs(pc.total - _count(cfg)) / _count(cfg) < 0.02


def test_weight_bytes():
    cfg = tiny_config("llama").to_dict()
    assert G.weight_bytes(cfg, 2) == 2 * G.param_count(cfg).total
    assert G.weight_bytes(cfg, 0.5) == (G.param_count(cfg).total + 1) // 2
    assert G.param_count(cfg).to_dict()["total"] == G.param_count(cfg).total
