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
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import os
import secrets
import sys
import types
import weakref
from collections import Counter
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

import torch

from kvtrace.format.schema import EventKind, LayerType, Outcome, PayloadKind, Phase, ReadingLabel
from kvtrace.format.storage import StorageFault, hold_sigxfsz, release_sigxfsz
from kvtrace.format.writer import TraceWriter, monotonic_ns
from kvtrace.recorder import hooks as _hooks
from kvtrace.recorder.accounting import account
from kvtrace.recorder.layouts import (
    FastPlan,
    FastStep,
    FastStepTotals,
    KvRow,
    LayerReading,
    LayoutContext,
    cache_parts,
    context_from_config,
    fast_plan,
    is_offloading,
    read_cache,
    read_step_fast,
    valid_kv,
    wait_for_offload,
)
from kvtrace.recorder.retention import RetentionTracker
from kvtrace.recorder.sampling import token_axis, unsampled_tokens

_OOM_ERRORS: tuple[type[BaseException], ...] = tuple(
    {getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)} - {None}
)
_MAX_ERROR_TEXT = 500
_DECODE_STEP = int(EventKind.DECODE_STEP)


class CannotWriteOutput(OSError):
    """An output of the session (trace, metrics textfile) cannot be written; raised before the
    model runs."""


class CannotWriteTrace(CannotWriteOutput):
    """The trace path cannot be created; raised before the model runs."""


class CannotServeMetrics(OSError):
    """The Prometheus endpoint cannot be bound (address in use, bad host); raised before the model
    runs."""


@dataclass
class RecordOptions:
    """Options of a recording session (all are stored in /meta recorder_settings_json)."""

    model_id: str | None = None  # defaults to config._name_or_path
    store_prompts: bool = False  # prompt text (or token ids without a tokenizer) in the trace
    tokenizer: Any = None  # decodes prompt ids when store_prompts is on
    # The full post-request measurement after every request, at return: gc.collect(), AFTER_GC,
    # torch.cuda.empty_cache(), AFTER_EMPTY_CACHE. Off by default: the collection costs ~0.25 s in
    # a transformers process and empty_cache makes the next request allocate its cache from the
    # driver again. Off, both run only when the retention check finds KV storage still alive.
    empty_cache: bool = False
    reset_peak: bool = True  # reset_peak_memory_stats() at request start, for the PEAK reading
    # Weak-reference tracking of KV storages that outlive a request. Off, nothing can show that
    # storage survived, so no gc.collect()/empty_cache() runs after requests unless empty_cache=True.
    retention: bool = True
    telemetry_hz: float = 5.0  # NVML + allocator + RSS samples; 20 Hz cost ~2% of decode (telemetry.py)
    nvml: bool = True
    allocator: bool = True
    sampling: Any = None  # kvtrace.recorder.sampling.SamplingSettings, a dict of its fields, or None
    # Per-layer structure (/kv rows, the /steps row, retention observation) is read at the prefill
    # step, at decode steps that are multiples of N, at content-sampling steps and at the last step;
    # every step still gets its DECODE_STEP event. 1: every step.
    structure_every: int = 8
    flush_interval_s: float = 1.0
    prometheus: str | None = None  # "HOST:PORT": serve live metrics at http://HOST:PORT/metrics
    prometheus_textfile: str | None = None  # node_exporter textfile, rewritten atomically
    prometheus_linger_s: float = 30.0  # keep serving the final metrics after close (docs/exports.md)
    settings_extra: dict[str, Any] = field(default_factory=dict)  # e.g. the CLI's arguments

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("tokenizer", "sampling", "settings_extra")}
        out["tokenizer"] = type(self.tokenizer).__name__ if self.tokenizer is not None else None
        s = self.sampling
        out["sampling"] = asdict(s) if is_dataclass(s) else s
        out.update(self.settings_extra)
        return out


def check_writable(path: str | os.PathLike[str]) -> Path:
    """Fail early, with a clear message, when ``path`` cannot become a trace file."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise CannotWriteTrace(f"cannot write trace to {p}: it is a directory")
    if not parent.exists():
        raise CannotWriteTrace(f"cannot write trace to {p}: directory {parent} does not exist")
    if not parent.is_dir():
        raise CannotWriteTrace(f"cannot write trace to {p}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise CannotWriteTrace(f"cannot write trace to {p}: permission denied")
    return p


def check_textfile(path: str | os.PathLike[str]) -> Path:
    """Fail early when ``path`` cannot become a Prometheus textfile."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    what = f"cannot write Prometheus textfile {p}"
    if p.is_dir():
        raise CannotWriteOutput(f"{what}: it is a directory")
    if not parent.is_dir():
        raise CannotWriteOutput(f"{what}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CannotWriteOutput(f"{what}: permission denied")
    return p


@dataclass
class _Request:
    id: int
    start_ns: int
    prompt_len: int
    decoder_start_len: int
    expected_last: int  # step index of the last forward if no EOS comes first (-1 unknown)
    step: int = 0
    tokens_seen: int = 0
    fed: int = 0  # tokens fed to the model so far (cache length before the request + inputs)
    step_position: int = 0  # position of the current forward's first token (for sampled queries)
    sample_now: bool = False
    step_t: list[int] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    last_cache: Any = None  # weakref.ref to the Cache of the last finished step
    plan: FastPlan | None = None  # the per-step fast path for that Cache, when it qualifies
    layer_refs: list | None = None  # weakref.ref to each of its layers (for _cache_died)
    recorded: int = -1  # last step whose structure was read (or tried: a failure is not retried)
    final: tuple | None = None  # structure of the last step, read as its Cache died
    # Incremental sampling (SamplingSettings.tokens == "new"): per (layer, payload kind) the end
    # position of what earlier samples hold. whole_samples: this request rewrites cached tokens
    # (beam search, assisted decoding, a cache that shrank), so every sample holds every kept token.
    sampled_until: dict[tuple[int, int], int] = field(default_factory=dict)
    whole_samples: bool = False


@dataclass
class _PendingRetention:
    """A finished request whose retention verdict waits for the next request or close."""

    request: int
    cache: Any  # weakref.ref to its Cache, or None


class Recorder:
    """One recording session over one model. Use as a context manager (or start()/close())."""

    def __init__(self, model: torch.nn.Module, path: str | os.PathLike[str],
                 options: RecordOptions | None = None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"record() needs a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.options = options or RecordOptions()
        every = self.options.structure_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"structure_every must be an integer >= 1, got {every!r}")
        self._every = every
        self.path = check_writable(path)
        self._prom_address: tuple[str, int] | None = None
        if self.options.prometheus is not None:
            from kvtrace.export.prometheus import check_linger, parse_address

            self._prom_address = parse_address(str(self.options.prometheus))  # ValueError if malformed
            check_linger(self.options.prometheus_linger_s)
        if self.options.prometheus_textfile is not None:
            check_textfile(self.options.prometheus_textfile)
        self.exporter: Any = None  # kvtrace.export.prometheus.PrometheusExporter while open
        self._dropped_reported = 0
        self._pending_retention: _PendingRetention | None = None
        self.writer: TraceWriter | None = None
        self.telemetry: Any = None
        self.sampler: Any = None
        self.sampling: Any = None
        self.qcapture: Any = None
        self.errors: Counter = Counter()
        self.requests = 0
        self._ctx: LayoutContext | None = None
        self._layers_written = False
        self._kv_heads: dict[int, int] = {}  # layer -> KV heads (maps query heads onto KV heads)
        self._active: _Request | None = None
        self._started = False
        self._closed = False
        self._salt = secrets.token_bytes(32)
        self._retention = RetentionTracker()
        self._discovery = _hooks.Discovery(model, self._on_error)
        self._steps = _hooks.StepHooks(model, self._on_step_start, self._on_step_end, self._on_error)
        self._generate_patch: tuple[bool, Any] | None = None
        self._attn_before = _attn_snapshot(model)
        self.devices: list[int] = []
        self._sigxfsz_held = False

    # ---- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> Recorder:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Recorder:
        if self._started:
            return self
        from kvtrace.recorder.telemetry import Telemetry

        opts = self.options
        self.devices = Telemetry.devices_of(self.model)
        self.telemetry = Telemetry(self.devices, rate_hz=opts.telemetry_hz, use_nvml=opts.nvml,
                                   use_allocator=opts.allocator)
        self.sampling = _sampling_settings(opts.sampling)
        try:
            self.exporter = self._start_exporter()
            meta = self._meta()
        except BaseException:
            self.telemetry.close()
            raise
        # A write past RLIMIT_FSIZE must fail (EFBIG, handled by the writer), not kill the process.
        self._sigxfsz_held = hold_sigxfsz()
        try:
            self.writer = TraceWriter(self.path, meta, self.telemetry.device_infos(),
                                      flush_interval_s=opts.flush_interval_s,
                                      on_failure=self._on_storage_failure)
        except OSError as exc:
            self._release_sigxfsz()
            self.telemetry.close()
            self._close_exporter()
            raise CannotWriteTrace(f"cannot write trace to {self.path}: {exc}") from exc
        try:
            if self.exporter is not None:
                self.exporter.set_info(meta["model_id"], meta["model_type"])
                self.exporter.set_rss_source(self.telemetry.latest_rss)
                self.telemetry.listeners.append(self._on_telemetry)
            self.telemetry.attach(self.writer)
            self.telemetry.start()
            if self.sampling is not None:
                from kvtrace.recorder.sampling import PayloadSampler

                self.sampler = PayloadSampler(self.writer, self.sampling)
                if self.sampling.queries:
                    from kvtrace.recorder.qcapture import QueryCapture

                    self.qcapture = QueryCapture(self.model, self._on_query,
                                                 modules=decoder_self_attention(self.model))
                    self.qcapture.install()
            self._discovery.install()
            self._steps.install()
            self._patch_generate()
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
        self._closed = True
        if self._active is None:
            self._check_retention("close")
        self._unpatch_generate()
        self._steps.remove()
        self._discovery.remove()
        if self.qcapture is not None:
            try:
                self.qcapture.restore()
            except Exception as exc:  # noqa: BLE001
                self._on_error("restore-attention", exc)
        self._restore_attn()
        if self.sampler is not None:
            try:
                self.sampler.close()
            except Exception as exc:  # noqa: BLE001
                self._on_error("sampler-close", exc)
            self._report_dropped()
        if self.telemetry is not None:
            try:
                self.telemetry.close()  # its last tick still reaches the exporter
            except Exception as exc:  # noqa: BLE001
                self._on_error("telemetry-stop", exc)
        self._close_exporter()
        if self.writer is not None:
            self.writer.close()
        self._release_sigxfsz()

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

    # ---- live metrics ---------------------------------------------------------------------------

    def _start_exporter(self) -> Any:
        opts = self.options
        if self._prom_address is None and opts.prometheus_textfile is None:
            return None
        from kvtrace.export.prometheus import PrometheusExporter

        host, port = self._prom_address if self._prom_address is not None else (None, None)
        exporter = PrometheusExporter(host, port, textfile=opts.prometheus_textfile,
                                      linger_s=opts.prometheus_linger_s)
        try:
            return exporter.start()
        except OSError as exc:
            raise CannotServeMetrics(str(exc)) from None

    def _close_exporter(self) -> None:
        exporter, self.exporter = self.exporter, None
        if exporter is None:
            return
        try:
            exporter.close()
        except Exception as exc:  # noqa: BLE001 - e.g. the textfile's directory went away
            self._on_error("prometheus", exc)

    def _prom(self, method: str, *args: Any, **kwargs: Any) -> None:
        """One exporter update; a failure is a recorder error, never the model's."""
        exporter = self.exporter
        if exporter is None:
            return
        try:
            getattr(exporter, method)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            self._on_error("prometheus", exc)

    def _on_telemetry(self, device: int, mem: Any, alloc: Any) -> None:
        """Telemetry-thread listener: the readings just written, mirrored to the exporter."""
        exporter = self.exporter
        if exporter is None:
            return
        exporter.on_memory(
            device,
            mem.used if mem is not None else None,
            total_bytes=mem.total if mem is not None else None,
            reserved_bytes=alloc.reserved_bytes if alloc is not None else None,
            allocated_bytes=alloc.allocated_bytes if alloc is not None else None,
            inactive_split_bytes=alloc.inactive_split_bytes if alloc is not None else None,
            num_alloc_retries=alloc.num_alloc_retries if alloc is not None else None,
            num_ooms=alloc.num_ooms if alloc is not None else None,
        )

    def _report_dropped(self) -> None:
        sampler = self.sampler
        if sampler is None or self.exporter is None:
            return
        dropped = int(sampler.dropped)
        if dropped > self._dropped_reported:
            self._prom("on_dropped_samples", dropped - self._dropped_reported)
            self._dropped_reported = dropped

    @property
    def hook_time_ns(self) -> int:
        """Wall time spent in the recorder's per-step hooks so far (its direct cost)."""
        return self._steps.clock.ns

    @property
    def hook_calls(self) -> int:
        return self._steps.clock.calls

    @property
    def recorder_errors(self) -> int:
        """Exceptions raised (and swallowed) inside the recorder so far."""
        return sum(self.errors.values())

    # ---- /meta --------------------------------------------------------------------------------

    def _meta(self) -> dict[str, Any]:
        model, opts = self.model, self.options
        config = getattr(model, "config", None)
        gen_cfg = getattr(model, "generation_config", None)
        sources = self.telemetry.sources()
        every = self._every
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
            "prompt_hash_salt_sha256": hashlib.sha256(self._salt).hexdigest(),
            "contains_prompt_text": bool(opts.store_prompts),
            "contains_tensor_payloads": self.sampling is not None and bool(
                self.sampling.every_n_steps > 0 or self.sampling.at_prefill_end or self.sampling.at_last_step),
        }
        if self.sampling is not None:
            meta["payload_tokens"] = self.sampling.tokens
        meta.update(self.telemetry.versions())
        return meta

    # ---- generate wrapper ----------------------------------------------------------------------

    def _patch_generate(self) -> None:
        model = self.model
        had_own = "generate" in model.__dict__
        original = model.generate
        self._generate_patch = (had_own, model.__dict__.get("generate"))
        recorder = self

        def generate(*args: Any, **kwargs: Any) -> Any:
            if recorder._active is not None or recorder._closed:
                return original(*args, **kwargs)  # re-entrant call or closed session: pass through
            req = recorder._begin_request(args, kwargs)
            if req is None:
                return original(*args, **kwargs)
            try:
                out = original(*args, **kwargs)
            except BaseException as exc:
                recorder._abort_request(req, exc)
                raise
            recorder._finish_request(req, out, args, kwargs)
            return out

        generate.__wrapped__ = original  # type: ignore[attr-defined]
        generate.__doc__ = getattr(original, "__doc__", None)
        model.__dict__["generate"] = generate

    def _unpatch_generate(self) -> None:
        if self._generate_patch is None:
            return
        had_own, previous = self._generate_patch
        if had_own:
            self.model.__dict__["generate"] = previous
        else:
            self.model.__dict__.pop("generate", None)
        self._generate_patch = None

    # ---- requests -----------------------------------------------------------------------------

    def _begin_request(self, args: tuple, kwargs: dict) -> _Request | None:
        self._check_retention("next request")
        try:
            return self._begin_request_unguarded(args, kwargs)
        except Exception as exc:  # noqa: BLE001 - the user's generate runs regardless
            self._on_error("request-start", exc)
            return None

    def _begin_request_unguarded(self, args: tuple, kwargs: dict) -> _Request:
        w = self.writer
        assert w is not None
        rid = self.requests
        ids, embeds = _prompt_inputs(args, kwargs)
        batch, prompt_len, digest = 0, 0, b""
        if ids is not None:
            batch, prompt_len = int(ids.shape[0]), int(ids.shape[-1])
            raw = ids.detach().to("cpu", torch.int64).contiguous().numpy().astype("<i8").tobytes()
            digest = hashlib.sha256(self._salt + raw).hexdigest().encode()
        elif embeds is not None:
            batch, prompt_len = int(embeds.shape[0]), int(embeds.shape[1])
        text_ref = (0, 0)
        if self.options.store_prompts and ids is not None:
            text_ref = w.add_text(self._prompt_text(ids))
        gen_ref = w.add_text(json.dumps(_jsonable_kwargs(kwargs), sort_keys=True, default=str))
        self._readings(rid, ReadingLabel.BASELINE)
        if self.options.reset_peak:
            for d in self.devices:
                torch.cuda.reset_peak_memory_stats(d)
        start = monotonic_ns()
        w.begin_request((rid, int(Outcome.RUNNING), batch, prompt_len, 0, -1, start, 0, digest,
                         *text_ref, *gen_ref, 0, 0))
        self._event(EventKind.REQUEST_START, rid, t=start)
        self.requests += 1
        is_encdec = bool(getattr(getattr(self.model, "config", None), "is_encoder_decoder", False))
        dec = kwargs.get("decoder_input_ids")
        dec_len = int(dec.shape[-1]) if isinstance(dec, torch.Tensor) else (1 if is_encdec else 0)
        max_new = _max_new_tokens(self.model, kwargs, prompt_len if not is_encdec else dec_len)
        req = _Request(rid, start, 0 if is_encdec or ids is None else prompt_len, dec_len,
                       (max_new - 1) if max_new else -1)
        req.whole_samples = _rewrites_cache(self.model, kwargs)
        if self.options.retention:
            self._retention.begin()
        self._prom("on_request_start", rid)
        self._active = req
        return req

    def _finish_request(self, req: _Request, out: Any, args: tuple, kwargs: dict) -> None:
        self._active = None
        new_tokens = req.step
        try:
            new_tokens = self._finish_unguarded(req, out, kwargs)
        except Exception as exc:  # noqa: BLE001
            self._on_error("request-end", exc)
            self._safe_update(req.id, outcome=int(Outcome.OK), end_ns=monotonic_ns())
        self._prom("on_request_end", "ok", new_tokens=new_tokens)

    def _finish_unguarded(self, req: _Request, out: Any, kwargs: dict) -> int:
        w = self.writer
        assert w is not None
        rid = req.id
        self._final_structure(req)
        if self.sampler is not None:
            # Its staged copies must not be what keeps device memory busy below; their encoding and
            # writing finish in the background (close() joins them), off the caller's path.
            self.sampler.wait_copies()
        self._event(EventKind.GENERATE_RETURN, rid, step=req.step)
        self._readings(rid, ReadingLabel.AFTER_RETURN)
        if self.options.reset_peak and self.devices:
            t = monotonic_ns()
            w.append("readings", [
                (t, rid, int(ReadingLabel.PEAK), d, int(torch.cuda.max_memory_allocated(d)),
                 int(torch.cuda.max_memory_reserved(d)), -1, -1, -1, -1, -1) for d in self.devices])
        if self.options.empty_cache:  # the full measurement, asked for
            self._collect(rid)
            self._empty_cache(rid)
        if self.options.retention:  # the verdict waits until the caller could drop the output
            self._pending_retention = _PendingRetention(rid, req.last_cache)
        if self.sampler is not None:
            t = monotonic_ns()
            w.append("readings", [(t, rid, int(ReadingLabel.RECORDER_OWN), d,
                                   int(self.sampler.own_device_bytes_on(d)) if d >= 0 else 0,
                                   -1, -1, -1, -1, -1, -1) for d in (self.devices or [-1])])
            self._report_dropped()
        new_tokens, eos_step = _generated(out, req, kwargs, self.model)
        if eos_step >= 0:
            t_eos = req.step_t[eos_step] if eos_step < len(req.step_t) else monotonic_ns()
            self._event(EventKind.EOS, rid, step=eos_step, t=t_eos)
        self._report_request_errors(req)
        end = monotonic_ns()
        w.update_request(rid, outcome=int(Outcome.OK), end_ns=end, new_tokens=new_tokens, eos_step=eos_step)
        self._event(EventKind.REQUEST_END, rid, value=int(Outcome.OK), t=end)
        w.flush_soon()  # the flusher writes it within milliseconds, off the caller's thread
        return new_tokens

    def _collect(self, rid: int) -> None:
        """gc.collect() for request ``rid``, with its GC event and AFTER_GC reading."""
        collected = gc.collect()
        self._event(EventKind.GC, rid, value=int(collected))
        self._readings(rid, ReadingLabel.AFTER_GC)

    def _empty_cache(self, rid: int) -> None:
        if self.devices:
            torch.cuda.empty_cache()
            self._event(EventKind.EMPTY_CACHE, rid)
            self._readings(rid, ReadingLabel.AFTER_EMPTY_CACHE)

    def _check_retention(self, when: str) -> None:
        """The deferred retention verdict of the last finished request: after gc, which of its KV
        storages are still alive and (by type) who holds them. Never raises."""
        pending, self._pending_retention = self._pending_retention, None
        if pending is None or self.writer is None or self.writer.closed:
            return
        try:
            # Weak references first: a collection (~0.25 s) runs only when KV storage survived.
            measured = self.options.empty_cache  # gc and empty_cache already ran at return
            survivors = []
            if self._retention.any_alive():
                if measured:
                    gc.collect()
                else:
                    self._collect(pending.request)
                survivors = self._retention.finish()
                if survivors and not measured:  # a finding: show what the driver still holds
                    self._empty_cache(pending.request)
            self._retention.begin()
            try:
                held, chain = self._cache_holders(pending.cache)
            except Exception as exc:  # noqa: BLE001 - the rows go out without the holder chain
                self._on_error("retention-holders", exc)
                held, chain = set(), []
            w = self.writer
            rows = []
            for r in survivors:
                names = r.referrers
                if (r.device, r.storage, r.nbytes) in held:  # still reachable through that cache
                    names = ",".join(dict.fromkeys([n for n in names.split(",") if n] + chain))
                off, length = w.add_text(names) if names else (0, 0)
                rows.append((pending.request, r.layer, r.device, r.storage, r.nbytes, off, length))
            if rows:
                w.append("retention", rows)
            self._event(EventKind.NOTE, pending.request, value=len(rows), text=f"retention checked at {when}")
        except Exception as exc:  # noqa: BLE001
            self._on_error("retention-check", exc)

    def _cache_holders(self, ref: Any) -> tuple[set, list[str]]:
        """(storage keys the request's Cache still holds, type names from its sub-caches up to what
        holds the Cache) when that Cache is alive; (set(), []) otherwise."""
        cache = ref() if ref is not None else None
        if cache is None:
            return set(), []
        try:
            held: set = set()
            if self._ctx is not None:
                read_cache(cache, self._ctx, observe=lambda key, layer, tensor: held.add(key))
            # no comprehension may name `cache`: it would become a closure cell, a referrer of its own
            chain = [type(sub).__name__ for sub in _sub_caches(cache)]
            chain.append(type(cache).__name__)
            chain.extend(_holder_names(cache))
            return held, chain
        finally:
            del cache

    def _abort_request(self, req: _Request, exc: BaseException) -> None:
        """generate raised: record why, with the allocator state for an OOM; never raises."""
        self._active = None
        outcome = Outcome.ERROR
        try:
            w = self.writer
            assert w is not None
            rid = req.id
            summary = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_TEXT]
            if isinstance(exc, _OOM_ERRORS):
                outcome = Outcome.OOM
                self._event(EventKind.OOM, rid, step=req.step, device=self.devices[0] if self.devices else -1,
                            text=summary)
                self._readings(rid, ReadingLabel.AT_OOM)
            elif isinstance(exc, KeyboardInterrupt):
                outcome = Outcome.INTERRUPTED
                self._event(EventKind.INTERRUPT, rid, step=req.step)
            else:
                outcome = Outcome.ERROR
                self._event(EventKind.EXCEPTION, rid, step=req.step, text=summary)
            if self.options.retention:
                self._retention.begin()  # the traceback holds the cache: nothing to learn here
            self._report_request_errors(req)
            err = w.add_text(summary)
            end = monotonic_ns()
            w.update_request(rid, outcome=int(outcome), end_ns=end, new_tokens=req.step,
                             error_off=err[0], error_len=err[1])
            self._event(EventKind.REQUEST_END, rid, value=int(outcome), t=end)
            w.flush()
        except Exception as inner:  # noqa: BLE001 - never mask the user's exception
            self._on_error("request-abort", inner)
        self._prom("on_request_end", outcome.name.lower(), new_tokens=req.step)

    # ---- steps --------------------------------------------------------------------------------

    def _on_step_start(self, module: Any, args: tuple, kwargs: dict) -> None:
        req = self._active
        if req is None:
            return
        step = req.step
        if step == 0:
            self._event(EventKind.PREFILL_START, req.id, step=0)
            cache = _hooks.find_cache(args, kwargs)
            req.fed = int(cache.get_seq_length()) if cache is not None else 0
        # Positions are counted from the inputs, not from the last structure read: with
        # structure_every > 1 that read may be several steps old.
        req.step_position = req.fed
        req.fed += _new_tokens(args, kwargs)
        if self.sampler is not None:
            req.sample_now = bool(self.sampler.wants(step, is_prefill=step == 0,
                                                     is_last=step == req.expected_last))

    def _on_step_end(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        """Runs after every forward of a request: this is the recorder's per-step cost."""
        req = self._active
        if req is None:
            return
        step = req.step
        req.step = step + 1  # first: a failure below must not shift later steps
        t = monotonic_ns()
        req.step_t.append(t)
        w = self.writer
        assert w is not None
        if step == 0:
            self._event(EventKind.PREFILL_END, req.id, step=0, t=t)
        else:
            w.append("events", (t, _DECODE_STEP, req.id, step, -1, -1, step, 0, 0))
        cache = getattr(output, "past_key_values", None)
        if not isinstance(cache, _hooks.Cache):
            cache = _hooks.find_cache(args, kwargs)
            if cache is None and self._discovery.last_cache is not None:
                cache = self._discovery.last_cache()
        if cache is None:
            raise RuntimeError("no transformers Cache seen in this forward (use_cache=False?)")
        last = req.last_cache
        if last is None or last() is not cache:
            self._track_cache(req, cache)
        if step % self._every and step != req.expected_last and not req.sample_now:
            if self.exporter is not None:
                self._prom("on_step", "decode")
            return  # structure not read at this step (structure_every)
        self._structure(req, step, t, cache)

    def _track_cache(self, req: _Request, cache: Any) -> None:
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
        req.last_cache = weakref.ref(cache, functools.partial(self._cache_died, req))
        if self._ctx is None:
            self._ctx = context_from_config(getattr(self.model, "config", None))

    def _structure(self, req: _Request, step: int, t: int, cache: Any, *, memory: bool = True) -> None:
        """Read and write the per-layer structure of ``cache`` as the state after ``step``."""
        req.recorded = step
        ctx = self._ctx
        assert ctx is not None
        rid = req.id
        retention = self.options.retention
        if req.plan is not None and not req.sample_now:
            fast = read_step_fast(cache, req.plan, rid, step, t, self._retention.live if retention else None)
            if fast is not None:
                self._write_fast(req, fast, memory=memory)
                return
        readings = read_cache(cache, ctx, observe=self._retention.observe if retention else None)
        rows, naive, unique, valid, seen = _rows_of(rid, step, t, readings)
        req.plan = fast_plan(cache, ctx, readings)
        self._write_structure(req, step, t, rows, naive, unique, valid, seen, memory=memory)
        if not self._layers_written:
            self._write_layers(readings)
        if req.sample_now and self.sampler is not None:
            self._sample(req, step, cache, readings)

    def _write_fast(self, req: _Request, fast: FastStep, *, memory: bool = True) -> None:
        """The fast path's rows: two deferred blocks, converted by the writer's flusher."""
        w = self.writer
        assert w is not None
        w.append("kv", fast)
        w.append("steps", FastStepTotals(fast, *self._step_readings(fast.step, memory)))
        self._after_structure(req, fast.step, fast.seen, fast)

    def _write_structure(self, req: _Request, step: int, t: int, rows: list[KvRow], naive: int, unique: int,
                         valid: int, seen: int, *, memory: bool = True) -> None:
        w = self.writer
        assert w is not None
        w.append("kv", rows)
        phase, alloc, reserved, rss = self._step_readings(step, memory)
        w.append("steps", (req.id, step, phase, t, seen, naive, unique, valid, alloc, reserved, rss))
        self._after_structure(req, step, seen, rows)

    def _step_readings(self, step: int, memory: bool) -> tuple[int, int, int, int]:
        """(phase, allocated, reserved, RSS) of a /steps row. Allocator totals are read
        synchronously at the step (-1 when ``memory`` is off); RSS is the telemetry thread's latest
        sample (at most ~1/telemetry_hz old), never a /proc read on the model's thread."""
        alloc, reserved = self._step_memory() if memory else (-1, -1)
        return int(Phase.PREFILL if step == 0 else Phase.DECODE), alloc, reserved, self.telemetry.latest_rss()

    def _after_structure(self, req: _Request, step: int, seen: int, rows: list[KvRow] | FastStep) -> None:
        req.tokens_seen = seen
        req.recorded = step
        if self.options.retention:
            self._retention.end_step()
        if self.exporter is not None:
            self._prom_step(step, seen, rows.rows() if isinstance(rows, FastStep) else rows)

    def _cache_died(self, req: _Request, _ref: Any) -> None:
        """Weak-reference callback of a request's Cache. CPython calls it before the Cache's own
        attributes are cleared, so its layers are still alive: when the request's last step was not
        recorded (structure_every > 1, generate stopped early), read it now, store plain rows only.
        Never raises (an exception here would be printed by the interpreter)."""
        try:
            if self._active is not req or req.step == 0 or req.recorded == req.step - 1 or self._ctx is None:
                return
            refs = req.layer_refs
            if not refs:
                return
            layers = [r() for r in refs]
            if any(layer is None for layer in layers):
                return
            step = req.step - 1
            observe = self._retention.observe if self.options.retention else None
            readings = read_cache(types.SimpleNamespace(layers=layers), self._ctx, observe=observe)
            layers = None
            req.final = (step, *_rows_of(req.id, step, req.step_t[step], readings))
        except Exception as exc:  # noqa: BLE001
            try:
                self._on_error("final-structure", exc)
            except Exception:  # noqa: BLE001
                pass

    def _final_structure(self, req: _Request) -> None:
        """At request end: the last step's structure when no hook recorded it (structure_every),
        from the live Cache or from what :meth:`_cache_died` read; a NOTE when neither exists."""
        last = req.step - 1
        if last < 0 or req.recorded == last:
            return
        req.sample_now = False
        cache = req.last_cache() if req.last_cache is not None else None
        if cache is not None:
            # memory=False: the allocator now is not the allocator at that step
            self._structure(req, last, req.step_t[last], cache, memory=False)
            cache = None
            return
        final, req.final = req.final, None
        if final is not None and final[0] == last:
            step, rows, naive, unique, valid, seen = final
            self._write_structure(req, step, req.step_t[step], rows, naive, unique, valid, seen, memory=False)
            return
        self._event(EventKind.NOTE, req.id, step=last,
                    text=f"structure of the last step ({last}) not recorded: its cache was not readable")

    def _prom_step(self, step: int, seen: int, rows: list[KvRow]) -> None:
        self._prom("on_step", "prefill" if step == 0 else "decode", tokens_seen=seen)
        exporter = self.exporter
        try:
            for row in rows:
                exporter.on_kv(row[2], _layer_type_name(row[3]), row[13])
        except Exception as exc:  # noqa: BLE001
            self._on_error("prometheus", exc)
        self._report_dropped()

    def _step_memory(self) -> tuple[int, int]:
        if not self.devices:
            return (-1, -1)
        alloc = reserved = 0
        for d in self.devices:
            a, r = self.telemetry.step_reading(d)
            if a < 0 or r < 0:
                return (-1, -1)
            alloc += a
            reserved += r
        return alloc, reserved

    def _write_layers(self, readings: list[LayerReading]) -> None:
        w = self.writer
        assert w is not None
        names = self._discovery.module_names()
        rows = []
        for r in readings:
            name = names.get((r.cache_index, r.part), "")
            off, length = w.add_text(name) if name else (0, 0)
            rows.append((r.layer, r.layer_type, r.k_shape[1], r.k_shape[3], r.v_shape[3], r.window,
                         r.shared_from, off, length))
            if r.part == "self":
                self._kv_heads[r.cache_index] = int(r.k_shape[1])
        w.append("layers", rows)
        self._layers_written = True
        self._discovery.remove()  # names are known: no per-layer hook remains

    def _sample(self, req: _Request, step: int, cache: Any, readings: list[LayerReading]) -> None:
        offloaded = is_offloading(cache)
        if offloaded:
            wait_for_offload(cache)
        parts = dict(cache_parts(cache))
        with self.sampler.batch():  # one side-stream context and one event for the whole step
            self._submit_layers(req, step, cache, readings, parts, offloaded)

    def _submit_layers(self, req: _Request, step: int, cache: Any, readings: list[LayerReading],
                       parts: dict, offloaded: bool) -> None:
        settings = self.sampling
        for r in readings:
            if settings.layers is not None and r.layer not in settings.layers:
                continue
            if r.layer_type == LayerType.SHARED_CONSUMER:
                continue  # its producer's tensors are sampled under the producer's index
            k, v, start = valid_kv(cache, r)
            if k is None:
                continue
            # Dynamic layers replace their tensors (torch.cat) instead of writing into them, so the
            # copy may overlap later kernels; every other layout keeps the sampler's safe default
            # (the main stream waits for the copy): static, offloaded, quantized.
            mutable = False if not offloaded and _never_in_place(parts.get(r.part), r.cache_index) else None
            if r.layer_type == LayerType.LATENT:
                kinds = (PayloadKind.LATENT, PayloadKind.ROPE_KEY) if settings.latents else ()
            else:
                kinds = (PayloadKind.KEY, PayloadKind.VALUE)
            whole = settings.tokens == "all" or r.layer_type in _SAMPLED_WHOLE
            for kind, tensor in zip(kinds, (k, v), strict=False):
                self._submit_tokens(req, step, r.layer, kind, tensor, start, mutable, whole=whole)
            k = v = tensor = None  # no cache tensor outlives this call

    def _submit_tokens(self, req: _Request, step: int, layer: int, kind: PayloadKind, tensor: torch.Tensor,
                       start: int, mutable: bool | None, *, whole: bool) -> None:
        """Submit one layer's K, V or latent: whole, or (incremental sampling) only the tokens no
        earlier sample of this (request, layer, kind) holds."""
        key = (layer, int(kind))
        axis = token_axis(tensor)
        end = start + tensor.shape[axis] if axis is not None else None
        until = req.sampled_until.get(key)
        if until is not None and end is not None and end < until:
            req.whole_samples = True  # the cache shrank (cropped): positions may be rewritten
        if not (whole or req.whole_samples):
            tensor, start = unsampled_tokens(tensor, start, until)
            if tensor is None:
                return  # nothing new since the last sample
        if self.sampler.submit(req.id, step, layer, kind, tensor, token_start=start, mutable=mutable) \
                and end is not None:
            req.sampled_until[key] = end  # a dropped sample is retried at the next sampling step

    def _on_query(self, layer_idx: int, query: torch.Tensor) -> None:
        try:
            req = self._active
            if req is None or not req.sample_now or self.sampler is None:
                return
            if self.sampling.layers is not None and layer_idx not in self.sampling.layers:
                return
            group = self.qcapture.group_sizes.get(layer_idx) if self.qcapture is not None else None
            if group is None:  # the capture could not see the key: derive it from the geometry
                kv_heads = self._kv_heads.get(int(layer_idx), 0)
                heads = self._ctx.num_attention_heads if self._ctx is not None else 0
                group = heads // kv_heads if kv_heads and heads and heads % kv_heads == 0 else None
            self.sampler.submit(req.id, req.step, int(layer_idx), PayloadKind.QUERY, query,
                                token_start=req.step_position, group_size=group)
        except Exception as exc:  # noqa: BLE001
            self._on_error("query-capture", exc)

    # ---- rows ---------------------------------------------------------------------------------

    def _event(self, kind: EventKind, request: int = -1, *, step: int = -1, layer: int = -1,
               device: int = -1, value: int = 0, text: str = "", t: int | None = None) -> None:
        w = self.writer
        if w is None or w.closed:
            return
        off, length = w.add_text(text) if text else (0, 0)
        w.append("events", (monotonic_ns() if t is None else t, int(kind), request, step, layer, device,
                            value, off, length))

    def _readings(self, request: int, label: ReadingLabel) -> None:
        w = self.writer
        assert w is not None
        rows = []
        for d in self.devices or [-1]:
            r = self.telemetry.reading(d)
            rows.append((monotonic_ns(), request, int(label), d, r["allocated_bytes"], r["reserved_bytes"],
                         r["active_bytes"], r["inactive_split_bytes"], r["nvml_used_bytes"],
                         r["nvml_process_used_bytes"], r["rss_bytes"]))
        w.append("readings", rows)

    def _safe_update(self, rid: int, **fields: Any) -> None:
        try:
            assert self.writer is not None
            self.writer.update_request(rid, **fields)
        except Exception:  # noqa: BLE001
            pass

    def _on_error(self, site: str, exc: BaseException) -> None:
        """A recorder failure: counted, reported once per request as RECORDER_ERROR, swallowed."""
        summary = f"{site}: {type(exc).__name__}: {exc}"[:_MAX_ERROR_TEXT]
        self.errors[summary] += 1
        req = self._active
        rid = req.id if req is not None else -1
        first = True
        if req is not None:
            req.errors[summary] += 1
            first = req.errors[summary] == 1
        if first:
            self._event(EventKind.RECORDER_ERROR, rid, step=req.step if req else -1, value=1, text=summary)
        if self.exporter is not None:
            try:
                self.exporter.on_recorder_error()
            except Exception:  # noqa: BLE001 - counted above already; never recurse
                pass

    def _report_request_errors(self, req: _Request) -> None:
        for summary, n in req.errors.items():
            if n > 1:
                self._event(EventKind.RECORDER_ERROR, req.id, value=n, text=summary)

    def _prompt_text(self, ids: torch.Tensor) -> str:
        tok = self.options.tokenizer
        rows = ids.detach().cpu().tolist()
        if tok is not None:
            try:
                return "\n".join(tok.decode(r, skip_special_tokens=False) for r in rows)
            except Exception as exc:  # noqa: BLE001
                self._on_error("prompt-decode", exc)
        return "\n".join("token ids: " + " ".join(map(str, r)) for r in rows)

    def _restore_attn(self) -> None:
        for cfg, before in self._attn_before:
            try:
                if getattr(cfg, "_attn_implementation", None) != before:
                    cfg._attn_implementation = before
            except Exception as exc:  # noqa: BLE001
                self._on_error("restore-attention", exc)


def record(model: torch.nn.Module, path: str | os.PathLike[str], options: RecordOptions | None = None,
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
    return Recorder(model, path, options)


# ---- helpers ----------------------------------------------------------------------------------


def _rows_of(rid: int, step: int, t: int, readings: list[LayerReading]) -> tuple[list[KvRow], int, int, int, int]:
    """(/kv rows, naive, unique, valid bytes, max tokens seen) of one step's readings."""
    acc = account(readings)
    rows = [
        (rid, step, r.layer, r.layer_type, r.device, r.k_dtype, r.v_dtype, r.k_shape, r.v_shape,
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


def _layer_type_name(code: int) -> str:
    try:
        return LayerType(int(code)).name.lower()
    except ValueError:
        return f"type_{int(code)}"


def _dynamic_layer_types() -> tuple[type, ...]:
    try:
        from transformers import cache_utils
    except ImportError:  # pragma: no cover
        return ()
    return tuple(t for t in (getattr(cache_utils, n, None) for n in ("DynamicLayer", "DynamicSlidingWindowLayer"))
                 if isinstance(t, type))


_NEVER_IN_PLACE = _dynamic_layer_types()


def _never_in_place(sub: Any, index: int) -> bool:
    """The layer is exactly a DynamicLayer / DynamicSlidingWindowLayer (subclasses such as the
    quantized layers may keep buffers they write into)."""
    layers = getattr(sub, "layers", None)
    if layers is None or not 0 <= index < len(layers):
        return False
    return type(layers[index]) in _NEVER_IN_PLACE


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


def decoder_self_attention(model: torch.nn.Module) -> list[torch.nn.Module] | None:
    """For an encoder-decoder model, the decoder's self-attention modules (the ones whose queries
    pair with the self-attention cache); None (every ``layer_idx`` module) for decoder-only models.

    Encoder modules are excluded through ``get_encoder()``. Cross-attention attends to every
    encoder position, so it is never causal: decoder self-attention modules are the causal ones.
    Where modules do not say (no ``is_causal``), the first attention module of each layer is
    taken, the order every transformers decoder layer uses (self-attention, then cross)."""
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return None
    encoder_ids: set[int] = set()
    get_encoder = getattr(model, "get_encoder", None)
    if callable(get_encoder):
        try:
            encoder = get_encoder()
        except Exception:  # noqa: BLE001
            encoder = None
        if isinstance(encoder, torch.nn.Module):
            encoder_ids = {id(m) for m in encoder.modules()}
    named = [(n, m) for n, m in _hooks.layer_modules(model) if id(m) not in encoder_ids]
    # innermost layer_idx modules only: a decoder block may carry layer_idx too
    leaves = [m for n, m in named if not any(o.startswith(n + ".") for o, _ in named)]
    wanted = {m.layer_idx for m in leaves}
    causal = [m for m in leaves if getattr(m, "is_causal", None) is True]
    if causal and {m.layer_idx for m in causal} == wanted:
        return causal
    first: dict[int, torch.nn.Module] = {}
    for m in leaves:
        first.setdefault(m.layer_idx, m)
    return list(first.values())


# Layouts whose cached values change after they are written: never sampled incrementally.
_SAMPLED_WHOLE = frozenset({LayerType.QUANTIZED, LayerType.UNKNOWN})


def _rewrites_cache(model: Any, kwargs: dict) -> bool:
    """Does this generate call rewrite cached tokens (beams reorder the cache; assisted and
    prompt-lookup decoding crop rejected tokens)? Then samples hold every kept token."""
    if kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens"):
        return True
    beams = _gen_setting(model, kwargs, "num_beams")
    return isinstance(beams, int) and beams > 1


def _sampling_settings(value: Any) -> Any:
    if value is None or value is False:
        return None
    from kvtrace.recorder.sampling import SamplingSettings

    if isinstance(value, SamplingSettings):
        return value
    if isinstance(value, dict):
        return SamplingSettings(**value)
    if isinstance(value, int) and not isinstance(value, bool):
        return SamplingSettings(every_n_steps=value)
    raise TypeError("sampling must be SamplingSettings, a dict of its fields, or an int (every N steps)")


def _safe_to_dict(obj: Any) -> dict[str, Any]:
    if obj is None:
        return {}
    try:
        return json.loads(json.dumps(obj.to_dict(), default=str))
    except Exception:  # noqa: BLE001
        return {"unavailable": f"{type(obj).__name__}.to_dict() failed"}


def _attn_snapshot(model: torch.nn.Module) -> list[tuple[Any, Any]]:
    """(config, _attn_implementation) of every distinct config the model's modules carry."""
    out, seen = [], set()
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is None or id(cfg) in seen or not hasattr(cfg, "_attn_implementation"):
            continue
        seen.add(id(cfg))
        try:
            out.append((cfg, cfg._attn_implementation))
        except Exception:  # noqa: BLE001
            continue
    return out


def _prompt_inputs(args: tuple, kwargs: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    ids = kwargs.get("input_ids")
    if ids is None:
        ids = kwargs.get("inputs")
    if ids is None and args and isinstance(args[0], torch.Tensor):
        ids = args[0]
    if isinstance(ids, torch.Tensor) and ids.dim() == 1:
        ids = ids.unsqueeze(0)
    embeds = kwargs.get("inputs_embeds")
    return (ids if isinstance(ids, torch.Tensor) and not ids.is_floating_point() else None,
            embeds if isinstance(embeds, torch.Tensor) else None)


_JSON_SCALARS = (bool, int, float, str, type(None))


def _jsonable(value: Any) -> bool:
    if isinstance(value, _JSON_SCALARS):
        return True
    if isinstance(value, (list, tuple)):
        return all(_jsonable(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _jsonable(v) for k, v in value.items())
    return False


def _jsonable_kwargs(kwargs: dict) -> dict[str, Any]:
    """generate() kwargs that are plain JSON values; a GenerationConfig as its diff dict; the names
    of everything else (tensors, streamers, callables) under "_omitted"."""
    out: dict[str, Any] = {}
    omitted = []
    for k, v in kwargs.items():
        if _jsonable(v):
            out[k] = v
        elif k == "generation_config" and hasattr(v, "to_diff_dict"):
            try:
                out[k] = json.loads(json.dumps(v.to_diff_dict(), default=str))
            except Exception:  # noqa: BLE001
                omitted.append(k)
        else:
            omitted.append(k)
    if omitted:
        out["_omitted"] = sorted(omitted)
    return out


def _gen_setting(model: Any, kwargs: dict, name: str) -> Any:
    if kwargs.get(name) is not None:
        return kwargs[name]
    for cfg in (kwargs.get("generation_config"), getattr(model, "generation_config", None)):
        v = getattr(cfg, name, None)
        if v is not None:
            return v
    return None


def _max_new_tokens(model: Any, kwargs: dict, start_len: int) -> int | None:
    n = _gen_setting(model, kwargs, "max_new_tokens")
    if n is not None:
        return int(n)
    max_len = _gen_setting(model, kwargs, "max_length")
    if max_len is not None:
        return max(int(max_len) - start_len, 0)
    return None


def _eos_ids(model: Any, kwargs: dict) -> set[int]:
    eos = _gen_setting(model, kwargs, "eos_token_id")
    if eos is None:
        return set()
    if isinstance(eos, torch.Tensor):
        eos = eos.flatten().tolist()
    if isinstance(eos, int):
        eos = [eos]
    return {int(e) for e in eos}


def _generated(out: Any, req: _Request, kwargs: dict, model: Any) -> tuple[int, int]:
    """(new tokens, step that produced the first EOS in any sequence or -1) from generate's output."""
    seqs = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
    if not isinstance(seqs, torch.Tensor) or seqs.dim() != 2:
        return req.step, -1
    start = req.decoder_start_len if req.decoder_start_len else req.prompt_len
    new = seqs[:, start:]
    eos = _eos_ids(model, kwargs)
    eos_step = -1
    if eos and new.numel():
        hits = torch.isin(new, torch.tensor(sorted(eos), device=new.device)).any(dim=0).nonzero()
        if hits.numel():
            eos_step = int(hits[0, 0])
    return int(new.shape[1]), eos_step

