"""Config parsing: per-layer KV geometry from a plain config dict (``config.to_dict()`` or a hub
``config.json``), following transformers 5.23's cache layer rules (see the package docstring)."""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvtrace.geometry.hybrid import hybrid_layer_types, remap_layer_types
from kvtrace.geometry.model import MLA_CACHE_MODES, LayerGeometry, MlaCacheMode, MLADims, ModelGeometry
from kvtrace.geometry.sharing import kv_sharing_map

_ATTENTION_OF_LAYER_TYPE = {
    "full_attention": "full",
    "sliding_attention": "sliding",
    "chunked_attention": "chunked",
    # KV plus a recurrent/conv state (LinearAttentionAnd*Layer): the KV part behaves as above; the
    # state, constant in sequence length, is not counted.
    "hybrid": "full",
    "hybrid_sliding": "sliding",
}
# Layer types with no per-token KV (recurrent/conv state or no attention at all).
_NO_KV_LAYER_TYPES = {"linear_attention", "conv", "mamba", "moe", "mlp", "dummy"}

# Models whose config builder turns ``global_head_dim`` / ``num_global_key_value_heads`` into
# per-layer overrides of the full-attention layers (see Gemma4TextConfig.__post_init__).
_GEMMA4_LIKE = ("gemma4", "diffusion_gemma")
# Models whose config halves the sliding window when ``use_bidirectional_attention == "all"``
# (and whose to_dict() writes back the un-halved value).
_GEMMA_BIDIRECTIONAL = ("gemma3", "gemma3n", "gemma4", "diffusion_gemma")


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The decoder text config of ``config`` (its nested ``text_config`` for multimodal models)."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a mapping (config.to_dict()), got {type(config).__name__}")
    tc = config.get("text_config")
    if isinstance(tc, Mapping) and tc:
        out = dict(tc)
        out.setdefault("model_type", config.get("model_type", ""))
        return out
    return dict(config)


def _get(cfg: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    """First non-None value among ``keys``."""
    for k in keys:
        v = cfg.get(k)
        if v is not None:
            return v
    return default


def _model_type(cfg: Mapping[str, Any]) -> str:
    return str(cfg.get("model_type") or "")


def _is_family(model_type: str, prefixes: Sequence[str]) -> bool:
    return any(model_type == p or model_type.startswith(p + "_") for p in prefixes)


def _per_layer_overrides(cfg: Mapping[str, Any], n_layers: int) -> dict[int, dict[str, Any]]:
    """Per-layer overrides: transformers 5.x ``per_layer_config`` (zero-padded string keys), or the
    hub-style gemma4 ``global_head_dim`` / ``num_global_key_value_heads`` the config builder expands."""
    plc = cfg.get("per_layer_config")
    if isinstance(plc, Mapping) and plc:
        out: dict[int, dict[str, Any]] = {}
        for k, v in plc.items():
            try:
                idx = int(k)
            except (TypeError, ValueError):
                continue  # keyed by layer type: resolved through layer_types below
            if isinstance(v, Mapping):
                out[idx] = dict(v)
        return out
    mt = _model_type(cfg)
    if _is_family(mt, _GEMMA4_LIKE) and "per_layer_config" not in cfg:
        # Gemma4TextConfig.__post_init__: full layers get head_dim=global_head_dim (default 512), and
        # num_global_key_value_heads only when attention_k_eq_v is set.
        over: dict[str, Any] = {"head_dim": cfg.get("global_head_dim", 512) or 512}
        if cfg.get("attention_k_eq_v", False) and cfg.get("num_global_key_value_heads") is not None:
            over["num_key_value_heads"] = cfg["num_global_key_value_heads"]
        types = _layer_types(cfg, n_layers)
        return {i: dict(over) for i, t in enumerate(types) if t == "full_attention"}
    return {}


def _layer_types(cfg: Mapping[str, Any], n_layers: int) -> list[str]:
    """transformers-style layer types, inferred like ``cache_utils.get_layer_types_and_kwargs``."""
    types = cfg.get("layer_types") or hybrid_layer_types(cfg)  # SSM hybrids spell it otherwise (geometry.hybrid)
    if types:
        types = list(types)
        if len(types) != n_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {n_layers} layers")
        return remap_layer_types(types)  # legacy names ("mamba", "attention") as transformers maps them
    if _get(cfg, "sliding_window", "sliding_window_size") is not None and cfg.get("use_sliding_window", True) is not False:
        if cfg.get("use_sliding_window") and cfg.get("max_window_layers") is not None:
            # qwen2/qwen3 hub configs: layers from max_window_layers on use the window
            mwl = int(cfg["max_window_layers"])
            return ["sliding_attention" if i >= mwl else "full_attention" for i in range(n_layers)]
        return ["sliding_attention"] * n_layers
    if cfg.get("attention_chunk_size") is not None:
        return ["chunked_attention"] * n_layers
    return ["full_attention"] * n_layers


# Config fields of SSM / hybrid models whose layer layout is not spelled out as ``layer_types`` in
# to_dict(): refuse them rather than silently treating every layer as full attention.
_HYBRID_MARKERS = (
    "layers_block_type", "attn_layer_indices", "attn_layer_period", "hybrid_override_pattern",
    "block_types", "mamba_d_state", "mamba_expand", "state_size",
)
# Two attention blocks per decoder layer (cache has 2 x num_hidden_layers layers): not modelled.
_UNSUPPORTED_MODEL_TYPES = ("longcat_flash",)
# Recurrent-depth models (a middle section of layers run several times per token, e.g. dory): the
# looped layers may write one cache layer per loop, so the cache's layer count is not the config's,
# and released configs list attention and MLP blocks as separate layer_types entries. Not modelled.
_LOOPED_MARKERS = ("n_recurrent_loops",)
# Attention and SSM side by side in every layer: the KV part is plain full attention (the SSM state,
# constant in sequence length, is not counted).
_PARALLEL_HYBRID = ("falcon_h1",)


def _check_supported(cfg: Mapping[str, Any]) -> None:
    mt = _model_type(cfg)
    if mt in _UNSUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {mt!r}: cache layout not supported by kvtrace.geometry")
    looped = next((k for k in _LOOPED_MARKERS if cfg.get(k) is not None), None)
    if looped is not None:
        raise ValueError(f"model_type {mt!r} is a recurrent-depth model ({looped!r}): its looped layers write "
                         "more cache layers than the config lists; not supported by kvtrace.geometry")
    if not cfg.get("layer_types") and mt not in _PARALLEL_HYBRID and hybrid_layer_types(cfg) is None:
        marker = next((k for k in _HYBRID_MARKERS if cfg.get(k) is not None), None)
        if marker is not None:
            raise ValueError(f"model_type {mt!r} looks like an SSM/hybrid model ({marker!r}) without "
                             "layer_types: not supported by kvtrace.geometry")


def _kv_sharing(cfg: Mapping[str, Any], types: Sequence[str]) -> dict[int, int]:
    """consumer layer -> producer layer of a config dict (strict: a layout without producers is refused)."""
    return kv_sharing_map(len(types), num_shared=int(cfg.get("num_kv_shared_layers") or 0), types=types, strict=True)


def _window(cfg: Mapping[str, Any], attention: str) -> int | None:
    if attention == "sliding":
        w = _get(cfg, "sliding_window", "sliding_window_size")  # the latter: attribute_map targets
        if w is None:
            return None
        w = int(w)
        if _is_family(_model_type(cfg), _GEMMA_BIDIRECTIONAL) and cfg.get("use_bidirectional_attention") == "all":
            w = w // 2 + 1  # the config halves it at load (exclusive FA bounds); to_dict stores it un-halved
        return w
    if attention == "chunked":
        c = cfg.get("attention_chunk_size")
        return None if c is None else int(c)
    return None


def _num_heads(cfg: Mapping[str, Any]) -> int:
    # decoder_attention_heads first: bart-like configs map num_attention_heads to the encoder's
    return int(_get(cfg, "decoder_attention_heads", "num_attention_heads", "num_heads", "n_head", default=0))


def _num_kv_heads(cfg: Mapping[str, Any], num_heads: int) -> int:
    if cfg.get("multi_query"):
        return 1
    return int(_get(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv", default=num_heads))


def _head_dim(cfg: Mapping[str, Any], num_heads: int) -> int:
    hd = _get(cfg, "head_dim", "d_kv", "attention_head_size", "attention_head_dim")  # the last: zamba, zamba2
    if hd is not None:
        return int(hd)
    hidden = _hidden_size(cfg)
    if not num_heads:
        raise ValueError("config has neither head_dim nor num_attention_heads")
    return hidden // num_heads


def _hidden_size(cfg: Mapping[str, Any]) -> int:
    return int(_get(cfg, "hidden_size", "d_model", "n_embd", "dim", default=0))


def _is_mla(cfg: Mapping[str, Any]) -> bool:
    return cfg.get("kv_lora_rank") is not None and cfg.get("qk_rope_head_dim") is not None


def _is_encoder_decoder(cfg: Mapping[str, Any]) -> bool:
    return bool(cfg.get("is_encoder_decoder")) or _model_type(cfg) in (
        "t5", "mt5", "umt5", "bart", "mbart", "marian", "pegasus", "blenderbot", "blenderbot-small",
    )


def _decoder_layer_count(cfg: Mapping[str, Any]) -> int:
    if _is_encoder_decoder(cfg):
        n = _get(cfg, "num_decoder_layers", "decoder_layers", "num_layers", "num_hidden_layers")
    else:
        n = _get(cfg, "num_hidden_layers", "num_layers", "n_layer")
    if n is None:
        listed = hybrid_layer_types(cfg)  # nemotron_h: the count is its layers_block_type's length
        if listed:
            return len(listed)
        raise ValueError("config has no layer count (num_hidden_layers / num_layers)")
    return int(n)


def mla_cache_mode(config: Mapping[str, Any], k_heads: Sequence[int] | np.ndarray | None = None) -> MlaCacheMode:
    """Which MLA layout a recorded cache used, from the head counts of its recorded keys: the latent
    (one head, transformers 5.x) unless most recorded keys have several heads (older versions'
    per-head expansion). Non-MLA configs and no recorded keys give "latent" (the default)."""
    cfg = text_config(config)
    if k_heads is None or cfg.get("kv_lora_rank") is None:
        return "latent"
    heads = np.asarray(k_heads, dtype=np.int64)
    heads = heads[heads > 0]
    return "expanded" if heads.size and int(np.median(heads)) > 1 else "latent"


def _check_sizes(config: Mapping[str, Any]) -> None:
    """ValueError before anything is sized from a value no model config holds (kvtrace.geometry.bounds:
    10**400 heads, a string where an integer belongs, a billion layers)."""
    from kvtrace.geometry.bounds import config_problems

    problems = config_problems(config) if isinstance(config, Mapping) else []
    if problems:
        raise ValueError(f"config {problems[0]}")


def layer_geometries(config: Mapping[str, Any], *, mla_cache: MlaCacheMode = "latent") -> list[LayerGeometry]:
    """Per-layer KV geometry of ``config`` (decoder layers, then cross-attention layers)."""
    return list(model_geometry(config, mla_cache=mla_cache).layers)


def model_geometry(config: Mapping[str, Any], *, mla_cache: MlaCacheMode = "latent") -> ModelGeometry:
    """KV geometry of a model from its config dict (``config.to_dict()`` or a ``config.json``).

    ``mla_cache`` picks how MLA layers are cached: ``"latent"`` (transformers 5.x) or ``"expanded"``.
    """
    if mla_cache not in MLA_CACHE_MODES:
        raise ValueError(f"mla_cache must be one of {MLA_CACHE_MODES}, got {mla_cache!r}")
    _check_sizes(config)
    cfg = text_config(config)
    _check_supported(cfg)
    mt = _model_type(cfg)
    n = _decoder_layer_count(cfg)
    types = _layer_types(cfg, n)
    overrides = _per_layer_overrides(cfg, n)
    sharing = _kv_sharing(cfg, types)
    is_mla = _is_mla(cfg)
    k_eq_v_cfg = bool(cfg.get("attention_k_eq_v", False))

    layers: list[LayerGeometry] = []
    own: dict[int, LayerGeometry] = {}
    for i, lt in enumerate(types):
        lc = ChainMap(overrides.get(i, {}), cfg)
        nh = _num_heads(lc)
        if lt in _NO_KV_LAYER_TYPES or lt not in _ATTENTION_OF_LAYER_TYPE:
            if lt not in _NO_KV_LAYER_TYPES:
                # e.g. indexed_attention (DSA indexer keys), compressed attention: refuse, don't guess
                raise ValueError(f"layer {i}: layer type {lt!r} is not supported by kvtrace.geometry")
            g = LayerGeometry(i, "no_kv", "none", 0, 0, 0, None, nh)
            layers.append(g)
            continue
        attention = _ATTENTION_OF_LAYER_TYPE[lt]
        window = _window(lc, attention)
        if attention != "full" and window is None:
            attention = "full"  # e.g. sliding_attention with sliding_window=None behaves as full
        kind = attention
        if is_mla:
            mla = MLADims(
                kv_lora_rank=int(lc["kv_lora_rank"]),
                qk_rope_head_dim=int(lc["qk_rope_head_dim"]),
                qk_nope_head_dim=int(lc.get("qk_nope_head_dim") or 0),
                v_head_dim=int(lc.get("v_head_dim") or 0),
                num_attention_heads=nh,
            )
            if mla_cache == "latent":
                g = LayerGeometry(i, "latent" if attention == "full" else kind, attention, 1,
                                  mla.kv_lora_rank, mla.qk_rope_head_dim, window, nh, mla=mla)
            else:
                g = LayerGeometry(i, kind, attention, nh, mla.qk_head_dim, mla.v_head_dim, window, nh, mla=mla)
        else:
            hd = _head_dim(lc, nh)
            kvh = _num_kv_heads(lc, nh)
            k_eq_v = k_eq_v_cfg and attention != "sliding"  # gemma4: only non-sliding layers
            g = LayerGeometry(i, kind, attention, kvh, hd, hd, window, nh, k_eq_v=k_eq_v)
        own[i] = g
        layers.append(g)

    # Consumers read their producer's tensors; they store nothing themselves.
    for i, p in sharing.items():
        src = own[p]
        layers[i] = LayerGeometry(
            i, "shared_consumer", src.attention, src.num_kv_heads, src.k_head_dim, src.v_head_dim,
            src.window, layers[i].num_attention_heads, src.kv_same_tensor, src.k_eq_v, p, src.mla,
        )

    enc_dec = _is_encoder_decoder(cfg)
    if enc_dec:
        nh = _num_heads(cfg)
        hd = _head_dim(cfg, nh)
        kvh = _num_kv_heads(cfg, nh)
        layers += [LayerGeometry(i, "cross_attention", "cross", kvh, hd, hd, None, nh) for i in range(n)]

    return ModelGeometry(
        model_type=mt,
        layers=tuple(layers),
        num_hidden_layers=n,
        hidden_size=_hidden_size(cfg),
        num_attention_heads=_num_heads(cfg),
        vocab_size=int(cfg.get("vocab_size") or 0),
        is_encoder_decoder=enc_dec,
        mla_cache=mla_cache if is_mla else None,
    )

