"""Errors raised on bad trace files; each maps to one documented CLI exit code.

The rule (README "Exit codes", spec §9.1): a file that cannot be identified as a kvtrace trace
(missing, a directory, not HDF5, HDF5 that does not open, no kvtrace marker) is
:class:`NotATrace` (exit 2); a newer major version is :class:`UnsupportedVersion` (exit 4); a file
that carries the kvtrace marker and a readable version but breaks the spec anywhere else, including
objects HDF5 cannot read and chunks that do not decode, is :class:`InvalidTrace` (exit 1). Every
command raises the same class for the same file, because they all read through one reader.
"""

from __future__ import annotations


class TraceError(Exception):
    """Base class: a trace cannot be used as asked. The message is one line for the user."""


class NotATrace(TraceError):
    """Unreadable file, not HDF5, or HDF5 without the kvtrace marker."""


class UnsupportedVersion(TraceError):
    """The trace's major format version is newer than this reader's."""


class InvalidTrace(TraceError):
    """Structurally a trace but breaking the spec (missing dataset, wrong dtype, ...)."""


class CorruptChunk(InvalidTrace):
    """A payload chunk that does not decode, or claims an impossible size."""


class CorruptTrace(InvalidTrace):
    """HDF5 objects of an identified trace that fail to read: damaged or truncated inside."""


class LimitExceeded(InvalidTrace):
    """The file asks for more decoding than a reader allows for its size (spec §9)."""


# What h5py raises on damaged files (RuntimeError for broken heaps, OSError for I/O).
H5_READ_ERRORS = (OSError, RuntimeError, KeyError, ValueError, TypeError)
