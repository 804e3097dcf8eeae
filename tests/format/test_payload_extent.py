"""Payload datasets grow ahead of use (few resizes) and are trimmed to what is used at close."""

from __future__ import annotations

import h5py
import numpy as np

from kvtrace.format import DeviceInfo, TraceWriter, schema
from kvtrace.format.reader import Trace
from kvtrace.format.writer import encode_payload

PK = schema.PayloadKind


def test_extent_grows_ahead_and_is_trimmed_at_close(tmp_path):
    path = tmp_path / "e.kvt.h5"
    chunk = schema.payload_chunk_elements(2)
    resizes = []
    with TraceWriter(path, {"model_id": "t", "model_type": "llama"}, [DeviceInfo(-1, "cpu", -1)]) as w:
        ds = w._ds[schema.payload_dataset_name(2)]
        original = ds.resize
        ds.resize = lambda shape: (resizes.append(shape), original(shape))  # count HDF5 resizes
        data = []
        for step in range(40):
            x = np.full((1, 1, 3 + step, 8), step, dtype=np.uint16)  # one chunk each
            data.append(x)
            w.write_payload(encode_payload(0, step, 0, PK.KEY, schema.CacheDType.BFLOAT16, x, shape=x.shape))
        assert len(resizes) == 1 and resizes[0][0] >= 40 * chunk  # one growth for 40 payloads
        w.flush()
        with Trace(path) as live:  # a SWMR reader sees every payload while the extent has slack
            assert [int(live.payload(i).data.reshape(-1)[0]) for i in range(40)] == list(range(40))
    with h5py.File(path, "r") as f:
        assert f[schema.payload_dataset_name(2)].shape == (40 * chunk,)
        assert f[schema.payload_dataset_name(4)].shape == (0,)
    with Trace(path) as t:
        for i, x in enumerate(data):
            np.testing.assert_array_equal(t.payload(i).data.reshape(x.shape), x)
