"""Every error kvtrace raises for the user, in one place; each class carries its exit code.

Library layers (format, analyzer, report, export, recorder) raise these and never import the CLI.
Every class derives from :class:`KvtraceError` and names its exit code (``exit_code``, a constant of
kvtrace/exitcodes.py; README "Exit codes" and spec/cli.md document them); the commands
(kvtrace/commands/common.guarded) turn one into a stderr line and that code. Where a builtin
exception says the same thing the class derives from it too (:class:`CannotWrite` is an OSError,
:class:`BadOption` a ValueError), so library callers may catch either. The base and the trace-file
errors are defined beside the reader (kvtrace/format/errors.py, which imports nothing) and
re-exported here so that callers need one import.
"""

from __future__ import annotations

from typing import ClassVar

from kvtrace import exitcodes
from kvtrace.format.errors import (
    CorruptChunk,
    CorruptTrace,
    InvalidTrace,
    KvtraceError,
    LimitExceeded,
    NotATrace,
    TraceError,
    UnsupportedVersion,
)

__all__ = [
    "BadOption", "BundleError", "CannotWrite", "ContentRefused", "CorruptChunk", "CorruptTrace", "InvalidTrace",
    "KvtraceError", "LimitExceeded", "NotATrace", "TraceError", "TraceIncomplete", "Unavailable",
    "UnsupportedVersion",
]


class Unavailable(KvtraceError):
    """A component the command needs is missing (torch, CUDA, triton, matplotlib...)."""

    exit_code: ClassVar[int] = exitcodes.UNAVAILABLE


class CannotWrite(KvtraceError, OSError):
    """An output path cannot be created or written (a trace, a report, a table, a metrics file).
    The recorder's former names for it, CannotWriteOutput and CannotWriteTrace, are aliases."""

    exit_code: ClassVar[int] = exitcodes.CANNOT_WRITE


class TraceIncomplete(KvtraceError):
    """Recording finished but the trace could not be fully written (disk full, EFBIG, EIO)."""

    exit_code: ClassVar[int] = exitcodes.IO_ERROR


class ContentRefused(KvtraceError):
    """A trace holds prompt text or tensor contents and content was not allowed."""

    exit_code: ClassVar[int] = exitcodes.REFUSED


class BundleError(KvtraceError):
    """A Zenodo bundle cannot be made from these inputs; `kind` is "usage" (exit 64), "invalid" (an
    input trace breaks the spec, exit 1) or "output" (the bundle cannot be written, exit 73)."""

    exit_code: ClassVar[int] = exitcodes.USAGE
    CODES: ClassVar[dict[str, int]] = {"usage": exitcodes.USAGE, "invalid": exitcodes.INVALID,
                                       "output": exitcodes.CANNOT_WRITE}

    def __init__(self, message: str, kind: str = "usage") -> None:
        super().__init__(message)
        self.kind = kind
        self.exit_code = self.CODES.get(kind, exitcodes.USAGE)  # type: ignore[misc]


class BadOption(KvtraceError, ValueError):
    """A value the user gave does not fit (exit 64 through the CLI, shown as click's
    "Invalid value for OPTION: ..."); `option` names the option, or None."""

    exit_code: ClassVar[int] = exitcodes.USAGE

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option
