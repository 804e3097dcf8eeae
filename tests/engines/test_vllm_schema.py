"""kvtrace's own copy of vLLM's KV-event schema (kvtrace/engines/vllm_events.py) against vLLM's classes:
a script run in the vLLM venv encodes batches with vllm.distributed.kv_events (every field of each event
set, both hash kinds), and kvtrace decodes them here without vLLM."""

from __future__ import annotations

import json
import subprocess

import pytest
from engine_helpers import PYTHON, VENV

pytest.importorskip("msgspec", reason="kvtrace[engines] (msgspec) is not installed")

from kvtrace.engines.vllm_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    hash_text,
)

ENCODE = r'''
import json, msgspec
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared
stored = BlockStored(block_hashes=[b"\x01" * 32, 7], parent_block_hash=b"\x09" * 32, token_ids=list(range(64)),
                     block_size=32, lora_id=3, medium="GPU", lora_name="adapter", extra_keys=[("a", 1), None],
                     group_idx=1, kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=None,
                     locality="LOCAL", ownership="tier", session_id="s1")
removed = BlockRemoved(block_hashes=[b"\x02" * 32], medium="CPU", group_idx=2, locality="REMOTE", ownership="x")
batch = KVEventBatch(ts=1795861537.25, events=[stored, removed, AllBlocksCleared()], data_parallel_rank=1)
print(json.dumps({"payload": msgspec.msgpack.Encoder().encode(batch).hex(),
                  "fields": sorted(BlockStored.__struct_fields__)}))
'''


@pytest.fixture(scope="module")
def encoded() -> dict:
    if not PYTHON.exists():
        pytest.skip(f"no vLLM venv at {VENV} (scripts/test.sh makes it, best effort; set KVTRACE_VLLM_VENV)")
    run = subprocess.run([str(PYTHON), "-c", ENCODE], capture_output=True, text=True, timeout=300)
    if run.returncode != 0:
        pytest.skip(f"vLLM's kv_events do not import in {VENV}: {run.stderr.strip()[-300:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_vllm_batches_decode_with_kvtrace_schema(encoded: dict) -> None:
    batch = decode_batch(bytes.fromhex(encoded["payload"]))
    assert batch.ts == 1795861537.25 and batch.data_parallel_rank == 1
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert isinstance(cleared, AllBlocksCleared)
    assert [hash_text(h) for h in stored.block_hashes] == ["01" * 32, "i7"]
    assert stored.parent_block_hash == b"\x09" * 32 and stored.token_ids == list(range(64))
    assert (stored.block_size, stored.medium, stored.group_idx, stored.kv_cache_spec_kind) == (32, "GPU", 1,
                                                                                              "full_attention")
    assert removed.block_hashes == [b"\x02" * 32] and (removed.medium, removed.group_idx) == ("CPU", 2)


def test_every_field_kvtrace_reads_is_one_of_vllms(encoded: dict) -> None:
    ours = set(BlockStored.__struct_fields__)
    assert ours <= set(encoded["fields"]), ours - set(encoded["fields"])
