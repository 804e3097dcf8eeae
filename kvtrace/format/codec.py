"""Payload chunk codec: byte shuffle + one zstd frame per chunk, as HDF5 filters 2 and 32015.

Encoding happens off the writer's lock (the recorder runs it in background threads); decoding
never trusts the frame: the declared content size must equal the chunk size before any buffer
is allocated, which stops decompression bombs.
"""

from __future__ import annotations

import numpy as np
import zstandard

from kvtrace.format.errors import CorruptChunk

SHUFFLE_SKIPPED = 0x1  # HDF5 filter_mask bit for pipeline position 0 (shuffle)
ZSTD_SKIPPED = 0x2  # bit for pipeline position 1 (zstd)


def shuffle_bytes(raw: bytes | memoryview | np.ndarray, itemsize: int) -> bytes:
    """HDF5 shuffle: byte k of every element together, k = 0..itemsize-1."""
    buf = np.frombuffer(raw, dtype=np.uint8)
    if itemsize == 1:
        return buf.tobytes()
    return buf.reshape(-1, itemsize).T.tobytes()


def unshuffle_bytes(data: bytes, itemsize: int) -> bytes:
    buf = np.frombuffer(data, dtype=np.uint8)
    if itemsize == 1:
        return buf.tobytes()
    return buf.reshape(itemsize, -1).T.tobytes()


def encode_chunks(
    carrier: np.ndarray, chunk_elements: int, level: int = 3
) -> list[bytes]:
    """Split a 1-D carrier array into zero-padded chunks and encode each one.

    Returns one zstd frame (content size recorded) per chunk of `chunk_elements` elements.
    """
    flat = np.ascontiguousarray(carrier).reshape(-1)
    itemsize = flat.dtype.itemsize
    n_chunks = max(1, -(-flat.size // chunk_elements))
    padded = np.zeros(n_chunks * chunk_elements, dtype=flat.dtype)
    padded[: flat.size] = flat
    cctx = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=True)
    frames = []
    for i in range(n_chunks):
        part = padded[i * chunk_elements : (i + 1) * chunk_elements]
        frames.append(cctx.compress(shuffle_bytes(part.view(np.uint8), itemsize)))
    return frames


def decode_chunk(filter_mask: int, stored: bytes, chunk_bytes: int, itemsize: int) -> bytes:
    """Undo the pipeline for one stored chunk, honouring filter_mask. Returns raw chunk bytes."""
    data = stored
    if not filter_mask & ZSTD_SKIPPED:
        try:
            params = zstandard.get_frame_parameters(stored)
        except zstandard.ZstdError as exc:
            raise CorruptChunk(f"not a zstd frame ({exc})") from None
        if params.content_size in (0, zstandard.CONTENTSIZE_UNKNOWN):
            raise CorruptChunk("zstd frame does not record its content size")
        if params.content_size != chunk_bytes:
            raise CorruptChunk(
                f"zstd frame claims {params.content_size} bytes, chunk holds {chunk_bytes}; refused"
            )
        try:
            data = zstandard.ZstdDecompressor().decompress(stored, max_output_size=chunk_bytes)
        except zstandard.ZstdError as exc:
            raise CorruptChunk(f"zstd frame does not decode ({exc})") from None
    if len(data) != chunk_bytes:
        raise CorruptChunk(f"chunk decodes to {len(data)} bytes, expected {chunk_bytes}")
    if not filter_mask & SHUFFLE_SKIPPED:
        data = unshuffle_bytes(data, itemsize)
    return data
