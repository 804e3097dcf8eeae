"""Read a transformers cache's per-layer structure: shapes, dtypes, storages, token counts.

One function, :func:`read_cache`, turns any transformers 5.x ``Cache`` into plain
:class:`LayerReading` records (ints and tuples only: nothing here keeps a tensor alive). The layer
class decides how tokens are counted, never the model's name:

* ``DynamicLayer``: holds every token seen, in one freshly concatenated tensor.
* ``DynamicSlidingWindowLayer``: ``cumulative_length`` tokens seen, ``window - 1`` kept, as a view
  into the tensor it just concatenated (so its storage is larger than the view: both are recorded).
* ``StaticLayer`` / ``StaticSlidingWindowLayer``: whole preallocation is allocated, valid length from
  ``cumulative_length`` (a device tensor: read once per step, see ``_static_seen``) or
  ``cumulative_length_int``.
* quantized layers (fp8, quanto, hqq): quantized tensors (+ scales) plus the full-precision residual.
* ``DummyLayer`` or a missing layer (KV-shared consumers): no tensors; reported with the producer's
  shapes and 0 bytes.
* MLA (deepseek): keys ``[B, 1, T, kv_lora_rank]`` (c_KV), values ``[B, 1, T, qk_rope_head_dim]``;
  the older expanded layout is per-head K/V and is read like any full layer.
* ``EncoderDecoderCache``: self-attention layers, then cross-attention layers numbered after them.

Offloaded caches need no special reading: shapes and storage pointers of CPU-resident layers are
valid while their copies are in flight; only tensor *contents* need :func:`wait_for_offload`.

Why one module over 600 lines: the per-step fast path (:func:`fast_plan`, :func:`read_step_fast`)
is the general reader's rules for plain dynamic layers, kept next to them so a change to one is seen
against the other; both must give byte-identical /kv rows (tests/recorder/test_overhead_paths.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvtrace.format.schema import DTYPE_ITEMSIZE, KV, TORCH_DTYPE_NAMES, CacheDType, LayerType
from kvtrace.format.writer import RowBlock
from kvtrace.geometry import kv_sharing_map
from kvtrace.recorder.rows import KvRow

StorageKey = tuple[int, int, int]  # (device index or -1, storage data_ptr, storage nbytes)

_SLIDING_TYPES = ("sliding_attention", "chunked_attention", "hybrid_sliding")


def _cls(name: str) -> type | None:
    """A transformers cache class by name, or None on versions that lack it (5.17 has no fp8)."""
    try:
        from transformers import cache_utils
    except ImportError:  # pragma: no cover - the recorder needs transformers anyway
        return None
    return getattr(cache_utils, name, None)


_DynamicLayer = _cls("DynamicLayer")
_DynamicSliding = _cls("DynamicSlidingWindowLayer")
_StaticLayer = _cls("StaticLayer")
_StaticSliding = _cls("StaticSlidingWindowLayer")
_BaseQuantized = _cls("BaseQuantizedLayer") or _cls("QuantizedLayer")
_Fp8Layer = _cls("Fp8QuantizedLayer")
_DummyLayer = _cls("DummyLayer")
_EncDecCache = _cls("EncoderDecoderCache")


_DTYPE_CODES: dict[torch.dtype, int] = {}


def dtype_code(dtype: torch.dtype | None) -> int:
    if dtype is None:
        return int(CacheDType.UNKNOWN)
    code = _DTYPE_CODES.get(dtype)
    if code is None:
        code = int(TORCH_DTYPE_NAMES.get(str(dtype).removeprefix("torch."), CacheDType.UNKNOWN))
        _DTYPE_CODES[dtype] = code
    return code


def device_index(device: torch.device) -> int:
    return -1 if device.type == "cpu" else int(device.index or 0)


def storage_of(t: torch.Tensor) -> tuple[StorageKey, int] | None:
    """(identity key, nbytes) of a tensor's untyped storage; None for 0-byte or storage-less ones."""
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None  # tensor subclasses without a storage: their leaves are read instead
    nbytes = int(s.nbytes())
    if nbytes == 0:
        return None
    return (device_index(t.device), int(s.data_ptr()), nbytes), nbytes


def tensor_leaves(obj: Any, _depth: int = 0) -> Iterator[torch.Tensor]:
    """Every plain tensor inside a tensor, tensor subclass (``__tensor_flatten__``), tuple, list or
    dict: quantized backends keep (data, scale, zero-point, ...) structures of various shapes."""
    if _depth > 6 or obj is None:
        return
    if isinstance(obj, torch.Tensor):
        flatten = getattr(type(obj), "__tensor_flatten__", None)
        if flatten is not None and type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
            try:
                names, _ = obj.__tensor_flatten__()
                for n in names:
                    yield from tensor_leaves(getattr(obj, n, None), _depth + 1)
                return
            except Exception:  # noqa: BLE001 - fall back to the wrapper itself
                pass
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from tensor_leaves(item, _depth + 1)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            yield from tensor_leaves(item, _depth + 1)


def _shape4(t: torch.Tensor | None) -> tuple[int, int, int, int]:
    if t is None:
        return (0, 0, 0, 0)
    s = tuple(int(x) for x in t.shape)[-4:]
    return (0,) * (4 - len(s)) + s  # type: ignore[return-value]


def _tokens(t: torch.Tensor | None) -> int:
    return int(t.shape[-2]) if t is not None and t.dim() >= 2 else 0


@dataclass(slots=True)
class LayerReading:
    """One layer of one cache at one step; plain ints so nothing here holds a tensor."""

    layer: int
    layer_type: int
    device: int = -1
    k_dtype: int = 0
    v_dtype: int = 0
    k_shape: tuple[int, int, int, int] = (0, 0, 0, 0)
    v_shape: tuple[int, int, int, int] = (0, 0, 0, 0)
    tokens_seen: int = 0
    tokens_kept: int = 0
    bytes_valid: int = 0
    expanded_bytes: int = 0
    k_storage: int = 0
    v_storage: int = 0
    k_storage_bytes: int = 0
    v_storage_bytes: int = 0
    # Every storage this layer owns (K, V, quantized data, scales, residual), in order, with
    # repeats when K and V alias: accounting de-duplicates them.
    storages: list[tuple[StorageKey, int]] = field(default_factory=list)
    shared_from: int = -1
    window: int = -1
    part: str = "self"  # "self" or "cross"
    cache_index: int = 0  # index of the layer inside its (sub-)cache

    @property
    def num_kv_heads(self) -> int:
        return self.k_shape[1]


@dataclass
class LayoutContext:
    """What the config says about layers, computed once per session (see :func:`context_from_config`)."""

    num_layers: int = 0
    layer_types: list[str] = field(default_factory=list)
    consumers: dict[int, int] = field(default_factory=dict)  # consumer layer -> producer layer
    windows: dict[int, int] = field(default_factory=dict)
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    mla_v_head_dim: int | None = None
    num_attention_heads: int = 0


def context_from_config(config: Any) -> LayoutContext:
    """Layer types, KV sharing and MLA dims from a transformers config (decoder text config)."""
    cfg = config
    try:
        cfg = config.get_text_config(decoder=True)
    except (AttributeError, TypeError):
        pass
    n = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "num_decoder_layers", None) \
        or getattr(cfg, "num_layers", None) or 0
    n = int(n)
    types = list(getattr(cfg, "layer_types", None) or [])
    if len(types) != n:
        types = []
    ctx = LayoutContext(num_layers=n, layer_types=types)
    ctx.consumers = _kv_sharing_map(cfg, types, n)
    window = getattr(cfg, "sliding_window", None)
    chunk = getattr(cfg, "attention_chunk_size", None)
    for i, t in enumerate(types):
        if t in ("sliding_attention", "hybrid_sliding") and window:
            ctx.windows[i] = int(window)
        elif t == "chunked_attention" and chunk:
            ctx.windows[i] = int(chunk)
    if getattr(cfg, "kv_lora_rank", None) is not None and getattr(cfg, "qk_rope_head_dim", None) is not None:
        ctx.kv_lora_rank = int(cfg.kv_lora_rank)
        ctx.qk_rope_head_dim = int(cfg.qk_rope_head_dim)
        ctx.qk_nope_head_dim = int(getattr(cfg, "qk_nope_head_dim", 0) or 0)
        ctx.mla_v_head_dim = int(getattr(cfg, "v_head_dim", 0) or 0)
    ctx.num_attention_heads = int(getattr(cfg, "num_attention_heads", 0) or getattr(cfg, "num_heads", 0) or 0)
    return ctx


def _kv_sharing_map(cfg: Any, types: Sequence[str], n: int) -> dict[int, int]:
    """consumer -> producer by geometry.kv_sharing_map. transformers >= 5.2x exposes
    ``kv_sharing_modes`` ("reuse" marks a consumer); older versions only ``num_kv_shared_layers``."""
    try:
        modes = getattr(cfg, "kv_sharing_modes", None)
    except Exception:  # noqa: BLE001 - a property that raises on odd configs
        modes = None
    shared = int(getattr(cfg, "num_kv_shared_layers", 0) or 0)
    return kv_sharing_map(n, num_shared=shared, modes=modes, types=types)


def cache_parts(cache: Any) -> list[tuple[str, Any]]:
    """[("self", cache)] or, for an EncoderDecoderCache, its self- and cross-attention caches."""
    if _EncDecCache is not None and isinstance(cache, _EncDecCache):
        return [("self", cache.self_attention_cache), ("cross", cache.cross_attention_cache)]
    return [("self", cache)]


def is_offloading(cache: Any) -> bool:
    return any(bool(getattr(c, "offloading", False)) for _, c in cache_parts(cache))


def wait_for_offload(cache: Any) -> None:
    """Before reading *contents* of an offloaded cache: the offload copies run on the default
    stream and prefetches on ``cache.prefetch_stream`` (transformers 5.x); wait for both."""
    if not torch.cuda.is_available():
        return
    for _, c in cache_parts(cache):
        if not getattr(c, "offloading", False):
            continue
        stream = getattr(c, "prefetch_stream", None)
        if stream is not None:
            stream.synchronize()
        torch.cuda.synchronize()


class _StaticSeen:
    """Reads a StaticLayer's ``cumulative_length`` (a device tensor) at most once per cache per
    step on GPUs: every full static layer advances in lockstep, and each read is a device sync."""

    def __init__(self) -> None:
        self.value: int | None = None

    def get(self, layer: Any) -> int:
        cl = layer.cumulative_length
        if not isinstance(cl, torch.Tensor):
            return int(cl)
        if cl.device.type == "cpu":
            return int(cl)
        if self.value is None:
            self.value = int(cl)
        return self.value


Observer = Callable[[StorageKey, int, torch.Tensor], None]


def read_cache(cache: Any, ctx: LayoutContext, observe: Observer | None = None) -> list[LayerReading]:
    """Per-layer readings of every layer of ``cache`` (self layers, consumers, cross layers).

    ``observe(key, layer, tensor)`` is called for every storage found (retention tracking); it must
    not keep the tensor."""
    out: list[LayerReading] = []
    parts = cache_parts(cache)
    n_self = max(ctx.num_layers, len(getattr(parts[0][1], "layers", ())))
    for part, sub in parts:
        layers = list(getattr(sub, "layers", ()))
        static_seen = _StaticSeen()
        offset = 0 if part == "self" else n_self
        count = len(layers) if part == "cross" else n_self
        for i in range(count):
            layer = layers[i] if i < len(layers) else None
            if part == "self" and i in ctx.consumers and (layer is None or _holds_nothing(layer)):
                out.append(LayerReading(i, int(LayerType.SHARED_CONSUMER), shared_from=ctx.consumers[i],
                                        cache_index=i))
                continue
            if layer is None:
                continue
            r = _read_layer(layer, i + offset, i, part, ctx, static_seen, observe)
            if r is not None:
                out.append(r)
    _fill_consumers(out)
    return out


def _holds_nothing(layer: Any) -> bool:
    if _DummyLayer is not None and isinstance(layer, _DummyLayer):
        return True
    return getattr(layer, "keys", None) is None and getattr(layer, "_quantized_keys", None) is None


def _fill_consumers(readings: list[LayerReading]) -> None:
    """A consumer reports what it reads (its producer's shapes, storages, tokens seen) but holds
    nothing itself: tokens_kept and every byte count stay 0."""
    by_layer = {r.layer: r for r in readings if r.part == "self"}
    for r in readings:
        if r.layer_type != LayerType.SHARED_CONSUMER:
            continue
        p = by_layer.get(r.shared_from)
        if p is None:
            continue
        r.device, r.k_dtype, r.v_dtype = p.device, p.k_dtype, p.v_dtype
        r.k_shape, r.v_shape = p.k_shape, p.v_shape
        r.tokens_seen, r.window = p.tokens_seen, p.window
        r.k_storage, r.v_storage = p.k_storage, p.v_storage
        r.k_storage_bytes, r.v_storage_bytes = p.k_storage_bytes, p.v_storage_bytes


def _layer_type(layer: Any, index: int, part: str, ctx: LayoutContext, keys: torch.Tensor | None,
                values: torch.Tensor | None) -> LayerType:
    if part == "cross":
        return LayerType.CROSS_ATTENTION
    if _is_latent(keys, values, ctx):
        return LayerType.LATENT
    if _BaseQuantized is not None and isinstance(layer, _BaseQuantized):
        return LayerType.QUANTIZED
    if _Fp8Layer is not None and isinstance(layer, _Fp8Layer):
        return LayerType.QUANTIZED
    if _StaticSliding is not None and isinstance(layer, _StaticSliding):
        return LayerType.STATIC_SLIDING
    if _StaticLayer is not None and isinstance(layer, _StaticLayer):
        return LayerType.STATIC
    if _DynamicSliding is not None and isinstance(layer, _DynamicSliding):
        kind = ctx.layer_types[index] if index < len(ctx.layer_types) else ""
        return LayerType.CHUNKED if kind == "chunked_attention" else LayerType.SLIDING
    if _DynamicLayer is not None and isinstance(layer, _DynamicLayer):
        return LayerType.FULL
    return LayerType.UNKNOWN


def _is_latent(keys: torch.Tensor | None, values: torch.Tensor | None, ctx: LayoutContext) -> bool:
    if ctx.kv_lora_rank is None or keys is None or values is None or keys.dim() != 4:
        return False
    return (int(keys.shape[1]) == 1 and int(keys.shape[-1]) == ctx.kv_lora_rank
            and int(values.shape[-1]) == ctx.qk_rope_head_dim)


def _read_dynamic_fast(layer: Any, index: int, cache_index: int, part: str, ctx: LayoutContext,
                       observe: Observer | None) -> LayerReading | None:
    """The common case (plain DynamicLayer / DynamicSlidingWindowLayer, distinct K and V storages)
    with the fewest tensor-attribute calls: this runs for every layer at every decode step.
    Returns None to defer to the general reader."""
    k, v = layer.keys, layer.values
    if type(k) is not torch.Tensor or type(v) is not torch.Tensor or k.dim() != 4 or v.dim() != 4:
        return None
    ks, vs = k.shape, v.shape
    if ctx.kv_lora_rank is not None:
        return None  # MLA (latent or expanded): the general reader adds the expanded size
    kst, vst = k.untyped_storage(), v.untyped_storage()
    kp, vp = kst.data_ptr(), vst.data_ptr()
    if kp == vp:
        return None  # K and V alias: the general reader counts the storage once
    kn, vn = kst.nbytes(), vst.nbytes()
    dev = k.get_device()
    sliding = type(layer) is _DynamicSliding
    kept = ks[2]
    r = LayerReading(
        index, int(LayerType.SLIDING if sliding else LayerType.FULL), dev, dtype_code(k.dtype),
        dtype_code(v.dtype), tuple(ks), tuple(vs), layer.cumulative_length if sliding else kept, kept,
        k.nbytes + v.nbytes, 0, kp, vp, kn, vn, [], -1, -1, part, cache_index,
    )
    if sliding:
        r.window = int(layer.sliding_window)
        if ctx.layer_types and cache_index < len(ctx.layer_types) and \
                ctx.layer_types[cache_index] == "chunked_attention":
            r.layer_type = int(LayerType.CHUNKED)
    if kn:
        kk = (dev, kp, kn)
        r.storages.append((kk, kn))
        if observe is not None:
            observe(kk, index, k)
    if vn:
        vk = (dev, vp, vn)
        r.storages.append((vk, vn))
        if observe is not None:
            observe(vk, index, v)
    return r


def _read_layer(layer: Any, index: int, cache_index: int, part: str, ctx: LayoutContext,
                static_seen: _StaticSeen, observe: Observer | None) -> LayerReading | None:
    cls = type(layer)
    if (cls is _DynamicLayer or cls is _DynamicSliding) and part == "self":
        fast = _read_dynamic_fast(layer, index, cache_index, part, ctx, observe)
        if fast is not None:
            return fast
    keys = getattr(layer, "keys", None)
    values = getattr(layer, "values", None)
    qk = getattr(layer, "_quantized_keys", None)
    qv = getattr(layer, "_quantized_values", None)
    quantized = qk is not None or qv is not None
    if not isinstance(keys, torch.Tensor) and not quantized:
        return None  # not initialised yet, or a layer kind without K/V (recurrent state)
    lt = _layer_type(layer, cache_index, part, ctx, keys, values)
    r = LayerReading(index, int(lt), part=part, cache_index=cache_index)

    # The tensors whose shapes/dtypes describe the layer: quantized data when present.
    k_main = next(iter(tensor_leaves(qk)), None) if quantized else keys
    v_main = next(iter(tensor_leaves(qv)), None) if quantized else values
    if k_main is None:
        k_main = keys
    if v_main is None:
        v_main = values
    ref = k_main if k_main is not None else v_main
    if ref is not None:
        r.device = device_index(ref.device)
    r.k_dtype = dtype_code(k_main.dtype if k_main is not None else None)
    r.v_dtype = dtype_code(v_main.dtype if v_main is not None else None)
    r.k_shape, r.v_shape = _shape4(k_main), _shape4(v_main)

    # Token counts by layer class.
    if _StaticSliding is not None and isinstance(layer, _StaticSliding):
        seen = int(getattr(layer, "cumulative_length_int", 0))
        kept = min(seen, int(layer.max_cache_len))
    elif _StaticLayer is not None and isinstance(layer, _StaticLayer):
        seen = static_seen.get(layer) if layer.is_initialized else 0
        kept = min(seen, int(layer.max_cache_len))
    elif quantized:
        seen = int(getattr(layer, "cumulative_length", 0))
        kept = seen
    elif _DynamicSliding is not None and isinstance(layer, _DynamicSliding):
        seen = int(layer.cumulative_length)
        kept = _tokens(keys)
    else:
        kept = _tokens(keys)
        seen = int(getattr(layer, "cumulative_length", kept)) if not isinstance(
            getattr(layer, "cumulative_length", None), torch.Tensor) else kept
    r.tokens_seen, r.tokens_kept = seen, kept

    window = getattr(layer, "sliding_window", None)
    if window is None and _StaticSliding is not None and isinstance(layer, _StaticSliding):
        window = ctx.windows.get(cache_index, int(layer.max_cache_len))
    if window is None and part == "self":
        window = ctx.windows.get(cache_index)
    r.window = int(window) if window is not None else -1

    # Storages: K and V first (their ptrs go into the row), then every other tensor the layer owns.
    k_st = storage_of(k_main) if k_main is not None else None
    v_st = storage_of(v_main) if v_main is not None else None
    if k_st:
        r.k_storage, r.k_storage_bytes = k_st[0][1], k_st[1]
        r.storages.append(k_st)
        if observe is not None:
            observe(k_st[0], index, k_main)
    if v_st:
        r.v_storage, r.v_storage_bytes = v_st[0][1], v_st[1]
        r.storages.append(v_st)
        if observe is not None:
            observe(v_st[0], index, v_main)
    if quantized:
        for t in _quantized_extras(layer, k_main, v_main):
            st = storage_of(t)
            if st:
                r.storages.append(st)
                if observe is not None:
                    observe(st[0], index, t)

    r.bytes_valid = _valid_bytes(layer, keys, values, k_main, v_main, kept, quantized, k_st, v_st)
    if lt == LayerType.LATENT:
        r.expanded_bytes = _expanded_bytes(ctx, k_main, kept)
    elif ctx.kv_lora_rank is not None and k_main is not None and k_main.dim() == 4 and part == "self":
        r.expanded_bytes = _expanded_bytes(ctx, k_main, kept)  # older expanded MLA layout
    return r


def _quantized_extras(layer: Any, k_main: torch.Tensor | None, v_main: torch.Tensor | None
                      ) -> Iterable[torch.Tensor]:
    """Scales, zero points and the full-precision residual of a quantized layer."""
    skip = {id(k_main), id(v_main)}
    for obj in (getattr(layer, "_quantized_keys", None), getattr(layer, "_quantized_values", None),
                getattr(layer, "keys", None), getattr(layer, "values", None)):
        for t in tensor_leaves(obj):
            if id(t) not in skip:
                skip.add(id(t))
                yield t


def _view_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else int(t.numel()) * int(t.element_size())


def _valid_bytes(layer: Any, keys: torch.Tensor | None, values: torch.Tensor | None,
                 k_main: torch.Tensor | None, v_main: torch.Tensor | None, kept: int, quantized: bool,
                 k_st: tuple | None, v_st: tuple | None) -> int:
    """Bytes holding the tokens the layer keeps (no preallocation slack, no out-of-window slack)."""
    if quantized:
        # Quantized token data plus the full-precision residual; scales are not token data.
        data = _view_bytes(k_main) + _view_bytes(v_main)
        if k_main is not keys:
            data += _view_bytes(keys) + _view_bytes(values)
        return data
    same = k_st is not None and v_st is not None and k_st[0] == v_st[0] and _same_view(keys, values)
    if _StaticLayer is not None and isinstance(layer, _StaticLayer):
        k = _per_token_bytes(keys) * kept
        v = _per_token_bytes(values) * kept
    else:
        k, v = _view_bytes(keys), _view_bytes(values)
    return k if same else k + v


def _same_view(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is not None and b is not None and a.data_ptr() == b.data_ptr()
            and a.shape == b.shape and a.stride() == b.stride())


def _per_token_bytes(t: torch.Tensor | None) -> int:
    if t is None or t.dim() < 2 or int(t.shape[-2]) == 0:
        return 0
    return _view_bytes(t) // int(t.shape[-2])


def _expanded_bytes(ctx: LayoutContext, k: torch.Tensor | None, kept: int) -> int:
    """Bytes the per-head (expanded) K and V would take for the kept tokens of an MLA layer."""
    if k is None or ctx.kv_lora_rank is None:
        return 0
    batch = int(k.shape[0]) if k.dim() == 4 else 1
    per_token = ctx.num_attention_heads * (
        (ctx.qk_nope_head_dim or 0) + (ctx.qk_rope_head_dim or 0) + (ctx.mla_v_head_dim or 0))
    return batch * kept * per_token * int(k.element_size())


def valid_kv(cache: Any, reading: LayerReading) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """(K, V, first token position) restricted to the tokens the layer keeps, for content sampling.

    The caller must drop the returned tensors as soon as it has queued their copies."""
    sub = dict(cache_parts(cache)).get(reading.part)
    layers = getattr(sub, "layers", ())
    if sub is None or reading.cache_index >= len(layers) or reading.layer_type == LayerType.SHARED_CONSUMER:
        return None, None, 0
    layer = layers[reading.cache_index]
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if getattr(layer, "_quantized_keys", None) is not None:
        keys = next(iter(tensor_leaves(layer._quantized_keys)), keys)
        values = next(iter(tensor_leaves(layer._quantized_values)), values)
    if not isinstance(keys, torch.Tensor) or keys.dim() < 2:
        return None, None, 0
    kept = reading.tokens_kept
    start = max(reading.tokens_seen - kept, 0)
    if reading.layer_type in (LayerType.STATIC, LayerType.STATIC_SLIDING):
        keys, values = keys[..., :kept, :], values[..., :kept, :]
    return keys, values, start


# ---- the per-step fast path -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FastPlan:
    """What stays constant for one plain dynamic cache, learnt from one full :func:`read_cache` of
    it. Per layer: (class, layer-type code, slides, device, K dtype code, V dtype code). A
    DynamicLayer's device and dtypes are fixed by its first update (``torch.cat`` onto it keeps
    them); the plan is rebuilt at every general read. Holds no tensor. The numpy columns are what
    :class:`FastStep` needs to build its rows off the model's thread."""

    layers: tuple[tuple[type, int, bool, int, int, int], ...]
    classes: tuple[type, ...] = field(init=False)
    sliding: tuple[bool, ...] = field(init=False)
    devices: tuple[int, ...] = field(init=False)
    columns: dict[str, np.ndarray] = field(init=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen dataclass: derived fields are set once, here
        set_(self, "classes", tuple(spec[0] for spec in self.layers))
        set_(self, "sliding", tuple(spec[2] for spec in self.layers))
        set_(self, "devices", tuple(spec[3] for spec in self.layers))
        itemsize = {int(k): v for k, v in DTYPE_ITEMSIZE.items()}
        set_(self, "columns", {
            "layer": np.arange(len(self.layers), dtype=np.int64),
            "layer_type": np.array([spec[1] for spec in self.layers], dtype=np.int64),
            "device": np.array(self.devices, dtype=np.int64),
            "k_dtype": np.array([spec[4] for spec in self.layers], dtype=np.int64),
            "v_dtype": np.array([spec[5] for spec in self.layers], dtype=np.int64),
            "k_itemsize": np.array([itemsize[spec[4]] for spec in self.layers], dtype=np.int64),
            "v_itemsize": np.array([itemsize[spec[5]] for spec in self.layers], dtype=np.int64),
        })


def fast_plan(cache: Any, ctx: LayoutContext, readings: Sequence[LayerReading]) -> FastPlan | None:
    """A plan when every layer of ``cache`` is a plain DynamicLayer / DynamicSlidingWindowLayer with
    its own K and V storages (no KV sharing, no MLA, no offloading, no cross-attention), else None:
    those caches always take the general reader."""
    if _DynamicLayer is None or ctx.consumers or ctx.kv_lora_rank is not None:
        return None
    if len(cache_parts(cache)) != 1 or is_offloading(cache):
        return None
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or not layers or len(readings) != len(layers):
        return None
    plan = []
    for i, (layer, r) in enumerate(zip(layers, readings, strict=True)):
        cls = type(layer)
        if cls is not _DynamicLayer and cls is not _DynamicSliding:
            return None
        if r.cache_index != i or r.part != "self" or len(r.storages) != 2 or r.storages[0][0] == r.storages[1][0]:
            return None
        if int(r.k_dtype) not in _ITEMSIZE_CODES or int(r.v_dtype) not in _ITEMSIZE_CODES:
            return None
        plan.append((cls, int(r.layer_type), cls is _DynamicSliding, r.device, r.k_dtype, r.v_dtype))
    if len({key for r in readings for key, _ in r.storages}) != 2 * len(readings):
        return None  # storages shared across layers: the general accounting de-duplicates them
    return FastPlan(tuple(plan))


_ITEMSIZE_CODES = frozenset(int(k) for k in DTYPE_ITEMSIZE)

# storage key -> (layer, weakref to the untyped storage, weakref to a tensor on it or None): the
# format of RetentionTracker.live, filled in place by the fast path (no call per storage)
LiveMap = dict

_PER_LAYER = 7  # FastStep.values per layer: k shape, v shape, k ptr, v ptr, k bytes, v bytes, seen


class FastStep(RowBlock):
    """One decode step of a cache that matches a :class:`FastPlan`: the few values read per layer
    on the model's thread, turned into /kv rows (and the /steps totals) by the writer's flusher.

    Byte-exact with ``read_cache`` + ``accounting.account`` for these caches: every storage is
    distinct (checked when reading), so allocated == unique == K storage + V storage bytes, and
    valid == K and V elements x item size (what ``Tensor.nbytes`` gives for these dense tensors)."""

    __slots__ = ("_arrays", "plan", "request", "seen", "step", "t", "values")

    def __init__(self, request: int, step: int, t: int, plan: FastPlan, values: list, seen: int) -> None:
        self.request, self.step, self.t, self.plan, self.values, self.seen = request, step, t, plan, values, seen
        self._arrays: dict[str, np.ndarray] | None = None

    def _columns(self) -> dict[str, np.ndarray]:
        if self._arrays is None:
            v, n = self.values, _PER_LAYER
            cols = self.plan.columns
            k_shape = np.array(v[0::n], dtype=np.int64).reshape(-1, 4)
            v_shape = np.array(v[1::n], dtype=np.int64).reshape(-1, 4)
            k_bytes = np.array(v[4::n], dtype=np.uint64)
            v_bytes = np.array(v[5::n], dtype=np.uint64)
            valid = k_shape.prod(axis=1) * cols["k_itemsize"] + v_shape.prod(axis=1) * cols["v_itemsize"]
            self._arrays = {
                "k_shape": k_shape, "v_shape": v_shape,
                "k_storage": np.array(v[2::n], dtype=np.uint64), "v_storage": np.array(v[3::n], dtype=np.uint64),
                "k_storage_bytes": k_bytes, "v_storage_bytes": v_bytes, "own": k_bytes + v_bytes,
                "valid": valid.astype(np.uint64), "tokens_seen": np.array(v[6::n], dtype=np.uint64),
                "tokens_kept": k_shape[:, 2].astype(np.uint64),
            }
        return self._arrays

    def rows_array(self, dtype: np.dtype) -> np.ndarray:
        a, cols = self._columns(), self.plan.columns
        out = np.zeros(len(self.plan.layers), dtype=dtype)
        out["request"], out["step"], out["t_ns"] = self.request, self.step, self.t
        for name in ("layer", "layer_type", "device", "k_dtype", "v_dtype"):
            out[name] = cols[name]
        for name in ("k_shape", "v_shape", "k_storage", "v_storage", "k_storage_bytes", "v_storage_bytes",
                     "tokens_seen", "tokens_kept"):
            out[name] = a[name]
        out["bytes_allocated"] = a["own"]
        out["bytes_unique"] = a["own"]
        out["bytes_valid"] = a["valid"]
        return out

    def totals(self) -> tuple[int, int]:
        """(unique bytes, valid bytes) of the step: naive == unique for these caches."""
        a = self._columns()
        return int(a["own"].sum()), int(a["valid"].sum())

    def rows(self) -> list[KvRow]:
        """The rows as typed tuples (for consumers on the model's thread, e.g. live observers)."""
        return [KvRow._make(r.tolist()) for r in self.rows_array(KV)]


class FastStepTotals(RowBlock):
    """The /steps row of a :class:`FastStep`, built with it by the flusher."""

    __slots__ = ("alloc", "fast", "phase", "reserved", "rss")

    def __init__(self, fast: FastStep, phase: int, alloc: int, reserved: int, rss: int) -> None:
        self.fast, self.phase, self.alloc, self.reserved, self.rss = fast, phase, alloc, reserved, rss

    def rows_array(self, dtype: np.dtype) -> np.ndarray:
        f = self.fast
        unique, valid = f.totals()
        return np.array([(f.request, f.step, self.phase, f.t, f.seen, unique, unique, valid,
                          self.alloc, self.reserved, self.rss)], dtype=dtype)


def read_step_fast(cache: Any, plan: FastPlan, request: int, step: int, t: int,
                   live: LiveMap | None = None) -> FastStep | None:
    """The step's :class:`FastStep` for a cache that matches ``plan``, or None when its layers
    differ from the plan (the caller then takes the general reader).

    Runs at every recorded decode step on the model's thread, so per layer it reads only what
    changes (K/V shapes, their storages' pointers and sizes, the sliding layers' token count) and
    leaves every conversion to the flusher. Every storage goes into ``live`` (retention) with a
    weak reference to the storage only; an entry for the same key is replaced, which for these
    caches can only be the same storage."""
    layers = cache.layers
    if len(layers) != len(plan.classes):
        return None
    values: list = []
    put = values.extend
    tensor_type = torch.Tensor
    wref = weakref.ref
    seen_max = 0
    for i, (layer, cls, sliding) in enumerate(zip(layers, plan.classes, plan.sliding, strict=True)):
        if type(layer) is not cls:
            return None
        k, v = layer.keys, layer.values
        if type(k) is not tensor_type or type(v) is not tensor_type:
            return None
        ks, vs = k.shape, v.shape  # torch.Size: an immutable tuple, no reference to the tensor
        if len(ks) != 4 or len(vs) != 4:
            return None
        kst, vst = k.untyped_storage(), v.untyped_storage()
        kn, vn = kst.nbytes(), vst.nbytes()
        if not kn or not vn:
            return None  # a 0-byte storage is not counted at all by the general reader
        kp, vp = kst.data_ptr(), vst.data_ptr()
        seen = layer.cumulative_length if sliding else ks[2]
        if seen > seen_max:
            seen_max = seen
        put((ks, vs, kp, vp, kn, vn, seen))
        if live is not None:
            dev = plan.devices[i]
            live[(dev, kp, kn)] = (i, wref(kst), None)
            live[(dev, vp, vn)] = (i, wref(vst), None)
    ptrs = values[2::_PER_LAYER] + values[3::_PER_LAYER]
    if len(set(ptrs)) != len(ptrs):
        return None  # a storage shared between layers: only the general accounting de-duplicates
    return FastStep(request, step, t, plan, values, seen_max)
