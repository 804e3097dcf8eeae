"""What a flush and an open cost the writer (it runs beside the model): one H5Fflush per flush
unless rows refer to something written in the same flush, the empty layout built once per process, and a byte
shuffle that matches the reference for any byte order."""

from __future__ import annotations

import numpy as np

from kvtrace.format import TraceWriter, schema
from kvtrace.format.codec import shuffle_bytes, shuffle_chunks
from kvtrace.format.reader import Trace
from kvtrace.format.validate import validate
from kvtrace.format.writer import _layout_image, encode_payload


def _count_file_flushes(w: TraceWriter) -> list[int]:
    calls: list[int] = []
    original = w._file.flush
    w._file.flush = lambda: (calls.append(1), original())[1]  # instance attribute: this writer only
    return calls


def test_rows_alone_take_one_file_flush(tmp_path):
    with TraceWriter(tmp_path / "a.kvt.h5", {"contains_tensor_payloads": True}, flush_interval_s=60) as w:
        calls = _count_file_flushes(w)
        row = [0] * 15
        row[2], row[5], row[8] = 1, -1, b"0" * 64
        w.begin_request(tuple(row))
        w.append("events", (0, 1, 0, 0, -1, -1, 0, 0, 0))
        w.flush()
        assert len(calls) == 2  # the request row first, then the rows that name it
        w.append("events", [(i, 1, 0, i, -1, -1, i, 0, 0) for i in range(1, 70)])
        w.append("telemetry/process", [(i, i) for i in range(5)])
        w.flush()
        assert len(calls) == 3  # rows alone: one (h5py's Dataset.resize would add one per table)
        # text, then the rows that point into it: the text is flushed first
        off, n = w.add_text("hello")
        w.append("events", (99, 1, 0, 0, -1, -1, 0, off, n))
        w.flush()
        assert len(calls) == 5
        # a payload's chunks are flushed before the index row that points at them
        raw = np.arange(100, dtype=np.uint16)
        w.write_payload(encode_payload(0, 0, 0, schema.PayloadKind.KEY, schema.CacheDType.BFLOAT16, raw))
        w.flush()
        assert len(calls) == 7
        w.update_request(0, outcome=1, end_ns=123)
    report = validate(tmp_path / "a.kvt.h5")
    assert report.valid, report.problems
    with Trace(tmp_path / "a.kvt.h5") as t:
        assert t.complete and t.nrows("events") == 71 and t.nrows("telemetry/process") == 5
        assert np.array_equal(t.payload(0).data.reshape(-1), raw)


def test_layout_image_built_once_and_meta_per_trace(tmp_path):
    _layout_image(3)
    misses = _layout_image.cache_info().misses
    for i in range(3):
        with TraceWriter(tmp_path / f"{i}.kvt.h5", {"model_id": f"m{i}"}, flush_interval_s=60):
            pass
    assert _layout_image.cache_info().misses == misses
    for i in range(3):
        assert validate(tmp_path / f"{i}.kvt.h5").valid
        with Trace(tmp_path / f"{i}.kvt.h5") as t:
            assert t.meta.model_id == f"m{i}"


def test_shuffle_of_byte_swapped_input_matches_the_reference():
    rng = np.random.default_rng(3)
    for dtype in (">u2", ">u4", "<u8", ">u8"):
        data = rng.integers(0, 1 << 16, 40, dtype=np.uint64).astype(dtype)
        got = shuffle_chunks(data, 8)
        raw = data.view(np.uint8)
        size = data.dtype.itemsize
        for i in range(5):
            assert got[i].tobytes() == shuffle_bytes(raw[i * 8 * size:(i + 1) * 8 * size], size)
