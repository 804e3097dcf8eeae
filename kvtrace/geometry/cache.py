"""Cache sizes: the one expected-KV rule, over numpy arrays.

:func:`token_counts` and :func:`layer_bytes` say what a cache layer holds and how much storage it
spans, elementwise over series of steps; the analyser calls them with whole columns of a trace. The
scalar functions below (``kept_tokens``, ``allocated_tokens``, ``layer_kv_bytes``, ``kv_bytes``;
what ``kvtrace calc`` and the report's KV check use) validate their arguments and call the same rule
with one element, so the scalar and the vectorised answers cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtrace.geometry.model import (
    CACHE_KINDS,
    FP8_SCALE_BYTES,
    CacheKind,
    KVBytes,
    LayerGeometry,
    ModelGeometry,
)


def token_counts(
    layer: LayerGeometry,
    tokens_seen: np.ndarray | int,
    *,
    static: np.ndarray | bool = False,
    capacity: np.ndarray | int = 0,
    last_step_tokens: np.ndarray | int = 1,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(kept, allocated, overflow)`` tokens of a self-attention layer, elementwise.

    ``static`` marks steps of a static cache whose ``max_cache_len`` is ``capacity``; the others are
    dynamic. A dynamic full layer holds every token seen; a dynamic sliding/chunked layer keeps
    ``window - 1`` as a view into the tensor that concatenated them with the last forward's
    ``last_step_tokens``; a static layer preallocates ``capacity`` (``min(window, capacity)`` when it
    slides) and keeps ``window`` tokens. ``overflow`` marks static full steps past their capacity,
    where no size is defined.
    """
    seen = np.asarray(tokens_seen, dtype=np.int64)
    static = np.asarray(static, dtype=bool)
    capacity = np.asarray(capacity, dtype=np.int64)
    q = np.clip(np.asarray(last_step_tokens, dtype=np.int64), 1, np.maximum(seen, 1))
    if layer.window is None:
        kept_dyn = alloc_dyn = seen
        cap = capacity
    else:
        kept_dyn = np.minimum(seen, layer.window - 1)
        alloc_dyn = np.minimum(seen - q, layer.window - 1) + q
        cap = np.minimum(capacity, layer.window)
    kept = np.where(static, np.minimum(seen, cap), kept_dyn)
    alloc = np.where(seen > 0, np.where(static, cap, alloc_dyn), 0)
    overflow = static & (layer.window is None) & (seen > cap)
    return kept, alloc, overflow


def per_token_bytes(
    layer: LayerGeometry, k_item: np.ndarray | int, v_item: np.ndarray | int | None = None,
    batch: np.ndarray | int = 1,
) -> np.ndarray | int:
    """Bytes one token adds to ``layer``: K and V (once when they are one tensor), times batch."""
    if not layer.stores_kv:
        return 0
    v_item = k_item if v_item is None else v_item
    v = 0 if layer.kv_same_tensor else layer.v_head_dim * v_item
    return batch * layer.num_kv_heads * (layer.k_head_dim * k_item + v)


def layer_bytes(
    layer: LayerGeometry,
    tokens_seen: np.ndarray | int,
    k_item: np.ndarray | int,
    v_item: np.ndarray | int,
    batch: np.ndarray | int = 1,
    *,
    static: np.ndarray | bool = False,
    capacity: np.ndarray | int = 0,
    last_step_tokens: np.ndarray | int = 1,
    fp8: np.ndarray | bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(allocated, valid, overflow)`` bytes of a self-attention layer, elementwise (see
    :func:`token_counts`); ``fp8`` steps add the two fp32 per-tensor scales to allocated."""
    seen = np.asarray(tokens_seen, dtype=np.int64)
    if not layer.stores_kv:
        zero = np.zeros(seen.shape, dtype=np.int64)
        return zero, zero.copy(), np.zeros(seen.shape, dtype=bool)
    kept, alloc_t, overflow = token_counts(layer, seen, static=static, capacity=capacity,
                                           last_step_tokens=last_step_tokens)
    per_token = np.asarray(per_token_bytes(layer, np.asarray(k_item, dtype=np.int64),
                                           np.asarray(v_item, dtype=np.int64),
                                           np.asarray(batch, dtype=np.int64)))
    scales = np.where(np.asarray(fp8, dtype=bool) & (seen > 0), FP8_SCALE_BYTES, 0)
    return alloc_t * per_token + scales, kept * per_token, overflow


# --------------------------------------------------------------------------------------------
# scalar callers: validate, then one element of the rule above


def _check_cache_kind(layer: LayerGeometry, cache_kind: str) -> None:
    if cache_kind not in CACHE_KINDS:
        raise ValueError(f"cache_kind must be one of {CACHE_KINDS}, got {cache_kind!r}")
    if cache_kind == "quantized_fp8" and layer.stores_kv and layer.attention not in ("full", "cross"):
        raise ValueError("QuantizedCache only supports models whose layers are all full attention")


def _static_capacity(layer: LayerGeometry, max_cache_len: int | None) -> int:
    if max_cache_len is None:
        raise ValueError("cache_kind='static' needs max_cache_len")
    if layer.window is not None:
        return min(layer.window, int(max_cache_len))
    return int(max_cache_len)


def _scalar_args(
    layer: LayerGeometry, tokens_seen: int, cache_kind: str, max_cache_len: int | None,
    encoder_len: int | None,
) -> dict:
    """Checked keyword arguments of :func:`token_counts` for one step.

    A cross-attention layer holds the encoder output (``encoder_len`` tokens once anything was
    seen), whatever the cache kind: it is sized as a full layer that has seen that many tokens.
    """
    _check_cache_kind(layer, cache_kind)
    if tokens_seen < 0:
        raise ValueError("tokens_seen must be >= 0")
    if not layer.stores_kv:
        return {"tokens_seen": int(tokens_seen)}
    if layer.kind == "cross_attention":
        if encoder_len is None:
            raise ValueError("a cross-attention layer needs encoder_len")
        return {"tokens_seen": int(encoder_len) if tokens_seen > 0 else 0}
    if cache_kind == "static":
        cap = _static_capacity(layer, max_cache_len)
        if layer.window is None and tokens_seen > cap:
            raise ValueError(f"{tokens_seen} tokens do not fit a static cache of {cap}")
        return {"tokens_seen": int(tokens_seen), "static": True, "capacity": int(max_cache_len)}  # type: ignore[arg-type]
    return {"tokens_seen": int(tokens_seen)}


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
    args = _scalar_args(layer, tokens_seen, cache_kind, max_cache_len, encoder_len)
    if not layer.stores_kv:
        return 0
    return int(token_counts(layer, **args)[0])


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
    args = _scalar_args(layer, tokens_seen, cache_kind, max_cache_len, encoder_len)
    if not layer.stores_kv:
        return 0
    return int(token_counts(layer, last_step_tokens=last_step_tokens, **args)[1])


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
    args = _scalar_args(layer, tokens_seen, cache_kind, max_cache_len, encoder_len)
    alloc, valid, _ = layer_bytes(layer, k_item=dtype_bytes, v_item=dtype_bytes, batch=batch,
                                  last_step_tokens=last_step_tokens, fp8=cache_kind == "quantized_fp8", **args)
    return int(alloc), int(valid)


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
