"""Payload chunk codec: byte shuffle + one zstd frame per chunk, as HDF5 filters 2 and 32015.

Encoding happens off the writer's lock (the recorder runs it in background threads), so it keeps
its GIL-held stretches short: the shuffle is one numpy copy into a preallocated array (numpy
releases the GIL for plain copies, while older numpy's `tobytes` of a transposed view copied
element by element holding it), padding touches only the last chunk, and python-zstandard
compresses with the GIL released. Decoding never trusts the frame: the declared content size
must equal the chunk size before any buffer is allocated, which stops decompression bombs, and
the chunk must hold exactly that one frame.
"""

from __future__ import annotations

import sys
import threading

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


def shuffle_chunks(carrier: np.ndarray, chunk_elements: int) -> np.ndarray:
    """Zero-pad a carrier array to whole chunks and HDF5-shuffle each chunk.

    Returns C-contiguous uint8 [n_chunks, itemsize, chunk_elements] (at least one chunk): row i
    holds byte k of every element of chunk i, k = 0..itemsize-1, i.e. ``shuffle_bytes`` of each
    zero-padded chunk. All full chunks move in one GIL-free numpy copy; only the last, partial
    chunk is padded.
    """
    flat = np.ascontiguousarray(carrier).reshape(-1)
    itemsize = flat.dtype.itemsize
    full, rest = divmod(flat.size, chunk_elements)
    n_chunks = max(1, full + (rest > 0))
    out = np.empty((n_chunks, itemsize, chunk_elements), dtype=np.uint8)
    src = flat.view(np.uint8)
    split = full * chunk_elements * itemsize
    if full:
        _split_bytes(flat[: full * chunk_elements].reshape(full, chunk_elements), out[:full])
    if n_chunks > full:
        last = out[full]
        last[:, rest:] = 0
        np.copyto(last[:, :rest], src[split:].reshape(rest, itemsize).T)
    return out


_UNSIGNED = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _split_bytes(src: np.ndarray, out: np.ndarray) -> None:
    """out[i, k, j] = byte k of element src[i, j]. One shift-and-narrow ufunc per byte plane:
    ~2.5x faster than a strided byte transpose (bench/profile_payload_path.py), and ufuncs on
    numbers release the GIL like plain copies do. Big-endian or byte-swapped input takes the
    transpose."""
    itemsize = src.dtype.itemsize
    unsigned = _UNSIGNED.get(itemsize)
    if unsigned is None or not src.dtype.isnative or sys.byteorder != "little":
        np.copyto(out, src.view(np.uint8).reshape(*src.shape, itemsize).transpose(0, 2, 1))
        return
    words = src.view(unsigned)
    np.bitwise_and(words, 0xFF, out=out[:, 0], casting="unsafe")
    for k in range(1, itemsize):
        np.right_shift(words, 8 * k, out=out[:, k], casting="unsafe")


def compress_shuffled(chunks: np.ndarray, level: int = 3) -> list[bytes]:
    """One zstd frame (content size and checksum recorded) per already-shuffled chunk.

    `chunks` is C-contiguous uint8 with one chunk per row of its first axis (what
    ``shuffle_chunks`` returns). The frames are the ones ``encode_chunks`` writes for the
    unshuffled data.
    """
    return compress_shuffled_many([chunks], level)[0]


def compress_shuffled_many(chunk_arrays: list[np.ndarray], level: int = 3, *, threads: int = 1) -> list[list[bytes]]:
    """:func:`compress_shuffled` of several payloads in ONE zstd call, which holds no GIL from the
    first chunk to the last: a background thread that re-takes the GIL after every chunk makes
    the model's thread wait for it each time. ``threads`` > 1 compresses the chunks on that many
    of libzstd's own threads inside the call (same frames, any thread count)."""
    rows: list[np.ndarray] = []
    counts = []
    for chunks in chunk_arrays:
        if chunks.dtype != np.uint8 or not chunks.flags.c_contiguous or chunks.ndim < 1:
            raise ValueError("shuffled chunks must be a C-contiguous uint8 array, one chunk per row")
        flat = chunks.reshape(len(chunks), -1)
        rows.extend(flat)
        counts.append(len(flat))
    if not rows:
        return [[] for _ in chunk_arrays]
    frames = [bytes(segment) for segment in _compressor(level).multi_compress_to_buffer(rows, threads=max(1, threads))]
    out, at = [], 0
    for n in counts:
        out.append(frames[at:at + n])
        at += n
    return out


_per_thread = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor for ``level`` (a ZstdCompressor is not thread-safe, and building
    one allocates its tables with the GIL held: once per thread, not once per payload)."""
    cache = getattr(_per_thread, "compressors", None)
    if cache is None:
        cache = _per_thread.compressors = {}
    cctx = cache.get(level)
    if cctx is None:
        cctx = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=True)
    return cctx


def encode_chunks(
    carrier: np.ndarray, chunk_elements: int, level: int = 3
) -> list[bytes]:
    """Split a 1-D carrier array into zero-padded chunks and encode each one.

    Returns one zstd frame (content size recorded) per chunk of `chunk_elements` elements.
    """
    return compress_shuffled(shuffle_chunks(carrier, chunk_elements), level)


def decode_chunk(filter_mask: int, stored: bytes, chunk_bytes: int, itemsize: int) -> bytes:
    """Undo the pipeline for one stored chunk, honouring filter_mask. Returns raw chunk bytes."""
    data = _decompressed(filter_mask, stored, chunk_bytes)
    if not filter_mask & SHUFFLE_SKIPPED:
        data = unshuffle_bytes(data, itemsize)
    return data


def decode_chunk_into(out: np.ndarray, filter_mask: int, stored: bytes, itemsize: int) -> None:
    """:func:`decode_chunk` into ``out`` (uint8, exactly one chunk): the unshuffle writes straight
    into the caller's array, so a payload costs its own size plus one chunk, not three copies."""
    data = np.frombuffer(_decompressed(filter_mask, stored, out.size), dtype=np.uint8)
    if filter_mask & SHUFFLE_SKIPPED or itemsize == 1:
        out[:] = data
    else:
        out.reshape(-1, itemsize)[:] = data.reshape(itemsize, -1).T


def check_chunk(filter_mask: int, stored: bytes, chunk_bytes: int) -> None:
    """Decode one chunk and drop the result: what validation needs (bounded memory, no unshuffle)."""
    _decompressed(filter_mask, stored, chunk_bytes)


def _decompressed(filter_mask: int, stored: bytes, chunk_bytes: int) -> bytes:
    """The chunk's shuffled bytes. The frame is never trusted: its declared content size must equal
    the chunk size before anything is allocated (decompression bombs), it must be exactly one frame
    (spec §6: trailing bytes or a second frame are refused, not ignored) and complete."""
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
        # A decompression object stops at the end of the first frame and keeps what follows in
        # unused_data; libzstd sizes its output from the checked content size and fails rather
        # than write past it.
        dobj = zstandard.ZstdDecompressor().decompressobj()
        try:
            data = dobj.decompress(stored)
        except zstandard.ZstdError as exc:
            raise CorruptChunk(f"zstd frame does not decode ({exc})") from None
        if not dobj.eof:
            raise CorruptChunk("zstd frame is truncated")
        if dobj.unused_data:
            raise CorruptChunk(f"{len(dobj.unused_data)} bytes after the zstd frame (one frame per chunk); refused")
    if len(data) != chunk_bytes:
        raise CorruptChunk(f"chunk decodes to {len(data)} bytes, expected {chunk_bytes}")
    return data
