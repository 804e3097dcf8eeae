"""Helpers several detectors share: expected bytes per (step, layer), layer naming, ranges."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvtrace import geometry as geo
from kvtrace.analyzer.replay import ReplayContext, RequestTimeline
from kvtrace.format import schema

_ITEMSIZE = {int(k): v for k, v in schema.DTYPE_ITEMSIZE.items()}
CROSS = int(schema.LayerType.CROSS_ATTENTION)
_ITEM_LUT = np.zeros(max(_ITEMSIZE) + 1, dtype=np.int64)
for _code, _size in _ITEMSIZE.items():
    _ITEM_LUT[_code] = _size


_FP8 = (int(schema.CacheDType.FLOAT8_E4M3FN), int(schema.CacheDType.FLOAT8_E5M2))
_QUANT = int(schema.LayerType.QUANTIZED)


def quantized_opaque(layer_type: np.ndarray | int, k_dtype: np.ndarray | int) -> np.ndarray:
    """Quantized layers whose bytes follow no formula (anything but fp8 payloads)."""
    return (np.asarray(layer_type) == _QUANT) & ~np.isin(np.asarray(k_dtype), _FP8)


def itemsize(code: int) -> int:
    return _ITEMSIZE.get(int(code), 0)


def expected_grid(ctx: ReplayContext, req: RequestTimeline) -> tuple[np.ndarray, np.ndarray]:
    """(allocated, valid) expected bytes with the shape of the request's KV grid; -1 where no
    rule applies (layer unknown to the config, cross-attention, non-fp8 quantized)."""
    g = req.kv
    alloc = np.full(g.present.shape, -1, dtype=np.int64)
    valid = np.full(g.present.shape, -1, dtype=np.int64)
    if g.empty:
        return alloc, valid
    seen = g["tokens_seen"]
    # Tokens of each layer's last forward: the growth of tokens_seen since the previous step.
    prev = np.vstack([np.zeros((1, seen.shape[1]), dtype=np.int64), np.maximum(seen[:-1], 0)])
    last = np.maximum(seen - prev, 1)
    batch = np.where(g["batch"] > 0, g["batch"], max(req.batch_size, 1))
    k_item = _ITEM_LUT[np.clip(g["k_dtype"], 0, _ITEM_LUT.size - 1)]
    v_item = _ITEM_LUT[np.clip(g["v_dtype"], 0, _ITEM_LUT.size - 1)]
    v_item = np.where(v_item > 0, v_item, k_item)
    # Quantized layers other than fp8 (quanto/hqq: packed ints + scales + a residual) have no
    # closed form: itemsize 0 marks them unknown. Seen as a 1.7x "duplication" on clean quanto runs.
    opaque = quantized_opaque(g["layer_type"], g["k_dtype"])
    k_item = np.where(opaque, 0, k_item)
    v_item = np.where(opaque, 0, v_item)
    for li, layer in enumerate(g.layers):
        a, v = ctx.expectation.expected(
            int(layer), seen[:, li], last[:, li], g["layer_type"][:, li], k_item[:, li], v_item[:, li],
            batch[:, li], g["k_len"][:, li],
        )
        keep = g.present[:, li] & (g["layer_type"][:, li] != CROSS)
        alloc[:, li] = np.where(keep, a, -1)
        valid[:, li] = np.where(keep, v, -1)
    return alloc, valid


def dynamic_kept_tokens(layer: geo.LayerGeometry | None, tokens_seen: int) -> int:
    """Tokens a dynamic cache layer keeps after `tokens_seen` (geometry's rule; all of them when the
    layer is unknown), for the numbers detectors quote in their messages."""
    if layer is None:
        return int(tokens_seen)
    return int(geo.token_counts(layer, tokens_seen)[0])


def layer_kind(ctx: ReplayContext, layer: int, recorded_type: int | None = None) -> str:
    """The config's kind of a layer, else the recorded one."""
    g = ctx.expectation.get(layer)
    if g is not None and recorded_type != CROSS:
        return g.kind
    if recorded_type is not None:
        try:
            return schema.LayerType(int(recorded_type)).name.lower()
        except ValueError:
            return "unknown"
    return "unknown"


def layer_ranges(layers: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    xs = sorted({int(x) for x in layers})
    if not xs:
        return "none"
    parts: list[str] = []
    start = prev = xs[0]
    for x in xs[1:] + [None]:  # type: ignore[list-item]
        if x is not None and x == prev + 1:
            prev = x
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(parts)


def layers_phrase(layers: Iterable[int]) -> str:
    xs = sorted({int(x) for x in layers})
    return f"layer {xs[0]}" if len(xs) == 1 else f"layers {layer_ranges(xs)}"


def plural(n: int, word: str) -> str:
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


def verb(items: Iterable[int], singular: str, plural_form: str) -> str:
    """Agreement for messages about one or several layers."""
    return singular if len(set(items)) == 1 else plural_form


def attention_heads(ctx: ReplayContext) -> int:
    """Query heads of the model (0 when unknown)."""
    if ctx.expectation.model is not None:
        return int(ctx.expectation.model.num_attention_heads)
    try:
        return int(geo.text_config(ctx.meta.model_config).get("num_attention_heads") or 0)
    except TypeError:
        return 0


def activation_itemsize(req: RequestTimeline) -> int:
    """Element size of the request's cached K (the activations' dtype in practice)."""
    g = req.kv
    if g.empty:
        return 0
    codes = g["k_dtype"][g.present]
    return itemsize(int(np.median(codes))) if codes.size else 0


def eager_scores_bytes(ctx: ReplayContext, req: RequestTimeline) -> int:
    """One layer's eager-attention score matrices over the prompt: batch x heads x S^2 x itemsize
    (flash / SDPA kernels never materialise them); 0 when unknown."""
    heads, item = attention_heads(ctx), activation_itemsize(req)
    return max(req.batch_size, 1) * heads * req.prompt_tokens ** 2 * item if heads and item else 0


def device_cap(ctx: ReplayContext, dev: int) -> int | None:
    """The caching allocator's per-process cap on `dev` recorded in /meta limits, when it binds
    (below 99% of the device); None otherwise."""
    total = ctx.device_total(dev) or 0
    limits = ctx.meta.sources.get("limits") if isinstance(ctx.meta.sources, dict) else None
    entry = ((limits or {}).get("devices") or {}).get(str(dev)) if isinstance(limits, dict) else None
    allowed = entry.get("allowed_bytes") if isinstance(entry, dict) else None
    if isinstance(allowed, int) and 0 < allowed < 0.99 * total:
        return allowed
    return None


def allowed_memory(ctx: ReplayContext, dev: int) -> tuple[int, str]:
    """(bytes, name) of the memory the process may use on `dev`: the per-process cap when one
    binds, else the device (0 when unknown)."""
    cap = device_cap(ctx, dev)
    if cap is not None:
        return cap, "per-process memory cap"
    return ctx.device_total(dev) or 0, "device memory"
