"""What a recording session is asked to do (:class:`RecordOptions`), the checks made before the
model runs, and the errors those checks raise. No torch here: the CLI validates with it cheaply."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

from kvtrace.errors import CannotWrite, Unavailable

# An output of the session (trace, metrics textfile) cannot be written; raised before the model
# runs. The one "cannot write" error (exit 73), under the names the recorder's API gave it.
CannotWriteOutput = CannotWrite
CannotWriteTrace = CannotWrite


class CannotServeMetrics(Unavailable, OSError):
    """The Prometheus endpoint cannot be bound (address in use, bad host); raised before the model
    runs (exit 69, as every resource the command needs and cannot have)."""


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
    # Who owns the memory (/owners, format 1.5): allocator snapshots (GPU) or a tensor census (CPU)
    # at request ends that left something to explain, OOMs and growth past the live KV.
    owners: bool = True
    owners_every_s: float = 60.0  # the periodic owner reading (GPU only); 0: off
    # Allocation stacks through torch.cuda.memory._record_memory_history: /owners names the largest
    # unknown blocks' allocation sites. Off by default (its cost: docs/benchmarks.md).
    memory_history: bool = False
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


def sampling_settings(value: Any) -> Any:
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
