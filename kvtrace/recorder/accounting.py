"""Exact KV byte accounting by storage identity.

Two tensors share memory exactly when they share an untyped storage, identified here by
(device, storage data_ptr, storage nbytes). Values are never compared: equal values in distinct
storages cost twice, one storage seen through two tensors (K is V, a consumer reading a producer,
a view kept by two layers) costs once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtrace.recorder.layouts import LayerReading, StorageKey


@dataclass(frozen=True)
class StepBytes:
    naive: int  # sum of every storage of every layer, no de-duplication (what a naive tool reports)
    unique: int  # de-duplicated over the whole cache
    valid: int  # bytes holding kept tokens (layers wholly aliasing earlier layers not re-added)
    allocated: list[int]  # per reading: distinct storage bytes within the layer
    unique_per_layer: list[int]  # per reading: bytes not already counted by an earlier layer


def layer_allocated(reading: LayerReading) -> int:
    """Bytes of the distinct storages one layer owns (K aliasing V counts once)."""
    seen: set[StorageKey] = set()
    total = 0
    for key, nbytes in reading.storages:
        if key not in seen:
            seen.add(key)
            total += nbytes
    return total


def account(readings: Sequence[LayerReading]) -> StepBytes:
    """Per-layer allocated/unique bytes and the cache totals, layers taken in order."""
    counted: set[StorageKey] = set()
    naive = unique = valid = 0
    allocated: list[int] = []
    unique_per: list[int] = []
    for r in readings:
        allocated.append(layer_allocated(r))
        added = 0
        for key, nbytes in r.storages:
            naive += nbytes
            if key not in counted:
                counted.add(key)
                added += nbytes
        unique_per.append(added)
        unique += added
        if added or not r.storages:  # a layer entirely aliasing earlier ones adds no valid bytes
            valid += r.bytes_valid
    return StepBytes(naive, unique, valid, allocated, unique_per)
