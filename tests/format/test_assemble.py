"""Joining incremental payloads (spec §6.1): contiguous runs, gaps, overlaps, whole-mode lookups."""

from __future__ import annotations

import numpy as np
import pytest

from kvtrace.format import DeviceInfo, TraceWriter, schema
from kvtrace.format.assemble import ContentsAssembler
from kvtrace.format.reader import Trace
from kvtrace.format.writer import encode_payload

PK = schema.PayloadKind
F32 = schema.CacheDType.FLOAT32


def _tokens(start: int, count: int, offset: float = 0.0) -> np.ndarray:
    """[1, 2, count, 3] whose every element encodes its absolute position (+ offset)."""
    pos = np.arange(start, start + count, dtype=np.float32) + offset
    return np.broadcast_to(pos[None, None, :, None], (1, 2, count, 3)).copy()


def _write(path, payload_tokens: str | None, pieces: list[tuple[int, int, int, float]]) -> None:
    meta = {"model_id": "t", "model_type": "llama"}
    if payload_tokens is not None:
        meta["payload_tokens"] = payload_tokens
    with TraceWriter(path, meta, [DeviceInfo(-1, "cpu", -1)]) as w:
        for step, start, count, offset in pieces:
            x = _tokens(start, count, offset)
            w.write_payload(encode_payload(0, step, 0, PK.KEY, F32, x, shape=x.shape, token_start=start))


def _positions(p) -> list[float]:
    return p.to_float32()[0, 0, :, 0].tolist()


def test_increments_join_into_one_run(tmp_path):
    path = tmp_path / "a.kvt.h5"
    _write(path, "new", [(0, 0, 5, 0), (4, 5, 4, 0), (8, 9, 4, 0)])
    with Trace(path) as t:
        a = ContentsAssembler(t)
        assert a.incremental
        at8 = a.at(0, 0, PK.KEY, 8)
        assert (at8.step, at8.token_start, at8.shape) == (8, 0, (1, 2, 13, 3))
        assert _positions(at8) == list(range(13))
        at5 = a.at(0, 0, PK.KEY, 5)  # between samples: what was sampled up to then
        assert at5.step == 5 and _positions(at5) == list(range(9))
        assert a.at(0, 0, PK.KEY, 8, first=10).token_start == 10
        assert _positions(a.at(0, 0, PK.KEY, 8, first=10)) == [10, 11, 12]
        assert a.at(0, 0, PK.VALUE, 8) is None and a.at(1, 0, PK.KEY, 8) is None


def test_a_gap_ends_the_run_and_later_samples_win(tmp_path):
    path = tmp_path / "b.kvt.h5"
    # step 8 misses positions 9..10 (a dropped sample); step 12 rewrites 12 (offset marks it)
    _write(path, "new", [(0, 0, 9, 0), (8, 11, 2, 0), (12, 12, 3, 0.5)])
    with Trace(path) as t:
        a = ContentsAssembler(t)
        assert _positions(a.at(0, 0, PK.KEY, 8)) == [11, 12]
        at12 = a.at(0, 0, PK.KEY, 12)
        assert at12.token_start == 11 and _positions(at12) == [11, 12.5, 13.5, 14.5]


def test_whole_samples_are_returned_as_stored(tmp_path):
    path = tmp_path / "c.kvt.h5"
    _write(path, None, [(0, 0, 5, 0), (4, 0, 9, 0)])  # a 1.0-style trace: no payload_tokens
    with Trace(path) as t:
        assert t.meta.payload_tokens == "all"
        a = ContentsAssembler(t)
        assert not a.incremental
        assert _positions(a.at(0, 0, PK.KEY, 4)) == list(range(9))
        assert a.at(0, 0, PK.KEY, 3) is None  # nothing sampled at that step


@pytest.mark.parametrize("value", ["all", "new"])
def test_payload_tokens_round_trips(tmp_path, value):
    path = tmp_path / "d.kvt.h5"
    _write(path, value, [])
    with Trace(path) as t:
        assert t.meta.payload_tokens == value and "payload_tokens" not in t.meta.extra
