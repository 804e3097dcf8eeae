"""Every error kvtrace raises for the user, in one place; the CLI maps each to one exit code.

Library layers (format, analyzer, report, export) raise these and never import the CLI; the
commands (kvtrace/commands/common.exit_code_for) turn them into one stderr line and the exit code
that README "Exit codes" and spec/cli.md document. The trace-file errors are defined beside the
reader (kvtrace/format/errors.py, which imports nothing) and re-exported here so that callers
need one import.
"""

from __future__ import annotations

from kvtrace.format.errors import (
    CorruptChunk,
    CorruptTrace,
    InvalidTrace,
    LimitExceeded,
    NotATrace,
    TraceError,
    UnsupportedVersion,
)

__all__ = [
    "BadOption", "BundleError", "CannotWrite", "ContentRefused", "CorruptChunk", "CorruptTrace", "InvalidTrace",
    "LimitExceeded", "NotATrace", "TraceError", "TraceIncomplete", "Unavailable", "UnsupportedVersion",
]


class Unavailable(Exception):
    """A component the command needs is missing (torch, CUDA, triton, matplotlib...)."""


class CannotWrite(Exception):
    """An output path cannot be created."""


class TraceIncomplete(Exception):
    """Recording finished but the trace could not be fully written (disk full, EFBIG, EIO)."""


class ContentRefused(Exception):
    """A trace holds prompt text or tensor contents and content was not allowed."""


class BundleError(Exception):
    """A Zenodo bundle cannot be made from these inputs; `kind` is "usage", "invalid" or "output"."""

    def __init__(self, message: str, kind: str = "usage") -> None:
        super().__init__(message)
        self.kind = kind


class BadOption(ValueError):
    """A value the user gave does not fit (exit 64 through the CLI, shown as click's
    "Invalid value for OPTION: ..."); `option` names the option, or None."""

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option
