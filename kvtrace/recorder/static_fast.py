"""The per-step reader of static caches (``StaticLayer`` / ``StaticSlidingWindowLayer``): the path
``generate(cache_implementation="static")`` takes, which transformers compiles on GPUs.

A static cache preallocates every layer's K and V once and writes into them in place, so everything
the general reader finds (shapes, dtypes, storages, allocated bytes, the accounting across layers)
is fixed once a request's first structure read has seen it. What changes is how many tokens each
layer holds, and reading that from the cache costs a device sync on a GPU (``cumulative_length`` of a
full static layer is a device tensor) that drains the compiled step's queue. The recorder already
counts the tokens it feeds the model (``RequestState.fed``), so a full static layer's count is known
without touching the device; a sliding static layer keeps a host-side count
(``cumulative_length_int``). Per structure step this reads, on the model's thread, one identity
check per layer and one integer per sliding layer; the flusher builds the rows.

Byte-exact with the general reader for the caches a :class:`StaticPlan` accepts (tested against it).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtrace.format.schema import KV
from kvtrace.recorder.layouts import FastStep, LayerReading, LiveMap, cache_parts, is_offloading

try:
    from transformers import cache_utils as _cu

    _STATIC = getattr(_cu, "StaticLayer", None)
    _STATIC_SLIDING = getattr(_cu, "StaticSlidingWindowLayer", None)
except ImportError:  # pragma: no cover - the recorder needs transformers
    _STATIC = _STATIC_SLIDING = None


@dataclass(frozen=True)
class StaticPlan:
    """One static cache as its first structure read saw it. Holds weak references only."""

    layers: tuple[weakref.ref, ...]  # the layer objects
    keys: tuple[weakref.ref, ...]  # each layer's K tensor (written in place, never replaced)
    values: tuple[weakref.ref, ...]
    sliding: tuple[bool, ...]
    max_len: np.ndarray  # tokens each layer can hold (its preallocation)
    token_bytes: np.ndarray  # K + V bytes of one token of the whole batch, per layer
    template: np.ndarray  # the /kv rows of the read, in KV's dtype: the fixed columns
    live: tuple[tuple[Any, int, weakref.ref], ...]  # retention entries: (storage key, layer, storage)


def static_plan(cache: Any, readings: list[LayerReading], rows: list) -> StaticPlan | None:
    """A plan when every layer of ``cache`` is a StaticLayer or StaticSlidingWindowLayer (exactly those
    classes: a subclass may manage its tensors otherwise) with its own K and V storages, else None.
    ``rows``: the /kv rows (KvRow tuples) the general reader built from ``readings`` at this read."""
    if _STATIC is None or len(cache_parts(cache)) != 1 or is_offloading(cache):
        return None
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or not layers or len(layers) != len(readings) or len(rows) != len(layers):
        return None
    keys, values, sliding, max_len, token_bytes, live, storages = [], [], [], [], [], [], set()
    for i, (layer, r) in enumerate(zip(layers, readings, strict=True)):
        cls = type(layer)
        if cls is not _STATIC and cls is not _STATIC_SLIDING:
            return None
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        if k is None or v is None or r.cache_index != i or r.part != "self" or len(r.storages) != 2:
            return None
        if k.dim() != 4 or v.dim() != 4 or k.shape[-2] == 0:
            return None
        storages.update(key for key, _ in r.storages)
        keys.append(weakref.ref(k))
        values.append(weakref.ref(v))
        sliding.append(cls is _STATIC_SLIDING)
        max_len.append(int(layer.max_cache_len))
        token_bytes.append(k.nbytes // int(k.shape[-2]) + v.nbytes // int(v.shape[-2]))
        live.append((r.storages[0][0], i, weakref.ref(k.untyped_storage())))
        live.append((r.storages[1][0], i, weakref.ref(v.untyped_storage())))
    if len(storages) != 2 * len(layers):
        return None  # storages shared between layers: only the general accounting de-duplicates
    return StaticPlan(tuple(weakref.ref(layer) for layer in layers), tuple(keys), tuple(values), tuple(sliding),
                      np.array(max_len, dtype=np.int64), np.array(token_bytes, dtype=np.int64),
                      np.array([tuple(r) for r in rows], dtype=KV), tuple(live))


class StaticStep(FastStep):
    """One structure step of a static cache: the template rows with this step's token counts."""

    __slots__ = ("counts",)

    def __init__(self, request: int, step: int, t: int, plan: StaticPlan, counts: list[int]) -> None:
        # FastStep's fields, as its /steps totals and observers read them
        super().__init__(request, step, t, plan, [], int(max(counts)))  # type: ignore[arg-type]
        self.counts = counts

    def rows_array(self, dtype: np.dtype) -> np.ndarray:
        plan: StaticPlan = self.plan  # type: ignore[assignment]
        out = plan.template.astype(dtype, copy=True)
        seen = np.array(self.counts, dtype=np.int64)
        kept = np.minimum(seen, plan.max_len)
        out["request"], out["step"], out["t_ns"] = self.request, self.step, self.t
        out["tokens_seen"], out["tokens_kept"] = seen, kept
        out["bytes_valid"] = kept * plan.token_bytes
        return out

    def totals(self) -> tuple[int, int]:
        rows = self.rows_array(KV)
        return int(rows["bytes_unique"].sum()), int(rows["bytes_valid"].sum())


def read_step_static(cache: Any, plan: StaticPlan, request: int, step: int, t: int, fed: int,
                     live: LiveMap | None = None) -> StaticStep | None:
    """The step's rows for a cache that still matches ``plan``, or None (the caller then takes the
    general reader). ``fed``: tokens fed to the model so far in this request (what a full static
    layer holds, counted from the inputs instead of read from the device)."""
    layers = cache.layers
    if len(layers) != len(plan.layers):
        return None
    counts = []
    for layer, lref, kref, vref, sliding in zip(layers, plan.layers, plan.keys, plan.values, plan.sliding,
                                                strict=True):
        if layer is not lref() or layer.keys is not kref() or layer.values is not vref():
            return None
        counts.append(int(getattr(layer, "cumulative_length_int", fed)) if sliding else fed)
    if live is not None:
        for key, index, swr in plan.live:
            live[key] = (index, swr, None)
    return StaticStep(request, step, t, plan, counts)
