"""Built-in architecture presets: the real KV geometry of well-known models, as config overrides.

Each preset is a plain dict of ``AutoConfig.for_model(model_type, **overrides)`` keyword arguments
that spells out every field the KV geometry and the parameter count depend on (so that
:func:`preset_geometry` and ``kvtrace calc`` work without transformers). Random-weight models built
from them reproduce the real cache layout exactly; no weights are downloaded.

Shrinking (:func:`preset_config` with ``layers`` / ``width_scale`` / ``vocab``) keeps the KV geometry
of the layers that remain (KV heads, head dims, window, MLA latent dims, query heads) and the
layer-type pattern; it shrinks depth, hidden size, MLP/expert widths, expert count and vocabulary.

Only this module's builder functions import torch/transformers, lazily.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtrace import geometry as _geometry

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

SWA, FULL = "sliding_attention", "full_attention"


def _pattern(n: int, period: int, *, last_full: bool = False) -> list[str]:
    """``period - 1`` sliding layers then one full layer, repeated (gemma style)."""
    types = [SWA if (i + 1) % period else FULL for i in range(n)]
    if last_full:
        types[-1] = FULL
    return types


@dataclass(frozen=True)
class Preset:
    """A named architecture: ``model_type`` plus config overrides, with where the values come from."""

    name: str
    description: str
    model_type: str
    overrides: Mapping[str, Any]
    source: str
    aliases: tuple[str, ...] = field(default=())
    # default depth when shrinking for tests: the shortest prefix showing every layer kind
    tiny_layers: int = 2
    # how the released checkpoint stores its weights, by part ("default", "attention", "mlp"):
    # what `kvtrace calc` counts unless told otherwise (kvtrace.calc.WEIGHT_DTYPE_BYTES names)
    weight_dtypes: Mapping[str, str] = field(default_factory=lambda: {"default": "bf16"})
    # parameters of the transformers model these overrides build (meta device), where
    # kvtrace.geometry.param_count has no exact formula for the family (hybrid models' state mixers):
    # what `kvtrace calc --preset` counts (tests/geometry/test_presets.py checks it against transformers)
    params: int | None = None

    def config_dict(self) -> dict[str, Any]:
        """``{"model_type": ..., **overrides}`` (a deep copy): what the geometry functions accept."""
        return {"model_type": self.model_type, **copy.deepcopy(dict(self.overrides))}


_PRESETS: dict[str, Preset] = {}


def _add(p: Preset) -> None:
    _PRESETS[p.name] = p


_add(Preset(
    "pythia-1.4b", "EleutherAI Pythia 1.4B: GPT-NeoX, MHA, 16 heads x 128, 24 layers", "gpt_neox",
    dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=16,
         vocab_size=50304, max_position_embeddings=2048, layer_norm_eps=1e-5, hidden_act="gelu",
         use_parallel_residual=True, attention_bias=True, tie_word_embeddings=False,
         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
         bos_token_id=0, eos_token_id=0),
    "EleutherAI/pythia-1.4b config.json (rotary_pct 0.25)", weight_dtypes={"default": "fp16"},
))
_add(Preset(
    "llama-3.1-8b", "Meta Llama 3.1 8B: GQA 32 query / 8 KV heads x 128, 32 layers", "llama",
    dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
         num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
         rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
         bos_token_id=128000, eos_token_id=128001),
    "meta-llama/Llama-3.1-8B config.json",
))
_add(Preset(
    "mistral-7b-v0.1", "Mistral 7B v0.1: GQA 32/8 x 128, 4096-token sliding window on every layer", "mistral",
    dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
         num_key_value_heads=8, head_dim=128, vocab_size=32000, max_position_embeddings=32768,
         sliding_window=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=1, eos_token_id=2),
    "mistralai/Mistral-7B-v0.1 config.json",
))
_add(Preset(
    "qwen3-8b", "Qwen3 8B: GQA 32/8 x 128, q/k norms, 36 full-attention layers", "qwen3",
    dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
         num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
         rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, use_sliding_window=False,
         layer_types=[FULL] * 36, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
         bos_token_id=151643, eos_token_id=151645),
    "Qwen/Qwen3-8B config.json",
))
_add(Preset(
    "gemma-3-4b", "Gemma 3 4B (text tower): 8 query / 4 KV heads x 256, 5 local (window 1024) : 1 global",
    "gemma3_text",
    dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
         num_key_value_heads=4, head_dim=256, vocab_size=262208, max_position_embeddings=131072,
         sliding_window=1024, layer_types=_pattern(34, 6), query_pre_attn_scalar=256,
         rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
         rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                          "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
         pad_token_id=0, bos_token_id=2, eos_token_id=1),
    "google/gemma-3-4b-it config.json, text_config", tiny_layers=6,
))
_add(Preset(
    "gemma-4-e2b", "Gemma 4 E2B (text tower): 8 query / 1 KV head, 256 local / 512 global head dim, "
    "window 512, 4 local : 1 global, last 20 layers reuse earlier KV, per-layer embeddings",
    "gemma4_text",
    dict(hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8,
         num_key_value_heads=1, head_dim=256, global_head_dim=512, attention_k_eq_v=False,
         vocab_size=262144, vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256,
         num_kv_shared_layers=20, use_double_wide_mlp=True, sliding_window=512,
         layer_types=_pattern(35, 5, last_full=True), max_position_embeddings=131072, rms_norm_eps=1e-6,
         final_logit_softcapping=30.0, tie_word_embeddings=True, attention_bias=False,
         enable_moe_block=False, pad_token_id=0, bos_token_id=2, eos_token_id=1),
    "google/gemma-4-E2B-it config.json text_config, as reproduced in public configs/tests (not "
    "downloaded here); transformers 5.23 Gemma4TextConfig", tiny_layers=10,
))
_add(Preset(
    "gemma-4-26b-a4b", "Gemma 4 26B-A4B (text tower): 16 query heads; local 8 KV x 256 (window 1024), "
    "global 2 KV x 512 with K=V projection; 5 local : 1 global; 128-expert MoE block",
    "gemma4_text",
    dict(hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16,
         num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=2,
         attention_k_eq_v=True, vocab_size=262144, vocab_size_per_layer_input=262144,
         hidden_size_per_layer_input=0, num_kv_shared_layers=0, sliding_window=1024,
         layer_types=_pattern(30, 6, last_full=True), enable_moe_block=True, num_experts=128,
         top_k_experts=8, moe_intermediate_size=704, max_position_embeddings=262144, rms_norm_eps=1e-6,
         final_logit_softcapping=30.0, tie_word_embeddings=True, attention_bias=False,
         pad_token_id=0, bos_token_id=2, eos_token_id=1),
    "google/gemma-4-26B-A4B-it config.json text_config, as reproduced in public configs (not downloaded "
    "here); transformers 5.23 Gemma4TextConfig / EP plan note 'num_global_key_value_heads=2'", tiny_layers=6,
))
for _name, _layers, _experts in (("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)):
    _add(Preset(
        _name, f"OpenAI {_name}: 64 query / 8 KV heads x 64, alternating sliding (window 128) / full, "
        f"{_layers} layers, {_experts} experts (top-4)", "gpt_oss",
        dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=_layers, num_attention_heads=64,
             num_key_value_heads=8, head_dim=64, sliding_window=128, layer_types=[SWA, FULL] * (_layers // 2),
             num_local_experts=_experts, num_experts_per_tok=4, vocab_size=201088,
             max_position_embeddings=131072, rms_norm_eps=1e-5, attention_bias=True, tie_word_embeddings=False,
             rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
             pad_token_id=199999, eos_token_id=200002),
        f"openai/{_name} config.json", weight_dtypes={"default": "bf16", "mlp": "mxfp4"},
    ))
_add(Preset(
    "glm-4.5-air", "Zhipu GLM-4.5-Air: 96 query / 8 KV heads x 128, 46 layers (1 dense + 45 MoE, 128 experts)",
    "glm4_moe",
    dict(hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=46,
         num_attention_heads=96, num_key_value_heads=8, head_dim=128, n_routed_experts=128, n_shared_experts=1,
         num_experts_per_tok=8, first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True,
         routed_scaling_factor=1.0, vocab_size=151552, max_position_embeddings=131072, attention_bias=True,
         use_qk_norm=False, rms_norm_eps=1e-5, tie_word_embeddings=False,
         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
         pad_token_id=151329, eos_token_id=151329),
    "zai-org/GLM-4.5-Air config.json (MTP layer not instantiated by transformers)", aliases=("glm-4.5",),
))
_add(Preset(
    "deepseek-v3", "DeepSeek-V3: MLA (latent 512 + rope 64 cached per token), 128 heads, 61 layers "
    "(3 dense + 58 MoE, 256 experts)", "deepseek_v3",
    dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
         num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512, q_lora_rank=1536,
         qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
         num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3, routed_scaling_factor=2.5,
         norm_topk_prob=True, vocab_size=129280, max_position_embeddings=163840, rms_norm_eps=1e-6,
         attention_bias=False, tie_word_embeddings=False, rope_interleave=True,
         rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
                          "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                          "original_max_position_embeddings": 4096},
         bos_token_id=0, eos_token_id=1),
    "deepseek-ai/DeepSeek-V3 config.json (MTP layer not instantiated by transformers)",
    weight_dtypes={"default": "bf16", "attention": "fp8", "mlp": "fp8"},
))
_add(Preset(
    "deepseek-v2-lite", "DeepSeek-V2-Lite: MLA (latent 512 + rope 64), 16 heads, no q LoRA, 27 layers "
    "(1 dense + 26 MoE, 64 experts, top-6)", "deepseek_v2",
    dict(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
         num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
         qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=64, n_shared_experts=2,
         num_experts_per_tok=6, n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.0,
         vocab_size=102400, max_position_embeddings=163840, rms_norm_eps=1e-6, attention_bias=False,
         tie_word_embeddings=False,
         rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
                          "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                          "original_max_position_embeddings": 4096},
         bos_token_id=100000, eos_token_id=100001),
    "deepseek-ai/DeepSeek-V2-Lite config.json",
))

# ---- hybrid models: attention beside layers holding a constant-size conv / recurrent state -------
# (kvtrace.geometry.hybrid; format 1.5 /state). kvtrace.geometry.param_count has no exact formula for
# their state mixers: `params` is transformers' own count of the model these overrides build.
LIN = "linear_attention"
_add(Preset(
    "qwen3-next-80b-a3b", "Qwen3-Next 80B-A3B: 36 gated delta-net layers (16 key / 32 value heads x 128, conv 4) "
    "and 12 full-attention layers (16 query / 2 KV heads x 256), 512 experts (top-10)", "qwen3_next",
    dict(hidden_size=2048, intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16,
         num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
         linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32, num_experts=512,
         num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
         decoder_sparse_step=1, norm_topk_prob=True, vocab_size=151936, max_position_embeddings=262144,
         rms_norm_eps=1e-6, tie_word_embeddings=False, layer_types=[LIN, LIN, LIN, FULL] * 12,
         rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
         bos_token_id=151643, eos_token_id=151645),
    "transformers Qwen3NextConfig defaults (its docstring: 'the Qwen3-Next-80B-A3B style configuration', checkpoint "
    "Qwen/Qwen3-Next-80B-A3B-Instruct) for every attention, linear-attention and expert field; intermediate_size "
    "5120, max_position_embeddings 262144 and rope_theta 1e7 as published in its config.json (recalled, not "
    "downloaded here; intermediate_size is unused: every layer is MoE)", aliases=("qwen3-next",), tiny_layers=4, params=79_674_391_296
))
_add(Preset(
    "falcon-h1-7b", "Falcon-H1 7B: 44 parallel hybrid layers, each attention (12 query / 2 KV heads x 128) beside "
    "Mamba-2 (24 heads x 128, state 256, conv 4)", "falcon_h1",
    dict(hidden_size=3072, intermediate_size=12288, num_hidden_layers=44, num_attention_heads=12,
         num_key_value_heads=2, head_dim=128, mamba_d_ssm=3072, mamba_n_heads=24, mamba_d_head=128,
         mamba_n_groups=1, mamba_d_state=256, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256,
         vocab_size=130048, max_position_embeddings=262144, rms_norm_eps=1e-5, tie_word_embeddings=False,
         pad_token_id=0, bos_token_id=1, eos_token_id=11),
    "depth, width, heads, KV heads, Mamba heads, head dims and state size: the Falcon-H1 table of transformers' "
    "model_doc/falcon_h1.md (H1 7B: 44 / 3072 / 12 / 2 / 24 / 128,128 / 256); mamba_d_ssm = 24 x 128; groups, "
    "conv and expand: FalconH1Config defaults (1, 4, 2); vocab 130048, intermediate 12288 and eos 11 as published "
    "in tiiuae/Falcon-H1-7B-Instruct config.json (recalled, not downloaded here)", tiny_layers=2, params=7_585_513_568
))
_add(Preset(
    "jamba-v0.1", "AI21 Jamba v0.1 (52B, 12B active): 32 layers, attention (32 query / 8 KV heads x 128) every "
    "8th from layer 4, Mamba-1 elsewhere (inner 8192, state 16, conv 4), 16 experts (top-2) every 2nd layer",
    "jamba",
    dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
         num_key_value_heads=8, attn_layer_period=8, attn_layer_offset=4, expert_layer_period=2,
         expert_layer_offset=1, num_experts=16, num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4,
         mamba_expand=2, mamba_dt_rank=256, mamba_conv_bias=True, mamba_proj_bias=False, vocab_size=65536,
         max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False,
         pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "transformers JambaConfig defaults (checkpoint ai21labs/Jamba-v0.1); Jamba-1.5-Mini keeps this layout "
    "(32 layers, 1 attention : 7 Mamba, 16 experts)", aliases=("jamba", "jamba-1.5-mini"), tiny_layers=5, params=51_570_323_328
))
_add(Preset(
    "lfm2-1.2b", "Liquid LFM2 1.2B: 16 layers, 10 short-convolution (kernel 3) and 6 attention "
    "(32 query / 8 KV heads x 64) at layers 2, 5, 8, 10, 12, 14", "lfm2",
    dict(hidden_size=2048, intermediate_size=12288, num_hidden_layers=16, num_attention_heads=32,
         num_key_value_heads=8, conv_L_cache=3, conv_bias=False, block_multiple_of=256,
         block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True, vocab_size=65536,
         max_position_embeddings=128000, norm_eps=1e-5, tie_word_embeddings=True,
         layer_types=["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
         pad_token_id=0, bos_token_id=1, eos_token_id=7),
    "LiquidAI/LFM2-1.2B config.json (hidden 2048, 16 layers, 32/8 heads, conv_L_cache 3, full_attn_idxs "
    "[2, 5, 8, 10, 12, 14], vocab 65536; recalled, not downloaded here); transformers' model_doc/lfm2.md: "
    "'16 blocks: 10 double-gated short-range convolution blocks and 6 blocks of grouped query attention'; "
    "Lfm2Config's docstring names the checkpoint", aliases=("lfm2",), tiny_layers=3, params=1_170_340_608
))
_add(Preset(
    "nemotron-h-8b", "NVIDIA Nemotron-H 8B: 52 layers, 24 Mamba-2 (128 heads x 64, 8 groups, state 128, conv 4), "
    "4 attention (32 query / 8 KV heads x 128), 24 MLP", "nemotron_h",
    dict(hidden_size=4096, intermediate_size=21504, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
         ssm_state_size=128, mamba_num_heads=128, mamba_head_dim=64, n_groups=8, conv_kernel=4, expand=2,
         mamba_ssm_cache_dtype="float32", vocab_size=131072, max_position_embeddings=8192,
         layers_block_type=[{"M": "mamba", "*": "attention", "-": "mlp"}[c]
                            for c in "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"],
         num_hidden_layers=52, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "transformers NemotronHConfig defaults for every attention and Mamba field (hidden 4096, 32/8 heads x 128, "
    "128 Mamba heads x 64, 8 groups, state 128, conv 4; their in_proj width 2*8192 + 2*8*128 + 128 = 18560 is "
    "the published Nemotron-H-8B-Base-8K's); the 52-layer pattern M-M-M-M*-... of nvidia/Nemotron-H-8B-Base-8K "
    "(hybrid_override_pattern, as published in NeMo / Megatron-Bridge docs)", aliases=("nemotron-h",),
    tiny_layers=8, params=8_100_852_736
))


def list_presets() -> list[str]:
    """Names of the built-in presets."""
    return list(_PRESETS)


def get_preset(name: str) -> Preset:
    """The preset called ``name`` (case-insensitive; aliases accepted)."""
    key = name.strip().lower()
    if key in _PRESETS:
        return _PRESETS[key]
    for p in _PRESETS.values():
        if key in p.aliases:
            return p
    raise KeyError(f"unknown preset {name!r}; known: {', '.join(_PRESETS)}")


# --------------------------------------------------------------------------------------------
# shrinking (pure python)

_EXPERT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts")
_TOPK_KEYS = ("num_experts_per_tok", "top_k_experts")
_TOKEN_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id")


def _round_to(x: float, multiple: int, minimum: int) -> int:
    return max(minimum, int(round(x / multiple)) * multiple)


def _layer_types_of(d: Mapping[str, Any]) -> list[str]:
    return _geometry._layer_types(d, int(d["num_hidden_layers"]))


def _shrink_depth(d: dict[str, Any], layers: int) -> None:
    n = int(d["num_hidden_layers"])
    if not 1 <= layers <= n:
        raise ValueError(f"layers must be in [1, {n}], got {layers}")
    types = _layer_types_of(d)[:layers]
    if _geometry._is_family(d["model_type"], ("gemma4",)) and types[-1] != FULL:
        types[-1] = FULL  # Gemma4TextConfig forces the last layer to full attention
    d["num_hidden_layers"] = layers
    if "layer_types" in d:
        d["layer_types"] = types
    if isinstance(d.get("layers_block_type"), list):  # nemotron_h / zamba2 spell their layout here
        d["layers_block_type"] = d["layers_block_type"][:layers]
    shared = int(d.get("num_kv_shared_layers") or 0)
    if shared:
        # keep the consumer share; drop consumers until every consumer type has a producer
        s = min(layers - 1, shared * layers // n)
        while s > 0 and not set(types[layers - s:]) <= set(types[:layers - s]):
            s -= 1
        d["num_kv_shared_layers"] = s
    if d.get("first_k_dense_replace"):
        # keep at least one MoE layer when there are two layers or more
        d["first_k_dense_replace"] = min(int(d["first_k_dense_replace"]), max(layers - 1, 0))


def _shrink_width(d: dict[str, Any], scale: float) -> None:
    if not 0 < scale <= 1:
        raise ValueError(f"width_scale must be in (0, 1], got {scale}")
    if scale == 1:
        return
    derived_head_dim = d["model_type"] in ("gpt_neox",) or (
        "head_dim" not in d and not _geometry._is_mla(d))
    if not derived_head_dim:  # head_dim = hidden / heads otherwise: hidden must stay
        d["hidden_size"] = _round_to(d["hidden_size"] * scale, 64, 64)
    for k in ("intermediate_size", "moe_intermediate_size"):
        if d.get(k):
            d[k] = _round_to(d[k] * scale, 16, 16)
    if d.get("q_lora_rank"):
        d["q_lora_rank"] = _round_to(d["q_lora_rank"] * scale, 16, 16)
    if d.get("hidden_size_per_layer_input"):
        d["hidden_size_per_layer_input"] = _round_to(d["hidden_size_per_layer_input"] * scale, 8, 8)
    for k in _EXPERT_KEYS:
        if d.get(k):
            topk = max(int(d.get(t) or 1) for t in _TOPK_KEYS)
            d[k] = max(topk, math.ceil(d[k] * scale))
            if d.get("n_group") and d[k] % int(d["n_group"]):
                d["n_group"] = d["topk_group"] = 1  # grouped routing needs experts divisible by groups


def _shrink_vocab(d: dict[str, Any], vocab: int) -> None:
    if vocab < 16:
        raise ValueError("vocab must be >= 16")
    d["vocab_size"] = vocab
    if d.get("vocab_size_per_layer_input"):
        d["vocab_size_per_layer_input"] = vocab
    ids = {0: "pad_token_id", 1: "eos_token_id", 2: "bos_token_id"}
    for value, k in ids.items():
        if k in d and d[k] is not None and d[k] >= vocab:
            d[k] = value


def preset_config_dict(
    name: str, *, layers: int | None = None, width_scale: float | None = None, vocab: int | None = None
) -> dict[str, Any]:
    """The preset's config dict (``model_type`` included), optionally shrunk; no torch needed."""
    d = get_preset(name).config_dict()
    if layers is not None:
        _shrink_depth(d, layers)
    if width_scale is not None:
        _shrink_width(d, width_scale)
    if vocab is not None:
        _shrink_vocab(d, vocab)
    return d


def preset_geometry(
    name: str,
    *,
    layers: int | None = None,
    width_scale: float | None = None,
    vocab: int | None = None,
    mla_cache: _geometry.MlaCacheMode = "latent",
) -> _geometry.ModelGeometry:
    """KV geometry of a preset (optionally shrunk), computed from its overrides alone (no torch)."""
    d = preset_config_dict(name, layers=layers, width_scale=width_scale, vocab=vocab)
    return _geometry.model_geometry(d, mla_cache=mla_cache)


def tiny_shrink_args(name: str) -> dict[str, Any]:
    """Default shrink for CPU tests: the preset's ``tiny_layers``, hidden ~256, vocab 512."""
    p = get_preset(name)
    hidden = int(p.overrides["hidden_size"])
    return {"layers": p.tiny_layers, "width_scale": min(1.0, 256 / hidden), "vocab": 512}


# --------------------------------------------------------------------------------------------
# memory: random weights are materialised at once

# A build is refused when its weights exceed this share of the memory available now; the rest is
# left for activations, the KV cache and the process itself.
MEMORY_SHARE = 0.8


class PresetTooLarge(MemoryError):
    """A preset's random weights would not fit in the memory available now."""


def available_memory(device: str | Any) -> tuple[int, str]:
    """(bytes available now, where): free memory of a CUDA device, else available RAM (psutil)."""
    dev = str(device)
    if dev.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(dev))[0]), f"free on {dev}"
    import psutil

    return int(psutil.virtual_memory().available), "of RAM available"


def check_fits(config: Mapping[str, Any], dtype_bytes: float, device: str | Any, *, name: str) -> tuple[int, int, str]:
    """(weight bytes, bytes available, where) of building ``config`` on ``device``; raises
    :class:`PresetTooLarge` when the weights exceed ``MEMORY_SHARE`` of what is available."""
    from kvtrace.units import format_bytes

    need = _geometry.weight_bytes(config, dtype_bytes)
    free, where = available_memory(device)
    if need > MEMORY_SHARE * free:
        raise PresetTooLarge(f"preset {name} needs {format_bytes(need)} for its random weights "
                             f"({dtype_bytes:g} B/parameter), {format_bytes(free)} {where}")
    return need, free, where


# --------------------------------------------------------------------------------------------
# transformers builders (lazy imports)


def preset_config(
    name: str, *, layers: int | None = None, width_scale: float | None = None, vocab: int | None = None
) -> PretrainedConfig:
    """A transformers config for the preset, optionally shrunk (KV geometry of kept layers preserved)."""
    from transformers import AutoConfig

    d = preset_config_dict(name, layers=layers, width_scale=width_scale, vocab=vocab)
    model_type = d.pop("model_type")
    return AutoConfig.for_model(model_type, **d)


def preset_model(
    name: str,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    layers: int | None = None,
    shrink: bool = True,
    seed: int = 0,
) -> PreTrainedModel:
    """A random-weight model of the preset in eval mode.

    ``shrink=True`` applies :func:`tiny_shrink_args` (``layers`` overrides its depth) so the model
    builds and generates on a CPU in seconds; ``shrink=False`` builds the real size (``layers`` may
    still cut depth), refused with :class:`PresetTooLarge` when it would not fit (:func:`check_fits`).
    """
    import torch
    from transformers import AutoModelForCausalLM

    kw: dict[str, Any] = tiny_shrink_args(name) if shrink else {}
    if layers is not None:
        kw["layers"] = layers
    dtype = dtype or torch.float32
    check_fits(preset_config_dict(name, **kw), dtype.itemsize, device, name=get_preset(name).name)
    cfg = preset_config(name, **kw)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval()
    if model.generation_config.pad_token_id is None:
        eos = model.generation_config.eos_token_id
        model.generation_config.pad_token_id = eos[0] if isinstance(eos, list) else eos
    return model


# --------------------------------------------------------------------------------------------
# documentation


def _describe_kinds(geom: _geometry.ModelGeometry) -> str:
    parts = []
    for kind, count in geom.kind_counts().items():
        g = next(x for x in geom.layers if x.kind == kind)
        if kind == "shared_consumer":
            parts.append(f"{count} shared (reuse KV)")
        elif kind == "no_kv":
            parts.append(f"{count} without KV (state, MLP)")
        elif kind == "latent":
            parts.append(f"{count} MLA latent {g.k_head_dim}+{g.v_head_dim}")
        else:
            dims = f"{g.num_kv_heads}x{g.k_head_dim}"
            win = f", window {g.window}" if g.window else ""
            keqv = ", K=V proj" if g.k_eq_v else ""
            parts.append(f"{count} {kind} {dims}{win}{keqv}")
    return "; ".join(parts)


def presets_markdown(dtype_bytes: int = 2, contexts: tuple[int, ...] = (8192, 131072)) -> str:
    """The preset table of ``docs/presets.md`` (KV bytes in binary units, ``dtype_bytes`` per element;
    hybrid models' conv/recurrent state per sequence, recurrent states in float32)."""
    from kvtrace.units import format_bytes

    def fb(n: int) -> str:
        return format_bytes(n, precision=2)

    from kvtrace.geometry.hybrid import state_geometry

    ctx_heads = " | ".join(f"KV @ {c // 1024}Ki tokens" for c in contexts)
    lines = [
        f"| preset | model_type | params | layers: KV heads x head dim | query heads | KV/token | "
        f"vs MHA | {ctx_heads} | state/sequence |",
        "|" + "---|" * (8 + len(contexts)),
    ]
    for name in list_presets():
        p = get_preset(name)
        geom = preset_geometry(name)
        bpt = _geometry.bytes_per_token(geom, dtype_bytes)["total"]
        mha = _geometry.mha_equivalent_bytes_per_token(geom, dtype_bytes)
        params = p.params if p.params is not None else _geometry.param_count(p.config_dict()).total
        at = " | ".join(fb(_geometry.kv_bytes(geom, c, dtype_bytes).allocated) for c in contexts)
        sg = state_geometry(p.config_dict())
        state = f"{fb(sg.bytes_per_sequence(dtype_bytes))} ({len(sg.layers)} layers)" if sg is not None else "none"
        lines.append(
            f"| `{name}` | {p.model_type} | {params / 1e9:.2f} bn | {_describe_kinds(geom)} | "
            f"{geom.num_attention_heads} | {fb(bpt)} | {bpt / mha:.1%} | {at} | {state} |"
        )
    return "\n".join(lines)
