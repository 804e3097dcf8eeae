"""Errors raised on bad trace files; each maps to one documented CLI exit code.

The rule (README "Exit codes", spec §9.1): a file that cannot be identified as a kvtrace trace
(missing, a directory, not HDF5, HDF5 that does not open, no kvtrace marker) is
:class:`NotATrace` (exit 2); a newer major version is :class:`UnsupportedVersion` (exit 4); a file
that carries the kvtrace marker and a readable version but breaks the spec anywhere else, including
objects HDF5 cannot read and chunks that do not decode, is :class:`InvalidTrace` (exit 1). Every
command raises the same class for the same file, because they all read through one reader.

:class:`KvtraceError`, the base of every error kvtrace raises for the user, is defined here rather
than in kvtrace/errors.py because the format imports nothing outside itself; kvtrace.errors
re-exports it with the other classes. The codes are written as numbers here for the same reason;
tests/test_errors.py checks them against kvtrace/exitcodes.py.
"""

from __future__ import annotations

from typing import ClassVar


class KvtraceError(Exception):
    """Base of every error kvtrace raises for the user: a one-line message, and ``exit_code``, the
    code the CLI exits with (a constant of kvtrace/exitcodes.py, documented in spec/cli.md "Exit
    codes"). Each subclass sets its own; the CLI (kvtrace.commands.common.guarded) reads it."""

    exit_code: ClassVar[int] = 70  # exitcodes.INTERNAL: only a subclass says what went wrong


class TraceError(KvtraceError):
    """Base class: a trace cannot be used as asked. The message is one line for the user."""

    exit_code: ClassVar[int] = 2  # exitcodes.UNREADABLE


class NotATrace(TraceError):
    """Unreadable file, not HDF5, or HDF5 without the kvtrace marker."""


class UnsupportedVersion(TraceError):
    """The trace's major format version is newer than this reader's."""

    exit_code: ClassVar[int] = 4  # exitcodes.VERSION


class InvalidTrace(TraceError):
    """Structurally a trace but breaking the spec (missing dataset, wrong dtype, ...)."""

    exit_code: ClassVar[int] = 1  # exitcodes.INVALID


class CorruptChunk(InvalidTrace):
    """A payload chunk that does not decode, or claims an impossible size."""


class CorruptTrace(InvalidTrace):
    """HDF5 objects of an identified trace that fail to read: damaged or truncated inside."""


class LimitExceeded(InvalidTrace):
    """The file asks for more decoding than a reader allows for its size (spec §9)."""


# What h5py raises on damaged files (RuntimeError for broken heaps, OSError for I/O).
H5_READ_ERRORS = (OSError, RuntimeError, KeyError, ValueError, TypeError)
