"""Per-layer KV-cache geometry and analytical cache/weight sizes, from a plain config dict.

This package reads config *fields only* (what ``PretrainedConfig.to_dict()`` gives in transformers 5.x,
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

Modules: ``model`` (the dataclasses), ``config`` (config parsing), ``sharing`` (the KV-sharing
rule, also used by the recorder), ``cache`` (the expected-KV rule over numpy arrays, with its
scalar callers) and ``params`` (parameter counts). Everything public is re-exported here.
"""

from __future__ import annotations

from kvtrace.geometry.cache import (
    allocated_tokens,
    bytes_per_token,
    cache_tokens_after_generate,
    generate_static_max_cache_len,
    kept_tokens,
    kv_bytes,
    layer_bytes,
    layer_kv_bytes,
    mha_equivalent_bytes_per_token,
    per_token_bytes,
    token_counts,
)
from kvtrace.geometry.config import (
    _get,
    _is_family,
    _is_mla,
    _layer_types,
    layer_geometries,
    mla_cache_mode,
    model_geometry,
    text_config,
)
from kvtrace.geometry.model import (
    CACHE_KINDS,
    FP8_SCALE_BYTES,
    LAYER_KINDS,
    MLA_CACHE_MODES,
    CacheKind,
    KVBytes,
    LayerGeometry,
    LayerKind,
    MlaCacheMode,
    MLADims,
    ModelGeometry,
)
from kvtrace.geometry.params import ParamCount, param_count, weight_bytes
from kvtrace.geometry.selection import selection_problem
from kvtrace.geometry.sharing import kv_sharing_map

__all__ = [
    "selection_problem",
    "CACHE_KINDS", "FP8_SCALE_BYTES", "LAYER_KINDS", "MLA_CACHE_MODES", "CacheKind", "KVBytes",
    "LayerGeometry", "LayerKind", "MLADims", "MlaCacheMode", "ModelGeometry", "ParamCount",
    "allocated_tokens", "bytes_per_token", "cache_tokens_after_generate", "generate_static_max_cache_len",
    "kept_tokens", "kv_bytes", "kv_sharing_map", "layer_bytes", "layer_geometries", "layer_kv_bytes",
    "mha_equivalent_bytes_per_token", "mla_cache_mode", "model_geometry", "param_count", "per_token_bytes",
    "text_config", "token_counts", "weight_bytes",
    # config readers that presets.py and calc.py share (kept under their historical names)
    "_get", "_is_family", "_is_mla", "_layer_types",
]
