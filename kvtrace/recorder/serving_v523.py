"""Paged-cache adapter for transformers 5.23's continuous batching (read from 5.23.0's
generation/continuous_batching: cache.py, cache_allocators/).

Layout: one flat uint8 pool of ``num_sectors`` sectors of ``bytes_per_sector`` (two trash sectors
before them, never allocated); each attention type has a ``CacheAllocator`` in
``cache.cache_allocators`` that takes whole sectors from ``cache.pool`` and cuts them into blocks of
``bytes_per_block`` holding ``tokens_per_page`` positions of one request in each of its
``pages_per_block`` layers. A block is in a request's ``block_table``, cached in the allocator's
``ledger.cached_blocks`` (unreferenced, reusable by prefix matching), or free: free blocks of the
allocator's sectors (``pool.count_free_blocks(index)``) plus whole free sectors. The cache's own
``compute_free_capacity(relative=False)`` is exactly those free bytes, so at every step
``pool − free = Σ (blocks in use + cached) × bytes_per_block``. Sliding allocators are ring buffers
of at most ``sliding_window`` positions and never share blocks.
"""

from __future__ import annotations

from typing import Any

from kvtrace.format.schema import LayerType
from kvtrace.recorder.serving_cache import CacheState, GroupState


class V523:
    label = "transformers 5.23 paged cache (cache_allocators)"

    def __init__(self, cache_cls: type) -> None:
        self.cache_cls = cache_cls

    def matches(self, cache: Any) -> bool:
        return (isinstance(getattr(cache, "cache_allocators", None), dict) and hasattr(cache, "num_sectors")
                and hasattr(cache, "compute_free_capacity"))

    def read(self, cache: Any) -> CacheState:
        groups = []
        for alloc in cache.cache_allocators.values():
            tables = alloc.block_table
            ledger = getattr(alloc, "ledger", None)
            # shared_ref_counts holds only blocks referenced more than once (BlockLedger.acquire)
            shared = set(getattr(ledger, "shared_ref_counts", ()))
            window = int(getattr(alloc, "sliding_window", 0) or 0)
            groups.append(GroupState(
                group=int(alloc.index),
                layer_type=LayerType.SLIDING if window > 0 else LayerType.FULL,
                layers=int(alloc.pages_per_block), window=window if window > 0 else -1,
                tokens_per_block=int(alloc.tokens_per_page), bytes_per_block=int(alloc.bytes_per_block),
                blocks_total=int(alloc.num_blocks),
                blocks_in_use=_distinct_blocks(tables, shared),
                blocks_cached=len(ledger.cached_blocks) if ledger is not None else -1,
                blocks_free=int(cache.pool.count_free_blocks(alloc.index)),
                tables=tables, shared=shared))
        return CacheState(pool_bytes=int(cache.num_sectors * cache.bytes_per_sector),
                          free_bytes=int(cache.compute_free_capacity(relative=False)), groups=groups)

    # evict_cached_blocks returns every cached block of every allocator to the pool at once
    def eviction_hook(self) -> tuple[type, str] | None:
        return (self.cache_cls, "evict_cached_blocks")

    def eviction_target(self, cache: Any) -> Any:
        return cache

    def cached_total(self, target: Any) -> int:
        return sum(len(a.ledger.cached_blocks) for a in target.cache_allocators.values())

    def prefix_blocks(self, cache: Any, tokens: int) -> int:
        # search_prefix_match gives each allocator prefix_len // tokens_per_page shared blocks
        return sum(tokens // int(a.tokens_per_page) for a in cache.cache_allocators.values())

    def offloaded_bytes(self, offloader: Any, cache: Any, request_id: str) -> int:
        cpu = getattr(offloader, "_request_id_to_cpu_blocks", {}).get(request_id) or {}
        return sum(len(ids) * int(cache.cache_allocators[name].bytes_per_block) for name, ids in cpu.items())

    def pool_tensors(self, cache: Any) -> list[Any]:
        # the whole preallocated pool is one uint8 tensor (trash sectors included); blocks are views
        t = getattr(cache, "cache_tensor", None)
        return [t] if t is not None else []


def _distinct_blocks(tables: dict[str, list[int]], shared: set[int]) -> int:
    """Blocks referenced by the tables, each once. With no block referenced twice (the ledger's
    shared set is empty) that is the tables' total length, without building a set of every block."""
    if not shared:
        return sum(map(len, tables.values()))
    return len({b for blocks in tables.values() for b in blocks})


def load() -> V523 | None:
    """The adapter when the installed transformers has 5.23's cache_allocators package."""
    try:
        from transformers.generation.continuous_batching import cache, cache_allocators  # noqa: F401
    except Exception:  # noqa: BLE001 - another generation (or none)
        return None
    cls = getattr(cache, "PagedAttentionCache", None)
    if cls is None or "evict_cached_blocks" not in cls.__dict__:
        return None
    return V523(cls)
