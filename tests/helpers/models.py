"""Tiny random-weight models with real KV geometry, for tests across kvtrace.

Every model here is built from a real transformers config class (``AutoConfig.for_model``) with
small overrides: hidden 64, vocab 256, 2-6 layers, 2-4 KV heads and a sliding window of 8 so that
window saturation happens within ~10 generated tokens. Nothing is downloaded. Weights are seeded
(``torch.manual_seed(seed)`` right before construction), so two builds give identical models.

Stable API (recorder, analyser and geometry tests rely on it):

* ``TINY_MODEL_NAMES``: the supported names.
* ``TINY_HYBRID_NAMES``: hybrid models whose cache holds conv / recurrent state beside the KV
  (qwen3_next, falcon_h1, jamba, lfm2, minimax, Mamba-2 hybrids, kimi_linear); built the same way.
* ``tiny_config_dict(name)``: the override dict (plain python, no torch/transformers import).
* ``tiny_config(name)``: a ``PretrainedConfig``.
* ``tiny_model(name, dtype=torch.float32, seed=0)``: an eval-mode ``*ForCausalLM`` (or
  ``T5ForConditionalGeneration`` for ``"t5"``).
* ``TINY_WINDOW``: the sliding window used by every windowed tiny model.
* ``tiny_prompt(length, batch=1, seed=0)``: deterministic prompt ids.
* ``cache_tensor_bytes(cache)``: measured ``(allocated, valid)`` bytes per cache layer.

torch and transformers are imported lazily, inside the functions, so importing this module is free.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

TINY_WINDOW = 8
TINY_VOCAB = 256

# Token ids all < TINY_VOCAB; generate() with min_new_tokens == max_new_tokens never stops early.
_TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}

_SWA = "sliding_attention"
_FULL = "full_attention"

# name -> (model_type, overrides). Keep the names stable: other modules and tests use them.
_TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt_neox": (
        "gpt_neox",
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=256),
    ),
    "llama": (
        "llama",
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=128, max_position_embeddings=256),
    ),
    "mistral": (
        "mistral",
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=128, max_position_embeddings=256, sliding_window=TINY_WINDOW),
    ),
    "qwen3": (
        "qwen3",
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=128, max_position_embeddings=256),
    ),
    "gemma3_text": (
        "gemma3_text",
        dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=128, max_position_embeddings=256, sliding_window=TINY_WINDOW,
             layer_types=[_SWA, _SWA, _FULL]),
    ),
    "gemma4_text": (
        "gemma4_text",
        dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, global_head_dim=32, intermediate_size=128, max_position_embeddings=256,
             sliding_window=TINY_WINDOW, layer_types=[_SWA, _SWA, _FULL],
             vocab_size_per_layer_input=TINY_VOCAB, hidden_size_per_layer_input=8),
    ),
    # Full layers share the K and V projection (attention_k_eq_v) and use num_global_key_value_heads.
    "gemma4_text_keqv": (
        "gemma4_text",
        dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
             intermediate_size=128, max_position_embeddings=256, sliding_window=TINY_WINDOW,
             layer_types=[_SWA, _SWA, _FULL],
             vocab_size_per_layer_input=TINY_VOCAB, hidden_size_per_layer_input=8),
    ),
    # Layers 3..5 reuse the KV of layer 1 (last sliding producer) and layer 2 (last full producer).
    "gemma4_text_shared": (
        "gemma4_text",
        dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, global_head_dim=32, intermediate_size=128, max_position_embeddings=256,
             sliding_window=TINY_WINDOW, layer_types=[_SWA, _SWA, _FULL, _SWA, _SWA, _FULL],
             num_kv_shared_layers=3,
             vocab_size_per_layer_input=TINY_VOCAB, hidden_size_per_layer_input=8),
    ),
    "gpt_oss": (
        "gpt_oss",
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
             max_position_embeddings=256, sliding_window=TINY_WINDOW, layer_types=[_SWA, _FULL],
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    ),
    "glm4_moe": (
        "glm4_moe",
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4,
             n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
             max_position_embeddings=256),
    ),
    "deepseek_v3": (
        "deepseek_v3",
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
             intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
             num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
             kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
             max_position_embeddings=256, rope_interleave=True),
    ),
    "t5": (
        "t5",
        dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
             relative_attention_num_buckets=8, relative_attention_max_distance=32, decoder_start_token_id=0),
    ),
    "bart": (
        "bart",
        dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
             encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64, decoder_start_token_id=2,
             forced_bos_token_id=None, forced_eos_token_id=None),
    ),
}

TINY_MODEL_NAMES: tuple[str, ...] = tuple(_TINY)

_LIN, _CONV = "linear_attention", "conv"

# Hybrid models: attention beside layers whose cache holds a constant-size conv / recurrent state
# (format 1.5 /state). Kept out of TINY_MODEL_NAMES (their state is not KV: the KV matrices over
# those names stay KV-only); each name is its model_type. Sizes as above, state dimensions small.
_TINY_HYBRID: dict[str, tuple[str, dict[str, Any]]] = {
    # gated delta-net layers (conv + recurrent state) and one full-attention layer
    "qwen3_next": ("qwen3_next", dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, max_position_embeddings=256, linear_conv_kernel_dim=4, linear_key_head_dim=8,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        layer_types=[_LIN, _LIN, _LIN, _FULL])),
    # every layer attention and Mamba-2 side by side (LinearAttentionAndFullAttentionLayer)
    "falcon_h1": ("falcon_h1", dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, max_position_embeddings=256, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
        mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16)),
    # Mamba-1 layers, attention every 4th from layer 2
    "jamba": ("jamba", dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        max_position_embeddings=256, attn_layer_period=4, attn_layer_offset=2, expert_layer_period=2,
        expert_layer_offset=1, num_experts=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
        use_mamba_kernels=False)),
    # short-convolution layers (conv state only)
    "lfm2": ("lfm2", dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        max_position_embeddings=256, layer_types=[_CONV, _FULL, _CONV, _FULL], conv_L_cache=3,
        block_multiple_of=16)),
    # lightning attention: its state lives in MiniMaxCache.linear_cache, not in a layer object
    "minimax": ("minimax", dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, max_position_embeddings=256, num_local_experts=2, block_size=16,
        layer_types=[_LIN, _FULL, _LIN, _FULL])),
    # Mamba-2 hybrids
    "bamba": ("bamba", dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        max_position_embeddings=256, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16)),
    "zamba2": ("zamba2", dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
        max_position_embeddings=256, layers_block_type=["mamba", "hybrid", "mamba", "mamba"], mamba_d_state=8,
        mamba_d_conv=4, mamba_expand=2, n_mamba_heads=4, mamba_ngroups=1, chunk_size=16, use_mamba_kernels=False,
        adapter_rank=8)),
    "nemotron_h": ("nemotron_h", dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, max_position_embeddings=256, layers_block_type=["mamba", "attention", "mamba", "mlp"],
        ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=16, n_groups=1, conv_kernel=4, expand=1, chunk_size=16,
        use_mamba_kernels=False)),
    "granitemoehybrid": ("granitemoehybrid", dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        max_position_embeddings=256, layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=4,
        mamba_d_head=32, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
        num_local_experts=2, shared_intermediate_size=32)),
    # kimi delta attention (conv + recurrent) beside MLA full attention
    "kimi_linear": ("kimi_linear", dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
        max_position_embeddings=256, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        linear_head_dim=16, linear_num_heads=4, moe_intermediate_size=32, num_local_experts=2,
        num_experts_per_tok=1, layer_types=[_LIN, _FULL, _LIN, _LIN])),
}
TINY_HYBRID_NAMES: tuple[str, ...] = tuple(_TINY_HYBRID)


def tiny_model_type(name: str) -> str:
    """The transformers ``model_type`` behind a tiny model name."""
    return _lookup(name)[0]


def tiny_config_dict(name: str) -> dict[str, Any]:
    """``AutoConfig.for_model`` overrides for ``name`` (includes ``model_type``); no torch needed."""
    model_type, overrides = _lookup(name)
    out = {"model_type": model_type, "vocab_size": TINY_VOCAB, **_TOKENS}
    out.update(copy.deepcopy(overrides))
    return out


def tiny_config(name: str, **extra: Any) -> PretrainedConfig:
    """A real transformers config for the tiny model ``name`` (``extra`` overrides win)."""
    from transformers import AutoConfig

    kwargs = tiny_config_dict(name)
    model_type = kwargs.pop("model_type")
    kwargs.update(extra)
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(name: str, dtype: torch.dtype | None = None, seed: int = 0, **extra: Any) -> PreTrainedModel:
    """Build the tiny random-weight model ``name`` in eval mode, deterministically seeded."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    cfg = tiny_config(name, **extra)
    dtype = torch.float32 if dtype is None else dtype
    torch.manual_seed(seed)
    if cfg.is_encoder_decoder:
        model = AutoModelForSeq2SeqLM.from_config(cfg, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval()
    model.generation_config.pad_token_id = _TOKENS["pad_token_id"]
    return model


def tiny_prompt(length: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    """Deterministic prompt ids ``[batch, length]`` in ``[3, TINY_VOCAB)`` (avoids bos/eos/pad)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, TINY_VOCAB, (batch, length), generator=gen)


def _layer_tensors(layer: Any) -> list[tuple[torch.Tensor, bool]]:
    """(tensor, is_payload) pairs; quantisation scales are not payload."""
    qk = getattr(layer, "_quantized_keys", None)
    if qk is not None:  # fp8 QuantizedCache: (payload, fp32 scale) for K and for V
        (k, ks), (v, vs) = qk, layer._quantized_values
        return [(k, True), (ks, False), (v, True), (vs, False)]
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    return [(t, True) for t in (keys, values) if t is not None and t.numel() > 0]


def cache_tensor_bytes(cache: Any) -> list[tuple[int, int]]:
    """Measured ``(allocated, valid)`` bytes of each cache layer, in ``kvtrace.geometry`` order.

    ``allocated`` sums the storages behind the layer's tensors, each storage counted once across the
    whole cache (deduplicated by ``untyped_storage().data_ptr()``); ``valid`` sums the tensors' own
    ``numel() * element_size()`` (quantisation scales count as allocated only; static layers count
    only the ``get_seq_length()`` tokens they hold, capped at ``max_cache_len``). For an ``EncoderDecoderCache`` the self-attention layers come first,
    then the cross-attention layers. KV-sharing consumers (``DummyLayer``) give ``(0, 0)``.
    """
    caches = [cache.self_attention_cache, cache.cross_attention_cache] if hasattr(
        cache, "self_attention_cache") else [cache]
    seen: set[int] = set()
    out = []
    for c in caches:
        for layer in c.layers:
            alloc = valid = 0
            cap = getattr(layer, "max_cache_len", None)  # static layers: preallocated to cap tokens
            held = min(int(layer.get_seq_length()), cap) if cap else None
            for t, payload in _layer_tensors(layer):
                if payload:
                    nbytes = t.numel() * t.element_size()
                    valid += nbytes if cap is None else nbytes // cap * held
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    alloc += storage.nbytes()
            out.append((alloc, valid))
    return out


def _lookup(name: str) -> tuple[str, dict[str, Any]]:
    try:
        return _TINY[name] if name in _TINY else _TINY_HYBRID[name]
    except KeyError:
        raise KeyError(f"unknown tiny model {name!r}; known: {', '.join(TINY_MODEL_NAMES + TINY_HYBRID_NAMES)}") from None
