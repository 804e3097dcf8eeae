"""The trace format: schema, writer, reader, validation. Imports no torch."""

from kvtrace.format.errors import (
    CorruptChunk,
    InvalidTrace,
    NotATrace,
    TraceError,
    UnsupportedVersion,
)
from kvtrace.format.reader import Payload, Trace, TraceMeta, open_trace
from kvtrace.format.schema import (
    FORMAT_VERSION,
    CacheDType,
    EventKind,
    LayerType,
    Outcome,
    PayloadKind,
    Phase,
    ReadingLabel,
)
from kvtrace.format.tables import Table
from kvtrace.format.writer import DeviceInfo, EncodedPayload, TraceWriter, encode_payload, monotonic_ns

__all__ = [
    "FORMAT_VERSION",
    "CacheDType",
    "CorruptChunk",
    "DeviceInfo",
    "EncodedPayload",
    "EventKind",
    "InvalidTrace",
    "LayerType",
    "NotATrace",
    "Outcome",
    "Payload",
    "PayloadKind",
    "Phase",
    "ReadingLabel",
    "Table",
    "Trace",
    "TraceError",
    "TraceMeta",
    "TraceWriter",
    "UnsupportedVersion",
    "encode_payload",
    "monotonic_ns",
    "open_trace",
]
