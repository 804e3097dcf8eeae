"""The preshuffled codec route (shuffle_chunks + compress_shuffled, what the sampler's workers run)
writes byte-identical frames to the original pad-then-shuffle-each-chunk encoding, and its copies
and compression release the GIL (the reason it exists)."""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest
import zstandard

from kvtrace.format import CacheDType, PayloadKind, encode_payload, schema
from kvtrace.format.codec import (
    compress_shuffled,
    decode_chunk,
    encode_chunks,
    shuffle_bytes,
    shuffle_chunks,
)

CARRIERS = ["u1", "<u2", "<u4", "<u8"]


def _reference_frames(carrier: np.ndarray, chunk_elements: int, level: int) -> list[bytes]:
    """The encoding as first written: full-size zero padding, then tobytes-shuffle chunk by chunk."""
    flat = np.ascontiguousarray(carrier).reshape(-1)
    n_chunks = max(1, -(-flat.size // chunk_elements))
    padded = np.zeros(n_chunks * chunk_elements, dtype=flat.dtype)
    padded[: flat.size] = flat
    cctx = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=True)
    return [
        cctx.compress(shuffle_bytes(padded[i * chunk_elements : (i + 1) * chunk_elements].view(np.uint8),
                                    flat.dtype.itemsize))
        for i in range(n_chunks)
    ]


def _random(n: int, carrier: str, seed: int) -> np.ndarray:
    size = np.dtype(carrier).itemsize
    return np.random.default_rng(seed).integers(0, 256, n * size, dtype=np.uint8).view(carrier)


@pytest.mark.parametrize("carrier", CARRIERS)
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 48, 50])  # empty, < 1 chunk, exact, ragged
def test_frames_match_the_reference_encoding(carrier, n) -> None:
    chunk = 16
    data = _random(n, carrier, seed=n)
    for level in (1, 3):
        want = _reference_frames(data, chunk, level)
        assert compress_shuffled(shuffle_chunks(data, chunk), level) == want
        assert encode_chunks(data, chunk, level) == want


@pytest.mark.parametrize("carrier", CARRIERS)
def test_shuffle_chunks_layout(carrier) -> None:
    chunk, n = 8, 21
    data = _random(n, carrier, seed=7)
    size = data.dtype.itemsize
    got = shuffle_chunks(data, chunk)
    assert got.shape == (3, size, chunk) and got.dtype == np.uint8 and got.flags.c_contiguous
    padded = np.zeros(3 * chunk, dtype=data.dtype)
    padded[:n] = data
    for i in range(3):
        part = padded[i * chunk : (i + 1) * chunk].view(np.uint8)
        assert got[i].tobytes() == shuffle_bytes(part, size)
        for k in range(size):  # row k holds byte k of every element (little-endian carriers)
            np.testing.assert_array_equal(got[i, k], part.reshape(chunk, size)[:, k])
    assert not got[2, :, n - 2 * chunk :].any()  # the padding is zeros


def test_non_contiguous_input_is_shuffled_in_element_order() -> None:
    base = _random(6 * 7, "<u2", seed=3).reshape(6, 7)
    view = base.T[:, ::2]  # transposed and strided
    assert compress_shuffled(shuffle_chunks(view, 5), 1) == _reference_frames(view.copy(), 5, 1)


@pytest.mark.parametrize(
    ("dtype", "carrier"),
    [(CacheDType.BFLOAT16, "<u2"), (CacheDType.FLOAT16, "<u2"), (CacheDType.FLOAT32, "<u4"),
     (CacheDType.FLOAT8_E4M3FN, "u1"), (CacheDType.INT8, "u1")],
)
def test_real_chunk_size_and_encode_payload(dtype, carrier) -> None:
    size = np.dtype(carrier).itemsize
    chunk = schema.payload_chunk_elements(size)
    for n in (chunk // 3, 2 * chunk, 2 * chunk + 5):  # < 1 chunk, exact multiple, ragged
        data = _random(n, carrier, seed=n + size)
        want = _reference_frames(data, chunk, 1)
        assert len(want) == max(1, -(-n // chunk))
        assert encode_payload(0, 0, 0, PayloadKind.KEY, dtype, data, level=1).frames == want
        frames = compress_shuffled(shuffle_chunks(data, chunk), 1)
        assert frames == want
        raw = b"".join(decode_chunk(0, f, chunk * size, size) for f in frames)
        assert raw[: n * size] == data.tobytes() and not any(raw[n * size :])


def test_compress_shuffled_refuses_what_it_cannot_send_as_rows() -> None:
    chunks = shuffle_chunks(_random(32, "<u2", seed=1), 16)
    with pytest.raises(ValueError):
        compress_shuffled(chunks.view("<u2"))  # not bytes
    with pytest.raises(ValueError):
        compress_shuffled(chunks.transpose(0, 2, 1))  # not C-contiguous


def _main_thread_turns(op, reps: int) -> int:
    """How often this thread ran while another thread was inside `op` (repeated `reps` times).

    Forced GIL switches are off (switch interval 1000 s), so this thread only runs while the
    other one has released the GIL of its own accord: 0 means `op` held it throughout.
    """
    started, done = threading.Event(), threading.Event()

    def work() -> None:
        started.set()
        for _ in range(reps):
            op()
        done.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    turns = 0
    try:
        worker = threading.Thread(target=work)
        worker.start()
        while worker.is_alive() and not done.is_set():
            turns += started.is_set()
            time.sleep(1e-4)  # releases the GIL: the worker can take it back
        worker.join()
    finally:
        sys.setswitchinterval(old)
    return turns


def test_shuffle_and_compress_release_the_gil() -> None:
    data = _random(1 << 21, "<u2", seed=5)  # 4 MiB
    chunk = schema.payload_chunk_elements(2)
    chunks = shuffle_chunks(data, chunk)
    # The probe can fail: a copy that holds the GIL lets this thread run not once.
    assert _main_thread_turns(lambda: bytes(bytearray(4 << 20)), reps=10) == 0
    # ~1 ms a call since the shuffle runs as ufuncs: enough calls that the probe gets to look
    assert _main_thread_turns(lambda: shuffle_chunks(data, chunk), reps=100) > 0
    assert _main_thread_turns(lambda: compress_shuffled(chunks, 1), reps=5) > 0
