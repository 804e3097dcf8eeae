"""The per-step part of the recorder: the two forward hooks on the model, which Cache a forward
used, the per-layer structure read (the fast path for plain dynamic caches, the general reader
otherwise) and its /kv, /steps and /layers rows, the read of a request's last step as its Cache
dies, and the step as observers see it.

Owns the hooks (:class:`~kvtrace.recorder.hooks.StepHooks`, discovery of attention modules), the
layout context, the /layers table (written once) and ``structure_every``. Everything per request is
in :class:`~kvtrace.recorder.context.RequestState`: a serving recorder whose scheduler runs several
requests in one forward would call :meth:`StepRecorder.structure` once per request with that
request's cache view, and reuse the rows, the fast path and the death read unchanged.
"""

from __future__ import annotations

import functools
import types
import weakref
from typing import Any

import torch

from kvtrace.format.schema import EventKind
from kvtrace.format.writer import monotonic_ns
from kvtrace.labels import layer_type_name
from kvtrace.recorder import hooks as _hooks
from kvtrace.recorder.accounting import account
from kvtrace.recorder.context import RequestState, SessionContext
from kvtrace.recorder.layouts import (
    FastStep,
    FastStepTotals,
    LayerReading,
    LayoutContext,
    cache_parts,
    context_from_config,
    fast_plan,
    read_cache,
    read_step_fast,
)
from kvtrace.recorder.readings import MemoryReadings
from kvtrace.recorder.retention import RetentionTracker
from kvtrace.recorder.rows import EventRow, KvRow, LayerRow, StepRow
from kvtrace.recorder.state import StateReading, read_states, state_rows
from kvtrace.recorder.static_fast import StaticPlan, read_step_static, static_plan
from kvtrace.recorder.submission import SampleSubmission

_DECODE_STEP = int(EventKind.DECODE_STEP)


class StepRecorder:
    def __init__(self, model: torch.nn.Module, ctx: SessionContext, readings: MemoryReadings,
                 submission: SampleSubmission, retention: RetentionTracker, every: int) -> None:
        self.model = model
        self.ctx = ctx
        self.readings = readings
        self.submission = submission
        self._retention = retention
        self.every = every
        self.layout: LayoutContext | None = None  # from the model config, at the first Cache seen
        self._layers_written = False
        self._kv_heads: dict[int, int] = {}  # layer -> KV heads (maps query heads onto KV heads)
        self._state_sources: dict[str, tuple[int, int]] = {}  # state source path -> /text reference
        self.discovery = _hooks.Discovery(model, ctx.error)
        self.hooks = _hooks.StepHooks(model, self.on_step_start, self.on_step_end, ctx.error)
        submission.group_of = self.query_group

    def install(self) -> None:
        self.discovery.install()
        self.hooks.install()

    def remove(self) -> None:
        self.hooks.remove()
        self.discovery.remove()

    def query_group(self, layer: int) -> int | None:
        """Query heads per KV head of ``layer``, from the geometry (None when unknown)."""
        kv_heads = self._kv_heads.get(layer, 0)
        heads = self.layout.num_attention_heads if self.layout is not None else 0
        return heads // kv_heads if kv_heads and heads and heads % kv_heads == 0 else None

    def on_step_start(self, module: Any, args: tuple, kwargs: dict) -> None:
        req = self.ctx.active
        if req is None:
            return
        step = req.step
        if step == 0:
            self.ctx.event(EventKind.PREFILL_START, req.id, step=0)
            cache = _hooks.find_cache(args, kwargs)
            req.fed = int(cache.get_seq_length()) if cache is not None else 0
        # Positions are counted from the inputs, not from the last structure read: with
        # structure_every > 1 that read may be several steps old.
        req.step_position = req.fed
        req.fed += _new_tokens(args, kwargs)
        if self.submission.sampler is not None:
            req.sample_now = self.submission.wants(req, step)

    def on_step_end(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        """Runs after every forward of a request: this is the recorder's per-step cost."""
        req = self.ctx.active
        if req is None:
            return
        step = req.step
        req.step = step + 1  # first: a failure below must not shift later steps
        t = monotonic_ns()
        req.step_t.append(t)
        w = self.ctx.writer
        assert w is not None
        if step == 0:
            self.ctx.event(EventKind.PREFILL_END, req.id, step=0, t=t)
        else:
            w.append("events", EventRow(t, _DECODE_STEP, req.id, step, -1, -1, step, 0, 0))
        cache = _hooks.cache_of_output(output)
        if cache is None:
            cache = _hooks.find_cache(args, kwargs)
            if cache is None and self.discovery.last_cache is not None:
                cache = self.discovery.last_cache()
        if cache is None:
            raise RuntimeError("no transformers Cache seen in this forward (use_cache=False?)")
        last = req.last_cache
        if last is None or last() is not cache:
            self.track_cache(req, cache)
        if step % self.every and step != req.expected_last and not req.sample_now:
            if self.ctx.observers:
                self.ctx.observers.notify("on_step", "decode")
            return  # structure not read at this step (structure_every)
        self.structure(req, step, t, cache)

    def track_cache(self, req: RequestState, cache: Any) -> None:
        """A Cache seen for the first time in this request: weak references to it (with a callback
        that reads its last step as it dies) and to its layers; no fast-path plan yet."""
        req.plan = None
        refs = None
        if len(cache_parts(cache)) == 1:
            try:
                refs = [weakref.ref(layer) for layer in getattr(cache, "layers", ())]
            except TypeError:  # layers without weak-reference support: no read at death
                refs = None
        req.layer_refs = refs
        req.last_cache = weakref.ref(cache, functools.partial(self.cache_died, req))
        if self.layout is None:
            self.layout = context_from_config(getattr(self.model, "config", None))

    def structure(self, req: RequestState, step: int, t: int, cache: Any, *, memory: bool = True) -> None:
        """Read and write the per-layer structure of ``cache`` as the state after ``step``."""
        req.recorded = step
        ctx = self.layout
        assert ctx is not None
        rid = req.id
        retention = self.ctx.options.retention
        if req.plan is not None and not req.sample_now:
            live = self._retention.live if retention else None
            if isinstance(req.plan, StaticPlan):  # counts from the inputs: no device read
                fast = read_step_static(cache, req.plan, rid, step, t, req.fed, live)
            else:
                fast = read_step_fast(cache, req.plan, rid, step, t, live)
            if fast is not None:
                self._write_fast(req, fast, memory=memory)
                return
        observe = self._retention.observe if retention else None
        readings = read_cache(cache, ctx, observe=observe)
        rows, naive, unique, valid, seen = rows_of(rid, step, t, readings)
        # A cache holding state (hybrid models) always takes this reader: the fast path reads K/V only.
        states = read_states(cache, ctx.num_layers, observe=observe)
        req.plan = None if states else fast_plan(cache, ctx, readings) or static_plan(cache, readings, rows)
        self.write_structure(req, step, t, rows, naive, unique, valid, seen, memory=memory)
        if states:
            self.write_states(rid, step, t, readings, states)
        if not self._layers_written:
            self._write_layers(readings)
        if req.sample_now and self.submission.sampler is not None:
            self.submission.sample(req, step, cache, readings)

    def _write_fast(self, req: RequestState, fast: FastStep, *, memory: bool = True) -> None:
        """The fast path's rows: two deferred blocks, converted by the writer's flusher."""
        w = self.ctx.writer
        assert w is not None
        w.append("kv", fast)
        w.append("steps", FastStepTotals(fast, *self.readings.step_readings(fast.step, memory)))
        self._after_structure(req, fast.step, fast.seen, fast)

    def write_structure(self, req: RequestState, step: int, t: int, rows: list[KvRow], naive: int,
                        unique: int, valid: int, seen: int, *, memory: bool = True) -> None:
        w = self.ctx.writer
        assert w is not None
        w.append("kv", rows)
        phase, alloc, reserved, rss = self.readings.step_readings(step, memory)
        w.append("steps", StepRow(req.id, step, phase, t, seen, naive, unique, valid, alloc, reserved, rss))
        self._after_structure(req, step, seen, rows)

    def _after_structure(self, req: RequestState, step: int, seen: int, rows: list[KvRow] | FastStep) -> None:
        req.tokens_seen = seen
        req.recorded = step
        if self.ctx.options.retention:
            self._retention.end_step()
        if self.ctx.observers:
            self._observe_step(step, seen, rows.rows() if isinstance(rows, FastStep) else rows)

    def cache_died(self, req: RequestState, _ref: Any) -> None:
        """Weak-reference callback of a request's Cache. CPython calls it before the Cache's own
        attributes are cleared, so its layers are still alive: when the request's last step was not
        recorded (structure_every > 1, generate stopped early), read it now, store plain rows only.
        Never raises (an exception here would be printed by the interpreter)."""
        try:
            if self.ctx.active is not req or req.step == 0 or req.recorded == req.step - 1 or self.layout is None:
                return
            refs = req.layer_refs
            if not refs:
                return
            layers = [r() for r in refs]
            if any(layer is None for layer in layers):
                return
            step = req.step - 1
            observe = self._retention.observe if self.ctx.options.retention else None
            dying = types.SimpleNamespace(layers=layers)  # the layers' states; the Cache's own attributes are gone
            readings = read_cache(dying, self.layout, observe=observe)
            states = read_states(dying, self.layout.num_layers, observe=observe)
            layers = dying = None
            req.final = (step, *rows_of(req.id, step, req.step_t[step], readings), readings, states)
        except Exception as exc:  # noqa: BLE001
            try:
                self.ctx.error("final-structure", exc)
            except Exception:  # noqa: BLE001
                pass

    def final_structure(self, req: RequestState) -> None:
        """At request end: the last step's structure when no hook recorded it (structure_every),
        from the live Cache or from what :meth:`cache_died` read; a NOTE when neither exists."""
        last = req.step - 1
        if last < 0 or req.recorded == last:
            return
        req.sample_now = False
        cache = req.last_cache() if req.last_cache is not None else None
        if cache is not None:
            # memory=False: the allocator now is not the allocator at that step
            self.structure(req, last, req.step_t[last], cache, memory=False)
            cache = None
            return
        final, req.final = req.final, None
        if final is not None and final[0] == last:
            step, rows, naive, unique, valid, seen, readings, states = final
            self.write_structure(req, step, req.step_t[step], rows, naive, unique, valid, seen, memory=False)
            if states:
                self.write_states(req.id, step, req.step_t[step], readings, states)
            return
        self.ctx.event(EventKind.NOTE, req.id, step=last,
                       text=f"structure of the last step ({last}) not recorded: its cache was not readable")

    def write_states(self, rid: int, step: int, t: int, readings: list[LayerReading],
                     states: list[StateReading]) -> None:
        """The /state rows of one step (format 1.5), de-duplicated against its KV storages."""
        w = self.ctx.writer
        assert w is not None
        rows, _, _ = state_rows(rid, step, t, readings, states, self._state_text)
        w.append("state", rows)

    def _state_text(self, source: str) -> tuple[int, int]:
        """/text reference of a state's source path, stored once per session."""
        ref = self._state_sources.get(source)
        if ref is None:
            w = self.ctx.writer
            assert w is not None
            ref = self._state_sources[source] = w.add_text(source)
        return ref

    def _observe_step(self, step: int, seen: int, rows: list[KvRow]) -> None:
        observers = self.ctx.observers
        observers.notify("on_step", "prefill" if step == 0 else "decode", tokens_seen=seen)
        observers.kv(rows, layer_type_name)
        self.submission.report_dropped()

    def _write_layers(self, readings: list[LayerReading]) -> None:
        w = self.ctx.writer
        assert w is not None
        names = self.discovery.module_names()
        rows = []
        for r in readings:
            name = names.get((r.cache_index, r.part), "")
            off, length = w.add_text(name) if name else (0, 0)
            rows.append(LayerRow(r.layer, r.layer_type, r.k_shape[1], r.k_shape[3], r.v_shape[3], r.window,
                                 r.shared_from, off, length))
            if r.part == "self":
                self._kv_heads[r.cache_index] = int(r.k_shape[1])
        w.append("layers", rows)
        self._layers_written = True
        self.discovery.remove()  # names are known: no per-layer hook remains



def rows_of(rid: int, step: int, t: int, readings: list[LayerReading]) -> tuple[list[KvRow], int, int, int, int]:
    """(/kv rows, naive, unique, valid bytes, max tokens seen) of one step's readings."""
    acc = account(readings)
    rows = [
        KvRow(rid, step, r.layer, r.layer_type, r.device, r.k_dtype, r.v_dtype, r.k_shape, r.v_shape,
         r.tokens_seen, r.tokens_kept, acc.allocated[i], r.bytes_valid, acc.unique_per_layer[i],
         r.k_storage, r.v_storage, r.k_storage_bytes, r.v_storage_bytes, r.expanded_bytes, t)
        for i, r in enumerate(readings)
    ]
    seen = max((r.tokens_seen for r in readings if r.part == "self"), default=0)
    return rows, acc.naive, acc.unique, acc.valid, seen


def _new_tokens(args: tuple, kwargs: dict) -> int:
    """Tokens one forward feeds (its input_ids / inputs_embeds length), 0 when not visible."""
    x = None
    for key in ("decoder_input_ids", "decoder_inputs_embeds", "input_ids", "inputs_embeds"):  # decoder first
        x = kwargs.get(key)
        if x is not None:
            break
    if x is None and args:
        x = args[0]
    shape = getattr(x, "shape", None)
    return int(shape[1]) if shape is not None and len(shape) >= 2 else 0
