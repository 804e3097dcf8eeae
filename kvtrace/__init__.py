"""kvtrace: record and analyse the KV cache of Hugging Face Transformers models.

`import kvtrace` never imports torch: the recorder is loaded only when `record` is called.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvtrace._version import __version__
from kvtrace.format import FORMAT_VERSION, Trace, open_trace

if TYPE_CHECKING:  # pragma: no cover - the recorder (torch) loads only when record() is called
    from kvtrace.recorder import Recorder, RecordOptions
    from kvtrace.recorder.sampling import SamplingSettings

__all__ = ["FORMAT_VERSION", "Trace", "__version__", "analyze", "open", "record"]


def open(path: str) -> Trace:  # noqa: A001 - mirrors h5py.File / builtins.open usage
    """Open a trace; nothing else is read until asked, as with h5py: tables are attributes read by
    slices or by request (``trace.kv[:]``, ``trace.kv.where(request=0)``), payloads one at a time
    (``trace.payload(i)``), any table as a data frame (``trace.to_pandas("kv")``). See
    :class:`kvtrace.format.Trace`."""
    return open_trace(path)


def record(
    model: Any,
    path: str | os.PathLike[str],
    *,
    model_id: str | None = None,
    store_prompts: bool = False,
    tokenizer: Any = None,
    empty_cache: bool = False,
    reset_peak: bool = True,
    retention: bool = True,
    owners: bool = True,
    owners_every_s: float = 60.0,
    memory_history: bool = False,
    telemetry_hz: float = 5.0,
    nvml: bool = True,
    allocator: bool = True,
    sampling: SamplingSettings | dict[str, Any] | int | None = None,
    structure_every: int = 8,
    flush_interval_s: float = 1.0,
    prometheus: str | None = None,
    prometheus_textfile: str | os.PathLike[str] | None = None,
    prometheus_linger_s: float = 30.0,
    settings_extra: dict[str, Any] | None = None,
    options: RecordOptions | None = None,
    observers: Sequence[Any] = (),
) -> Recorder:
    """Record every ``generate`` call on ``model`` into the trace at ``path``.

    A context manager (``with kvtrace.record(model, "run.kvt.h5"): model.generate(...)``); the trace
    is complete when the block exits. It also records continuous batching inside the block
    (``generate_batch``, ``ContinuousBatchingManager``, ``generate(cache_implementation="paged")``).
    Fails before touching the model when ``path`` cannot be written (CannotWriteTrace, an OSError).
    Needs the ``record`` extra (torch, transformers).

    Args:
        model: a transformers model (``PreTrainedModel``); hooks are added to its attention modules
            for the block's duration and removed after.
        path: the trace file to write (HDF5, spec/kvtrace-format.md).
        model_id: the name stored in the trace; default ``config._name_or_path``.
        store_prompts: store prompt text in the trace (token ids without a tokenizer). Off by
            default: a trace holds a salted hash of each prompt only.
        tokenizer: decodes prompt ids when ``store_prompts`` is on.
        empty_cache: after every request run ``gc.collect()`` and ``torch.cuda.empty_cache()`` and
            read memory after each (about +0.25 s per request). Off, they run only when the
            retention check finds KV storage still alive.
        reset_peak: reset the allocator's peak statistics at each request start (the PEAK reading).
        retention: track KV storages by weak reference and list those alive after their request,
            with the types holding them (the post_eos detector's proof).
        owners: name who owns the memory (/owners) at the moments verdicts are decided: a request's
            end that left something to explain, an OOM, growth past the live KV (an allocator
            snapshot on a GPU, a census of the tensors the garbage collector tracks on a CPU).
        owners_every_s: also read the owners every this many seconds (GPU only; 0: off).
        memory_history: record allocation stacks (torch.cuda.memory._record_memory_history) so the
            largest unknown owners are named by their allocation site. Off by default: it slows
            generate (docs/benchmarks.md).
        telemetry_hz: rate of the background sampler (NVML, allocator, process RSS).
        nvml: poll NVML (GPU memory as the driver sees it).
        allocator: sample the PyTorch caching allocator.
        sampling: store K/V (and optionally Q) contents: a ``SamplingSettings``, a dict of its
            fields, or an int (every N decode steps). None: no tensor contents are stored.
        structure_every: read the per-layer cache structure at prefill, every N-th decode step,
            sampling steps and the last step (1: every step).
        flush_interval_s: how often the writer flushes (a killed process loses at most this much).
        prometheus: ``"HOST:PORT"``: serve live metrics at ``http://HOST:PORT/metrics``.
        prometheus_textfile: a node_exporter textfile, rewritten atomically.
        prometheus_linger_s: keep serving the final metrics this long after the block exits.
        settings_extra: more settings to store in the trace's ``recorder_settings_json``.
        options: all of the above as one :class:`kvtrace.recorder.RecordOptions` (instead of
            keywords; not both).
        observers: extra live listeners (kvtrace.recorder.observers protocol).

    Returns:
        the :class:`kvtrace.recorder.Recorder` (its ``storage_failure``, ``requests`` and
        ``recorder_errors`` tell how the recording went).
    """
    given = {name: value for name, value in locals().items()
             if name in _OPTION_DEFAULTS and _differs(value, _OPTION_DEFAULTS[name])}
    try:
        from kvtrace.recorder import record as _record
    except ImportError as exc:
        raise ImportError(
            f"recording needs torch and transformers ({exc}); install with: pip install 'kvtrace[record]'"
        ) from exc
    if given.get("settings_extra") is None:
        given.pop("settings_extra", None)
    return _record(model, path, options, observers=observers, observer_factory=_live_observers, **given)


# The keyword defaults of `record`, which are RecordOptions' own (a test keeps the two equal).
_OPTION_DEFAULTS: dict[str, Any] = {
    name: p.default for name, p in inspect.signature(record).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in ("options", "observers")
}


def _differs(value: Any, default: Any) -> bool:
    """Whether a keyword of `record` was given a value of its own (only those reach RecordOptions,
    so ``options=`` with no other keyword is not taken for both)."""
    if value is default:
        return False
    if isinstance(default, (bool, int, float, str)) and type(value) is type(default):
        return bool(value != default)
    return True


def _live_observers(options: Any) -> list[Any]:
    """The live listeners RecordOptions ask for, handed to the recorder (which imports no exporter)."""
    if options.prometheus is None and options.prometheus_textfile is None:
        return []
    from kvtrace.export.prometheus_serving import observers_for  # the exporter + its serving metrics

    return observers_for(options)


def analyze(trace: Any, **options: Any) -> Any:
    """Run the detectors on a trace (path or open Trace); returns an analysis report."""
    from kvtrace.analyzer import analyze as _analyze

    return _analyze(trace, **options)
