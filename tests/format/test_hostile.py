"""Hostile files: decoding work and memory are bounded by the file's size, whatever it declares.

Peak memory is measured in a fresh wrapper process (RUSAGE_CHILDREN of the wrapper sees only the
kvtrace child), so earlier tests' subprocesses cannot inflate it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import zstandard
from fmt_helpers import write_minimal, zero_row

from kvtrace import exitcodes
from kvtrace.format import Trace, schema
from kvtrace.format.errors import CorruptChunk, InvalidTrace, LimitExceeded

C2 = schema.payload_chunk_elements(2)  # elements per chunk of the 2-byte carrier
ZERO_CHUNK_FRAME = zstandard.ZstdCompressor(level=19, write_content_size=True, write_checksum=True).compress(
    b"\0" * schema.PAYLOAD_CHUNK_BYTES)

MEASURE = """
import resource, subprocess, sys, time
t0 = time.perf_counter()
p = subprocess.run([sys.executable, "-m", "kvtrace.cli", *sys.argv[1:]], capture_output=True, text=True)
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
import json
print(json.dumps({"rc": p.returncode, "err": p.stderr, "out": p.stdout, "peak": peak,
                  "s": time.perf_counter() - t0}))
"""


def measured(*args: str) -> dict:
    env = dict(os.environ, KVTRACE_DEBUG="")
    proc = subprocess.run([sys.executable, "-c", MEASURE, *args], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def index_row(first_chunk: int, n_chunks: int, n_elements: int) -> tuple:
    names = schema.PAYLOAD_INDEX.names
    row = list(zero_row(schema.PAYLOAD_INDEX))
    row[names.index("kind")] = int(schema.PayloadKind.KEY)
    row[names.index("dtype")] = int(schema.CacheDType.BFLOAT16)
    row[names.index("ndim")] = 1
    row[names.index("shape")] = [n_elements, 0, 0, 0, 0, 0]
    row[names.index("itemsize")] = 2
    row[names.index("first_chunk")] = first_chunk
    row[names.index("n_chunks")] = n_chunks
    row[names.index("n_elements")] = n_elements
    return tuple(row)


def zero_chunk_trace(path: Path, chunks: int, rows: list[tuple], frame: bytes = ZERO_CHUNK_FRAME) -> Path:
    """A minimal trace whose 2-byte carrier holds `chunks` copies of one tiny frame (a 256 KiB
    chunk of zeros compresses to ~30 bytes) and whose index holds `rows`."""
    write_minimal(path)
    with h5py.File(path, "a") as f:
        f["meta"].attrs["contains_tensor_payloads"] = True
        ds = f[schema.payload_dataset_name(2)]
        ds.resize((chunks * C2,))
        for c in range(chunks):
            ds.id.write_direct_chunk((c * C2,), frame, filter_mask=0)
        index = f["payloads/index"]
        index.resize((len(rows),))
        index[:] = np.array(rows, dtype=schema.PAYLOAD_INDEX)
    return path


def test_8192_tiny_chunks_decoding_to_2_gib_are_refused_quickly_in_little_memory(tmp_path):
    """The issue's file: under 1 MiB on disk, one payload of 8,192 chunks that decode to 2 GiB
    (27 s and 6.3 GB before; now refused from the index alone)."""
    p = zero_chunk_trace(tmp_path / "amp.kvt.h5", 8192, [index_row(0, 8192, 8192 * C2)])
    assert p.stat().st_size < 1 << 20
    for command in ("validate", "info", "analyze"):
        r = measured(command, str(p))
        assert r["rc"] == exitcodes.INVALID, r
        assert "over the reader's limit" in r["err"] and "2.0 GiB" in r["err"] and "Traceback" not in r["err"]
        assert r["peak"] < 512 << 20, r["peak"]  # the bound; python + kvtrace alone is ~60 MiB


def test_same_chunks_as_many_small_payloads_also_refused(tmp_path):
    """The limit covers every payload together, not each one: 8,192 one-chunk payloads."""
    p = zero_chunk_trace(tmp_path / "many.kvt.h5", 8192, [index_row(c, 1, C2) for c in range(8192)])
    r = measured("validate", str(p))
    assert r["rc"] == exitcodes.INVALID and "8192 payloads would decode to 2.0 GiB" in r["err"], r


def test_validation_streams_a_payload_within_the_limit(tmp_path):
    """960 chunks (240 MiB decoded, under the 256 MiB floor) in one payload: validate decodes it a
    chunk at a time. Materialising it (as the reader did) would need at least 240 MiB; the bound
    of 128 MiB sits between that and the ~60 MiB an idle interpreter with kvtrace uses."""
    p = zero_chunk_trace(tmp_path / "big.kvt.h5", 960, [index_row(0, 960, 960 * C2)])
    r = measured("validate", str(p))
    assert r["rc"] == exitcodes.OK, r
    assert r["peak"] < 128 << 20, r["peak"]
    control = measured("--version")
    assert control["peak"] < 128 << 20  # the control: the same process doing nothing


def test_reader_decodes_a_payload_into_one_array(tmp_path):
    p = zero_chunk_trace(tmp_path / "one.kvt.h5", 3, [index_row(0, 3, 2 * C2 + 5)])
    with Trace(p) as t:
        payload = t.payload(0)
    assert payload.data.shape == (2 * C2 + 5,) and not payload.data.any()


def test_trailing_frame_after_the_chunk_frame_is_refused(tmp_path):
    """Spec §6: exactly one frame per chunk. A valid frame followed by a second (bomb) frame was
    accepted, the second frame ignored."""
    second = zstandard.ZstdCompressor(level=1).compress(b"\0" * (64 << 20))
    p = zero_chunk_trace(tmp_path / "two.kvt.h5", 1, [index_row(0, 1, 100)], ZERO_CHUNK_FRAME + second)
    r = measured("validate", str(p))
    assert r["rc"] == exitcodes.INVALID and "after the zstd frame" in r["err"], r
    with Trace(p) as t, pytest.raises(CorruptChunk, match="after the zstd frame"):
        t.payload(0)


def test_truncated_frame_is_refused(tmp_path):
    p = zero_chunk_trace(tmp_path / "cut.kvt.h5", 1, [index_row(0, 1, 100)], ZERO_CHUNK_FRAME[:-6])
    r = measured("validate", str(p))
    assert r["rc"] == exitcodes.INVALID and "payload 0" in r["err"], r


def test_shared_chunks_and_inflated_chunk_counts_are_invalid(tmp_path):
    shared = zero_chunk_trace(tmp_path / "shared.kvt.h5", 2, [index_row(0, 2, 2 * C2)] * 50)
    inflated = zero_chunk_trace(tmp_path / "inflated.kvt.h5", 4, [index_row(0, 4, 1)])
    for p, message in ((shared, "share chunks"), (inflated, "claims 4 chunks")):
        r = measured("validate", str(p))
        assert r["rc"] == exitcodes.INVALID and message in r["err"], r
        with pytest.raises(InvalidTrace, match=message):
            Trace(p)


def test_a_table_declaring_a_billion_rows_is_refused_at_open(tmp_path):
    """Unwritten chunks read as zeros and occupy no space: /kv can declare 10^9 rows (80 GB) in a
    file of a few KiB. Every command refuses it before reading a row."""
    p = tmp_path / "rows.kvt.h5"
    write_minimal(p)
    with h5py.File(p, "a") as f:
        f["kv"].resize((10**9,))
    assert p.stat().st_size < 1 << 20
    t0 = time.perf_counter()
    for command in ("validate", "info"):
        r = measured(command, str(p))
        assert r["rc"] == exitcodes.INVALID and "/kv (1000000000 rows)" in r["err"], r
        assert r["peak"] < 512 << 20
    assert time.perf_counter() - t0 < 60  # a hang guard, not a benchmark
    with pytest.raises(LimitExceeded):
        Trace(p, check=False).table("kv")


def test_text_reference_over_the_string_cap_is_invalid(tmp_path):
    p = tmp_path / "text.kvt.h5"
    write_minimal(p)
    with h5py.File(p, "a") as f:
        f["text"].resize((10**8,))  # unwritten: zeros, no space
        row = f["requests"][0]
        row["error_len"] = 50_000_000
        f["requests"][0] = row
    r = measured("validate", str(p))
    assert r["rc"] == exitcodes.INVALID and "string limit" in r["err"], r
    with Trace(p) as t, pytest.raises(InvalidTrace, match="strings are at most"):
        t.text(0, 50_000_000)


def test_an_index_of_millions_of_zero_rows_is_checked_in_blocks(tmp_path):
    """/payloads/index grown to 2.5 million unwritten (zero) rows, just under the decode limit, in a
    file of ~50 KiB: the index is checked 65,536 rows at a time, each broken rule reported once
    with its row count (1.2 GiB peak and 21 s when every row was flagged one by one)."""
    p = tmp_path / "index.kvt.h5"
    write_minimal(p)
    rows = (256 << 20) // schema.PAYLOAD_INDEX.itemsize - 10
    with h5py.File(p, "a") as f:
        f["payloads/index"].resize((rows,))
    for command in ("validate", "info"):
        r = measured(command, str(p))
        assert r["rc"] == exitcodes.INVALID, r
        assert f"payload itemsize 0 is not one of (1, 2, 4, 8) ({rows} rows)" in r["err"]
        assert r["peak"] < 256 << 20, r["peak"]  # the index alone is 256 MiB: it is never held whole


def test_json_attribute_of_millions_of_objects_stays_small(tmp_path):
    """Just under the 4 MiB JSON limit, 1.4 million empty objects: parsing is bounded (~25x the
    text) and the lone-surrogate cleaner does not walk documents without \\uD8xx escapes."""
    p = tmp_path / "json.kvt.h5"
    write_minimal(p)
    with h5py.File(p, "a") as f:
        f["meta"].attrs["model_config_json"] = "[" + ",".join(["{}"] * ((4 << 20) // 3 - 1)) + "]"
    r = measured("validate", str(p))
    assert r["rc"] == exitcodes.INVALID and "model_config_json" in r["err"], r
    assert r["peak"] < 512 << 20, r["peak"]
    with h5py.File(p, "a") as f:
        f["meta"].attrs["model_config_json"] = "[" + ",".join(["{}"] * ((4 << 20) // 3 + 1)) + "]"
    r = measured("info", str(p))
    assert r["rc"] == exitcodes.INVALID and "implausibly large" in r["err"], r
