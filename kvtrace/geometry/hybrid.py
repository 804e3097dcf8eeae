"""Hybrid models: which layers hold a constant-size state instead of (or beside) a KV, and how many
bytes that state takes per sequence, from a plain config dict (no torch, no transformers).

Hybrid models mix attention with layers whose transformers cache (``LinearAttentionLayer``, or
``LinearAttentionAndFullAttentionLayer`` for parallel hybrids) holds per sequence a convolution
window (``conv_states``) and/or a recurrent state (``recurrent_states``), or, for MiniMax, a
lightning-attention state in ``MiniMaxCache.linear_cache``. Their size does not depend on the tokens
seen. The shapes below were read from each family's modeling code in transformers 5.24 (and are the
same in 5.17) and are checked against the tensors of tiny random-weight models on the CPU
(tests/recorder/test_hybrid_state.py, tests/geometry/test_hybrid_geometry.py):

=======================  ==================================================  ===========================
mixer (config feature)   conv state per sequence                             recurrent state
=======================  ==================================================  ===========================
gated delta-net          ``[2·nk·dk + nv·dv, linear_conv_kernel_dim]``        ``[nv, dk, dv]`` float32
(``linear_num_value_     (qwen3_next, qwen3_5, olmo_hybrid, lara_mini)
heads``)
kimi delta attention     ``[3·H·D, linear_conv_kernel_dim]``                  ``[H, D, D]`` float32
(``linear_num_heads``)   (kimi_linear, bailing_hybrid)
Mamba-2 (a groups        ``[I + 2·G·N, d_conv]``                              ``[heads, I/heads, N]``
field)                   (falcon_h1, bamba, zamba2, nemotron_h,               float32
                         granitemoehybrid, mamba2)
Mamba-1                  ``[I, d_conv]`` (jamba, mamba, falcon_mamba, zamba)  ``[I, N]`` float32
short convolution        ``[hidden, conv_L_cache]`` (lfm2, lfm2_moe, lfm3)    none
(``conv_L_cache``)
lightning attention      none; ``linear_cache`` ``[heads, D, D]`` (minimax)   (kind ``other``)
=======================  ==================================================  ===========================

``I`` is the mixer's inner width (``mamba_d_ssm``, or Nemotron-H's ``mamba_num_heads ·
mamba_head_dim``, else ``expand · hidden``), ``N`` the SSM state size, ``G`` its groups. Conv states
and MiniMax's state take the model's (cache) dtype; recurrent states are float32 whatever the model
dtype (measured with bf16 models on transformers 5.17 and 5.24; Kimi and Bailing cast explicitly,
Nemotron-H names ``mamba_ssm_cache_dtype: float32``). A family not in this table that still has
state layers raises ``ValueError`` naming it rather than guessing.

Also here: the layer plan of SSM hybrids whose config dict spells it otherwise than ``layer_types``
(``layers_block_type``, Nemotron-H's ``hybrid_override_pattern``, Bamba's ``attn_layer_indices``,
Jamba's ``attn_layer_period`` / ``attn_layer_offset``, pure Mamba), as transformers' config classes
derive it, with the legacy names (``mamba``, ``attention``) mapped to the current ones.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# transformers' legacy layer-type names (configuration_utils._LEGACY_LAYER_TYPE_REMAP)
LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}
# Nemotron-H hub configs: one character per layer
_PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
# Layer types whose cache layer holds a state (hybrid*: a KV too)
STATE_LAYER_TYPES = frozenset({"linear_attention", "conv", "hybrid", "hybrid_sliding"})

STATE_KINDS = ("conv", "recurrent", "other")
FLOAT32 = 4


@dataclass(frozen=True)
class StateTensor:
    """One state tensor of one layer, for one sequence."""

    kind: str  # "conv", "recurrent" or "other" (the /state kinds)
    shape: tuple[int, ...]  # without the batch dimension
    float32: bool = False  # held in float32 whatever the cache dtype (recurrent states)

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    def nbytes(self, dtype_bytes: int) -> int:
        """Bytes per sequence with a cache (model) dtype of ``dtype_bytes``."""
        return self.elements * (FLOAT32 if self.float32 else int(dtype_bytes))


@dataclass(frozen=True)
class LayerState:
    layer: int
    tensors: tuple[StateTensor, ...]

    def nbytes(self, dtype_bytes: int) -> int:
        return sum(t.nbytes(dtype_bytes) for t in self.tensors)


@dataclass(frozen=True)
class StateGeometry:
    """The state a hybrid model's cache holds per sequence, layer by layer."""

    model_type: str
    mixer: str  # "gated_delta_net", "kimi_delta", "mamba2", "mamba1", "short_conv", "lightning"
    layers: tuple[LayerState, ...]

    def bytes_per_sequence(self, dtype_bytes: int) -> int:
        return sum(s.nbytes(dtype_bytes) for s in self.layers)

    def by_kind(self, dtype_bytes: int) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.layers:
            for t in s.tensors:
                out[t.kind] = out.get(t.kind, 0) + t.nbytes(dtype_bytes)
        return out

    def per_layer(self, dtype_bytes: int) -> dict[int, int]:
        return {s.layer: s.nbytes(dtype_bytes) for s in self.layers}


def _get(cfg: Mapping[str, Any], *keys: str) -> Any:
    for k in keys:
        v = cfg.get(k)
        if v is not None:
            return v
    return None


def _int(cfg: Mapping[str, Any], *keys: str) -> int:
    v = _get(cfg, *keys)
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < 0:
        raise ValueError(f"config has no usable {' / '.join(keys)} ({v!r}) for the state geometry")
    return int(v)


def remap_layer_types(types: list[Any]) -> list[str]:
    return [LEGACY_LAYER_TYPES.get(str(t), str(t)) for t in types]


def hybrid_layer_types(cfg: Mapping[str, Any]) -> list[str] | None:
    """The layer types of an SSM hybrid whose config dict does not hold ``layer_types``, as its
    transformers config class derives them; None when the config is not such a model."""
    lbt = cfg.get("layers_block_type")
    if isinstance(lbt, list) and lbt:  # zamba, zamba2, nemotron_h (5.17+)
        return remap_layer_types(lbt)
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:  # nemotron_h hub configs
        unknown = sorted(set(pattern) - set(_PATTERN))
        if unknown:
            raise ValueError(f"hybrid_override_pattern holds unknown layer codes {unknown}")
        return [_PATTERN[c] for c in pattern]
    n = cfg.get("num_hidden_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return None
    if "mamba_d_ssm" in cfg:  # falcon_h1: attention and Mamba-2 side by side in every layer
        return ["hybrid"] * n
    if "attn_layer_indices" in cfg and "mamba_d_state" in cfg:  # bamba: attention at the listed layers
        listed = cfg.get("attn_layer_indices") or []
        return ["full_attention" if i in listed else "linear_attention" for i in range(n)]
    period, offset = cfg.get("attn_layer_period"), cfg.get("attn_layer_offset")
    if isinstance(period, int) and isinstance(offset, int) and period > 0 and "mamba_d_state" in cfg:  # jamba
        return ["full_attention" if i % period == offset else "linear_attention" for i in range(n)]
    if {"state_size", "conv_kernel", "expand"} <= set(cfg) and not cfg.get("num_attention_heads"):
        return ["linear_attention"] * n  # mamba, mamba2, falcon_mamba: no attention at all
    return None


def state_layer_types(cfg: Mapping[str, Any]) -> list[str] | None:
    """Every layer's type: ``layer_types`` (legacy names mapped) or the hybrid layout above."""
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        return remap_layer_types(types)
    return hybrid_layer_types(cfg)


def _mixer(cfg: Mapping[str, Any], model_type: str) -> tuple[str, tuple[StateTensor, ...]]:
    """The state tensors one state layer holds per sequence, by the config's mixer fields."""
    hidden = _int(cfg, "hidden_size", "d_model")
    if cfg.get("linear_num_value_heads") is not None:  # gated delta-net
        nk, dk = _int(cfg, "linear_num_key_heads"), _int(cfg, "linear_key_head_dim")
        nv, dv = _int(cfg, "linear_num_value_heads"), _int(cfg, "linear_value_head_dim")
        kernel = _int(cfg, "linear_conv_kernel_dim")
        return "gated_delta_net", (StateTensor("conv", (2 * nk * dk + nv * dv, kernel)),
                                   StateTensor("recurrent", (nv, dk, dv), float32=True))
    if cfg.get("linear_num_heads") is not None and cfg.get("linear_head_dim") is not None:  # kimi delta attention
        h, d = _int(cfg, "linear_num_heads"), _int(cfg, "linear_head_dim")
        kernel = _int(cfg, "linear_conv_kernel_dim")
        return "kimi_delta", (StateTensor("conv", (3 * h * d, kernel)), StateTensor("recurrent", (h, d, d), float32=True))
    if cfg.get("conv_L_cache") is not None:  # lfm2 short convolutions
        return "short_conv", (StateTensor("conv", (hidden, _int(cfg, "conv_L_cache"))),)
    if model_type == "minimax" or cfg.get("linear_attn_alpha_factor") is not None:  # lightning attention
        heads = _int(cfg, "num_attention_heads")
        d = int(cfg.get("head_dim") or hidden // heads)
        return "lightning", (StateTensor("other", (heads, d, d)),)
    d_state = _get(cfg, "mamba_d_state", "ssm_state_size", "state_size")
    if d_state is None:
        raise ValueError(f"model_type {model_type!r}: its state layers are of a kind kvtrace.geometry does not "
                         "model (no gated delta-net, Mamba, short-convolution or lightning-attention fields)")
    n = _int(cfg, "mamba_d_state", "ssm_state_size", "state_size")
    kernel = _int(cfg, "mamba_d_conv", "conv_kernel")
    groups = _get(cfg, "mamba_n_groups", "mamba_ngroups", "n_groups")
    if cfg.get("mamba_d_ssm") is not None:
        inner = _int(cfg, "mamba_d_ssm")
    elif cfg.get("mamba_num_heads") is not None and cfg.get("mamba_head_dim") is not None:
        inner = _int(cfg, "mamba_num_heads") * _int(cfg, "mamba_head_dim")
    else:
        expand = _get(cfg, "mamba_expand", "expand")
        if not isinstance(expand, (int, float)) or isinstance(expand, bool) or expand <= 0:
            raise ValueError(f"config has no usable mamba_expand / expand ({expand!r}) for the state geometry")
        inner = int(expand * hidden)
    heads = _get(cfg, "mamba_n_heads", "n_mamba_heads", "mamba_num_heads", "num_heads")
    if groups is not None:  # Mamba-2: B and C of every group share the conv with x
        g = _int(cfg, "mamba_n_groups", "mamba_ngroups", "n_groups")
        h = _int(cfg, "mamba_n_heads", "n_mamba_heads", "mamba_num_heads", "num_heads")
        if not h or inner % h:
            raise ValueError(f"Mamba-2 inner width {inner} does not split into {h} heads")
        return "mamba2", (StateTensor("conv", (inner + 2 * g * n, kernel)),
                          StateTensor("recurrent", (h, inner // h, n), float32=True))
    h = int(heads) if isinstance(heads, int) and heads > 0 and inner % heads == 0 else 1
    rec = (h, inner // h, n) if h > 1 else (inner, n)
    return "mamba1", (StateTensor("conv", (inner, kernel)), StateTensor("recurrent", rec, float32=True))


# Families whose linear-attention layers keep their state outside the cache (in the modules) or in a
# layout this module does not model: refused with the reason, never guessed.
_NOT_MODELLED = {
    "recurrent_gemma": "keeps its recurrent and conv states in its modules, not in the cache",
    "zaya": "its conv state spans two kernels and its recurrent state is a delayed value",
    "inkling": "its hybrid layers hold several conv states per layer",
}


def state_geometry(config: Mapping[str, Any]) -> StateGeometry | None:
    """The state the cache of ``config``'s model holds per sequence (None: no state layers).

    Raises ValueError for a model whose state layers are not modelled (see the module docstring)."""
    from kvtrace.geometry.config import text_config

    cfg = text_config(config)
    model_type = str(cfg.get("model_type") or "")
    family = next((k for k in _NOT_MODELLED if model_type == k or model_type.startswith(k)), None)
    if family is not None:
        raise ValueError(f"model_type {model_type!r} {_NOT_MODELLED[family]}: its state is not modelled by "
                         "kvtrace.geometry")
    types = state_layer_types(cfg)
    if not types:
        return None
    layers = [i for i, t in enumerate(types) if t in STATE_LAYER_TYPES]
    if not layers:
        return None
    mixer, tensors = _mixer(cfg, model_type)
    return StateGeometry(model_type, mixer, tuple(LayerState(i, tensors) for i in layers))
