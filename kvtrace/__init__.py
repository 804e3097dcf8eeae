"""kvtrace: record and analyse the KV cache of Hugging Face Transformers models.

`import kvtrace` never imports torch: the recorder is loaded only when `record` is called.
"""

from __future__ import annotations

from typing import Any

from kvtrace._version import __version__
from kvtrace.format import FORMAT_VERSION, Trace, open_trace

__all__ = ["FORMAT_VERSION", "Trace", "__version__", "analyze", "open", "record"]


def open(path: str) -> Trace:  # noqa: A001 - mirrors h5py.File / builtins.open usage
    """Open a trace lazily (see kvtrace.format.Trace)."""
    return open_trace(path)


def record(model: Any, path: str, **options: Any) -> Any:
    """Context manager recording every `generate` call on `model` into `path`.

    Needs the `record` extra (torch, transformers)."""
    try:
        from kvtrace.recorder import record as _record
    except ImportError as exc:
        raise ImportError(
            f"recording needs torch and transformers ({exc}); install with: pip install 'kvtrace[record]'"
        ) from exc
    return _record(model, path, observer_factory=_live_observers, **options)


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
