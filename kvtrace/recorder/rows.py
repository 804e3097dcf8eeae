"""Typed rows the recorder writes: the NamedTuples that kvtrace.format.schema derives from its
column declarations (one per table, fields in the table's order). Re-exported here so the recorder's
parts import their rows from one place. A NamedTuple is a tuple, so the writer buffers and converts
them exactly as positional tuples; the names only stop rows being built by position."""

from __future__ import annotations

from kvtrace.format.schema import EventRow, KvRow, LayerRow, ReadingRow, RequestRow, RetentionRow, StepRow

__all__ = ["EventRow", "KvRow", "LayerRow", "ReadingRow", "RequestRow", "RetentionRow", "StepRow"]
