"""Third-party HDF5 readers (h5py + hdf5plugin's zstd filter) decode our payload datasets
to exactly the bytes kvtrace's own reader returns; the file opens with libver bounds pinned."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from kvtrace.format import CacheDType, PayloadKind, Trace, TraceWriter, encode_payload, schema

hdf5plugin = pytest.importorskip("hdf5plugin")


def test_hdf5plugin_reads_same_bytes(tmp_path):
    rng = np.random.default_rng(3)
    arrays = {
        CacheDType.BFLOAT16: rng.integers(0, 1 << 16, (1, 4, 300, 64), dtype=np.uint16),
        CacheDType.FLOAT32: rng.standard_normal((2, 2, 77, 128)).astype(np.float32),
        CacheDType.FLOAT8_E4M3FN: rng.integers(0, 256, (1, 1, 999, 64), dtype=np.uint8),
    }
    path = tmp_path / "i.kvt.h5"
    with TraceWriter(path) as w:
        for code, a in arrays.items():
            w.write_payload(encode_payload(0, 0, 1, PayloadKind.VALUE, code, a))
    with Trace(path) as t, h5py.File(path, "r") as f:
        assert t.payload_filters(2) == [schema.FILTER_SHUFFLE, schema.FILTER_ZSTD]
        for i, row in enumerate(t.payload_index[:]):
            ours = t.payload(i).data
            ds = f[schema.payload_dataset_name(int(row["itemsize"]))]
            start = int(row["first_chunk"]) * ds.chunks[0]
            theirs = ds[start : start + int(row["n_elements"])]
            assert theirs.tobytes() == ours.tobytes()
            assert ours.tobytes() == np.ascontiguousarray(arrays[CacheDType(int(row["dtype"]))]).tobytes()


def test_superblock_is_pinned_for_old_readers(tmp_path):
    path = tmp_path / "v.kvt.h5"
    with TraceWriter(path):
        pass
    with open(path, "rb") as fh:
        head = fh.read(9)
    # Superblock version 3 (HDF5 1.10 format, needed by SWMR), never the 2.0-only version 4.
    assert head[:8] == b"\x89HDF\r\n\x1a\n" and head[8] == 3
