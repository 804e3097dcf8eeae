"""Per-layer KV-cache geometry and analytical cache/weight sizes, from a plain config dict.

This module reads config *fields only* (what ``PretrainedConfig.to_dict()`` gives in transformers 5.x,
or a hub ``config.json``) and never imports torch or transformers: the analyser and ``kvtrace calc``
must run without them. The rules below mirror transformers 5.23 and were checked against real cache
tensors of tiny random-weight models (``tests/geometry``):

* ``DynamicLayer`` (full attention) holds every token seen, in a freshly concatenated tensor.
* ``DynamicSlidingWindowLayer`` (sliding and chunked attention) keeps the last ``window - 1`` tokens
  once saturated, as a *view* into the tensor it just concatenated: its storage holds
  ``min(seen - q, window - 1) + q`` tokens, ``q`` being the tokens of the last forward (``window`` in
  steady decode; the whole prompt right after a prefill longer than the window).
* ``StaticLayer`` preallocates ``max_cache_len`` tokens at the first update; ``StaticSlidingWindowLayer``
  preallocates ``min(window, max_cache_len)`` and keeps the last ``window`` tokens (not ``window - 1``).
* KV-sharing consumers (gemma3n / gemma4 ``num_kv_shared_layers``) are ``DummyLayer`` (no tensors).
* gemma4 ``attention_k_eq_v`` shares the K and V *projection* on full layers only, but the cache
  still stores two distinct tensors (K gets k_norm + RoPE, V gets v_norm): counted twice.
* deepseek_v2/v3 cache the MLA latent as a single head: keys ``[B, 1, T, kv_lora_rank]``, values
  ``[B, 1, T, qk_rope_head_dim]``. ``mla_cache="expanded"`` models older versions that cached
  per-head K (``qk_nope + qk_rope``) and V (``v_head_dim``).
* ``QuantizedCache(backend="fp8")`` stores K and V in one byte per element plus one fp32 per-tensor
  scale each; it only accepts models whose layers are all full attention.

Layer kinds: ``full``, ``sliding``, ``chunked``, ``shared_consumer``, ``latent`` (MLA),
``cross_attention`` and ``no_kv`` (linear-attention / conv / mamba layers: their constant-size state
is not counted; ``hybrid`` layers count their KV only). Layouts this module does not model (DSA
indexer caches, SSM hybrids without ``layer_types``, two-attention-per-layer models) raise
``ValueError`` instead of guessing.

Sizes are in bytes; anything printed elsewhere uses binary units (KiB, MiB, GiB).
"""

from __future__ import annotations

import math
from collections import ChainMap
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

LayerKind = Literal["full", "sliding", "chunked", "shared_consumer", "latent", "cross_attention", "no_kv"]
CacheKind = Literal["dynamic", "static", "quantized_fp8"]
MlaCacheMode = Literal["latent", "expanded"]

LAYER_KINDS: tuple[str, ...] = (
    "full", "sliding", "chunked", "shared_consumer", "latent", "cross_attention", "no_kv",
)
CACHE_KINDS: tuple[str, ...] = ("dynamic", "static", "quantized_fp8")
MLA_CACHE_MODES: tuple[str, ...] = ("latent", "expanded")

# Bytes of the two fp32 per-tensor scales (K and V) an fp8 quantized layer keeps.
FP8_SCALE_BYTES = 8

# transformers layer_types -> our attention pattern names.
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


@dataclass(frozen=True)
class MLADims:
    """Multi-head latent attention dimensions (deepseek_v2 / deepseek_v3)."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    num_attention_heads: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class LayerGeometry:
    """What one cache layer stores, per token and per sequence.

    ``num_kv_heads``, ``k_head_dim`` and ``v_head_dim`` describe the cached tensors
    ``keys [B, num_kv_heads, T, k_head_dim]`` and ``values [B, num_kv_heads, T, v_head_dim]``
    (for a shared consumer: the tensors it reads from its producer).
    """

    index: int
    kind: str
    attention: str  # "full" | "sliding" | "chunked" | "cross" | "none": the attention pattern
    num_kv_heads: int
    k_head_dim: int
    v_head_dim: int
    window: int | None = None  # sliding window / attention chunk size, in tokens
    num_attention_heads: int = 0
    kv_same_tensor: bool = False  # keys and values are one tensor: count once
    k_eq_v: bool = False  # K and V share one projection (gemma4 attention_k_eq_v); cache still has 2 tensors
    shares_kv_with: int | None = None  # producer layer a shared consumer reads
    mla: MLADims | None = None

    @property
    def stores_kv(self) -> bool:
        """Whether this layer owns cache tensors (consumers and no-KV layers own none)."""
        return self.kind not in ("shared_consumer", "no_kv")

    @property
    def elements_per_token(self) -> int:
        """Cached elements per token per sequence (0 for layers that store nothing)."""
        if not self.stores_kv:
            return 0
        v = 0 if self.kv_same_tensor else self.v_head_dim
        return self.num_kv_heads * (self.k_head_dim + v)

    @property
    def mha_elements_per_token(self) -> int:
        """Elements per token if this layer were plain multi-head attention with its own K and V."""
        if self.kind == "no_kv":
            return 0
        if self.mla is not None:
            return self.mla.num_attention_heads * (self.mla.qk_head_dim + self.mla.v_head_dim)
        return self.num_attention_heads * (self.k_head_dim + self.v_head_dim)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ModelGeometry:
    """All cache layers of a model: decoder layers first, then cross-attention layers if any."""

    model_type: str
    layers: tuple[LayerGeometry, ...]
    num_hidden_layers: int  # decoder layers
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    is_encoder_decoder: bool = False
    mla_cache: str | None = None

    def __iter__(self) -> Iterator[LayerGeometry]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def decoder_layers(self) -> tuple[LayerGeometry, ...]:
        return tuple(g for g in self.layers if g.kind != "cross_attention")

    @property
    def cross_layers(self) -> tuple[LayerGeometry, ...]:
        return tuple(g for g in self.layers if g.kind == "cross_attention")

    def kind_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for g in self.layers:
            out[g.kind] = out.get(g.kind, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"] = [g.to_dict() for g in self.layers]
        return d


@dataclass(frozen=True)
class KVBytes:
    """Cache bytes of a whole model: ``allocated`` (tensor storage) and ``valid`` (tokens held)."""

    allocated: int
    valid: int
    per_layer: tuple[tuple[int, int], ...] = field(default_factory=tuple)


# --------------------------------------------------------------------------------------------
# config reading


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
    types = cfg.get("layer_types")
    if types:
        types = list(types)
        if len(types) != n_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {n_layers} layers")
        return [str(t) for t in types]
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
# Attention and SSM side by side in every layer: the KV part is plain full attention (the SSM state,
# constant in sequence length, is not counted).
_PARALLEL_HYBRID = ("falcon_h1",)


def _check_supported(cfg: Mapping[str, Any]) -> None:
    mt = _model_type(cfg)
    if mt in _UNSUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {mt!r}: cache layout not supported by kvtrace.geometry")
    if not cfg.get("layer_types") and mt not in _PARALLEL_HYBRID:
        marker = next((k for k in _HYBRID_MARKERS if cfg.get(k) is not None), None)
        if marker is not None:
            raise ValueError(f"model_type {mt!r} looks like an SSM/hybrid model ({marker!r}) without "
                             "layer_types: not supported by kvtrace.geometry")


def _kv_sharing(cfg: Mapping[str, Any], types: Sequence[str]) -> dict[int, int]:
    """consumer layer -> producer layer, as gemma3n/gemma4 ``kv_sharing_modes``: the last
    ``num_kv_shared_layers`` layers reuse the KV of the last earlier layer of the same type."""
    n_shared = int(cfg.get("num_kv_shared_layers") or 0)
    if n_shared <= 0:
        return {}
    n = len(types)
    first = n - n_shared
    if first <= 0:
        raise ValueError(f"num_kv_shared_layers={n_shared} leaves no producer layer among {n}")
    last_of_type: dict[str, int] = {}
    for i in range(first):
        last_of_type[types[i]] = i
    out = {}
    for i in range(first, n):
        if types[i] not in last_of_type:
            raise ValueError(f"shared layer {i} ({types[i]}) has no producer of the same type")
        out[i] = last_of_type[types[i]]
    return out


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
    hd = _get(cfg, "head_dim", "d_kv", "attention_head_size")
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
        raise ValueError("config has no layer count (num_hidden_layers / num_layers)")
    return int(n)


# --------------------------------------------------------------------------------------------
# geometry


def layer_geometries(config: Mapping[str, Any], *, mla_cache: MlaCacheMode = "latent") -> list[LayerGeometry]:
    """Per-layer KV geometry of ``config`` (decoder layers, then cross-attention layers)."""
    return list(model_geometry(config, mla_cache=mla_cache).layers)


def model_geometry(config: Mapping[str, Any], *, mla_cache: MlaCacheMode = "latent") -> ModelGeometry:
    """KV geometry of a model from its config dict (``config.to_dict()`` or a ``config.json``).

    ``mla_cache`` picks how MLA layers are cached: ``"latent"`` (transformers 5.x) or ``"expanded"``.
    """
    if mla_cache not in MLA_CACHE_MODES:
        raise ValueError(f"mla_cache must be one of {MLA_CACHE_MODES}, got {mla_cache!r}")
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


# --------------------------------------------------------------------------------------------
# cache sizes


def _check_cache_kind(layer: LayerGeometry, cache_kind: str) -> None:
    if cache_kind not in CACHE_KINDS:
        raise ValueError(f"cache_kind must be one of {CACHE_KINDS}, got {cache_kind!r}")
    if cache_kind == "quantized_fp8" and layer.stores_kv and layer.attention not in ("full", "cross"):
        raise ValueError("QuantizedCache only supports models whose layers are all full attention")


def _static_capacity(layer: LayerGeometry, max_cache_len: int | None, encoder_len: int | None) -> int:
    if layer.kind == "cross_attention":
        cap = encoder_len if encoder_len is not None else max_cache_len
        if cap is None:
            raise ValueError("a static cross-attention layer needs encoder_len")
        return int(cap)
    if max_cache_len is None:
        raise ValueError("cache_kind='static' needs max_cache_len")
    if layer.window is not None:
        return min(layer.window, int(max_cache_len))
    return int(max_cache_len)


def kept_tokens(
    layer: LayerGeometry,
    tokens_seen: int,
    cache_kind: CacheKind = "dynamic",
    max_cache_len: int | None = None,
    *,
    encoder_len: int | None = None,
) -> int:
    """Tokens the cache layer holds (valid) after ``tokens_seen`` tokens went through it.

    ``tokens_seen`` is what ``cache.get_seq_length()`` reports (after ``generate`` with a prompt of P
    tokens and N new tokens: ``P + N - 1``; see :func:`cache_tokens_after_generate`). For a
    cross-attention layer the cache holds the encoder output: ``encoder_len`` tokens.
    """
    _check_cache_kind(layer, cache_kind)
    if tokens_seen < 0:
        raise ValueError("tokens_seen must be >= 0")
    if not layer.stores_kv:
        return 0
    if layer.kind == "cross_attention":
        if encoder_len is None:
            raise ValueError("a cross-attention layer needs encoder_len")
        return int(encoder_len) if tokens_seen > 0 else 0
    if cache_kind == "static":
        cap = _static_capacity(layer, max_cache_len, encoder_len)
        if layer.window is None and tokens_seen > cap:
            raise ValueError(f"{tokens_seen} tokens do not fit a static cache of {cap}")
        return min(tokens_seen, cap)
    if layer.window is not None:
        # DynamicSlidingWindowLayer keeps window - 1 tokens (the next query brings the window-th).
        return min(tokens_seen, layer.window - 1)
    return tokens_seen


def allocated_tokens(
    layer: LayerGeometry,
    tokens_seen: int,
    cache_kind: CacheKind = "dynamic",
    max_cache_len: int | None = None,
    *,
    encoder_len: int | None = None,
    last_step_tokens: int = 1,
) -> int:
    """Tokens the layer's tensor *storage* spans (>= :func:`kept_tokens`).

    ``last_step_tokens`` is the number of tokens of the last forward (1 while decoding, the prompt
    length right after prefill): a dynamic sliding layer's cached view lives inside the tensor that
    concatenated its ``window - 1`` kept tokens with those new tokens.
    """
    kept = kept_tokens(layer, tokens_seen, cache_kind, max_cache_len, encoder_len=encoder_len)
    if not layer.stores_kv or tokens_seen == 0:
        return 0
    if layer.kind == "cross_attention":
        if cache_kind == "static":
            return _static_capacity(layer, max_cache_len, encoder_len)
        return kept
    if cache_kind == "static":
        return _static_capacity(layer, max_cache_len, encoder_len)
    if layer.window is not None:
        q = max(1, min(int(last_step_tokens), tokens_seen))
        return min(tokens_seen - q, layer.window - 1) + q
    return kept


def layer_kv_bytes(
    layer: LayerGeometry,
    tokens_seen: int,
    dtype_bytes: int,
    batch: int = 1,
    cache_kind: CacheKind = "dynamic",
    max_cache_len: int | None = None,
    *,
    encoder_len: int | None = None,
    last_step_tokens: int = 1,
) -> tuple[int, int]:
    """``(bytes_allocated, bytes_valid)`` of one cache layer.

    Consumers of shared KV cost 0; a K==V single tensor is counted once; static layers count their
    whole preallocation as allocated; ``quantized_fp8`` adds the two fp32 scales to allocated
    (pass ``dtype_bytes=1``).
    """
    if dtype_bytes <= 0 or batch <= 0:
        raise ValueError("dtype_bytes and batch must be positive")
    kw = dict(encoder_len=encoder_len)
    valid_t = kept_tokens(layer, tokens_seen, cache_kind, max_cache_len, **kw)
    alloc_t = allocated_tokens(layer, tokens_seen, cache_kind, max_cache_len,
                               last_step_tokens=last_step_tokens, **kw)
    per_token = layer.elements_per_token * dtype_bytes * batch
    allocated, valid = alloc_t * per_token, valid_t * per_token
    if cache_kind == "quantized_fp8" and layer.stores_kv and tokens_seen > 0:
        allocated += FP8_SCALE_BYTES
    return allocated, valid


def kv_bytes(
    geometry: ModelGeometry | Sequence[LayerGeometry],
    tokens_seen: int,
    dtype_bytes: int,
    batch: int = 1,
    cache_kind: CacheKind = "dynamic",
    max_cache_len: int | None = None,
    *,
    encoder_len: int | None = None,
    last_step_tokens: int = 1,
) -> KVBytes:
    """Whole-cache bytes: the sum of :func:`layer_kv_bytes` over every layer."""
    layers = geometry.layers if isinstance(geometry, ModelGeometry) else tuple(geometry)
    per = tuple(
        layer_kv_bytes(g, tokens_seen, dtype_bytes, batch, cache_kind, max_cache_len,
                       encoder_len=encoder_len, last_step_tokens=last_step_tokens)
        for g in layers
    )
    return KVBytes(sum(a for a, _ in per), sum(v for _, v in per), per)


def bytes_per_token(
    geometry: ModelGeometry | Sequence[LayerGeometry], dtype_bytes: int, *, batch: int = 1
) -> dict[str, int]:
    """Cache bytes added per token, summed over the layers of each kind, before any window saturates.

    Keys are layer kinds present in the model plus ``"total"``. Cross-attention layers are included
    (per encoder token); consumers and no-KV layers contribute 0.
    """
    layers = geometry.layers if isinstance(geometry, ModelGeometry) else tuple(geometry)
    out: dict[str, int] = {}
    for g in layers:
        out[g.kind] = out.get(g.kind, 0) + g.elements_per_token * dtype_bytes * batch
    out["total"] = sum(v for k, v in out.items())
    return out


def mha_equivalent_bytes_per_token(
    geometry: ModelGeometry | Sequence[LayerGeometry], dtype_bytes: int, *, batch: int = 1
) -> int:
    """Bytes per token of the same model as plain multi-head attention: every layer caching
    ``num_attention_heads x head_dim`` for K and V (no GQA, sharing, window or latent)."""
    layers = geometry.layers if isinstance(geometry, ModelGeometry) else tuple(geometry)
    return sum(g.mha_elements_per_token for g in layers) * dtype_bytes * batch


def cache_tokens_after_generate(prompt_len: int, new_tokens: int, *, is_encoder_decoder: bool = False) -> int:
    """Tokens seen by the (self-attention) cache at the end of ``generate``: the last generated
    token is never fed back. Decoder-only: ``P + N - 1``; encoder-decoder: ``N`` (the decoder start
    token plus ``N - 1`` generated ones; the encoder prompt sits in the cross-attention cache)."""
    if new_tokens < 1:
        raise ValueError("new_tokens must be >= 1")
    return new_tokens if is_encoder_decoder else prompt_len + new_tokens - 1


def generate_static_max_cache_len(prompt_len: int, new_tokens: int, *, is_encoder_decoder: bool = False) -> int:
    """``max_cache_len`` that ``generate(cache_implementation="static")`` allocates on a fresh model:
    ``max_length - 1``. (A model remembers its largest earlier value and never shrinks it.)"""
    return new_tokens if is_encoder_decoder else prompt_len + new_tokens - 1


# --------------------------------------------------------------------------------------------
# parameter count


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
