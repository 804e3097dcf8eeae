"""Errors raised on bad trace files; each maps to one documented CLI exit code."""

from __future__ import annotations


class TraceError(Exception):
    """Base class: a trace cannot be used as asked. The message is one line for the user."""


class NotATrace(TraceError):
    """Unreadable file, not HDF5, or HDF5 without the kvtrace marker."""


class UnsupportedVersion(TraceError):
    """The trace's major format version is newer than this reader's."""


class InvalidTrace(TraceError):
    """Structurally a trace but breaking the spec (missing dataset, wrong dtype, ...)."""


class CorruptChunk(TraceError):
    """A payload chunk that does not decode, or claims an impossible size."""


class CorruptTrace(TraceError):
    """HDF5 structures that fail to read: truncated or damaged file."""


# What h5py raises on damaged files (RuntimeError for broken heaps, OSError for I/O).
H5_READ_ERRORS = (OSError, RuntimeError, KeyError, ValueError, TypeError)
