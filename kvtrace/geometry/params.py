"""Parameter counts and weight bytes from a config dict (text tower only)."""

from __future__ import annotations

import math
from collections import ChainMap
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from kvtrace.geometry.config import (
    _ATTENTION_OF_LAYER_TYPE,
    _GEMMA4_LIKE,
    _decoder_layer_count,
    _get,
    _head_dim,
    _hidden_size,
    _is_family,
    _is_mla,
    _kv_sharing,
    _layer_types,
    _model_type,
    _num_heads,
    _num_kv_heads,
    _per_layer_overrides,
    text_config,
)


@dataclass(frozen=True)
class ParamCount:
    """Parameter count by part. ``exact`` says whether the family formula is known to match
    ``sum(p.numel() for p in model.parameters())`` of the transformers model (text tower only)."""

    embedding: int
    attention: int
    mlp: int
    norm: int
    lm_head: int
    other: int
    exact: bool

    @property
    def total(self) -> int:
        return self.embedding + self.attention + self.mlp + self.norm + self.lm_head + self.other

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["total"] = self.total
        return d


_EXACT_DECODERS = (
    "llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma4_text", "gpt_oss", "glm4_moe",
    "deepseek_v2", "deepseek_v3",
)


def param_count(config: Mapping[str, Any]) -> ParamCount:
    """Parameter count of the text model described by ``config``.

    Exact (equal to the transformers model's ``parameters()``) for gpt_neox, llama, mistral, qwen2,
    qwen3, gemma3, gemma4 (incl. per-layer embeddings, k_eq_v, KV sharing, double-wide MLP, MoE
    block), gpt_oss, glm4_moe, deepseek_v2/v3 (MTP layers are not instantiated by transformers and
    not counted), t5 and bart. Other model types fall back to a llama-like estimate
    (``exact=False``): q/k/v/o projections, gated MLP or routed experts, two RMSNorms per layer.
    Vision/audio towers of multimodal configs are not counted.
    """
    cfg = text_config(config)
    mt = _model_type(cfg)
    if mt == "gpt_neox":
        return _pc_gpt_neox(cfg)
    if mt in ("t5", "mt5", "umt5"):
        return _pc_t5(cfg)
    if mt == "bart":
        return _pc_bart(cfg)
    return _pc_decoder(cfg, exact=mt in _EXACT_DECODERS)


def weight_bytes(config: Mapping[str, Any], dtype_bytes: float) -> int:
    """Approximate weight memory: :func:`param_count` x ``dtype_bytes`` (buffers and quantisation
    scales are ignored; pass 0.5 for 4-bit weights)."""
    return int(math.ceil(param_count(config).total * dtype_bytes))


def _tied(cfg: Mapping[str, Any], default: bool) -> bool:
    v = cfg.get("tie_word_embeddings")
    return default if v is None else bool(v)


def _pc_decoder(cfg: Mapping[str, Any], *, exact: bool) -> ParamCount:
    mt = _model_type(cfg)
    gemma4 = _is_family(mt, _GEMMA4_LIKE)
    four_norms = _is_family(mt, ("gemma2", "gemma3", "gemma3n", "gemma4", "diffusion_gemma"))
    H = _hidden_size(cfg)
    V = int(cfg.get("vocab_size") or 0)
    n = _decoder_layer_count(cfg)
    types = _layer_types(cfg, n)
    overrides = _per_layer_overrides(cfg, n)
    sharing = _kv_sharing(cfg, types)
    bias = bool(cfg.get("attention_bias", False))
    mlp_bias = bool(cfg.get("mlp_bias", False))
    attn = mlp = norm = other = 0

    for i, lt in enumerate(types):
        lc = ChainMap(overrides.get(i, {}), cfg)
        nh = _num_heads(lc)
        consumer = i in sharing
        # attention
        if _is_mla(lc):
            nope, rope = int(lc.get("qk_nope_head_dim") or 0), int(lc["qk_rope_head_dim"])
            vd, r = int(lc.get("v_head_dim") or 0), int(lc["kv_lora_rank"])
            ql = lc.get("q_lora_rank")
            if ql is None:
                attn += H * nh * (nope + rope)
            else:
                ql = int(ql)
                attn += H * ql + (ql if bias else 0) + ql * nh * (nope + rope)
                norm += ql
            attn += H * (r + rope) + ((r + rope) if bias else 0) + r * nh * (nope + vd)
            attn += nh * vd * H + (H if bias else 0)
            norm += r
        elif lt in _ATTENTION_OF_LAYER_TYPE:
            hd = _head_dim(lc, nh)
            kvh = _num_kv_heads(lc, nh)
            qkv_bias = bias or mt in ("qwen2", "qwen2_moe")
            o_bias = bias and mt not in ("glm4_moe", "qwen2", "qwen2_moe")
            attn += H * nh * hd + (nh * hd if qkv_bias else 0)  # q
            attn += nh * hd * H + (H if o_bias else 0)  # o
            if not consumer:
                n_kv_proj = 1 if (gemma4 and cfg.get("attention_k_eq_v") and lt != "sliding_attention") else 2
                attn += n_kv_proj * (H * kvh * hd + (kvh * hd if qkv_bias else 0))
            if mt == "gpt_oss":
                other += nh  # attention sinks
            if mt.startswith("qwen3") or mt.startswith("gemma3") or gemma4 or (mt == "glm4_moe" and cfg.get("use_qk_norm")):
                norm += hd  # q_norm
                if not consumer:
                    norm += hd  # k_norm (gemma4 v_norm has no weight)
        # feed-forward
        inter = _get(lc, "intermediate_size", default=0)
        inter = int(inter[i] if isinstance(inter, (list, tuple)) else inter)  # gemma3n: one per layer
        n_experts = _get(lc, "n_routed_experts", "num_local_experts", "num_experts")
        moe_inter = int(_get(lc, "moe_intermediate_size", default=inter))
        first_dense = int(_get(lc, "first_k_dense_replace", default=0))
        if mt == "gpt_oss":
            E = int(n_experts)
            mlp += E * H + E  # router
            mlp += E * H * 2 * inter + E * 2 * inter + E * inter * H + E * H
        elif mt in ("glm4_moe", "deepseek_v2", "deepseek_v3") and n_experts and i >= first_dense:
            E = int(n_experts)
            mlp += E * H  # router
            mlp += E * 2 * moe_inter * H + E * H * moe_inter
            shared = int(cfg.get("n_shared_experts") or 0)
            if shared:
                mlp += 3 * H * moe_inter * shared
        elif gemma4:
            width = inter * (2 if (cfg.get("use_double_wide_mlp") and consumer) else 1)
            mlp += 3 * H * width
            if cfg.get("enable_moe_block"):
                E = int(n_experts)
                mlp += H + E + E * H  # router: scale, per_expert_scale, proj
                mlp += E * 2 * moe_inter * H + E * H * moe_inter
                norm += 3 * H
        elif n_experts and not exact:
            E = int(n_experts)
            mlp += E * H + E * 3 * H * moe_inter
        else:
            mlp += 3 * H * inter + ((2 * inter + H) if mlp_bias else 0)
        # per-layer norms
        norm += (4 if four_norms else 2) * H
        if gemma4 and cfg.get("hidden_size_per_layer_input"):
            p = int(cfg["hidden_size_per_layer_input"])
            other += 2 * H * p
            norm += H

    embedding = V * H
    if gemma4 and cfg.get("hidden_size_per_layer_input"):
        p = int(cfg["hidden_size_per_layer_input"])
        vp = int(cfg.get("vocab_size_per_layer_input") or V)
        embedding += vp * n * p
        other += n * p * H
        norm += p
    norm += H  # final norm
    lm_head = 0 if _tied(cfg, default=mt.startswith("gemma")) else V * H
    return ParamCount(embedding, attn, mlp, norm, lm_head, other, exact)


def _pc_gpt_neox(cfg: Mapping[str, Any]) -> ParamCount:
    H, V, n = _hidden_size(cfg), int(cfg["vocab_size"]), _decoder_layer_count(cfg)
    inter = int(_get(cfg, "intermediate_size", default=4 * H))
    b = bool(cfg.get("attention_bias", True))
    attn = n * (H * 3 * H + (3 * H if b else 0) + H * H + (H if b else 0))
    mlp = n * (H * inter + inter + inter * H + H)
    norm = n * 4 * H + 2 * H
    lm_head = 0 if _tied(cfg, default=False) else V * H
    return ParamCount(V * H, attn, mlp, norm, lm_head, 0, True)


def _pc_t5(cfg: Mapping[str, Any]) -> ParamCount:
    H, V = _hidden_size(cfg), int(cfg["vocab_size"])
    nh = int(cfg["num_heads"])
    inner = nh * int(cfg["d_kv"])
    ff = int(cfg["d_ff"])
    n_enc = int(cfg["num_layers"])
    n_dec = int(_get(cfg, "num_decoder_layers", default=n_enc))
    gated = str(cfg.get("feed_forward_proj", "relu")).startswith("gated")
    ffn = (3 if gated else 2) * H * ff
    buckets = int(cfg.get("relative_attention_num_buckets", 32))
    attn = (n_enc + 2 * n_dec) * 4 * H * inner
    other = 2 * buckets * nh  # relative attention bias of the first encoder and decoder block
    norm = (2 * n_enc + 3 * n_dec + 2) * H
    mlp = (n_enc + n_dec) * ffn
    lm_head = 0 if _tied(cfg, default=True) else V * H
    return ParamCount(V * H, attn, mlp, norm, lm_head, other, True)


def _pc_bart(cfg: Mapping[str, Any]) -> ParamCount:
    H, V = _hidden_size(cfg), int(cfg["vocab_size"])
    n_enc, n_dec = int(cfg["encoder_layers"]), int(cfg["decoder_layers"])
    f_enc, f_dec = int(cfg["encoder_ffn_dim"]), int(cfg["decoder_ffn_dim"])
    pos = int(cfg["max_position_embeddings"]) + 2  # BartLearnedPositionalEmbedding offset
    proj = H * H + H
    attn = (n_enc * 4 + n_dec * 8) * proj
    mlp = n_enc * (2 * H * f_enc + f_enc + H) + n_dec * (2 * H * f_dec + f_dec + H)
    norm = (n_enc * 2 + n_dec * 3 + 2) * 2 * H
    lm_head = 0 if _tied(cfg, default=True) else V * H
    return ParamCount(V * H + 2 * pos * H, attn, mlp, norm, lm_head, 0, True)

