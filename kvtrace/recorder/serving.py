"""The serving part of the recorder: continuous batching (``model.generate_batch``,
``init_continuous_batching`` / ``ContinuousBatchingManager``, ``generate(cache_implementation="paged")``,
``transformers serve --continuous-batching``) recorded into /requests, /events and the 1.4 tables
/sched, /sched_groups and /blocks (spec §4.15-4.17).

What it writes, per continuous-batching (CB) request of the recorded model:

* one /requests row (outcome RUNNING at ``add_request``, batch size 1; prompt tokens, prompt hash, and
  in gen_args the manager's string id as ``cb_request_id`` and the manager's index as ``manager``;
  a parallel sequence that transformers forks from a request (num_return_sequences > 1) gets its
  own row when forked, with ``forked_from`` = the parent's trace id),
  updated at the end with new tokens, EOS step, outcome and end time: ``Scheduler.finish_request``
  gives OK (ERROR when transformers marked the request FAILED);
  ``ContinuousBatchProcessor._handle_request_error`` gives ERROR with the error's text (OOM for an
  out-of-memory error: the manager's OOM event, AT_OOM reading and /owners reading come first);
  ``Scheduler.clear_cancelled_requests`` gives INTERRUPTED with the error text "cancelled"; a request
  still in flight when the recording closes gives INTERRUPTED too;
* events (their ``step`` is the manager's scheduler step): REQUEST_START when queued (the arrival),
  SCHEDULED the step the scheduler admits it (again after each preemption; value = admissions so far),
  PREFIX_HIT when ``search_prefix_match`` serves prompt tokens from cached blocks (value = tokens),
  FIRST_TOKEN as the batch update that produced its first token returns (its t_ns − start_ns is the
  time to first token), PREEMPTED when transformers offloads or soft-resets it to make room (value =
  the positions it held; OFFLOADED follows with the bytes copied when they went to the CPU swap
  pool), EOS when its last token is an end-of-sequence token, REQUEST_END when finished or cancelled;
  and BLOCK_EVICTED (request −1, value = blocks) when cached prefix blocks go back to the pool; an
  event with request −1 names its manager in its text ("manager N: ...": the step numbers are per
  manager), and its count is also in that manager's /sched row of that step;
* per manager, /readings with request −1: BASELINE just before it first builds its batch processor
  and paged cache (in warmup() or as its generation loop starts), PEAK (CUDA) and AFTER_RETURN as
  each run of its loop ends;
* per scheduler step (one ``ContinuousBatchProcessor.prepare_next_batch`` that found work): one /sched
  row, one /sched_groups row per cache group and one /blocks row per running request and group, from
  the cache's own counters as the version adapter reads them (:mod:`kvtrace.recorder.serving_cache`).

``generate(cache_implementation="paged")`` is transformers' switch to generate_batch: the generate
wrapper passes it through, and its sequences are recorded here, one CB request each.

Nothing goes to /steps, /kv or /layers: those tables describe one request's forwards through a
transformers Cache, and the paged cache is not one (it reaches attention as ``cache=``). No forward
hook is used either, so CUDA graphs (transformers 5.23 replays captured forwards, which no hook sees)
change nothing recorded here. Each manager gets one NOTE that says so, with its CUDA-graph and
async-batching settings.

The hooks wrap methods on the transformers classes for the duration of the recording, and act only
for managers whose ``model`` is the recorded model; :meth:`ServingRecorder.remove` restores the
exact originals. The methods wrapped are those DESIGN.md lists as stable across 5.17 and 5.23
(manager, processor, scheduler, offloading manager, ``PagedAttentionCache.search_prefix_match``) plus
``_create_batch_processor`` (to tie a scheduler and a cache to their manager), ``_run_generation_loop``
(present in 5.17 and 5.23; the readings) and the adapter's
eviction method. Where a hooked method is missing, nothing is patched but the entry point
(``init_continuous_batching``); where the cache layout is unknown, requests and scheduler steps are
recorded but not the cache (its /sched columns are -1). Both say "unsupported transformers version"
when the recorded model actually enters continuous batching (not to every generate() user): a NOTE
in that session's trace and one line on stderr once per process, never an empty recording without
a word.
"""

from __future__ import annotations

import gc
import hashlib
import json
import sys
import threading
import weakref
from typing import Any

from kvtrace.format.schema import EventKind, Outcome, ReadingLabel
from kvtrace.format.writer import monotonic_ns
from kvtrace.memory_errors import is_host_oom, requested_bytes
from kvtrace.recorder.context import MAX_ERROR_TEXT, SessionContext
from kvtrace.recorder.requests import OOM_ERRORS, oom_device
from kvtrace.recorder.rows import RequestRow
from kvtrace.recorder.serving_cache import (
    UNSUPPORTED,
    CacheAdapter,
    StepCounts,
    adapter_for,
    batch_tokens,
    scheduled_batch,
    step_rows,
    transformers_version,
)

__all__ = ["UNSUPPORTED", "ServingRecorder", "batch_tokens"]

MAX_POOL_REQUESTS = 256  # requests a retained pool names
# "unsupported transformers version" lines already written to stderr by this process
_SAID_ON_STDERR: set[str] = set()
_STDERR_LOCK = threading.Lock()


class _Flight:
    """One CB request in flight: its trace id, whether the scheduler admitted it (since its last
    preemption), how often, and whether its first token was seen."""

    __slots__ = ("admissions", "first", "rid", "scheduled")

    def __init__(self, rid: int) -> None:
        self.rid = rid
        self.scheduled = False
        self.admissions = 0
        self.first = False  # its first token was seen (the FIRST_TOKEN event is written)


class _Manager:
    """What the recorder keeps per CB manager of the recorded model."""

    __slots__ = ("adapter", "baseline", "cache", "counts", "index", "lag", "noted", "oom", "processor", "ran", "ref",
                 "steps")

    def __init__(self, index: int) -> None:
        self.index = index
        # async batching: update_batch of step N runs after step N+1 was scheduled (one step of lag)
        self.lag = 0
        self.steps = 0  # scheduler steps recorded (the next step's index)
        self.counts = StepCounts()
        self.adapter: CacheAdapter | None = None  # None: this cache's layout is not known
        # weakref to its paged cache: the recorder never keeps a pool alive after its manager dropped it
        self.cache: Any = lambda: None
        self.processor: Any = lambda: None  # weakref to its batch processor (its scheduler: the running requests)
        self.oom: tuple[int, int] | None = None  # (id of the OOM error, step) whose reading is taken
        self.ran: list[int] = []  # trace ids of the requests it ran (the first MAX_POOL_REQUESTS)
        self.ref: Any = lambda: None  # weakref to the manager object
        self.baseline = False  # its BASELINE reading is written
        self.noted = False  # its NOTE (no per-layer rows; graph and async settings) is written


class ServingRecorder:
    """Continuous-batching hooks of one session. ``take_id`` shares the session's request-id sequence
    with the generate wrapper (ids stay unique in /requests)."""

    def __init__(self, model: Any, ctx: SessionContext, salt: bytes, take_id: Any, readings: Any = None) -> None:
        self.model = model
        self.ctx = ctx
        self.readings = readings  # MemoryReadings: labelled readings around each manager's loop
        self.owners: Any = None  # kvtrace.recorder.owners.OwnerRecorder, set by the session
        self.salt = salt
        self.take_id = take_id
        self.lock = threading.Lock()  # add_request runs on the caller's thread, the rest on CB's loop
        self.flights: dict[tuple[int, str], _Flight] = {}  # (id(manager), CB request id) -> flight
        # the flights whose first token is not seen yet: each batch update checks these, not every
        # running request (at 64 concurrent requests the full scan was a fifth of the per-step cost)
        self.awaiting_first: dict[tuple[int, str], _Flight] = {}
        # id(scheduler), id(batch processor), id(cache), id(eviction target) -> (id(manager), weakref to
        # the object): ids are reused once an object dies, so a lookup also checks it is the same object
        self.owner: dict[int, tuple[int, Any]] = {}
        self.managers: dict[int, _Manager] = {}  # id(manager) -> its state
        # set on CB's loop thread while offload_requests runs: the finish_request calls it makes
        # preempt a request (it is requeued), they do not end it
        self.preempting = threading.local()
        self.adapter: CacheAdapter | None = None
        self._patches: list[tuple[type, str, Any, Any]] = []
        self._said: set[str] = set()
        # pools whose manager's loop ended: (manager index, weakref to the manager, [(device, ptr, bytes,
        # weakref to the storage)], requests it ran), checked for outliving their manager (check_pools)
        self.ended: list[tuple[int, Any, list[tuple[int, int, int, Any]], list[int]]] = []
        self._phases = 0
        self._numbered = 0  # managers seen (their indexes)
        self.closed = False

    # ---- install / remove -----------------------------------------------------------------------

    def install(self) -> None:
        try:
            from transformers.generation.continuous_batching import cache, continuous_api, scheduler
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
        paged = getattr(cache, "PagedAttentionCache", None)
        hooks = [(mgr, "add_request"), (mgr, "_create_batch_processor"), (mgr, "_run_generation_loop"),
                 (proc, "prepare_next_batch"),
                 (proc, "update_batch"), (proc, "_handle_request_error"), (sched, "finish_request"),
                 (sched, "clear_cancelled_requests"), (offload, "offload_requests"), (paged, "search_prefix_match")]
        missing = [f"{getattr(cls, '__name__', '?')}.{name}" for cls, name in hooks
                   if cls is None or name not in cls.__dict__]
        if missing:  # all or nothing: half the hooks would write rows that never end
            # said when the recorded model enters continuous batching, not to every generate() user
            self._say_on_entry(continuous_api, f"continuous batching is not recorded: {UNSUPPORTED} "
                                               f"{transformers_version()} (transformers lacks {', '.join(missing)})")
            return
        self.adapter = adapter_for()  # None: said when a manager builds its cache (_register)
        self._note_refusals(continuous_api)
        me = self
        self._wrap(mgr, "add_request", lambda orig: lambda m, *a, **k: me._add_request(orig, m, a, k))
        self._wrap(mgr, "_create_batch_processor", lambda orig: lambda m, *a, **k: me._create(orig, m, a, k))
        self._wrap(mgr, "_run_generation_loop", lambda orig: lambda m, *a, **k: me._loop(orig, m, a, k))
        self._wrap(proc, "prepare_next_batch", lambda orig: lambda p, *a, **k: me._prepare(orig, p, a, k))
        self._wrap(sched, "finish_request", lambda orig: lambda s, *a, **k: me._finish(orig, s, a, k))
        self._wrap(sched, "clear_cancelled_requests", lambda orig: lambda s, *a, **k: me._cancelled(orig, s, a, k))
        self._wrap(proc, "_handle_request_error", lambda orig: lambda p, *a, **k: me._failed(orig, p, a, k))
        self._wrap(proc, "update_batch", lambda orig: lambda p, *a, **k: me._update(orig, p, a, k))
        self._wrap(offload, "offload_requests", lambda orig: lambda o, *a, **k: me._offload(orig, o, a, k))
        self._wrap(paged, "search_prefix_match", lambda orig: lambda c, *a, **k: me._prefix(orig, c, a, k))
        hook = self.adapter.eviction_hook() if self.adapter is not None else None
        if hook is not None and hook[1] in hook[0].__dict__:
            self._wrap(hook[0], hook[1], lambda orig: lambda t, *a, **k: me._evict(orig, t, a, k))

    def _say_on_entry(self, continuous_api: Any, text: str) -> None:
        """Continuous batching cannot be recorded: wrap its entry point (``init_continuous_batching``,
        which generate_batch, generate(cache_implementation="paged") and transformers serve all go
        through) so that the recorded model's first use of it says so."""
        mixin = getattr(continuous_api, "ContinuousMixin", None)
        if mixin is None or "init_continuous_batching" not in mixin.__dict__:
            return  # no entry point known: continuous batching cannot be used the way we know
        me = self

        def make(orig: Any) -> Any:
            def entry(model: Any, *a: Any, **k: Any) -> Any:
                if model is me.model and not me.closed:
                    me._unsupported(text)
                return orig(model, *a, **k)
            return entry

        self._wrap(mixin, "init_continuous_batching", make)

    def _note_refusals(self, continuous_api: Any) -> None:
        """transformers 5.23+ checks the model's layer types as the manager is built, inside
        ``init_continuous_batching`` (5.17: as the loop builds its processor, :meth:`_create`): an
        error there is said in the trace (:meth:`_refused`) before it reaches the caller."""
        mixin = getattr(continuous_api, "ContinuousMixin", None)
        if mixin is None or "init_continuous_batching" not in mixin.__dict__:
            return
        me = self

        def make(orig: Any) -> Any:
            def entry(model: Any, *a: Any, **k: Any) -> Any:
                try:
                    return orig(model, *a, **k)
                except Exception as exc:
                    if model is me.model and not me.closed:
                        me._refused(exc)
                    raise
            return entry

        self._wrap(mixin, "init_continuous_batching", make)

    def _unsupported(self, text: str) -> None:
        """Say it: a NOTE in this session's trace (once per session), and one line on stderr once per
        process (a server records session after session; the line would repeat at every one)."""
        if text in self._said:
            return
        self._said.add(text)
        self.ctx.event(EventKind.NOTE, text=text)
        with _STDERR_LOCK:
            if text in _SAID_ON_STDERR:
                return
            _SAID_ON_STDERR.add(text)
        try:
            sys.stderr.write(f"kvtrace: warning: {text}\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001, S110 - stderr closed: the NOTE is in the trace
            pass

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
            self.awaiting_first.clear()
            self.owner.clear()
        for flight in left:
            self._end(flight.rid, Outcome.INTERRUPTED, None, "still in flight when the recording closed")

    # ---- phase markers --------------------------------------------------------------------------

    def mark_phase(self, name: str, index: int | None = None) -> int:
        """A PHASE event (value = index, text = name) now; ``index`` defaults to one past the last."""
        if not isinstance(name, str) or not name:
            raise ValueError("a phase needs a non-empty name")
        w = self.ctx.writer
        if w is None or w.closed or self.closed:
            raise RuntimeError("mark_phase: the recording is not open")
        with self.lock:
            index = self._phases if index is None else int(index)
            self._phases = index + 1
        self._event(EventKind.PHASE, value=index, text=name[:MAX_ERROR_TEXT])
        w.flush_soon()
        return index

    # ---- hooks (each calls the original first or last and never raises on its own account) ------

    def _ours(self, manager: Any) -> bool:
        return not self.closed and getattr(manager, "model", None) is self.model

    def _owner_of(self, obj: Any) -> int | None:
        """The manager key of a processor, scheduler, cache or block manager registered by _register."""
        entry = self.owner.get(id(obj))
        return entry[0] if entry is not None and entry[1]() is obj else None

    def _manager(self, key: int) -> _Manager:
        """The manager's state, numbered in order of first sight (caller holds the lock)."""
        m = self.managers.get(key)
        if m is None:
            m = self.managers[key] = _Manager(self._numbered)
            self._numbered += 1
        return m

    def _see(self, manager: Any) -> int:
        """The key of a live manager object: a new manager whose id an earlier, dead one had gets a
        state (and index) of its own."""
        key = id(manager)
        orphans: list[_Flight] = []
        with self.lock:
            m = self.managers.get(key)
            if m is not None and m.ref() is not manager:
                del self.managers[key]
                m = None
                # requests the dead manager never ended: not to be mistaken for the new one's
                orphans = [self.flights.pop(k) for k in [k for k in self.flights if k[0] == key]]
                for k in [k for k in self.awaiting_first if k[0] == key]:
                    del self.awaiting_first[k]
            if m is None:
                m = self._manager(key)
                m.ref = weakref.ref(manager)
        for flight in orphans:
            self._end(flight.rid, Outcome.INTERRUPTED, None, "its continuous-batching manager is gone")
        return key

    def _add_request(self, orig: Any, manager: Any, args: tuple, kwargs: dict) -> Any:
        if self._ours(manager):
            try:
                # a manager built before this recording started (a persistent one, a server's): its
                # processor, scheduler and cache are taken on at its first request seen here
                processor = getattr(manager, "batch_processor", None)
                if processor is not None and self._owner_of(processor) is None:
                    self._register(self._see(manager), processor)
            except Exception as exc:  # noqa: BLE001
                self.ctx.error("cb-adopt", exc)
        request_id = orig(manager, *args, **kwargs)
        if request_id is not None and self._ours(manager):
            try:
                ids = kwargs.get("input_ids", args[0] if args else [])
                max_new = kwargs.get("max_new_tokens", args[2] if len(args) > 2 else None)
                self._begin(self._see(manager), str(request_id), list(ids), max_new)
            except Exception as exc:  # noqa: BLE001 - serving goes on unrecorded
                self.ctx.error("cb-add-request", exc)
        return request_id

    def _loop(self, orig: Any, manager: Any, args: tuple, kwargs: dict) -> Any:
        """The manager's generation loop (its background thread): PEAK and AFTER_RETURN readings when it
        ends (the cache is still held then), request -1 (they belong to the manager, not to one of its
        requests). The BASELINE is taken in :meth:`_create`, before the cache exists."""
        ours = self._ours(manager)
        try:
            return orig(manager, *args, **kwargs)
        finally:
            if ours and not self.closed:
                self._reading("after_return")
                self._watch_pool(manager)

    def _reading(self, which: str) -> None:
        r = self.readings
        w = self.ctx.writer
        if r is None or w is None or w.closed:
            return
        try:
            reset = self.ctx.options.reset_peak and r.devices
            if which == "baseline":
                r.write(-1, ReadingLabel.BASELINE)
                if reset:
                    r.reset_peak()
            else:
                if reset:
                    r.write_peak(-1)
                r.write(-1, ReadingLabel.AFTER_RETURN)
        except Exception as exc:  # noqa: BLE001
            self.ctx.error(f"cb-reading-{which}", exc)

    def _create(self, orig: Any, manager: Any, args: tuple, kwargs: dict) -> Any:
        # the first build of a manager's processor allocates its paged cache (from warmup() or from the
        # generation loop): the BASELINE reading goes just before it, once per manager
        if self._ours(manager) and getattr(manager, "batch_processor", None) is None:
            self.check_pools("the next manager's start")  # earlier managers' pools must be gone by now
            key = self._see(manager)
            if not self.managers[key].baseline:
                self.managers[key].baseline = True
                self._reading("baseline")
        try:
            processor = orig(manager, *args, **kwargs)
        except Exception as exc:
            if self._ours(manager):
                self._refused(exc)
            raise
        if self._ours(manager):
            try:
                self._register(self._see(manager), processor)
            except Exception as exc:  # noqa: BLE001
                self.ctx.error("cb-create", exc)
        return processor

    def _refused(self, exc: BaseException) -> None:
        """transformers could not build the manager's paged cache: say so in the trace (a NOTE and one
        stderr line) before the error reaches the caller. Its paged cache holds attention KV blocks
        only: a hybrid model's conv / recurrent state layers (kvtrace.geometry.hybrid) have no place
        in it, which transformers 5.17-5.24 refuse with "Invalid group/layer type"."""
        try:
            from kvtrace.geometry.config import text_config
            from kvtrace.geometry.hybrid import STATE_LAYER_TYPES, state_layer_types

            config = getattr(self.model, "config", None)
            types = state_layer_types(text_config(config.to_dict())) if config is not None else None
            held = sorted({t for t in types or () if t in STATE_LAYER_TYPES})
            why = (f": its paged cache holds attention KV only, and this model's {', '.join(held)} layers keep a "
                   "conv/recurrent state it has no place for; nothing of these requests is recorded (generate() "
                   "with a DynamicCache records their KV and state)" if held else "")
            self._unsupported(f"continuous batching refused by transformers {transformers_version()} "
                              f"({type(exc).__name__}: {str(exc)[:200]}){why}")
        except Exception as err:  # noqa: BLE001 - the caller's error matters more than our note
            self.ctx.error("cb-refused", err)

    def _register(self, key: int, processor: Any) -> None:
        cache = getattr(processor, "cache", None)
        adapter = self.adapter if self.adapter is not None and self.adapter.matches(cache) else None
        with self.lock:
            m = self._manager(key)
            # a manager that builds its processor again (a persistent manager, reused) keeps counting
            # steps, so (manager, step) stays unique in /sched
            m.cache, m.adapter = (weakref.ref(cache) if cache is not None else (lambda: None)), adapter
            m.processor = weakref.ref(processor)
            m.lag = 1 if getattr(processor, "use_async_batching", False) else 0
            for obj in (processor, getattr(processor, "scheduler", None), cache,
                        adapter.eviction_target(cache) if adapter is not None else None):
                if obj is not None:
                    self.owner[id(obj)] = (key, weakref.ref(obj))
        if not m.noted:
            m.noted = True
            self.ctx.event(EventKind.NOTE, text=_manager_note(m.index, processor))
        if adapter is None:
            why = (f"{type(cache).__name__} is not the {self.adapter.label}" if self.adapter is not None else
                   "no known cache layout: neither 5.23's cache_allocators nor 5.17's BlockManager")
            self._unsupported(f"continuous batching is recorded without its paged cache (/sched cache columns -1, "
                              f"no /blocks): {UNSUPPORTED} {transformers_version()} ({why})")

    def _prepare(self, orig: Any, processor: Any, args: tuple, kwargs: dict) -> Any:
        found = orig(processor, *args, **kwargs)
        key = self._owner_of(processor)
        if found and key is not None and not self.closed:
            try:
                self._step(key, processor)
            except Exception as exc:  # noqa: BLE001
                self.ctx.error("cb-step", exc)
        return found

    def _update(self, orig: Any, processor: Any, args: tuple, kwargs: dict) -> Any:
        scheduler = getattr(processor, "scheduler", None)
        forking = bool(getattr(scheduler, "_requests_to_fork", None))  # update_batch forks them at its end
        out = orig(processor, *args, **kwargs)
        key = self._owner_of(processor)
        if key is not None and not self.closed:
            try:
                if forking:
                    self._adopt_children(key, scheduler)
                active = getattr(scheduler, "active_requests", {})
                with self.lock:
                    waiting = [(rid, f) for (k, rid), f in self.awaiting_first.items() if k == key]
                for request_id, flight in waiting:
                    state = active.get(request_id)
                    if state is not None:
                        self._first_token(key, request_id, state, flight)
            except Exception as exc:  # noqa: BLE001
                self.ctx.error("cb-update", exc)
        return out

    def _adopt_children(self, key: int, scheduler: Any) -> None:
        """Parallel sequences (num_return_sequences > 1): transformers forks a request into children
        ``<id>__child#<i>`` that hold blocks and tokens of their own, never passing add_request. Each
        becomes a request row too (gen_args ``forked_from`` = the parent's trace id), running at once
        when its blocks were forked, else waiting to be prefilled from scratch."""
        for table in ("active_requests", "waiting_requests"):
            for request_id, state in list(getattr(scheduler, table, {}).items()):
                request_id = str(request_id)
                parent, sep, _ = request_id.partition("__child#")
                if not sep or (key, request_id) in self.flights or (key, parent) not in self.flights:
                    continue
                self._begin(key, request_id, list(getattr(state, "initial_tokens", ())),
                            getattr(state, "max_new_tokens", None),
                            forked_from=self.flights[(key, parent)].rid)

    def _last_step(self, key: int) -> int:
        """The step whose forward produced the tokens a batch update (or a finish inside it) handles."""
        m = self.managers.get(key)
        return max(m.steps - 1 - m.lag, 0) if m is not None and m.steps else -1

    def _first_token(self, key: int, request_id: Any, state: Any, flight: _Flight | None = None) -> None:
        """One FIRST_TOKEN per request, as the batch update that produced it returns (or at its finish,
        when that token was also its last): its time minus the request's start is the TTFT."""
        if flight is None:
            flight = self.flights.get((key, str(request_id)))
        if flight is None or flight.first or _new_tokens(state) == 0:
            return
        flight.first = True
        with self.lock:
            self.awaiting_first.pop((key, str(request_id)), None)
        self._event(EventKind.FIRST_TOKEN, flight.rid, step=self._last_step(key))

    def _finish(self, orig: Any, scheduler: Any, args: tuple, kwargs: dict) -> Any:
        key = self._owner_of(scheduler)
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
                eos_step = -1 if failed else _eos_step(state)
                if eos_step >= 0:
                    self._event(EventKind.EOS, flight.rid, step=self._last_step(key), value=eos_step)
                self._end(flight.rid, Outcome.ERROR if failed else Outcome.OK, state,
                          "transformers marked the request FAILED" if failed else "", eos_step=eos_step)
        return out

    def _failed(self, orig: Any, processor: Any, args: tuple, kwargs: dict) -> Any:
        """transformers fails a request (a batch's forward raised, or the loop died): ERROR, with the
        error's text; it covers waiting requests too, which no finish_request follows. An
        out-of-memory error makes it OOM: at the first request it fails, the manager's OOM event, its
        AT_OOM reading and the owner reading (who filled the device) are taken, before any of the
        batch's requests is finished (the scheduler still lists the ones that ran)."""
        key = self._owner_of(processor)
        error = kwargs.get("error", args[0] if args else None)
        oom = isinstance(error, OOM_ERRORS) or (isinstance(error, BaseException) and is_host_oom(error))
        if key is not None and oom and not self.closed:
            self._oom(key, processor, error)
        out = orig(processor, *args, **kwargs)
        state = kwargs.get("state", args[1] if len(args) > 1 else None)
        if key is not None:
            flight = self._pop(key, getattr(state, "request_id", None))
            if flight is not None:
                self._end(flight.rid, Outcome.OOM if oom else Outcome.ERROR, state,
                          f"{type(error).__name__}: {error}"[:MAX_ERROR_TEXT])
        return out

    def _oom(self, key: int, processor: Any, error: BaseException) -> None:
        """Once per error and step: transformers fails every request of the batch with the same error."""
        m = self.managers.get(key)
        if m is None:
            return
        step = max(m.steps - 1, 0) if m.steps else -1  # the step whose forward raised
        if m.oom == (id(error), step):
            return
        m.oom = (id(error), step)
        try:
            active = getattr(getattr(processor, "scheduler", None), "active_requests", {}) or {}
            with self.lock:
                running = sorted(f.rid for r in list(active) if (f := self.flights.get((key, str(r)))) is not None)
            device, note = oom_device(error, self.readings.devices if self.readings is not None else [])
            want = requested_bytes(str(error))
            # the running requests last, whole: the oom detector reads them back when no owner reading names them
            suffix = "; running requests " + (", ".join(map(str, running[:64])) if running else "none")
            text = f"manager {m.index}: {type(error).__name__}: {error}"[:max(MAX_ERROR_TEXT - len(suffix), 64)] + suffix
            self._event(EventKind.OOM, step=step, value=-1 if want is None else want, text=text, device=device)
            if note:
                self.ctx.event(EventKind.NOTE, step=step, device=device, text=f"manager {m.index}: {note}")
            if self.readings is not None and self.ctx.writer is not None and not self.ctx.writer.closed:
                self.readings.write(-1, ReadingLabel.AT_OOM)
            if self.owners is not None:
                self.owners.at_serving_oom(step)
        except Exception as exc:  # noqa: BLE001 - transformers' error handling goes on
            self.ctx.error("cb-oom", exc)

    def _watch_pool(self, manager: Any) -> None:
        """The manager's loop ended: weak references to its pool's storages, to check later that the pool
        dies with its manager (a view of the pool kept by user code holds all of it)."""
        try:
            m = self.managers.get(id(manager))
            cache = m.cache() if m is not None else None
            if cache is None or m.adapter is None:
                return
            refs: dict[int, tuple[int, int, int, Any]] = {}
            for t in m.adapter.pool_tensors(cache):
                st = t.untyped_storage()
                dev = -1 if t.device.type == "cpu" else int(t.device.index or 0)
                refs[int(st.data_ptr())] = (dev, int(st.data_ptr()), int(st.nbytes()), weakref.ref(st))
            cache = None
            with self.lock:
                self.ended = [e for e in self.ended if e[0] != m.index]  # a persistent manager's run again
                self.ended.append((m.index, m.ref, list(refs.values()), list(m.ran)))
        except Exception as exc:  # noqa: BLE001
            self.ctx.error("cb-pool-watch", exc)

    def check_pools(self, when: str) -> None:
        """Every pool whose manager is gone must be gone too: weak references first; a collection runs
        only when a pool storage is alive, and one still alive after it is retained (a NOTE with what
        holds it, and an /owners reading at moment request_end, request -1, that names the pool as KV of
        the manager's earlier requests). A manager still alive (a persistent one) keeps its pool by
        design. Never raises."""
        with self.lock:
            ended, self.ended = self.ended, []
        if not ended or self.ctx.writer is None or self.ctx.writer.closed:
            return
        try:
            if any(r() is not None for e in ended for *_, r in e[2]):
                gc.collect()
            keep = []
            for index, mref, refs, rids in ended:
                if mref() is not None:
                    keep.append((index, mref, refs, rids))  # its manager lives: the pool is its own
                    continue
                alive = [(d, p, n) for d, p, n, r in refs if r() is not None]
                if alive:
                    self._retained_pool(index, alive, rids, when)
            with self.lock:
                self.ended = keep + self.ended
        except Exception as exc:  # noqa: BLE001
            self.ctx.error("cb-pool-check", exc)

    def _retained_pool(self, index: int, alive: list[tuple[int, int, int]], rids: list[int], when: str) -> None:
        from kvtrace.recorder.retention import _tensors_on, holder_path

        found = _tensors_on(set(alive), per_key=4)
        tensors = [t for ts in found.values() for t in ts]
        held = ""
        for t in tensors:  # the first tensor on the pool whose holders reach a root (a view's base may not)
            held = holder_path(t, (found, tensors, *found.values()))
            if held and not held.startswith("nothing"):
                break
        t = None
        found.clear()
        tensors.clear()
        size = sum(n for _, _, n in alive)
        self.ctx.event(EventKind.NOTE, value=size, text=(
            f"manager {index}: its paged KV pool is still alive after the manager stopped (checked at {when}): "
            f"{size} bytes in {len(alive)} storage{'s' if len(alive) > 1 else ''}"
            + (f"; held by {held}" if held else ""))[:MAX_ERROR_TEXT])
        if self.owners is not None:
            self.owners.at_pool_retained(index, alive, rids, held)

    def pools(self) -> list[tuple[int, list[Any], list[int]]]:
        """(manager index, its paged pool's tensors, trace ids of its running requests) of every manager
        whose cache is alive and of a known layout: the owner readings call that pool KV."""
        out = []
        with self.lock:
            managers = [(key, m, m.cache()) for key, m in self.managers.items()]
        for key, m, cache in managers:
            if cache is None or m.adapter is None or m.ref() is None:  # a pool outliving its manager is no one's
                continue
            try:
                tensors = m.adapter.pool_tensors(cache)
            except Exception as exc:  # noqa: BLE001
                self.ctx.error("cb-pool", exc)
                continue
            active = getattr(getattr(m.processor(), "scheduler", None), "active_requests", {}) or {}
            with self.lock:
                rids = [f.rid for r in list(active) if (f := self.flights.get((key, str(r)))) is not None]
            out.append((m.index, tensors, rids))
            cache = None
        return out

    def _offload(self, orig: Any, offloader: Any, args: tuple, kwargs: dict) -> Any:
        self.preempting.on = True
        self.preempting.offloader = offloader
        try:
            return orig(offloader, *args, **kwargs)
        finally:
            self.preempting.on = False
            self.preempting.offloader = None

    def _preempted(self, key: int, request_id: Any, state: Any) -> None:
        with self.lock:
            flight = self.flights.get((key, str(request_id)))
            m = self.managers.get(key)
            if flight is None or m is None:
                return
            flight.scheduled = False  # its next admission is a SCHEDULED event again
            m.counts.preempted += 1
        step = m.steps
        # offload_requests sets PENDING on a request copied to the CPU pool, FINISHED on a soft reset
        to_cpu = getattr(getattr(state, "status", None), "name", "") == "PENDING"
        held = int(getattr(state, "position_offset", 0) or 0)
        self._event(EventKind.PREEMPTED, flight.rid, step=step, value=held,
                       text="offloaded to the CPU swap pool, requeued" if to_cpu else
                       "soft reset: KV freed, requeued; its tokens will be recomputed")
        if to_cpu and m.adapter is not None:
            try:
                copied = m.adapter.offloaded_bytes(getattr(self.preempting, "offloader", None), m.cache(),
                                                   str(request_id))
            except Exception as exc:  # noqa: BLE001
                self.ctx.error("cb-offload", exc)
                copied = -1
            self._event(EventKind.OFFLOADED, flight.rid, step=step, value=copied)

    def _prefix(self, orig: Any, cache: Any, args: tuple, kwargs: dict) -> Any:
        tokens = orig(cache, *args, **kwargs)
        key = self._owner_of(cache)
        if key is not None and tokens and not self.closed:
            try:
                request_id = kwargs.get("request_id", args[0] if args else None)
                with self.lock:
                    m = self.managers[key]
                    flight = self.flights.get((key, str(request_id)))
                    blocks = m.adapter.prefix_blocks(cache, int(tokens)) if m.adapter is not None else 0
                    m.counts.prefix_hit_tokens += int(tokens)
                    m.counts.prefix_hit_blocks += blocks
                shared = f"{blocks} cached blocks shared"
                # an event without a request names its manager (several managers share the step numbers)
                self._event(EventKind.PREFIX_HIT, flight.rid if flight is not None else -1, step=m.steps,
                            value=int(tokens), text=shared if flight is not None else
                            f"manager {m.index}: {shared} (a request this recording does not hold)")
            except Exception as exc:  # noqa: BLE001
                self.ctx.error("cb-prefix", exc)
        return tokens

    def _evict(self, orig: Any, target: Any, args: tuple, kwargs: dict) -> Any:
        key = self._owner_of(target)
        m = self.managers.get(key) if key is not None else None
        adapter = m.adapter if m is not None else None
        before = adapter.cached_total(target) if adapter is not None else 0
        out = orig(target, *args, **kwargs)
        if adapter is not None and not self.closed:
            try:
                evicted = before - adapter.cached_total(target)
                if evicted > 0:
                    with self.lock:
                        m.counts.evicted_blocks += evicted
                    self._event(EventKind.BLOCK_EVICTED, step=m.steps, value=evicted,
                                text=f"manager {m.index}: cached prefix blocks returned to the pool")
            except Exception as exc:  # noqa: BLE001
                self.ctx.error("cb-evict", exc)
        return out

    def _cancelled(self, orig: Any, scheduler: Any, args: tuple, kwargs: dict) -> Any:
        states = orig(scheduler, *args, **kwargs)
        key = self._owner_of(scheduler)
        if key is not None:
            for state in states or ():
                flight = self._pop(key, getattr(state, "request_id", None))
                if flight is not None:
                    self._end(flight.rid, Outcome.INTERRUPTED, state, "cancelled")
        return states

    # ---- live observers ---------------------------------------------------------------------------

    def _event(self, kind: EventKind, request: int = -1, *, step: int = -1, value: int = 0, text: str = "",
               t: int | None = None, device: int = -1) -> None:
        """A serving event into /events, and to the observers that listen for them."""
        t = monotonic_ns() if t is None else t
        self.ctx.event(kind, request, step=step, value=value, text=text, t=t, device=device)
        self._tell("on_serving_event", kind, request, value, t)

    def _tell(self, method: str, *args: Any) -> None:
        """Optional observer methods (``on_serving_step(sched_row, group_rows)``, ``on_serving_event(kind,
        request, value, t_ns)``): called on the observers that define them; a failure is a recorder error."""
        for obs in self.ctx.observers:
            fn = getattr(obs, method, None)
            if fn is None:
                continue
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - a listener never breaks serving
                self.ctx.error(f"{getattr(obs, 'name', type(obs).__name__)}: {method}", exc)

    # ---- rows -----------------------------------------------------------------------------------

    def _begin(self, key: int, request_id: str, ids: list[int], max_new: Any, forked_from: int | None = None) -> None:
        w = self.ctx.writer
        if w is None or w.closed:
            return
        raw = b"".join(int(t).to_bytes(8, "little", signed=True) for t in ids)
        digest = hashlib.sha256(self.salt + raw).hexdigest().encode()
        with self.lock:
            m = self._manager(key)
            index = m.index
            rid = self.take_id()
            if len(m.ran) < MAX_POOL_REQUESTS:
                m.ran.append(rid)
            self.flights[(key, request_id)] = self.awaiting_first[(key, request_id)] = _Flight(rid)
        args = {"cb_request_id": request_id, "manager": index, "max_new_tokens": max_new}
        if forked_from is not None:
            args["forked_from"] = forked_from
        gen = w.add_text(json.dumps(args, default=str))
        start = monotonic_ns()
        w.begin_request(RequestRow(rid, int(Outcome.RUNNING), 1, len(ids), 0, -1, start, 0, digest, 0, 0, *gen))
        self.ctx.event(EventKind.REQUEST_START, rid, t=start, text=f"queued (continuous batching {request_id})"
                       if forked_from is None else f"forked from request {forked_from} ({request_id})")
        self.ctx.observers.notify("on_request_start", rid)

    def _pop(self, key: int, request_id: Any) -> _Flight | None:
        with self.lock:
            self.awaiting_first.pop((key, str(request_id)), None)
            return self.flights.pop((key, str(request_id)), None)

    def _end(self, rid: int, outcome: Outcome, state: Any, why: str, *, eos_step: int = -1) -> None:
        try:
            w = self.ctx.writer
            if w is None or w.closed:
                return
            new_tokens = _new_tokens(state)
            err = w.add_text(why) if why and outcome != Outcome.OK else (0, 0)
            end = monotonic_ns()
            w.update_request(rid, outcome=int(outcome), end_ns=end, new_tokens=new_tokens, eos_step=eos_step,
                             error_off=err[0], error_len=err[1])
            self._event(EventKind.REQUEST_END, rid, value=int(outcome), t=end, text=why)  # observers: e2e latency
            w.flush_soon()
            self.ctx.observers.notify("on_request_end", outcome.name.lower(), new_tokens=new_tokens)
        except Exception as exc:  # noqa: BLE001
            self.ctx.error("cb-request-end", exc)

    def _step(self, key: int, processor: Any) -> None:
        w = self.ctx.writer
        if w is None or w.closed:
            return
        scheduler = getattr(processor, "scheduler", None)
        active = dict(getattr(scheduler, "active_requests", {}))
        with self.lock:
            m = self._manager(key)
            step, m.steps = m.steps, m.steps + 1
            counts, m.counts = m.counts, StepCounts()
            admitted: list[_Flight] = []
            rids: dict[str, int] = {}
            for request_id in active:
                flight = self.flights.get((key, str(request_id)))
                if flight is None:
                    continue
                rids[str(request_id)] = flight.rid
                if not flight.scheduled:
                    flight.scheduled = True
                    flight.admissions += 1
                    admitted.append(flight)
        t = monotonic_ns()
        for flight in admitted:
            self._event(EventKind.SCHEDULED, flight.rid, step=step, value=flight.admissions, t=t)
        cache = m.cache()
        state = m.adapter.read(cache) if m.adapter is not None and cache is not None else None
        starved = getattr(scheduler, "starved_requests", None)
        sched, groups, blocks = step_rows(
            t, m.index, step, state, active, rids,
            batch_tokens(scheduled_batch(processor)),
            counts, waiting=len(getattr(scheduler, "waiting_requests", {})),
            starved=len(starved) if isinstance(starved, list) else -1,
            max_batch_tokens=int(getattr(processor, "max_batch_tokens", -1) or -1))
        w.append("sched", sched)
        if groups:
            w.append("sched_groups", groups)
        if blocks:
            w.append("blocks", blocks)  # GroupBlocks: converted by the flusher
        self._tell("on_serving_step", sched, groups)


def _manager_note(index: int, processor: Any) -> str:
    """What a reader of the trace must know about a manager's forwards: they leave no per-layer rows
    (the paged cache reaches attention as ``cache=``, not as a transformers Cache, and under CUDA
    graphs a forward is a replay that no hook sees), and the graph and async settings it ran with."""
    cfg = getattr(processor, "cb_config", None)
    graphs: Any = "unknown"
    try:
        graphs = tuple(bool(b) for b in cfg.cuda_graph_booleans)
    except Exception:  # noqa: BLE001, S110 - a version without the property: said as unknown
        pass
    use_async = getattr(processor, "use_async_batching", None)
    asynchronous = "unknown" if use_async is None else "on" if use_async else "off"
    return (f"continuous-batching manager {index}: no per-layer rows (/steps, /kv, /layers) for its requests; "
            f"their paged KV cache is in /sched, /sched_groups and /blocks, read from the scheduler and cache "
            f"every step. CUDA graphs (varlen, decode): {graphs}; async batching {asynchronous}")


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


def _eos_step(state: Any) -> int:
    """Index of the request's last token (the step that produced it) when it is an EOS token, else -1."""
    tokens = getattr(state, "generated_tokens", None) or ()
    eos = getattr(state, "_eos_token_ids", None) or ()
    return len(tokens) - 1 if tokens and tokens[-1] in eos else -1
