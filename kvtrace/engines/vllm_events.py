"""vLLM's KV-cache events on the wire, decoded without vLLM.

vLLM (0.9+; checked against 0.32.0's ``vllm/distributed/kv_events.py``) publishes on a ZMQ PUB socket
multipart messages ``[topic, seq, payload]``: ``seq`` an 8-byte big-endian batch sequence number,
``payload`` a msgpack ``KVEventBatch``: an array ``[ts, events, data_parallel_rank?]`` (msgspec
``array_like``), each event a map tagged by its class name (``{"type": "BlockStored", ...}``). The
ROUTER replay endpoint answers ``[b"", start_seq]`` with ``[b"", topic, seq, payload]`` frames for every
buffered batch from ``start_seq`` on, then ``[b"", b"", -1 (8 bytes, signed), b""]``.

The structs below are kvtrace's own copy of that schema, only the fields kvtrace reads; unknown fields
are ignored (msgspec's default), so newer vLLM fields do not break decoding. Events encoded as arrays
(``[tag, field, ...]``: SGLang, and vLLM releases before the map form) are read too; docs/vllm.md lists
SGLang's differences read from its source. tests/engines/test_vllm_schema.py
encodes vLLM's own classes and decodes them here.
"""

from __future__ import annotations

from typing import Union

import msgspec

# A block hash: sha256 bytes (vLLM's default) or a 64-bit int (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES).
BlockHash = Union[bytes, int]  # noqa: UP007 - msgspec reads the alias at runtime
END_SEQ = -1  # the replay endpoint's end-of-replay marker (signed, 8 bytes)
MAX_HASH_BYTES = 64


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    """Full blocks entered the prefix cache (or, in ``kv_cache_report_mode="full"``, were reused from it)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    medium: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    """Blocks left the prefix cache (evicted for room, or freed without a hash)."""

    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    """The engine dropped its whole prefix cache (reset_prefix_cache)."""


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]  # noqa: UP007


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


# The array form: each event an array [tag, field, ...] (msgspec ``array_like`` events), as SGLang
# (python/sglang/srt/disaggregation/kv_events.py) and vLLM releases before the map form publish them.
# Fields past those named here (SGLang's lora_id, vLLM's later additions) are ignored.
class _StoredA(msgspec.Struct, tag="BlockStored", array_like=True, omit_defaults=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None


class _RemovedA(msgspec.Struct, tag="BlockRemoved", array_like=True, omit_defaults=True):
    block_hashes: list[BlockHash]
    medium: str | None = None


class _ClearedA(msgspec.Struct, tag="AllBlocksCleared", array_like=True, omit_defaults=True):
    pass


class _BatchA(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[_StoredA | _RemovedA | _ClearedA]
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
_DECODER_A = msgspec.msgpack.Decoder(_BatchA)


def _from_array(b: _BatchA) -> KVEventBatch:
    events: list[Event] = []
    for e in b.events:
        if isinstance(e, _StoredA):
            events.append(BlockStored(block_hashes=e.block_hashes, parent_block_hash=e.parent_block_hash,
                                      token_ids=e.token_ids, block_size=e.block_size, medium=e.medium))
        elif isinstance(e, _RemovedA):
            events.append(BlockRemoved(block_hashes=e.block_hashes, medium=e.medium))
        else:
            events.append(AllBlocksCleared())
    return KVEventBatch(ts=b.ts, events=events, data_parallel_rank=b.data_parallel_rank)


class BadBatch(ValueError):
    """A payload that is not a KVEventBatch of this schema (one line: why)."""


def decode_batch(payload: bytes) -> KVEventBatch:
    """One batch; BadBatch when the bytes are not one (hostile or of another schema)."""
    try:
        batch = _DECODER.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        try:
            batch = _from_array(_DECODER_A.decode(payload))
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise BadBatch(str(exc).splitlines()[0][:200]) from None
    for ev in batch.events:
        hashes = ev.block_hashes if isinstance(ev, BlockStored | BlockRemoved) else []
        for h in hashes:
            if isinstance(h, bytes) and len(h) > MAX_HASH_BYTES:
                raise BadBatch(f"a block hash of {len(h)} bytes (at most {MAX_HASH_BYTES})")
    return batch


def hash_text(h: BlockHash) -> str:
    """A block hash as text: hex of its bytes, or ``i`` + hex of an int hash."""
    if isinstance(h, bytes):
        return h.hex()
    return f"i{h & ((1 << 64) - 1):x}"


def decode_seq(raw: bytes) -> int | None:
    """The 8-byte big-endian sequence number of a frame (signed: -1 ends a replay); None if not 8 bytes."""
    if len(raw) != 8:
        return None
    return int.from_bytes(raw, "big", signed=True)
