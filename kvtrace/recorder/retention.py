"""Which KV storages of a request outlive it, and who still holds them.

During a request the tracker keeps, per storage identity, a weak reference to the untyped storage
(torch keeps a storage's Python object alive exactly as long as the storage itself, so the weak
reference dies with the memory) and one to the last tensor seen on it (to ask the garbage collector
who refers to it). It never holds a strong reference: recording cannot be the reason memory stays.
After generate returns, :meth:`RetentionTracker.any_alive` says whether any storage survived (no
collection needed to know that none did); if some did, the caller collects and
:meth:`RetentionTracker.finish` lists the survivors.
"""

from __future__ import annotations

import gc
import sys
import types
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from kvtrace.recorder.layouts import StorageKey, device_index

_PRUNE_EVERY = 64  # steps between sweeps of dead entries (bounds memory on long requests)
_MAX_REPORTED = 4096  # retained storages reported per request


@dataclass(frozen=True)
class Retained:
    layer: int
    device: int
    storage: int
    nbytes: int
    referrers: str  # comma-joined type names of the objects holding the tensor ("" if unknown)


class RetentionTracker:
    def __init__(self) -> None:
        # key -> (layer, storage weakref, tensor weakref or None)
        self._live: dict[StorageKey, tuple[int, weakref.ref, weakref.ref | None]] = {}
        self._steps = 0

    def begin(self) -> None:
        self._live.clear()
        self._steps = 0

    def observe(self, key: StorageKey, layer: int, tensor: torch.Tensor) -> None:
        """Remember a storage seen at this step (cheap when already known and alive)."""
        entry = self._live.get(key)
        if entry is not None and entry[1]() is not None:
            return
        try:
            swr = weakref.ref(tensor.untyped_storage())
        except (TypeError, RuntimeError):
            return
        try:
            twr: weakref.ref | None = weakref.ref(tensor)
        except TypeError:
            twr = None
        self._live[key] = (layer, swr, twr)

    @property
    def live(self) -> dict[StorageKey, tuple[int, weakref.ref, weakref.ref | None]]:
        """The storage map itself, for the per-step fast path (layouts.read_rows_fast) to fill in
        place: key -> (layer, weakref to the untyped storage, weakref to a tensor on it)."""
        return self._live

    def any_alive(self) -> bool:
        """Does any storage seen since :meth:`begin` still exist? Weak references only: no
        collection, microseconds per storage. False means no collection could find any."""
        return any(swr() is not None for _, swr, _ in self._live.values())

    def end_step(self) -> None:
        self._steps += 1
        if self._steps % _PRUNE_EVERY == 0:
            self._live = {k: v for k, v in self._live.items() if v[1]() is not None}

    def finish(self) -> list[Retained]:
        """Survivors after the caller's gc.collect(); clears the tracker."""
        entries, self._live = self._live, {}
        survivors = []
        for key, (layer, swr, twr) in entries.items():
            if swr() is None:
                continue
            if len(survivors) >= _MAX_REPORTED:
                break
            survivors.append((key, layer, twr))
        # The fast path keeps no tensor reference: find tensors for those storages in one scan.
        missing = {key for key, _, twr in survivors if twr is None or twr() is None}
        found_tensors = _tensors_on(missing) if missing else {}
        found: list[Retained] = []
        for key, layer, twr in survivors:
            tensor = twr() if twr is not None else None
            if tensor is None:
                tensor = found_tensors.get(key)
            device, ptr, nbytes = key
            found.append(Retained(layer, device, ptr, nbytes, _referrers(tensor, (entries, found_tensors))))
            tensor = None
        found_tensors.clear()
        return found


def _tensors_on(keys: set[StorageKey]) -> dict[StorageKey, torch.Tensor]:
    """One live tensor per storage key, found by scanning the garbage collector's objects. Runs
    only when storages survived a request (rare), never per step."""
    out: dict[StorageKey, torch.Tensor] = {}
    tensor_type = torch.Tensor
    for obj in gc.get_objects():
        if not issubclass(type(obj), tensor_type):  # type(), not isinstance: no __class__ lookups
            continue
        try:
            st = obj.untyped_storage()
            key = (device_index(obj.device), st.data_ptr(), st.nbytes())
        except (RuntimeError, NotImplementedError, TypeError):
            continue
        if key in keys and key not in out:
            out[key] = obj
            if len(out) == len(keys):
                break
    return out


def _referrers(tensor: torch.Tensor | None, own: tuple[Any, ...]) -> str:
    """Type names of what refers to the tensor, an object's ``__dict__`` named by its owner's type.

    The recorder's own frames and containers are excluded so they can never appear."""
    if tensor is None:
        return ""
    names: list[str] = []
    try:
        this_frame = sys._getframe()
        refs = gc.get_referrers(tensor)
        for r in refs:
            if any(r is o for o in own) or isinstance(r, types.FrameType) or r is this_frame:
                continue
            name = _owner_name(r, refs)
            if name and name not in names:
                names.append(name)
        del refs
    finally:
        del tensor
    return ",".join(names)


def _owner_name(obj: Any, exclude: list[Any]) -> str:
    if isinstance(obj, dict):
        for o in gc.get_referrers(obj):
            if o is exclude or isinstance(o, types.FrameType):
                continue
            if getattr(o, "__dict__", None) is obj:
                return type(o).__name__
        return "dict"
    return type(obj).__name__
