"""Paged-cache adapter for transformers 5.17's continuous batching (read from 5.17.0's
generation/continuous_batching: cache.py, cache_manager.py), the generation on the GPU machines.

Layout: ``group_size`` K and V tensors (``key_cache``/``value_cache``), each of
``(num_blocks + 2) × block_size`` positions (two trash blocks at the end). Layers are cut into groups
of ``group_size`` layers of one attention type (several groups per type are possible); a block id
given to group g holds ``block_size`` positions of one request in every layer of g, so one block is
``block_size × kv_heads × head_dim × itemsize × 2 × group_size`` bytes whatever the group. One
``BlockManager`` (``cache._block_manager``) hands out blocks to every group from one free list: a
block is uninitialised (free), initialised (complete, unreferenced, kept for prefix reuse: cached),
or in a group's ``block_table``. Its counters give ``pool − free = Σ (in use + cached) × block bytes``
where free is the uninitialised blocks; ``get_num_free_blocks()`` counts cached blocks as free too,
because it reclaims them on demand (``has_enough_free_blocks`` forgets their hashes: an eviction).
"""

from __future__ import annotations

from typing import Any

from kvtrace.format.schema import LayerType
from kvtrace.recorder.serving_cache import CacheState, GroupState


def _block_bytes(cache: Any) -> int:
    k = cache.key_cache[0]  # [(num_blocks + 2) * block_size, kv_heads, head_dim]
    per_position = int(k.shape[1]) * int(k.shape[2]) * int(k.element_size())
    return int(cache.block_size) * per_position * 2 * len(cache.key_cache)


class V517:
    label = "transformers 5.17 paged cache (group_cache_managers, BlockManager)"

    def __init__(self, manager_cls: type) -> None:
        self.manager_cls = manager_cls

    def matches(self, cache: Any) -> bool:
        return (isinstance(getattr(cache, "group_cache_managers", None), list)
                and hasattr(cache, "_block_manager") and bool(getattr(cache, "key_cache", None)))

    def read(self, cache: Any) -> CacheState:
        bm = cache._block_manager
        block_bytes = _block_bytes(cache)
        layers = len(cache.key_cache)
        by_id = bm._id_to_block
        shared = {b for b, blk in by_id.items() if blk.ref_count > 1}
        cached: dict[int, int] = {}
        for b in bm._init_block_ids:
            blk = by_id.get(b)
            if blk is not None:
                cached[blk.group_id] = cached.get(blk.group_id, 0) + 1
        groups = []
        for cm in cache.group_cache_managers:
            tables = cm.block_table
            window = int(getattr(cm, "sliding_window", 0) or 0)
            index = int(cm._index)
            groups.append(GroupState(
                group=index, layer_type=LayerType.SLIDING if window > 0 else LayerType.FULL, layers=layers,
                window=window if window > 0 else -1, tokens_per_block=int(cache.block_size),
                bytes_per_block=block_bytes, blocks_total=int(cache.num_blocks),
                blocks_in_use=len({b for blocks in tables.values() for b in blocks}),
                blocks_cached=cached.get(index, 0),
                blocks_free=-1,  # one free list for all groups: per group it does not exist
                tables=tables, shared=shared if getattr(cm, "uses_block_sharing", False) else set()))
        return CacheState(pool_bytes=int(cache.num_blocks) * block_bytes,
                          free_bytes=len(bm._uninit_block_ids) * block_bytes, groups=groups)

    def eviction_hook(self) -> tuple[type, str] | None:
        return (self.manager_cls, "has_enough_free_blocks")

    def eviction_target(self, cache: Any) -> Any:
        return cache._block_manager

    def cached_total(self, target: Any) -> int:
        return len(target._init_block_ids)

    def prefix_blocks(self, cache: Any, tokens: int) -> int:
        return tokens // int(cache.block_size)  # prefix sharing: one full-attention group only

    def offloaded_bytes(self, offloader: Any, cache: Any, request_id: str) -> int:
        cpu = getattr(offloader, "_request_id_to_cpu_blocks", {}).get(request_id) or []
        return len(cpu) * _block_bytes(cache)

    def pool_tensors(self, cache: Any) -> list[Any]:
        # one K and one V tensor per layer of a group, preallocated (trash blocks included)
        return [*getattr(cache, "key_cache", ()), *getattr(cache, "value_cache", ())]


def load() -> V517 | None:
    """The adapter when the installed transformers has 5.17's cache_manager.BlockManager."""
    try:
        from transformers.generation.continuous_batching import cache_manager
    except Exception:  # noqa: BLE001 - another generation (or none)
        return None
    cls = getattr(cache_manager, "BlockManager", None)
    if cls is None or "has_enough_free_blocks" not in cls.__dict__:
        return None
    return V517(cls)
