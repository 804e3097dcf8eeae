"""The sampled contents of one layer at one step, assembled from incremental payloads (spec §6.1).

A trace whose ``/meta payload_tokens`` is ``"new"`` stores, per (request, layer, kind), only the
tokens no earlier payload holds. The contents at step ``s`` are then the union of the payloads at
steps <= ``s``, the later payload winning where two overlap. :class:`ContentsAssembler` builds that
union as one :class:`~kvtrace.format.reader.Payload` covering the contiguous run of positions that
ends at the latest payload's last token; with ``"all"`` it returns the payload of step ``s`` as
stored. numpy only, like the rest of the format package.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from kvtrace.format import schema
from kvtrace.format.reader import Payload, Trace

__all__ = ["ContentsAssembler"]


class ContentsAssembler:
    """Contents of (request, layer, kind) at a step. Decoded payloads are cached per index row
    until :meth:`clear`, so assembling at every sampled step decodes each payload once."""

    def __init__(self, trace: Trace, index: np.ndarray | None = None) -> None:
        """``index``: the trace's payload index when the caller has already read it."""
        self.trace = trace
        self.incremental = trace.meta.payload_tokens == "new"
        if index is None:
            index = trace.payload_index[:]
        self._rows: dict[tuple[int, int, int], list[tuple[int, int]]] = {}  # -> [(step, row)]
        for i, r in enumerate(index):
            key = (int(r["request"]), int(r["layer"]), int(r["kind"]))
            self._rows.setdefault(key, []).append((int(r["step"]), i))
        for rows in self._rows.values():
            rows.sort()
        self._decoded: dict[int, Payload] = {}

    def clear(self) -> None:
        self._decoded.clear()

    def _payload(self, row: int) -> Payload:
        p = self._decoded.get(row)
        if p is None:
            p = self._decoded[row] = self.trace.payload(row)
        return p

    def at(self, request: int, layer: int, kind: int, step: int, *, first: int | None = None) -> Payload | None:
        """The contents at ``step`` (a payload whose ``step`` is ``step``), or None if nothing of
        this (request, layer, kind) was sampled at or before it (with ``"all"``: at it).

        ``first``: drop positions before it, e.g. ``tokens_seen - tokens_kept`` of the step's
        ``/kv`` row for exactly what a sliding cache still held (incremental samples also hold
        tokens it has dropped since, which the queries of earlier steps attended to)."""
        p = self._at(request, layer, kind, step)
        if p is None or first is None or first <= p.token_start:
            return p
        axis = schema.PAYLOAD_TOKEN_AXIS.get(len(p.shape))
        if axis is None:
            return p
        cut = min(first - p.token_start, p.shape[axis])
        data = _shaped(p)[(slice(None),) * axis + (slice(cut, None),)]
        return replace(p, shape=tuple(data.shape), token_start=p.token_start + cut, data=data)

    def _at(self, request: int, layer: int, kind: int, step: int) -> Payload | None:
        stored = self._rows.get((request, layer, int(kind)), ())
        if not self.incremental:
            at_step = [row for s, row in stored if s == step]
            return self._payload(at_step[-1]) if at_step else None
        rows = [row for s, row in stored if s <= step]
        if not rows:
            return None
        newest = self._payload(rows[-1])
        axis = schema.PAYLOAD_TOKEN_AXIS.get(len(newest.shape))
        if axis is None:
            return replace(newest, step=step)
        pieces = [_shaped(newest)]
        lo = newest.token_start
        for row in reversed(rows[:-1]):
            p = self._payload(row)
            if not _same_layout(p, newest, axis):
                break  # another head selection or width: not part of the same sequence
            begin, end = p.token_start, p.token_start + p.shape[axis]
            if end < lo:
                break  # a gap (a dropped sample): keep the contiguous run only
            if begin < lo:
                head = (slice(None),) * axis + (slice(0, lo - begin),)
                pieces.append(_shaped(p)[head])
                lo = begin
        data = np.concatenate(pieces[::-1], axis=axis) if len(pieces) > 1 else pieces[0]
        return replace(newest, step=step, shape=tuple(data.shape), token_start=lo, data=data)


def _shaped(p: Payload) -> np.ndarray:
    return p.data.reshape(p.shape)


def _same_layout(p: Payload, ref: Payload, axis: int) -> bool:
    """Same dtype, heads and every extent except the token axis."""
    if p.dtype != ref.dtype or len(p.shape) != len(ref.shape):
        return False
    if (p.head_start, p.head_stride) != (ref.head_start, ref.head_stride):
        return False
    return all(a == b for i, (a, b) in enumerate(zip(p.shape, ref.shape, strict=True)) if i != axis)
