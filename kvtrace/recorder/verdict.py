"""The retention verdict of a finished request: which of its KV storages are still alive once the
caller could drop generate's output, and who holds them (/retention rows, a NOTE saying when).

The verdict is deferred: taken at the start of the next request on the recorder, or at close. Per
request it costs a weak-reference check; a collection (GC event, AFTER_GC reading) runs only when
storage survived, and ``empty_cache`` (EMPTY_CACHE, AFTER_EMPTY_CACHE) only for a finding. Owns the
pending request and the :class:`~kvtrace.recorder.retention.RetentionTracker`. A serving recorder
would take a verdict per finished request id the same way (``defer`` then ``check``).
"""

from __future__ import annotations

import gc
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvtrace.format.schema import EventKind, Outcome, ReadingLabel
from kvtrace.recorder.context import SessionContext
from kvtrace.recorder.hooks import cache_of_output
from kvtrace.recorder.layouts import LayoutContext, cache_parts, read_cache
from kvtrace.recorder.readings import MemoryReadings
from kvtrace.recorder.retention import RetentionTracker, holder_path
from kvtrace.recorder.rows import RetentionRow


@dataclass
class PendingRetention:
    """A finished request whose retention verdict waits for the next request or close."""

    request: int
    cache: Any  # weakref.ref to its Cache, or None
    outcome: int = int(Outcome.OK)
    exc_id: int = 0  # id() of the exception generate raised (exceptions take no weak references)


class RetentionVerdict:
    def __init__(self, ctx: SessionContext, readings: MemoryReadings,
                 layout: Callable[[], LayoutContext | None]) -> None:
        self.ctx = ctx
        self.readings = readings
        self.layout = layout  # the steps part's layout context, once a Cache was seen
        self.tracker = RetentionTracker()
        self._pending: PendingRetention | None = None
        self.owners: Any = None  # kvtrace.recorder.owners.OwnerRecorder, set by the session
        self.in_flight: BaseException | None = None  # the exception leaving the session's with-block

    def defer(self, request: int, cache_ref: Any, *, outcome: int = int(Outcome.OK), exc_id: int = 0) -> None:
        """Take the verdict of ``request`` later (next request or close), whatever its outcome: a
        failed request's exception holds its cache while it propagates, and may be kept after."""
        self._pending = PendingRetention(request, cache_ref, outcome, exc_id)

    def observe_output(self, out: Any) -> None:
        """The Cache generate returned, observed once more: beam search reorders the cache after its
        last forward (new storages no step saw), and the caller may keep exactly those. Never raises."""
        try:
            cache = cache_of_output(out)
            layout = self.layout()
            if cache is not None and layout is not None:
                read_cache(cache, layout, observe=self.tracker.observe)
            cache = None
        except Exception as exc:  # noqa: BLE001
            self.ctx.error("retention-output", exc)

    def collect(self, rid: int) -> None:
        """gc.collect() for request ``rid``, with its GC event and AFTER_GC reading."""
        collected = gc.collect()
        self.ctx.event(EventKind.GC, rid, value=int(collected))
        self.readings.write(rid, ReadingLabel.AFTER_GC)

    def empty_cache(self, rid: int) -> None:
        if self.readings.devices:
            torch.cuda.empty_cache()
            self.ctx.event(EventKind.EMPTY_CACHE, rid)
            self.readings.write(rid, ReadingLabel.AFTER_EMPTY_CACHE)

    def check(self, when: str) -> None:
        """The deferred retention verdict of the last finished request: after gc, which of its KV
        storages are still alive and (by type) who holds them. Never raises."""
        pending, self._pending = self._pending, None
        if pending is None or self.ctx.writer is None or self.ctx.writer.closed:
            return
        try:
            if pending.exc_id and _propagating(self.in_flight, pending.exc_id):
                # The session closes while the request's own exception leaves its with-block: the
                # traceback holds the cache until it is handled, which happens after close.
                self.tracker.begin()
                self.ctx.event(EventKind.NOTE, pending.request, value=0,
                               text=f"retention not checked at {when}: the request's exception was still propagating")
                return
            # Weak references first: a collection (~0.25 s) runs only when KV storage survived.
            measured = self.ctx.options.empty_cache  # gc and empty_cache already ran at return
            collected = [measured]
            survivors = []
            held: set = set()
            chain: list[str] = []
            if self.tracker.any_alive():
                if measured:
                    gc.collect()
                else:
                    self.collect(pending.request)
                collected[0] = True
                try:  # what holds the Cache, walked once from it (its storages need no walk of their own)
                    held, chain = self._cache_holders(pending.cache)
                except Exception as exc:  # noqa: BLE001 - the rows go out without the holder chain
                    self.ctx.error("retention-holders", exc)
                survivors = self.tracker.finish(frozenset(held))
                if survivors and not measured:  # a finding: show what the driver still holds
                    self.empty_cache(pending.request)
            self.tracker.begin()
            w = self.ctx.writer
            rows = []
            for r in survivors:
                names = [n for n in r.referrers.split(",") if n]
                if (r.device, r.storage, r.nbytes) in held:  # still reachable through that cache
                    names += chain
                elif r.path:
                    names.append(r.path)
                text = ",".join(dict.fromkeys(names))
                off, length = w.add_text(text) if text else (0, 0)
                rows.append(RetentionRow(pending.request, r.layer, r.device, r.storage, r.nbytes, off, length))
            if rows:
                w.append("retention", rows)
            self.ctx.event(EventKind.NOTE, pending.request, value=len(rows), text=f"retention checked at {when}")
            if self.owners is not None:

                def collect() -> None:
                    if not collected[0]:
                        collected[0] = True
                        self.collect(pending.request)

                self.owners.at_verdict(pending.request, pending.outcome, survivors, collect)
        except Exception as exc:  # noqa: BLE001
            self.ctx.error("retention-check", exc)

    def _cache_holders(self, ref: Any) -> tuple[set, list[str]]:
        """(storage keys the request's Cache still holds, type names from its sub-caches up to what
        holds the Cache) when that Cache is alive; (set(), []) otherwise."""
        cache = ref() if ref is not None else None
        if cache is None:
            return set(), []
        try:
            held: set = set()
            layout = self.layout()
            if layout is not None:
                read_cache(cache, layout, observe=lambda key, layer, tensor: held.add(key))
            # no comprehension may name `cache`: it would become a closure cell, a referrer of its own
            chain = [type(sub).__name__ for sub in _sub_caches(cache)]
            chain.append(type(cache).__name__)
            chain.extend(_holder_names(cache))
            path = holder_path(cache)  # up to a root: a global, a kept exception's traceback, ...
            if path:
                chain.append(f"{type(cache).__name__} < {path}")
            return held, chain
        finally:
            del cache


def _sub_caches(cache: Any) -> list[Any]:
    out = []
    for _, sub in cache_parts(cache):
        if sub is not cache:
            out.append(sub)
    return out


def _holder_names(obj: Any) -> list[str]:
    """Type names of what refers to ``obj``, an instance ``__dict__`` named by its owner's type;
    frames (the caller's local variables, our own) are left out."""
    names: dict[str, None] = {}
    refs = gc.get_referrers(obj)
    try:
        for r in refs:
            if isinstance(r, types.FrameType):
                continue
            name = type(r).__name__
            if type(r) is dict:  # maybe an instance __dict__: name its owner
                owner = next((o for o in gc.get_referrers(r)
                              if o is not refs and getattr(o, "__dict__", None) is r), None)
                name = type(owner).__name__ if owner is not None else "dict"
            names[name] = None
    finally:
        del refs
    return list(names)


def _propagating(exc: BaseException | None, exc_id: int) -> bool:
    """Is the exception with id ``exc_id`` the one in flight, or chained inside it?"""
    seen = 0
    while exc is not None and seen < 32:
        if id(exc) == exc_id:
            return True
        exc, seen = exc.__context__ or exc.__cause__, seen + 1
    return False
