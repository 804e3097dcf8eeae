"""The recording session: ``with kvtrace.record(model, path) as rec: model.generate(...)``.

What a session changes while it is open, all undone by :meth:`Recorder.close`:

* an instance attribute ``model.generate`` wrapping the class method (one request per call);
* two forward hooks on the model (step start/end) and, for the first forward only, pre-hooks on
  the modules that carry ``layer_idx`` (to name the attention modules);
* with query sampling, the attention implementation (restored to the exact original value);
* ``torch.cuda.reset_peak_memory_stats()`` at each request start (for the PEAK reading; turn it
  off with ``reset_peak=False`` if the program reads the peak itself).

Nothing in here ever holds a strong reference to a cache tensor beyond the hook call that reads it.

Per-step cost: plain dynamic caches are read by ``layouts.read_step_fast`` (byte-exact with the
general reader, which every other cache takes). With ``structure_every=N`` the per-layer structure
is read only at the prefill step, steps that are multiples of N, content-sampling steps and the
last step. When generate stops before the step the recorder expected to be last, that step is read
at request end from the Cache if something still holds it, else from its layers inside the Cache's
weak-reference callback (CPython runs it before the Cache's attributes are cleared); if neither is
possible a NOTE event says the last step's structure was not recorded.

Retention: the AFTER_RETURN (and PEAK) readings are taken as generate returns; which KV storages the
request left alive (/retention) is decided later, when the caller has had the chance to drop
generate's output: at the start of the next generate call on this recorder, or at close. A NOTE
event says which of the two.

Per-request work is proportional to what it proves. A full ``gc.collect()`` costs ~0.25 s in a
process that imported transformers (~0.5 M tracked objects), so the retention check first asks its
weak references whether any KV storage of the request survived; only then does it collect (GC
event, AFTER_GC reading) and check again, and only storage that survived the collection (a
finding) is followed by ``torch.cuda.empty_cache()`` (EMPTY_CACHE event, AFTER_EMPTY_CACHE
reading), so that NVML shows what is really held. ``empty_cache=True`` asks for the full
measurement after every request instead (gc, then empty_cache, both readings, at return).

How it is cut: this module is the session (lifecycle and wiring); the work is done by parts that
each own their state and share only :class:`~kvtrace.recorder.context.SessionContext` (the writer,
the request in flight, the observers, the error count):

* :class:`~kvtrace.recorder.requests.Requests`: the generate wrapper, request begin/finish/abort;
* :class:`~kvtrace.recorder.verdict.RetentionVerdict`: the deferred retention verdict;
* :class:`~kvtrace.recorder.steps.StepRecorder`: hooks, fast path, structure reads, /kv /steps /layers;
* :class:`~kvtrace.recorder.submission.SampleSubmission`: content sampling and query capture;
* :class:`~kvtrace.recorder.readings.MemoryReadings`: telemetry and labelled readings;
* :class:`~kvtrace.recorder.observers.Observers`: live listeners (the Prometheus exporter is one,
  handed in by ``kvtrace.record``; this package imports nothing from kvtrace.export).

* :class:`~kvtrace.recorder.serving.ServingRecorder`: continuous batching (generate_batch, the
  manager API, generate(cache_implementation="paged")): the manager's and scheduler's calls,
  wrapped on the transformers classes while the session is open, write one /requests row per CB
  request, its lifecycle events and per scheduler step the /sched, /sched_groups and /blocks rows
  (format 1.4; no /steps or /kv rows: the paged cache is not a transformers Cache), and the PHASE
  markers of :meth:`Recorder.mark_phase`. It shares the request-id sequence with the generate wrapper.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from kvtrace.format.storage import StorageFault, hold_sigxfsz, release_sigxfsz
from kvtrace.format.writer import TraceWriter
from kvtrace.recorder import parallel
from kvtrace.recorder.context import SessionContext
from kvtrace.recorder.observers import ObserverFactory, RecorderObserver
from kvtrace.recorder.options import (
    CannotServeMetrics,
    CannotWriteOutput,
    CannotWriteTrace,
    RecordOptions,
    check_textfile,
    check_writable,
    sampling_settings,
)
from kvtrace.recorder.owners import OwnerRecorder
from kvtrace.recorder.readings import MemoryReadings
from kvtrace.recorder.requests import Requests
from kvtrace.recorder.serving import ServingRecorder
from kvtrace.recorder.steps import StepRecorder
from kvtrace.recorder.submission import SampleSubmission
from kvtrace.recorder.verdict import RetentionVerdict

__all__ = ["CannotServeMetrics", "CannotWriteOutput", "CannotWriteTrace", "RecordOptions", "Recorder",
           "check_textfile", "check_writable", "record"]


class Recorder:
    """One recording session over one model. Use as a context manager (or start()/close()).

    ``observers`` are live listeners (:class:`~kvtrace.recorder.observers.RecorderObserver`);
    ``observer_factory`` builds the ones the options ask for (``prometheus``,
    ``prometheus_textfile``): ``kvtrace.record`` passes the Prometheus exporter's."""

    def __init__(self, model: torch.nn.Module, path: str | os.PathLike[str],
                 options: RecordOptions | None = None, *, observers: Sequence[RecorderObserver] = (),
                 observer_factory: ObserverFactory | None = None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"record() needs a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.options = opts = options or RecordOptions()
        every = opts.structure_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"structure_every must be an integer >= 1, got {every!r}")
        self.path = check_writable(parallel.rank_path(path))  # one file per tensor-parallel rank
        live: list[RecorderObserver] = []
        if opts.prometheus is not None or opts.prometheus_textfile is not None:
            if observer_factory is None:
                raise ValueError("RecordOptions.prometheus/prometheus_textfile need the exporter: record through "
                                 "kvtrace.record(), or pass observers=[PrometheusExporter(...)]")
            live = list(observer_factory(opts))  # ValueError for a malformed address or linger
        if opts.prometheus_textfile is not None:
            check_textfile(opts.prometheus_textfile)
        self._live = live  # built from the options; the first is served as .exporter
        self._observers = [*live, *observers]
        self._exporter: Any = None
        self._ctx = ctx = SessionContext(opts)
        self._readings = MemoryReadings(model, ctx)
        self.sampling = sampling_settings(opts.sampling)
        _check_selection(model, self.sampling)
        self._submission = SampleSubmission(model, ctx, self.sampling)
        self._verdict = RetentionVerdict(ctx, self._readings, lambda: self._steps.layout)
        self._steps = StepRecorder(model, ctx, self._readings, self._submission, self._verdict.tracker, every)
        self._requests = Requests(model, ctx, secrets.token_bytes(32), self._readings, self._steps,
                                  self._submission, self._verdict)
        self._serving = ServingRecorder(model, ctx, self._requests.salt, self._take_request_id, self._readings)
        self._owners = OwnerRecorder(model, ctx, lambda: self._readings.devices, self._verdict.tracker)
        if opts.owners:  # who owns the memory at the verdict moments (/owners)
            self._verdict.owners = self._requests.owners = self._owners
            self._readings.on_step_memory = self._owners.on_step_memory
            self._serving.owners = self._owners  # an OOM inside continuous batching
            self._owners.pools = self._serving.pools  # the paged KV pools are KV, not unknown
        self._started = False
        self._closed = False
        self._sigxfsz_held = False

    # ---- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> Recorder:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        # a request's own exception leaving the with-block is not yet the caller's to keep or drop
        self._verdict.in_flight = exc[1] if len(exc) > 1 and isinstance(exc[1], BaseException) else None
        try:
            self.close()
        finally:
            self._verdict.in_flight = None

    def start(self) -> Recorder:
        if self._started:
            return self
        ctx = self._ctx
        telemetry = self._readings.open()
        try:
            try:
                ctx.observers.start(self._observers)
            except OSError as exc:
                raise CannotServeMetrics(str(exc)) from None
            self._exporter = self._live[0] if self._live else None
            meta = self._meta(telemetry)
        except BaseException:
            telemetry.close()
            raise
        # A write past RLIMIT_FSIZE must fail (EFBIG, handled by the writer), not kill the process.
        self._sigxfsz_held = hold_sigxfsz()
        try:
            ctx.writer = TraceWriter(self.path, meta, telemetry.device_infos(),
                                     flush_interval_s=self.options.flush_interval_s,
                                     on_failure=self._on_storage_failure)
        except OSError as exc:
            self._release_sigxfsz()
            telemetry.close()
            self._close_observers()
            # the writer's own message already names the trace ("cannot write trace X: ENOSPC (...)"):
            # said once, without the "[Errno 28]" of str(exc)
            said = exc.strerror if exc.strerror and str(self.path) in str(exc.strerror) else None
            raise CannotWriteTrace(said or f"cannot write trace to {self.path}: {exc.strerror or exc}") from exc
        try:
            ctx.observers.notify("on_session_start", meta["model_id"], meta["model_type"], telemetry.latest_rss)
            self._readings.start()
            if self.options.owners:
                self._owners.start()
            self._submission.start()
            self._steps.install()
            self._requests.patch_generate()
            self._serving.install()
        except BaseException:
            self._started = True
            self.close()
            raise
        self._started = True
        return self

    def close(self) -> None:
        """Undo every change to the model, stop background threads, close the trace. Idempotent."""
        if self._closed:
            return
        self._closed = self._requests.closed = True
        if self._ctx.active is None:
            self._verdict.check("close")
        self._serving.check_pools("close")  # a paged pool must die with its manager
        self._owners.close()
        self._requests.unpatch_generate()
        self._serving.remove()
        self._steps.remove()
        self._submission.restore_model()
        self._submission.close()
        self._readings.close()
        self._close_observers()
        if self._ctx.writer is not None:
            self._ctx.writer.close()
        self._release_sigxfsz()

    def mark_phase(self, name: str, index: int | None = None) -> int:
        """Mark the start of a load-test phase (``kvtrace loadtest``: baseline, single, concurrent,
        long, ...): one PHASE event now, value = ``index``, text = ``name`` (format 1.4). ``index``
        defaults to one past the last marked (0 first); returns the index written. Thread-safe;
        RuntimeError when the recording is not open, ValueError for an empty name."""
        return self._serving.mark_phase(name, index)

    def _take_request_id(self) -> int:
        """The next request id, shared by generate calls and continuous-batching requests."""
        rid = self._requests.count
        self._requests.count += 1
        return rid

    def _close_observers(self) -> None:
        self._exporter = None
        self._ctx.observers.close()

    def _release_sigxfsz(self) -> None:
        if self._sigxfsz_held:
            self._sigxfsz_held = False
            release_sigxfsz()

    @property
    def storage_failure(self) -> StorageFault | None:
        """Why the trace stopped being written (disk full, EFBIG, EIO, file deleted), or None.
        The trace then holds everything up to its last flush and is not marked complete."""
        return self.writer.failure if self.writer is not None else None

    def _on_storage_failure(self, fault: StorageFault) -> None:
        """Called once, by the writer, from whichever thread met the fault: one warning line."""
        try:
            sys.stderr.write(f"kvtrace: warning: stopped writing trace {self.path}: {fault.describe()}; "
                             "generation continues unrecorded, the trace keeps everything up to its "
                             "last flush\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001, S110 - stderr closed or broken: nothing else to tell
            pass

    # ---- what the parts hold, for callers and tests ---------------------------------------------

    @property
    def writer(self) -> TraceWriter | None:
        return self._ctx.writer

    @property
    def exporter(self) -> Any:
        """The live-metrics observer built from the options (the Prometheus exporter) while open."""
        return self._exporter

    @property
    def telemetry(self) -> Any:
        return self._readings.telemetry

    @property
    def devices(self) -> list[int]:
        return self._readings.devices

    @devices.setter
    def devices(self, value: list[int]) -> None:
        self._readings.devices = value

    @property
    def sampler(self) -> Any:
        return self._submission.sampler

    @property
    def qcapture(self) -> Any:
        return self._submission.qcapture

    @property
    def requests(self) -> int:
        """Requests begun so far."""
        return self._requests.count

    @property
    def errors(self) -> Counter:
        return self._ctx.errors

    @property
    def hook_time_ns(self) -> int:
        """Wall time spent in the recorder's per-step hooks so far (its direct cost)."""
        return self._steps.hooks.clock.ns

    @property
    def hook_calls(self) -> int:
        return self._steps.hooks.clock.calls

    @property
    def recorder_errors(self) -> int:
        """Exceptions raised (and swallowed) inside the recorder so far."""
        return sum(self._ctx.errors.values())

    # ---- /meta --------------------------------------------------------------------------------

    def _meta(self, telemetry: Any) -> dict[str, Any]:
        model, opts = self.model, self.options
        config = getattr(model, "config", None)
        gen_cfg = getattr(model, "generation_config", None)
        sources = telemetry.sources()
        every = self._steps.every
        sources["cache_structure"] = {
            "available": True, "structure_every": every,
            "reason": "per-layer shapes and storages read from the transformers Cache each step" if every == 1
            else f"per-layer shapes and storages read from the transformers Cache at the prefill step, every "
                 f"{every}th decode step, sampling steps and the last step",
        }
        if "process_rss" in sources:  # /steps rss_bytes is not a read at the step: say what it is
            sources["process_rss"]["steps_rss"] = "latest background sample, at most 1/rate_hz old (-1 before the first)"
        meta: dict[str, Any] = {
            "model_id": opts.model_id or str(getattr(config, "_name_or_path", "") or type(model).__name__),
            "model_type": str(getattr(config, "model_type", "unknown")),
            "model_config_json": _safe_to_dict(config),
            "generation_defaults_json": _safe_to_dict(gen_cfg),
            "recorder_settings_json": opts.to_json(),
            "sources_json": sources,
            "prompt_hash_salt_sha256": hashlib.sha256(self._requests.salt).hexdigest(),
            "contains_prompt_text": bool(opts.store_prompts),
            "contains_tensor_payloads": self.sampling is not None and bool(
                self.sampling.every_n_steps > 0 or self.sampling.at_prefill_end or self.sampling.at_last_step),
        }
        if self.sampling is not None:
            meta["payload_tokens"] = self.sampling.tokens
        shard = parallel.describe(model)  # device map / tensor-parallel rank (spec §3.1)
        if shard is not None:
            meta["parallel_json"] = shard
        meta.update(telemetry.versions())
        return meta


def record(model: torch.nn.Module, path: str | os.PathLike[str], options: RecordOptions | None = None, *,
           observers: Sequence[RecorderObserver] = (), observer_factory: ObserverFactory | None = None,
           **kwargs: Any) -> Recorder:
    """Record every ``model.generate`` call into the trace at ``path``.

    ``kwargs`` are :class:`RecordOptions` fields. Use as a context manager; any number of generate
    calls, one request each. Fails with :class:`CannotWriteTrace` before touching the model when
    ``path`` cannot be written."""
    if options is not None and kwargs:
        raise TypeError("pass either options= or keyword options, not both")
    if options is None:
        unknown = set(kwargs) - set(RecordOptions.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unknown record option(s): {', '.join(sorted(unknown))}")
        options = RecordOptions(**kwargs)
    return Recorder(model, path, options, observers=observers, observer_factory=observer_factory)


def _check_selection(model: torch.nn.Module, sampling: Any) -> None:
    """Sampled layers/heads must exist in this model (the CLI checks the same rule before loading):
    a selection matching nothing would leave a trace claiming contents it does not hold."""
    if sampling is None:
        return
    from kvtrace.geometry import selection_problem

    problem = selection_problem(_safe_to_dict(getattr(model, "config", None)), sampling.layers, sampling.heads)
    if problem is not None:
        raise ValueError(f"sampling {problem[1]}: {problem[0]}")


def _safe_to_dict(obj: Any) -> dict[str, Any]:
    if obj is None:
        return {}
    try:
        return json.loads(json.dumps(obj.to_dict(), default=str))
    except Exception:  # noqa: BLE001
        return {"unavailable": f"{type(obj).__name__}.to_dict() failed"}
