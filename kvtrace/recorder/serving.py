"""The serving part of the recorder (issue 16, first floor): continuous batching
(``model.generate_batch``, ``init_continuous_batching`` / ``ContinuousBatchingManager``) recorded
into the existing tables, without a format change.

What it writes, per continuous-batching (CB) request of the recorded model:

* one /requests row (outcome RUNNING at ``add_request``; prompt tokens, prompt hash, and in
  gen_args the manager's string id as ``cb_request_id``), updated at the end with new tokens,
  outcome and end time: ``Scheduler.finish_request`` gives OK (ERROR when transformers marked the
  request FAILED); ``ContinuousBatchProcessor._handle_request_error`` gives ERROR with the error's
  text; ``Scheduler.clear_cancelled_requests`` gives INTERRUPTED with the error text
  "cancelled"; a request still in flight when the recording closes gives INTERRUPTED too;
* events: REQUEST_START when queued (add_request), a NOTE "scheduled" the first step that the
  scheduler admits it (again after each preemption), a NOTE "first token" as the batch update
  that produced it returns (its t_ns - start_ns is the time to first token), NOTE "preempted"
  when transformers offloads or soft-resets it, REQUEST_END when finished or cancelled;
* per scheduler step (one ``ContinuousBatchProcessor.prepare_next_batch`` that found work), one
  NOTE event, request -1, step = the CB step index, value = blocks in use, and as text a JSON object
  with the paged cache's occupancy as the cache's own counters say: ``pool_bytes`` (the up-front
  pool), ``free_bytes`` (``compute_free_capacity(relative=False)``), per attention-type allocator
  distinct blocks in use (over the block tables) and total, ``tokens_per_block``, ``tokens_cached`` (Σ
  position_offset of the admitted requests, which the scheduler has already advanced: the tokens
  positions the cache holds once this step's forward has written them; a sliding-window allocator
  keeps only the window of them) and
  the running / waiting request counts, and the batch: ``batch_requests``, ``prefill_tokens`` and
  ``decode_tokens`` (query tokens of this step's forward: prompt positions, recomputed ones after a soft reset
  included, are prefill).

``generate(cache_implementation="paged")`` is transformers' switch to generate_batch: the generate
wrapper passes it through, and its sequences are recorded here, one CB request each.

Nothing goes to /steps, /kv or /layers: those tables describe one request's forwards through a
transformers Cache, and the paged cache is not one (it reaches attention as ``cache=``).

The hooks wrap methods on the transformers classes for the duration of the recording, and act only
for managers whose ``model`` is the recorded model; :meth:`ServingRecorder.remove` restores the
exact originals. Written against transformers 5.23's internals (``_create_batch_processor``,
``cache_allocators``, ``block_table``, ``position_offset``); where one of them is missing (5.17 has
``group_cache_managers`` instead) the occupancy NOTE says "unsupported transformers version" rather
than guessing numbers; where a hooked method is missing, nothing is patched and one NOTE says
"continuous batching is not recorded: unsupported transformers version". The methods patched are those DESIGN.md lists as stable across 5.17 and 5.23
plus ``_create_batch_processor`` (to tie a scheduler to its manager).
"""

from __future__ import annotations

import hashlib
import json
import threading
from typing import Any

from kvtrace.format.schema import EventKind, Outcome
from kvtrace.format.writer import monotonic_ns
from kvtrace.recorder.context import MAX_ERROR_TEXT, SessionContext
from kvtrace.recorder.rows import RequestRow

UNSUPPORTED = "unsupported transformers version"


class _Flight:
    """One CB request in flight: its trace id and whether the scheduler admitted it yet."""

    __slots__ = ("first", "rid", "scheduled")

    def __init__(self, rid: int) -> None:
        self.rid = rid
        self.scheduled = False
        self.first = False  # its first token was seen (the "first token" NOTE is written)


class ServingRecorder:
    """Continuous-batching hooks of one session. ``next_id`` / ``take_id`` share the session's
    request-id sequence with the generate wrapper (ids stay unique in /requests)."""

    def __init__(self, model: Any, ctx: SessionContext, salt: bytes, take_id: Any) -> None:
        self.model = model
        self.ctx = ctx
        self.salt = salt
        self.take_id = take_id
        self.lock = threading.Lock()  # add_request runs on the caller's thread, the rest on CB's loop
        self.flights: dict[tuple[int, str], _Flight] = {}  # (id(manager), CB request id) -> flight
        self.owner: dict[int, int] = {}  # id(scheduler) or id(batch processor) -> id(manager)
        self.steps: dict[int, int] = {}  # id(manager) -> CB steps recorded
        # set on CB's loop thread while offload_requests runs: the finish_request calls it makes
        # preempt a request (it is requeued), they do not end it
        self.preempting = threading.local()
        self._patches: list[tuple[type, str, Any, Any]] = []
        self.closed = False

    # ---- install / remove -----------------------------------------------------------------------

    def install(self) -> None:
        try:
            from transformers.generation.continuous_batching import continuous_api, scheduler
        except Exception:  # noqa: BLE001 - transformers without continuous batching: nothing to hook
            return
        try:
            from transformers.generation.continuous_batching import offloading_manager
        except Exception:  # noqa: BLE001 - a version without it is reported below as unsupported
            offloading_manager = None
        offload = getattr(offloading_manager, "OffloadingManager", None)
        mgr = getattr(continuous_api, "ContinuousBatchingManager", None)
        proc = getattr(continuous_api, "ContinuousBatchProcessor", None)
        sched = getattr(scheduler, "Scheduler", None)
        if mgr is None or proc is None or sched is None:
            return
        hooks = ((mgr, "add_request"), (mgr, "_create_batch_processor"), (proc, "prepare_next_batch"),
                 (proc, "update_batch"), (proc, "_handle_request_error"),
                 (sched, "finish_request"), (sched, "clear_cancelled_requests"), (offload, "offload_requests"))
        missing = [f"{getattr(cls, '__name__', 'OffloadingManager')}.{name}" for cls, name in hooks
                   if cls is None or name not in cls.__dict__]
        if missing:  # all or nothing: half the hooks would write rows that never end
            self.ctx.event(EventKind.NOTE, text=f"continuous batching is not recorded: {UNSUPPORTED} "
                                                f"(transformers lacks {', '.join(missing)})")
            return
        me = self
        self._wrap(mgr, "add_request", lambda orig: lambda m, *a, **k: me._add_request(orig, m, a, k))
        self._wrap(mgr, "_create_batch_processor", lambda orig: lambda m, *a, **k: me._create(orig, m, a, k))
        self._wrap(proc, "prepare_next_batch", lambda orig: lambda p, *a, **k: me._prepare(orig, p, a, k))
        self._wrap(sched, "finish_request", lambda orig: lambda s, *a, **k: me._finish(orig, s, a, k))
        self._wrap(sched, "clear_cancelled_requests", lambda orig: lambda s, *a, **k: me._cancelled(orig, s, a, k))
        self._wrap(proc, "_handle_request_error", lambda orig: lambda p, *a, **k: me._failed(orig, p, a, k))
        self._wrap(proc, "update_batch", lambda orig: lambda p, *a, **k: me._update(orig, p, a, k))
        self._wrap(offload, "offload_requests", lambda orig: lambda o, *a, **k: me._offload(orig, o, a, k))

    def _wrap(self, cls: type, name: str, make: Any) -> None:
        original = cls.__dict__[name]
        wrapper = make(original)
        wrapper.__wrapped__ = original
        wrapper.__doc__ = getattr(original, "__doc__", None)
        setattr(cls, name, wrapper)
        self._patches.append((cls, name, original, wrapper))

    def remove(self) -> None:
        """Restore the originals; requests still in flight end INTERRUPTED. Idempotent."""
        self.closed = True
        for cls, name, original, wrapper in reversed(self._patches):
            # another session's wrapper may sit on top of ours (two recordings open at once, closed in
            # another order): then ours stays in its chain, inert (closed, no owners) until that
            # session closes and restores past every inert wrapper below its own
            wrapper.kvtrace_inert = True
            if cls.__dict__.get(name) is wrapper:
                while getattr(original, "kvtrace_inert", False):
                    original = original.__wrapped__
                setattr(cls, name, original)
        self._patches.clear()
        with self.lock:
            left = list(self.flights.values())
            self.flights.clear()
            self.owner.clear()
        for flight in left:
            self._end(flight.rid, Outcome.INTERRUPTED, None, "still in flight when the recording closed")

    # ---- hooks (each calls the original first or last and never raises on its own account) ------

    def _ours(self, manager: Any) -> bool:
        return not self.closed and getattr(manager, "model", None) is self.model

    def _add_request(self, orig: Any, manager: Any, args: tuple, kwargs: dict) -> Any:
        request_id = orig(manager, *args, **kwargs)
        if request_id is not None and self._ours(manager):
            try:
                ids = kwargs.get("input_ids", args[0] if args else [])
                max_new = kwargs.get("max_new_tokens", args[2] if len(args) > 2 else None)
                self._begin(id(manager), str(request_id), list(ids), max_new)
            except Exception as exc:  # noqa: BLE001 - serving goes on unrecorded
                self.ctx.error("cb-add-request", exc)
        return request_id

    def _create(self, orig: Any, manager: Any, args: tuple, kwargs: dict) -> Any:
        processor = orig(manager, *args, **kwargs)
        if self._ours(manager):
            with self.lock:
                self.owner[id(processor)] = id(manager)
                self.owner[id(getattr(processor, "scheduler", None))] = id(manager)
        return processor

    def _prepare(self, orig: Any, processor: Any, args: tuple, kwargs: dict) -> Any:
        found = orig(processor, *args, **kwargs)
        key = self.owner.get(id(processor))
        if found and key is not None and not self.closed:
            try:
                self._step(key, processor)
            except Exception as exc:  # noqa: BLE001
                self.ctx.error("cb-step", exc)
        return found

    def _update(self, orig: Any, processor: Any, args: tuple, kwargs: dict) -> Any:
        out = orig(processor, *args, **kwargs)
        key = self.owner.get(id(processor))
        if key is not None and not self.closed:
            try:
                for request_id, state in list(getattr(processor.scheduler, "active_requests", {}).items()):
                    self._first_token(key, request_id, state)
            except Exception as exc:  # noqa: BLE001
                self.ctx.error("cb-update", exc)
        return out

    def _first_token(self, key: int, request_id: Any, state: Any, flight: _Flight | None = None) -> None:
        """One NOTE "first token" per request, as the batch update that produced it returns (or at its
        finish, when that token was also its last): its time minus the request's start is the TTFT."""
        if flight is None:
            flight = self.flights.get((key, str(request_id)))
        if flight is None or flight.first or _new_tokens(state) == 0:
            return
        flight.first = True
        self.ctx.event(EventKind.NOTE, flight.rid, text="first token")

    def _finish(self, orig: Any, scheduler: Any, args: tuple, kwargs: dict) -> Any:
        key = self.owner.get(id(scheduler))
        request_id = kwargs.get("request_id", args[0] if args else None)
        state = getattr(scheduler, "active_requests", {}).get(request_id) if key is not None else None
        out = orig(scheduler, *args, **kwargs)
        if key is not None and getattr(self.preempting, "on", False):
            self._preempted(key, request_id, state)
        elif key is not None:
            flight = self._pop(key, request_id)
            if flight is not None:
                self._first_token(key, request_id, state, flight)
                failed = getattr(getattr(state, "status", None), "name", "") == "FAILED"
                self._end(flight.rid, Outcome.ERROR if failed else Outcome.OK, state,
                          "transformers marked the request FAILED" if failed else "")
        return out

    def _failed(self, orig: Any, processor: Any, args: tuple, kwargs: dict) -> Any:
        """transformers fails a request (a batch's forward raised, or the loop died): ERROR, with the
        error's text; it covers waiting requests too, which no finish_request follows."""
        out = orig(processor, *args, **kwargs)
        key = self.owner.get(id(processor))
        error = kwargs.get("error", args[0] if args else None)
        state = kwargs.get("state", args[1] if len(args) > 1 else None)
        if key is not None:
            flight = self._pop(key, getattr(state, "request_id", None))
            if flight is not None:
                self._end(flight.rid, Outcome.ERROR, state, f"{type(error).__name__}: {error}"[:MAX_ERROR_TEXT])
        return out

    def _offload(self, orig: Any, manager: Any, args: tuple, kwargs: dict) -> Any:
        self.preempting.on = True
        try:
            return orig(manager, *args, **kwargs)
        finally:
            self.preempting.on = False

    def _preempted(self, key: int, request_id: Any, state: Any) -> None:
        with self.lock:
            flight = self.flights.get((key, str(request_id)))
            if flight is None:
                return
            flight.scheduled = False  # its next admission gets a "scheduled" NOTE again
        # offload_requests sets PENDING on a request copied to the CPU pool, FINISHED on a soft reset
        to_cpu = getattr(getattr(state, "status", None), "name", "") == "PENDING"
        self.ctx.event(EventKind.NOTE, flight.rid, value=_new_tokens(state),
                       text="preempted: KV offloaded to the CPU pool, requeued" if to_cpu else
                       "preempted: soft reset (KV freed, requeued; its tokens will be recomputed)")

    def _cancelled(self, orig: Any, scheduler: Any, args: tuple, kwargs: dict) -> Any:
        states = orig(scheduler, *args, **kwargs)
        key = self.owner.get(id(scheduler))
        if key is not None:
            for state in states or ():
                flight = self._pop(key, getattr(state, "request_id", None))
                if flight is not None:
                    self._end(flight.rid, Outcome.INTERRUPTED, state, "cancelled")
        return states

    # ---- rows -----------------------------------------------------------------------------------

    def _begin(self, key: int, request_id: str, ids: list[int], max_new: Any) -> None:
        w = self.ctx.writer
        if w is None or w.closed:
            return
        raw = b"".join(int(t).to_bytes(8, "little", signed=True) for t in ids)
        digest = hashlib.sha256(self.salt + raw).hexdigest().encode()
        gen = w.add_text(json.dumps({"cb_request_id": request_id, "max_new_tokens": max_new}, default=str))
        with self.lock:
            rid = self.take_id()
            self.flights[(key, request_id)] = _Flight(rid)
        start = monotonic_ns()
        w.begin_request(RequestRow(rid, int(Outcome.RUNNING), 1, len(ids), 0, -1, start, 0, digest, 0, 0, *gen))
        self.ctx.event(EventKind.REQUEST_START, rid, t=start, text=f"queued (continuous batching {request_id})")
        self.ctx.observers.notify("on_request_start", rid)

    def _pop(self, key: int, request_id: Any) -> _Flight | None:
        with self.lock:
            return self.flights.pop((key, str(request_id)), None)

    def _end(self, rid: int, outcome: Outcome, state: Any, why: str) -> None:
        try:
            w = self.ctx.writer
            if w is None or w.closed:
                return
            new_tokens = _new_tokens(state)
            err = w.add_text(why) if why and outcome != Outcome.OK else (0, 0)
            end = monotonic_ns()
            w.update_request(rid, outcome=int(outcome), end_ns=end, new_tokens=new_tokens,
                             error_off=err[0], error_len=err[1])
            self.ctx.event(EventKind.REQUEST_END, rid, value=int(outcome), t=end, text=why)
            w.flush_soon()
            self.ctx.observers.notify("on_request_end", outcome.name.lower(), new_tokens=new_tokens)
        except Exception as exc:  # noqa: BLE001
            self.ctx.error("cb-request-end", exc)

    def _step(self, key: int, processor: Any) -> None:
        scheduler = getattr(processor, "scheduler", None)
        active = dict(getattr(scheduler, "active_requests", {}))
        with self.lock:
            step = self.steps.get(key, 0)
            self.steps[key] = step + 1
            admitted = []
            for request_id in active:
                flight = self.flights.get((key, str(request_id)))
                if flight is not None and not flight.scheduled:
                    flight.scheduled = True
                    admitted.append(flight.rid)
        for rid in admitted:
            self.ctx.event(EventKind.NOTE, rid, step=step, text="scheduled (admitted by the continuous-batching scheduler)")
        occupancy = cache_occupancy(getattr(processor, "cache", None), active)
        occupancy.update(step=step, running=len(active), waiting=len(getattr(scheduler, "waiting_requests", {})),
                         **batch_tokens(getattr(getattr(processor, "inputs_and_outputs", None), "requests_in_batch", None)))
        self.ctx.event(EventKind.NOTE, -1, step=step, value=int(occupancy.get("blocks_in_use", 0)),
                       text="paged cache occupancy " + json.dumps(occupancy, sort_keys=True))


def _new_tokens(state: Any) -> int:
    """Tokens generated for the request; after a soft reset transformers moved the earlier ones into
    initial_tokens (past ``_true_initial_tokens``, the real prompt length)."""
    if state is None:
        return 0
    n = len(getattr(state, "generated_tokens", None) or ())
    true_initial = int(getattr(state, "_true_initial_tokens", 0) or 0)
    if true_initial:
        n += len(getattr(state, "initial_tokens", ())) - true_initial
    return n


def batch_tokens(batch: Any) -> dict[str, int]:
    """This step's query tokens split by phase, from the scheduled FutureRequestStates (5.23's
    ``inputs_and_outputs.requests_in_batch``); empty when that is not there."""
    if not isinstance(batch, list):
        return {}
    prefill = decode = 0
    for future in batch:
        n = int(getattr(future, "query_length", 0))
        state = getattr(future, "state", None)
        # status is DECODING as soon as the whole prompt is scheduled, so it cannot say the phase; the
        # scheduler has already advanced position_offset by n: past = position_offset - n. Tokens of
        # initial_tokens (the prompt, plus earlier output after a soft reset) are prefill (or recompute).
        past = int(getattr(state, "position_offset", 0)) - n
        if past >= len(getattr(state, "initial_tokens", ())):
            decode += n
        else:
            prefill += n
    return {"batch_requests": len(batch), "prefill_tokens": prefill, "decode_tokens": decode}


def cache_occupancy(cache: Any, active: dict[str, Any]) -> dict[str, Any]:
    """The paged cache's own counters (transformers 5.23 layout), or ``{"unavailable": ...}``."""
    allocators = getattr(cache, "cache_allocators", None)
    if not isinstance(allocators, dict) or not hasattr(cache, "compute_free_capacity"):
        return {"unavailable": UNSUPPORTED + " (no cache_allocators: the 5.17 layout is not read yet)"}
    per_type: dict[str, dict[str, int]] = {}
    in_use = 0
    for name, alloc in allocators.items():
        # distinct blocks: with prefix sharing one block sits in several requests' tables
        used = len({b for blocks in getattr(alloc, "block_table", {}).values() for b in blocks})
        in_use += used
        per_type[str(name)] = {"blocks_in_use": used, "blocks_total": int(getattr(alloc, "num_blocks", -1)),
                               "tokens_per_block": int(getattr(alloc, "tokens_per_block", -1)),
                               "bytes_per_block": int(getattr(alloc, "bytes_per_block", -1))}
    pool = int(cache.num_sectors * cache.bytes_per_sector)
    return {"pool_bytes": pool, "free_bytes": int(cache.compute_free_capacity(relative=False)),
            "blocks_in_use": in_use, "allocators": per_type,
            "tokens_cached": sum(int(getattr(s, "position_offset", 0)) for s in active.values())}
