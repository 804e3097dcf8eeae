"""Property-based round trips: every table's rows and every payload dtype survive write/read."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvtrace.format import (
    CacheDType,
    DeviceInfo,
    PayloadKind,
    Trace,
    TraceWriter,
    encode_payload,
    schema,
)
from kvtrace.format.numeric import to_float32


def rows_for(dtype: np.dtype, max_rows: int = 20):
    """Random structured rows for a table dtype; every field drawn over its full range."""
    return hnp.arrays(dtype=dtype, shape=st.integers(0, max_rows),
                      elements=None, fill=st.nothing())


TABLES_EXCEPT_REQUESTS = [t for t in schema.TABLES if t not in ("requests", "devices")]


@pytest.mark.slow
@given(data=st.data())
def test_every_table_round_trips(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("rt") / "t.kvt.h5"
    written: dict[str, np.ndarray] = {}
    with TraceWriter(path, {"model_id": "m"}, [DeviceInfo(0, "GPU-x", 1 << 34, "uuid")],
                     max_buffer_rows=7) as w:
        for table in TABLES_EXCEPT_REQUESTS:
            arr = data.draw(rows_for(schema.TABLES[table][0]), label=table)
            written[table] = arr
            for row in arr:
                w.append(table, row.item())
    with Trace(path, check=False) as t:  # random rows break the spec's row rules: raw bits only
        for table, arr in written.items():
            got = t.table(table, check_codes=False)  # raw bits, random codes included
            assert got.dtype == arr.dtype
            assert got.tobytes() == arr.tobytes(), table
        dev = t.devices[:]
        assert dev["name"][0] == b"GPU-x" and int(dev["total_memory_bytes"][0]) == 1 << 34


@given(texts=st.lists(st.text(max_size=200), max_size=10))
def test_text_heap_round_trips(tmp_path_factory, texts):
    path = tmp_path_factory.mktemp("tx") / "t.kvt.h5"
    with TraceWriter(path) as w:
        refs = [w.add_text(s) for s in texts]
    with Trace(path) as t:
        for s, (off, n) in zip(texts, refs, strict=True):
            assert t.text(off, n) == s.encode("utf-8", errors="replace").decode("utf-8")


def test_requests_update_before_and_after_flush(tmp_path):
    from fmt_helpers import request_row

    path = tmp_path / "r.kvt.h5"
    with TraceWriter(path) as w:
        w.begin_request(request_row(0))
        w.flush()  # row 0 now on disk: the update must rewrite it in place
        w.begin_request(request_row(1))
        w.update_request(0, outcome=int(schema.Outcome.OK), new_tokens=17, eos_step=16)
        w.update_request(1, outcome=int(schema.Outcome.OOM))
    with Trace(path) as t:
        r = t.requests[:]
        assert r["outcome"].tolist() == [schema.Outcome.OK, schema.Outcome.OOM]
        assert r["new_tokens"][0] == 17 and r["eos_step"][0] == 16


PAYLOAD_DTYPES = {
    CacheDType.FLOAT32: np.uint32,
    CacheDType.FLOAT16: np.uint16,
    CacheDType.BFLOAT16: np.uint16,
    CacheDType.FLOAT8_E4M3FN: np.uint8,
    CacheDType.FLOAT8_E5M2: np.uint8,
    CacheDType.INT8: np.uint8,
    CacheDType.FLOAT64: np.uint64,
}


@given(
    dtype=st.sampled_from(sorted(PAYLOAD_DTYPES)),
    shape=hnp.array_shapes(min_dims=1, max_dims=schema.PAYLOAD_MAX_NDIM, min_side=1, max_side=9),
    data=st.data(),
)
def test_payload_bits_round_trip(tmp_path_factory, dtype, shape, data):
    carrier = PAYLOAD_DTYPES[dtype]
    raw = data.draw(hnp.arrays(carrier, shape))
    path = tmp_path_factory.mktemp("pl") / "p.kvt.h5"
    with TraceWriter(path) as w:
        w.write_payload(encode_payload(2, 5, 7, PayloadKind.KEY, dtype, raw, head_start=1,
                                       head_stride=2, token_start=3))
    with Trace(path) as t:
        p = t.payload(0)
        assert (p.request, p.step, p.layer, p.kind) == (2, 5, 7, PayloadKind.KEY)
        assert (p.head_start, p.head_stride, p.token_start) == (1, 2, 3)
        assert p.shape == shape and p.dtype == dtype
        assert p.data.tobytes() == raw.tobytes()


def test_payload_spanning_many_chunks_and_odd_sizes(tmp_path):
    rng = np.random.default_rng(0)
    chunk = schema.payload_chunk_elements(2)
    sizes = [1, chunk - 1, chunk, chunk + 1, 3 * chunk + 17]
    arrays = [rng.integers(0, 1 << 16, size=n, dtype=np.uint16) for n in sizes]
    path = tmp_path / "big.kvt.h5"
    with TraceWriter(path) as w:
        for i, a in enumerate(arrays):
            w.write_payload(encode_payload(0, i, 0, PayloadKind.VALUE, CacheDType.BFLOAT16, a))
    with Trace(path) as t:
        assert [int(r["n_chunks"]) for r in t.payload_index[:]] == [1, 1, 1, 2, 4]
        for i, a in enumerate(arrays):
            assert np.array_equal(t.payload(i).data, a)


def test_real_kv_like_tensor_decodes_to_same_floats(tmp_path):
    torch = __import__("pytest").importorskip("torch")
    x = torch.randn(1, 2, 33, 64, dtype=torch.float32)
    for tdtype, code in [(torch.bfloat16, CacheDType.BFLOAT16), (torch.float16, CacheDType.FLOAT16),
                         (torch.float8_e4m3fn, CacheDType.FLOAT8_E4M3FN),
                         (torch.float8_e5m2, CacheDType.FLOAT8_E5M2)]:
        t = x.to(tdtype)
        bits = t.view(torch.uint8 if t.element_size() == 1 else torch.int16).numpy()
        path = tmp_path / f"{code.name}.kvt.h5"
        with TraceWriter(path) as w:
            w.write_payload(encode_payload(0, 0, 0, PayloadKind.KEY, code, bits))
        with Trace(path) as tr:
            got = tr.payload(0).to_float32()
        want = t.to(torch.float32).numpy()
        assert np.array_equal(got, want, equal_nan=True), code


def test_fp8_decoder_matches_torch_on_all_codes():
    torch = __import__("pytest").importorskip("torch")
    codes = torch.arange(256, dtype=torch.uint8)
    for tdtype, code in [(torch.float8_e4m3fn, CacheDType.FLOAT8_E4M3FN),
                         (torch.float8_e5m2, CacheDType.FLOAT8_E5M2)]:
        want = codes.view(tdtype).to(torch.float32).numpy()
        got = to_float32(codes.numpy(), code)
        assert np.array_equal(got, want, equal_nan=True)


def test_newer_minor_with_unknown_fields_and_attrs_is_readable(tmp_path):
    """Unknown extra fields (a future 1.x) are ignored; known ones still read."""
    import h5py

    path = tmp_path / "future.kvt.h5"
    from fmt_helpers import write_minimal

    write_minimal(path)
    with h5py.File(path, "a") as f:
        f.attrs["format_version"] = "1.7"
        f.attrs["format_minor"] = 7
        f["meta"].attrs["some_future_attr"] = "x"
        old = f["requests"][:]
        newdt = np.dtype([(n, old.dtype[n]) for n in old.dtype.names] + [("future_field", "<f8")])
        new = np.zeros(old.shape, dtype=newdt)
        for n in old.dtype.names:
            new[n] = old[n]
        del f["requests"]
        f.create_dataset("requests", data=new, maxshape=(None,), chunks=True)
        f.create_dataset("future_table", data=np.arange(3))
    with Trace(path) as t:
        assert t.version == "1.7"
        r = t.requests[:]
        assert r.dtype.names == schema.REQUESTS.names
        assert int(r["new_tokens"][0]) == 3
        assert t.meta.extra["some_future_attr"] == "x"


def test_payload_by_number_reads_one_index_row(tmp_path):
    path = tmp_path / "n.kvt.h5"
    arrays = [np.full(5, i, dtype=np.uint16) for i in range(3)]
    with TraceWriter(path) as w:
        for i, a in enumerate(arrays):
            w.write_payload(encode_payload(0, i, 0, PayloadKind.KEY, CacheDType.FLOAT16, a))
    with Trace(path) as t:
        assert t.payload(-1).step == 2 and np.array_equal(t.payload(-1).data, arrays[2])
        assert t.payload(1).step == 1
        import pytest

        with pytest.raises(IndexError, match="out of range"):
            t.payload(3)
