"""Read the constant-size state a hybrid model's cache holds beside its KV (format 1.5 /state).

Hybrid models mix attention with layers that keep a state instead of a KV. transformers holds it in
two ways, both read here by feature, never by model name or release:

* layers built on ``LinearAttentionCacheLayerMixin`` (``LinearAttentionLayer`` and the
  ``LinearAttentionAnd*AttentionLayer`` parallel hybrids): ``conv_states`` and ``recurrent_states``,
  dicts ``{state_idx: tensor or None}``. Any layer object with those dict attributes is read the
  same way (a model may register its own layer class).
* tensors the cache object itself holds outside ``layers`` (MiniMax's ``MiniMaxCache.linear_cache``,
  a list indexed by layer): every tensor found by walking the cache's own attributes (lists, tuples,
  dicts and tensor subclasses, a few levels deep) is a state of kind ``other``. An attribute holding a
  list or dict of at most one entry per layer ties each entry to that layer.

Each state tensor is one :class:`StateReading` (plain ints: nothing here keeps a tensor alive),
de-duplicated by storage against the step's KV storages and the states before it, exactly as
:mod:`kvtrace.recorder.accounting` does for the KV.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtrace.format.schema import STATE_MAX_NDIM, StateKind, StateRow
from kvtrace.recorder.layouts import (
    LayerReading,
    Observer,
    StorageKey,
    cache_parts,
    device_index,
    dtype_code,
    tensor_leaves,
)

_CONV = int(StateKind.CONV)
_RECURRENT = int(StateKind.RECURRENT)
_OTHER = int(StateKind.OTHER)
_STATE_DICTS = (("conv_states", _CONV), ("recurrent_states", _RECURRENT))
_MAX_DEPTH = 4  # nesting walked inside one cache attribute (MiniMax: list -> tensor)
_MAX_TENSORS = 4096  # tensors taken from the cache object's own attributes (a hostile/odd cache)


@dataclass(slots=True)
class StateReading:
    """One state tensor of one cache at one step."""

    layer: int  # decoder layer, -1 when the cache does not tie it to one
    kind: int  # StateKind code
    index: int  # state_idx, or the position inside the cache attribute
    device: int
    dtype: int  # CacheDType code
    shape: tuple[int, ...]
    storage: StorageKey
    storage_bytes: int
    valid_bytes: int
    source: str


def _reading(t: torch.Tensor, layer: int, kind: int, index: int, source: str) -> StateReading | None:
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    nbytes = int(s.nbytes())
    if nbytes == 0:
        return None
    dev = device_index(t.device)
    return StateReading(layer, kind, index, dev, dtype_code(t.dtype), tuple(int(x) for x in t.shape),
                        (dev, int(s.data_ptr()), nbytes), nbytes, int(t.numel()) * int(t.element_size()), source)


def _tensors(obj: Any, path: str, depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) of every plain tensor inside ``obj`` (tensor subclasses by their leaves)."""
    if depth > _MAX_DEPTH or obj is None:
        return
    if isinstance(obj, torch.Tensor):
        for leaf in tensor_leaves(obj):  # a tensor subclass by its leaves
            yield path, leaf
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from _tensors(item, f"{path}[{i}]", depth + 1)
    elif isinstance(obj, Mapping):
        for k, item in obj.items():
            yield from _tensors(item, f"{path}[{k!r}]" if not isinstance(k, int) else f"{path}[{k}]", depth + 1)


def _layer_states(layer: Any, index: int, path: str) -> Iterator[tuple[StateReading, torch.Tensor]]:
    for attr, kind in _STATE_DICTS:
        states = getattr(layer, attr, None)
        if not isinstance(states, Mapping):
            continue
        for idx, value in states.items():
            if value is None:
                continue
            for source, t in _tensors(value, f"{path}.{attr}[{idx}]"):
                r = _reading(t, index, kind, int(idx) if isinstance(idx, int) else 0, source)
                if r is not None:
                    yield r, t


def _cache_states(cache: Any, n_layers: int) -> Iterator[tuple[StateReading, torch.Tensor]]:
    """Tensors the cache object holds in its own attributes (not in ``layers``)."""
    try:
        attrs = vars(cache)
    except TypeError:  # __slots__ objects: no model-specific state to find this way
        return
    taken = 0
    for name, value in list(attrs.items()):
        if name == "layers" or isinstance(value, _SCALARS) or value is None:
            continue
        per_layer = isinstance(value, (list, tuple)) and 0 < len(value) <= n_layers or (
            isinstance(value, Mapping) and 0 < len(value) <= n_layers and all(isinstance(k, int) for k in value))
        items = (enumerate(value) if isinstance(value, (list, tuple)) else value.items()) if per_layer else [(None, value)]
        for key, item in items:
            for pos, (source, t) in enumerate(_tensors(item, name if key is None else f"{name}[{key}]")):
                layer = int(key) if key is not None and 0 <= int(key) < n_layers else -1
                r = _reading(t, layer, _OTHER, pos, source)
                if r is not None:
                    yield r, t
                    taken += 1
                    if taken >= _MAX_TENSORS:
                        return


_SCALARS = (str, bytes, int, float, bool, type)


def _may_hold_tensors(cache: Any) -> bool:
    """Whether the cache object has an attribute besides ``layers`` that could hold a tensor (a
    DynamicCache holds flags and a class only: the walk is skipped)."""
    try:
        attrs = vars(cache)
    except TypeError:
        return False
    return any(v is not None and not isinstance(v, _SCALARS) for k, v in attrs.items() if k != "layers")


def read_states(cache: Any, n_layers: int, observe: Observer | None = None) -> list[StateReading]:
    """Every state tensor of ``cache``: its layers' conv and recurrent states, then the tensors its
    cache object (each part of an encoder-decoder cache) holds outside ``layers``. ``observe`` as in
    :func:`kvtrace.recorder.layouts.read_cache` (retention tracking; it must not keep the tensor)."""
    out: list[StateReading] = []
    for part, sub in cache_parts(cache):
        layers = getattr(sub, "layers", None)
        layers = layers if isinstance(layers, (list, tuple)) else ()
        found = []
        for i, layer in enumerate(layers):
            # most layers (attention-only models) hold no state dict: no generator built for them
            if isinstance(getattr(layer, "conv_states", None), Mapping) or \
                    isinstance(getattr(layer, "recurrent_states", None), Mapping):
                found.append(_layer_states(layer, i if part == "self" else i + n_layers,
                                           f"layers[{i}]" if part == "self" else f"cross.layers[{i}]"))
        if _may_hold_tensors(sub):
            found.append(_cache_states(sub, max(n_layers, len(layers))))
        for pairs in found:
            for r, t in pairs:
                out.append(r)
                if observe is not None:
                    observe(r.storage, r.layer, t)
    return out


def state_rows(rid: int, step: int, t: int, readings: Sequence[LayerReading], states: Sequence[StateReading],
               text_ref: Any) -> tuple[list[Any], int, int]:
    """(/state rows, unique bytes, valid bytes) of one step. ``bytes_unique`` de-duplicates each
    storage against the step's KV storages and the states before it. ``text_ref(source)`` gives the
    (offset, length) of a source string in /text."""
    counted: set[StorageKey] = {key for r in readings for key, _ in r.storages}
    rows = []
    unique = valid = 0
    for s in states:
        added = 0
        if s.storage not in counted:
            counted.add(s.storage)
            added = s.storage_bytes
        shape = _shape6(s.shape)
        off, length = text_ref(s.source)
        rows.append(StateRow(rid, step, s.layer, s.kind, min(s.index, 0xFFFF), s.device, s.dtype,
                             min(len(s.shape), STATE_MAX_NDIM), shape, s.storage_bytes, s.valid_bytes, added,
                             s.storage[1], off, length, t))
        unique += added
        valid += s.valid_bytes if added else 0
    return rows, unique, valid


def _shape6(shape: tuple[int, ...]) -> list[int]:
    """The shape in 6 entries: more dimensions fold their leading ones into the first."""
    dims = list(shape)
    if len(dims) > STATE_MAX_NDIM:
        lead = 1
        for d in dims[: len(dims) - STATE_MAX_NDIM + 1]:
            lead *= d
        dims = [lead, *dims[len(dims) - STATE_MAX_NDIM + 1:]]
    return dims + [0] * (STATE_MAX_NDIM - len(dims))
