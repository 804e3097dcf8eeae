"""The pool-size what-if (kvtrace.engines.poolsim) against brute-force caches simulated access by access."""

from __future__ import annotations

import random
from collections import OrderedDict

import numpy as np
import pytest

from kvtrace.engines import poolsim


def brute_lru(keys: list[int], size: int) -> int:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for k in keys:
        if k in cache:
            hits += 1
            cache.move_to_end(k)
            continue
        if len(cache) >= size:
            cache.popitem(last=False)
        cache[k] = None
    return hits


def brute_belady(keys: list[int], size: int) -> int:
    """Belady by its definition: on a miss with a full cache, scan ahead for each cached block's next use."""
    cache: set[int] = set()
    hits = 0
    for i, k in enumerate(keys):
        if k in cache:
            hits += 1
            continue
        if len(cache) >= size:
            def next_use(b: int, i: int = i) -> int:
                for j in range(i + 1, len(keys)):
                    if keys[j] == b:
                        return j
                return len(keys) + b  # never again: any of them (ties do not change the hit count)
            cache.remove(max(cache, key=next_use))
        cache.add(k)
    return hits


def streams() -> list[list[int]]:
    rng = random.Random(7)
    out = [[], [1], [1, 1, 1], [1, 2, 3, 1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5], list(range(20)) * 3]
    for n, universe in ((60, 5), (200, 30), (300, 12), (150, 150)):
        out.append([rng.randrange(universe) for _ in range(n)])
    # prefix-shaped: requests that share leading blocks, as an engine's stream looks
    seq = []
    for _ in range(40):
        shared = rng.randrange(4)
        seq += [shared * 100 + j for j in range(rng.randrange(1, 6))] + [1000 + rng.randrange(50)]
    out.append(seq)
    return out


@pytest.mark.parametrize("keys", streams())
def test_lru_one_pass_equals_brute_force_at_every_size(keys: list[int]) -> None:
    dist = poolsim.stack_distances(keys)
    sizes = list(range(1, len(set(keys)) + 3))
    assert poolsim.lru_hits(dist, sizes) == [brute_lru(keys, c) for c in sizes]


@pytest.mark.parametrize("keys", streams())
def test_belady_equals_brute_force_and_bounds_lru(keys: list[int]) -> None:
    dist = poolsim.stack_distances(keys)
    for c in range(1, len(set(keys)) + 2):
        opt = poolsim.belady_hits(keys, c)
        assert opt == brute_belady(keys, c)
        assert opt >= poolsim.lru_hits(dist, [c])[0]


def test_first_accesses_miss_and_an_unbounded_pool_hits_every_repeat() -> None:
    keys = [3, 4, 3, 5, 4, 3]
    dist = poolsim.stack_distances(keys)
    assert dist.tolist() == [0, 0, 2, 0, 3, 3]
    assert poolsim.lru_hits(dist, [100]) == [len(keys) - len(set(keys))]
    assert poolsim.belady_hits(keys, 100) == 3


def test_table_rows() -> None:
    s = poolsim.Stream(np.array([0, 1, 0, 1, 2, 0]), np.zeros(6, dtype=bool), 32, True)
    rows = poolsim.table(s, [1, 2, 3])
    assert [r["lru_hits"] for r in rows] == [0, 2, 3]
    assert [r["belady_hits"] for r in rows] == [brute_belady([0, 1, 0, 1, 2, 0], c) for c in (1, 2, 3)]
    assert rows[1]["pool_tokens"] == 64 and rows[2]["lru_hit_rate"] == 0.5


def test_block_times_from_accesses_and_removals() -> None:
    s = poolsim.Stream(np.array([0, 1, 0, 0]), np.zeros(4, dtype=bool), 32, True,
                       t_ns=np.array([0, 1, 3, 10]) * 10**9, removed=[(0, 4 * 10**9), (1, 6 * 10**9)])
    bt = poolsim.block_times(s)
    # block 0: stored 0 s, reused 3 s, removed 4 s (lifetime 4, idle 1); stored again at 10 s, never removed
    # block 1: stored 1 s, removed 6 s (lifetime 5, idle 5). Reuse gaps: 0 -> 3 s only; the store at 10 s
    # follows a removal: a new residency, not a reuse
    assert bt["lifetime"]["count"] == 2 and bt["lifetime"]["max_s"] == 5.0
    assert bt["idle_before_removal"]["p50_s"] == 3.0  # the median of 1 s and 5 s
    assert bt["reuse_gap"]["count"] == 1 and bt["reuse_gap"]["max_s"] == 3.0


def test_computed_again_counts_stores_of_known_blocks() -> None:
    s = poolsim.Stream(np.array([0, 1, 0, 1, 0, 2]), np.array([False, False, True, False, False, False]), 32, True)
    assert poolsim.computed_again(s) == 2  # block 1 stored again at 3, block 0 at 4; the reuse at 2 is a hit
