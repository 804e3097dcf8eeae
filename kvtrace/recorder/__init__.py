"""The recorder: hooks on a Transformers model that write a kvtrace trace.

``record(model, path, **options)`` returns a :class:`Recorder` context manager; options are the
fields of :class:`RecordOptions`. The session module (torch, transformers) loads on first use, so
importing a sibling module such as ``kvtrace.recorder.telemetry`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from kvtrace.recorder.session import (
        CannotServeMetrics,
        CannotWriteOutput,
        CannotWriteTrace,
        Recorder,
        RecordOptions,
        check_textfile,
        check_writable,
        record,
    )

__all__ = ["CannotServeMetrics", "CannotWriteOutput", "CannotWriteTrace", "RecordOptions", "Recorder",
           "check_textfile", "check_writable", "record"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvtrace.recorder import session

        return getattr(session, name)
    raise AttributeError(f"module 'kvtrace.recorder' has no attribute {name!r}")
