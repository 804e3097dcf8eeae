"""Prefix-cache hit rate at every pool size, from an engine trace's block-hash stream (spec §10).

The stream is the engine trace's block accesses in time order: a stored block (a miss: its KV was
computed) and a reused block (a hit, published by vLLM for requests in ``kv_cache_report_mode="full"``)
are both one access to that block's (group, hash). Over that one stream:

* **LRU, every size in one pass** (Mattson et al.'s stack algorithm): each access's *stack distance*
  is the number of distinct blocks touched since the block's previous access, plus one; an LRU cache of
  C blocks hits exactly the accesses at distance <= C. Distances come from a Fenwick tree over the
  positions of each block's latest access (O(n log n)).
* **Belady's optimum** (evict the block whose next access is farthest): the most hits any eviction
  order gets at that size, the ceiling for every policy, computed per size (O(n log n) each).

A first access misses at every size (compulsory). The model is a cache of C blocks holding only what
the stream names: blocks pinned by running requests, partially filled blocks and the prefix chain
rule (a block is found only when its parents are) are outside it, so the numbers are a what-if of
the cache policy and size, not a replay of vLLM's scheduler.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtrace.format import schema

K = schema.EventKind
STORED = "kv blocks stored "
_REUSED = re.compile(r"manager \d+: kv reused group (\d+) block_size (\d+): ")
_STORED = re.compile(r"kv blocks stored group (\d+) block_size (\d+) ")
_REMOVED = re.compile(r"manager \d+: kv removed group (\d+) ")
_HASH = re.compile(r"[0-9a-fi]{1,130}")
MAX_ACCESSES = 50_000_000  # a hostile trace cannot make the simulation unbounded


@dataclass
class Stream:
    """A trace's block accesses: ``keys[i]`` the block (an integer id per distinct (group, hash)),
    ``hit[i]`` whether the engine served it from its cache (a reuse report) as recorded."""

    keys: np.ndarray
    hit: np.ndarray
    block_size: int
    reuse_reports: bool  # whether the trace holds reused blocks (else hits are invisible to the stream)
    bad_texts: int = 0
    t_ns: np.ndarray | None = None  # each access's time
    removed: list[tuple[int, int]] | None = None  # (block id, t_ns) of each removal of a block the stream named


def read_stream(trace: Any) -> Stream:
    """The block-access stream of an open engine trace (kvtrace.format.reader.Trace), in time order."""
    rows = trace.table("events")
    mask = (rows["kind"] == int(K.NOTE)) | (rows["kind"] == int(K.PREFIX_HIT)) | (rows["kind"] == int(K.BLOCK_EVICTED))
    rows = np.sort(rows[mask], order="t_ns", kind="stable")
    ids: dict[tuple[int, str], int] = {}
    keys: list[int] = []
    hit: list[bool] = []
    block = 0
    bad = 0
    reused_seen = False
    times: list[int] = []
    removed: list[tuple[int, int]] = []
    for r in rows:
        text = trace.text(int(r["text_off"]), int(r["text_len"]))
        if int(r["kind"]) == int(K.BLOCK_EVICTED):
            rm = _REMOVED.match(text)
            if rm is not None:
                for h in text.split(": ", 2)[-1].split():
                    key = ids.get((int(rm.group(1)), h))
                    if key is not None:
                        removed.append((key, int(r["t_ns"])))
            continue
        is_hit = int(r["kind"]) == int(K.PREFIX_HIT)
        m = (_REUSED if is_hit else _STORED).match(text)
        if m is None:
            continue  # another note, or a prefix_hit of a transformers recording
        group, size = int(m.group(1)), int(m.group(2))
        block = block or size
        hashes = text.split(": ", 2)[-1].split() if is_hit else text.split(": ", 1)[-1].split()
        for h in hashes:
            if not _HASH.fullmatch(h):
                bad += 1
                continue
            keys.append(ids.setdefault((group, h), len(ids)))
            hit.append(is_hit)
            times.append(int(r["t_ns"]))
            if len(keys) > MAX_ACCESSES:
                raise ValueError(f"more than {MAX_ACCESSES:,} block accesses: beyond what whatif --pool-sizes reads")
        reused_seen = reused_seen or is_hit
    return Stream(np.asarray(keys, dtype=np.int64), np.asarray(hit, dtype=bool), block, reused_seen, bad,
                  np.asarray(times, dtype=np.int64), removed)


def computed_again(stream: Stream) -> int:
    """Stores of a block the stream had already named: KV computed a second time for the same content,
    because the block was evicted in between (what a larger pool or a better policy would have saved)."""
    seen: set[int] = set()
    again = 0
    for k, h in zip(stream.keys.tolist(), stream.hit.tolist(), strict=True):
        if not h and k in seen:
            again += 1
        seen.add(k)
    return again


def block_times(stream: Stream) -> dict[str, Any]:
    """Every block's residency from the events, not a sample: lifetime (stored -> removed), idle time
    before its removal (last access -> removed) and reuse gaps (between two accesses of one block), in
    seconds: count, median, 90th percentile and maximum of each."""
    assert stream.t_ns is not None and stream.removed is not None
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    gaps: list[int] = []
    access = iter(zip(stream.keys.tolist(), stream.t_ns.tolist(), strict=True))
    pending = sorted(stream.removed, key=lambda kr: kr[1])
    lifetimes: list[int] = []
    idle: list[int] = []
    j = 0
    nxt = next(access, None)
    while nxt is not None or j < len(pending):
        if nxt is not None and (j >= len(pending) or nxt[1] <= pending[j][1]):
            k, t = nxt
            if k in last:
                gaps.append(t - last[k])
            first.setdefault(k, t)
            last[k] = t
            nxt = next(access, None)
        else:
            k, t = pending[j]
            j += 1
            if k in first:  # a removal ends the block's residency: the next store starts a new one
                lifetimes.append(t - first.pop(k))
                idle.append(t - last.pop(k))

    def stats(xs: list[int]) -> dict[str, Any]:
        if not xs:
            return {"count": 0, "p50_s": None, "p90_s": None, "max_s": None}
        a = np.asarray(xs, dtype=np.float64) / 1e9
        return {"count": len(xs), "p50_s": round(float(np.percentile(a, 50)), 6),
                "p90_s": round(float(np.percentile(a, 90)), 6), "max_s": round(float(a.max()), 6)}

    return {"lifetime": stats(lifetimes), "idle_before_removal": stats(idle), "reuse_gap": stats(gaps)}


def stack_distances(keys: Sequence[int] | np.ndarray) -> np.ndarray:
    """LRU stack distance of each access (distinct blocks since its previous access, plus one); 0 for
    a first access (a miss at every size)."""
    keys = np.asarray(keys, dtype=np.int64)
    n = keys.size
    tree = np.zeros(n + 1, dtype=np.int64)  # Fenwick tree: 1 at the position of each block's latest access
    last: dict[int, int] = {}
    out = np.zeros(n, dtype=np.int64)
    live = 0
    for i, k in enumerate(keys.tolist()):
        p = last.get(k)
        if p is not None:
            # distinct blocks whose latest access is after p: live - prefix(p)
            s, j = 0, p + 1
            while j > 0:
                s += tree[j]
                j -= j & -j
            out[i] = live - s + 1
            j = p + 1
            while j <= n:
                tree[j] -= 1
                j += j & -j
            live -= 1
        j = i + 1
        while j <= n:
            tree[j] += 1
            j += j & -j
        live += 1
        last[k] = i
    return out


def lru_hits(distances: np.ndarray, sizes: Iterable[int]) -> list[int]:
    """Hits of an LRU cache of each size, from stack distances (one pass over a histogram)."""
    d = distances[distances > 0]
    counts = np.bincount(d) if d.size else np.zeros(1, dtype=np.int64)
    cum = np.cumsum(counts)
    return [int(cum[min(c, cum.size - 1)]) if c > 0 else 0 for c in sizes]


def belady_hits(keys: Sequence[int] | np.ndarray, size: int) -> int:
    """Hits of Belady's optimal cache of `size` blocks (evict the block next used farthest ahead)."""
    keys = np.asarray(keys, dtype=np.int64)
    n = keys.size
    if size <= 0 or n == 0:
        return 0
    nxt = np.full(n, n, dtype=np.int64)  # the position of each access's block's next access (n: never)
    seen: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        k = int(keys[i])
        nxt[i] = seen.get(k, n)
        seen[k] = i
    cached: dict[int, int] = {}  # block -> its next access position
    heap: list[tuple[int, int]] = []  # (-next access, block), stale entries skipped
    hits = 0
    for i in range(n):
        k = int(keys[i])
        if k in cached:
            hits += 1
        elif len(cached) >= size:
            while True:
                neg, victim = heapq.heappop(heap)
                if cached.get(victim) == -neg:
                    del cached[victim]
                    break
        cached[k] = int(nxt[i])
        heapq.heappush(heap, (-int(nxt[i]), k))
    return hits


def default_sizes(distinct: int, recorded: int) -> list[int]:
    """Powers of two up to the stream's distinct blocks, and the recorded pool."""
    sizes = {1 << p for p in range(0, max(distinct, 1).bit_length() + 1)}
    if recorded > 0:
        sizes.add(recorded)
    return sorted(s for s in sizes if s <= max(distinct, recorded, 1) * 2)


def table(stream: Stream, sizes: Sequence[int]) -> list[dict[str, Any]]:
    """One row per pool size: accesses, LRU hits and hit rate, Belady's hits and hit rate."""
    n = int(stream.keys.size)
    dist = stack_distances(stream.keys)
    lru = lru_hits(dist, sizes)
    out = []
    for size, h in zip(sizes, lru, strict=True):
        opt = belady_hits(stream.keys, size)
        out.append({"pool_blocks": int(size), "pool_tokens": int(size) * stream.block_size, "accesses": n,
                    "lru_hits": h, "lru_hit_rate": h / n if n else 0.0, "belady_hits": opt,
                    "belady_hit_rate": opt / n if n else 0.0})
    return out
