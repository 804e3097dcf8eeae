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
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtrace.recorder.layouts import StorageKey, device_index

_PRUNE_EVERY = 64  # steps between sweeps of dead entries (bounds memory on long requests)
_MAX_REPORTED = 4096  # retained storages reported per request
_MAX_PATHS = 4  # distinct holder paths walked per request (each walk scans the gc's objects a few times)


@dataclass(frozen=True)
class Retained:
    layer: int
    device: int
    storage: int
    nbytes: int
    referrers: str  # comma-joined type names of the objects holding the tensor ("" if unknown)
    ref: Any = field(default=None, compare=False, repr=False)  # weakref to the untyped storage
    path: str = ""  # what keeps it alive, outward from its holder to a root (see holder_path)


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

    def finish(self, walked: frozenset = frozenset()) -> list[Retained]:
        """Survivors after the caller's gc.collect(); clears the tracker. What holds each is walked
        (:func:`holder_path`) except for storage keys in ``walked`` (the caller walked their holder)."""
        entries, self._live = self._live, {}
        survivors = []
        for key, (layer, swr, twr) in entries.items():
            if swr() is None:
                continue
            if len(survivors) >= _MAX_REPORTED:
                break
            survivors.append((key, layer, swr, twr))
        # The fast path keeps no tensor reference: find tensors for those storages in one scan.
        # Views count: a slice kept by user code holds the whole storage, and is found here by it.
        # A tensor seen during the request may live on only as a view's base (held from C++, no
        # Python referrer): then the tensors sharing its storage name the holder.
        keys = {key for key, _, _, _ in survivors}
        found_tensors = _tensors_on(keys) if keys else {}
        found: list[Retained] = []
        paths: dict[str, str] = {}  # holder names -> path, walked once per distinct holder set
        for key, layer, swr, twr in survivors:
            first = twr() if twr is not None else None
            candidates = ([first] if first is not None else []) + found_tensors.get(key, [])
            first = None
            own = (entries, found_tensors, survivors, found, candidates, *found_tensors.values())
            names, tensor = "", None
            for cand in candidates:
                names = _referrers(cand, own)
                if names:
                    tensor = cand
                    break
            if tensor is None and candidates:
                tensor = candidates[0]
            candidates.clear()
            device, ptr, nbytes = key
            if key not in walked and names not in paths and len(paths) < _MAX_PATHS and tensor is not None:
                paths[names] = holder_path(tensor, own)
            found.append(Retained(layer, device, ptr, nbytes, names, swr, paths.get(names, "")))
            tensor = None
        found_tensors.clear()
        return found


def _tensors_on(keys: set[StorageKey], per_key: int = 8) -> dict[StorageKey, list[torch.Tensor]]:
    """Up to ``per_key`` live tensors per storage key (the tensor and its views), found by scanning
    the garbage collector's objects. Runs only when storages survived a request, never per step."""
    out: dict[StorageKey, list[torch.Tensor]] = {}
    kinds = tensor_types()
    for obj in gc.get_objects():
        if type(obj) not in kinds:  # type(), not isinstance: no __class__ or metaclass lookups
            continue
        try:
            st = obj.untyped_storage()
            key = (device_index(obj.device), st.data_ptr(), st.nbytes())
        except (RuntimeError, NotImplementedError, TypeError):
            continue
        if key in keys:
            have = out.setdefault(key, [])
            if len(have) < per_key:
                have.append(obj)
    return out


def tensor_types() -> set[type]:
    """torch.Tensor and every subclass defined now (a set lookup per object is what makes a scan of
    the collector's ~0.5 M objects cheap; issubclass against torch's metaclass is not)."""
    kinds: set[type] = set()
    todo = [torch.Tensor]
    while todo:
        k = todo.pop()
        if k not in kinds:
            kinds.add(k)
            todo.extend(k.__subclasses__())
    return kinds


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


# ---- what keeps an object alive: a bounded walk up the referrer graph --------------------------------

_PATH_DEPTH = 12  # referrer levels walked (each level is one scan of the garbage collector's objects)
_PATH_WIDTH = 48  # objects followed per level
_SKIP_TYPES = (types.FrameType, types.CodeType, types.ModuleType, type)


def holder_path(obj: Any, own: tuple[Any, ...] = ()) -> str:
    """What keeps ``obj`` alive, outward from its nearest holder to a root, e.g.
    ``DynamicLayer < DynamicCache < dict < frame of _sample (utils.py:2780) < traceback of ValueError <
    list < global HELD of __main__``. Levels of referrers are found in one
    ``gc.get_referrers`` scan each (at most :data:`_PATH_DEPTH`); a frame kept by a traceback jumps
    straight to the exception holding that traceback. Roots: a module's globals, the exception being
    handled now (``sys.exc_info``), or nothing the garbage collector can see (a local variable of a
    running function, C code). The recorder's own containers (``own``) are never part of a path.
    Runs only for storage that survived a request; never raises."""
    try:
        return _holder_path(obj, own)
    except Exception:  # noqa: BLE001 - a name is a courtesy; the proof is the weak reference
        return ""


def _holder_path(obj: Any, own: tuple[Any, ...]) -> str:
    skip = {id(o) for o in own}
    parent: dict[int, int] = {}  # id(holder) -> id(what it holds), towards obj
    node: dict[int, Any] = {id(obj): obj}
    frontier = [obj]
    handling = sys.exc_info()[1]
    root: int | None = None
    root_text = ""
    this = sys._getframe()
    for _ in range(_PATH_DEPTH):
        skip.update((id(frontier), id(parent), id(node)))
        refs = gc.get_referrers(*frontier)
        skip.add(id(refs))
        want = {id(f) for f in frontier}
        nxt: list[Any] = []
        tb_frames: list[Any] = []
        for r in refs:
            kind = type(r)  # type(), never isinstance: no __class__ lookups on arbitrary objects
            if id(r) in skip or id(r) in node or r is this or issubclass(kind, _SKIP_TYPES[1:]):
                continue
            child = next((c for c in gc.get_referents(r) if id(c) in want), None)
            if child is None:
                continue
            if kind is types.TracebackType:  # jump: the exception whose traceback holds the frame
                tb_frames.append(child)
                continue
            if kind is types.FrameType:
                node[id(r)], parent[id(r)] = r, id(child)
                nxt.append(r)
                continue
            node[id(r)], parent[id(r)] = r, id(child)
            if kind is dict and _module_of(r) is not None:
                root, root_text = id(r), _global_name(r, child)
                break
            nxt.append(r)
        del refs
        if root is not None:
            break
        for frame, exc in _exceptions_with_frames(tb_frames):
            if id(exc) not in node:
                node[id(exc)], parent[id(exc)] = exc, id(frame)
                nxt.append(exc)
        hit = next((o for o in nxt if o is handling), None)
        if hit is not None:
            root, root_text = id(hit), f"the exception being handled now ({type(hit).__name__})"
            break
        frontier = nxt[:_PATH_WIDTH]
        nxt = tb_frames = []  # no list of this walk may show up as a holder at the next level
        if not frontier:
            break
    names: list[str] = []
    if root is None:  # the longest chain found, ended by what the collector cannot see
        if not parent:
            return "nothing the garbage collector tracks (a local variable of a running function or C code)"
        root = max(parent, key=lambda k: _depth(k, parent))
        root_text = ""
    cur: int | None = root
    while cur is not None and cur != id(obj):
        names.append(_describe(node[cur], parent, node))
        cur = parent.get(cur)
    names.reverse()
    if root_text:
        names[-1] = root_text
    elif names:
        names.append("(not held further by anything the garbage collector tracks: a running function's local?)")
    node.clear()
    # one entry of the comma-separated /retention referrers: no commas inside
    return " < ".join(n for n in names if n).replace(",", ";")


def _depth(k: int, parent: dict[int, int]) -> int:
    d = 0
    while k in parent and d < 64:
        k, d = parent[k], d + 1
    return d


def _exceptions_with_frames(frames: list[Any]) -> list[tuple[Any, BaseException]]:
    """(frame, exception) for each exception whose traceback chain holds one of ``frames``: one scan
    of the collector's objects for all of them."""
    if not frames:
        return []
    want = {id(f): f for f in frames}
    out = []
    for obj in gc.get_objects():
        if not issubclass(type(obj), BaseException):
            continue
        tb = obj.__traceback__
        n = 0
        while tb is not None and n < 256:
            if id(tb.tb_frame) in want:
                out.append((tb.tb_frame, obj))
                break
            tb, n = tb.tb_next, n + 1
    return out


def _module_of(d: dict) -> str | None:
    name = d.get("__name__") if "__builtins__" in d or "__loader__" in d else None
    return name if isinstance(name, str) else None


def _global_name(d: dict, value: Any) -> str:
    name = next((k for k, v in d.items() if v is value), "?")
    return f"global {name} of module {_module_of(d)}"


def _describe(o: Any, parent: dict[int, int], node: dict[int, Any]) -> str:
    kind = type(o)
    if kind is types.FrameType:
        code = o.f_code
        return f"frame of {code.co_name} ({code.co_filename.rsplit('/', 1)[-1]}:{o.f_lineno})"
    if issubclass(kind, BaseException):
        return f"{kind.__name__} exception (its traceback)"
    if type(o) is dict:  # maybe an instance __dict__: its owner names it
        for holder in gc.get_referrers(o):
            if getattr(holder, "__dict__", None) is o:
                return ""  # the owner object is the next name in the path
        return "dict"
    if kind is types.CellType:
        return "closure cell"
    if kind is types.FunctionType:
        return f"function {o.__qualname__}"
    return kind.__name__
