"""What the serving recorder reads from a paged KV cache at each scheduler step, whatever the
transformers internals behind it, and the /sched, /sched_groups and /blocks rows built from it
(format 1.4, spec §4.15-4.17).

The paged cache changed shape between transformers generations: one adapter per generation
(:mod:`kvtrace.recorder.serving_v523`, :mod:`kvtrace.recorder.serving_v517`) reads the cache's own
counters into a :class:`CacheState`; nothing here recomputes what the cache can say itself.
:func:`adapter_for` picks the adapter by the installed transformers' modules, and :meth:`matches`
checks each cache the manager builds, so an unknown layout is said (a NOTE, one stderr line),
never recorded as zeros.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvtrace.format.schema import LayerType, SchedGroupRow, SchedRow
from kvtrace.format.writer import RowBlock

UNSUPPORTED = "unsupported transformers version"


@dataclass
class GroupState:
    """One cache group (the layers of one attention type), as its allocator counts it."""

    group: int
    layer_type: LayerType
    layers: int
    window: int  # -1: full attention
    tokens_per_block: int  # sequence positions of one request per block
    bytes_per_block: int
    blocks_total: int
    blocks_in_use: int  # distinct blocks over the block tables
    blocks_cached: int  # -1: the version keeps none
    blocks_free: int  # -1: not per group in this version
    tables: dict[str, list[int]]  # CB request id -> its block ids (the allocator's own table, read only)
    shared: set[int] = field(default_factory=set)  # block ids referenced by more than one request


@dataclass
class CacheState:
    pool_bytes: int
    free_bytes: int
    groups: list[GroupState]


class CacheAdapter(Protocol):
    """Reads one transformers generation's paged cache. ``eviction_hook`` names the method whose
    calls may evict cached prefix blocks (class, method name) and ``eviction_target`` the object
    that method runs on for a given cache; ``cached_total`` counts cached blocks on that object."""

    label: str

    def matches(self, cache: Any) -> bool: ...
    def read(self, cache: Any) -> CacheState: ...
    def eviction_hook(self) -> tuple[type, str] | None: ...
    def eviction_target(self, cache: Any) -> Any: ...
    def cached_total(self, target: Any) -> int: ...
    def prefix_blocks(self, cache: Any, tokens: int) -> int: ...
    def offloaded_bytes(self, offloader: Any, cache: Any, request_id: str) -> int: ...
    def pool_tensors(self, cache: Any) -> list[Any]: ...


def adapter_for() -> CacheAdapter | None:
    """The adapter of the installed transformers' continuous-batching internals, or None."""
    from kvtrace.recorder import serving_v517, serving_v523

    for module in (serving_v523, serving_v517):
        adapter = module.load()
        if adapter is not None:
            return adapter
    return None


def transformers_version() -> str:
    try:
        import transformers

        return str(transformers.__version__)
    except Exception:  # noqa: BLE001 - the version is only named in a message
        return "unknown"


# ---- rows ------------------------------------------------------------------------------------------


@dataclass
class StepCounts:
    """What happened while one step was scheduled, counted by the hooks (reset after each row)."""

    prefix_hit_tokens: int = 0
    prefix_hit_blocks: int = 0
    evicted_blocks: int = 0
    preempted: int = 0


def step_rows(t_ns: int, manager: int, step: int, state: CacheState | None, active: dict[str, Any],
              rids: dict[str, int], batch: dict[str, int], counts: StepCounts, *, waiting: int, starved: int,
              max_batch_tokens: int) -> tuple[SchedRow, list[SchedGroupRow], list[GroupBlocks]]:
    """The rows of one step. ``active``: the scheduler's running requests (CB id -> RequestState, whose
    position_offset the scheduler has already advanced past this step's tokens); ``rids``: CB id ->
    trace request id for the requests this session recorded (others count in the totals only). The
    /blocks rows come as :class:`GroupBlocks`, converted by the writer's flusher, off the CB loop."""
    cb_ids = list(active)
    try:  # plain attribute reads in one comprehension: this runs on CB's loop thread every step
        pos = np.array([s.position_offset for s in active.values()], dtype=np.int64)
    except AttributeError:  # a state without it counts 0, as before
        pos = np.fromiter((int(getattr(active[c], "position_offset", 0)) for c in cb_ids), np.int64, len(cb_ids))
    pos = pos.reshape(len(cb_ids))
    rid = np.array([rids.get(c, -1) for c in cb_ids], dtype=np.int64).reshape(len(cb_ids))
    groups: list[SchedGroupRow] = []
    blocks: list[GroupBlocks] = []
    valid_bytes = in_use = cached = 0
    for g in state.groups if state is not None else ():
        tables = g.tables
        lens = np.fromiter((len(tables.get(c) or ()) for c in cb_ids), np.int64, len(cb_ids))
        held = np.minimum(pos, g.window) if g.window > 0 else pos
        tokens_valid = int(held[lens > 0].sum())
        shared = None
        if g.shared:  # blocks another running request also references (prefix sharing, forks)
            shared = np.fromiter((sum(1 for b in tables.get(c) or () if b in g.shared) for c in cb_ids), np.int64,
                                 len(cb_ids))
        blocks.append(GroupBlocks(manager, step, g.group, rid, lens, shared, held))
        valid_bytes += tokens_valid * g.bytes_per_block // g.tokens_per_block
        in_use += g.blocks_in_use
        cached += max(g.blocks_cached, 0)
        groups.append(SchedGroupRow(manager, step, g.group, int(g.layer_type), g.layers, g.window, g.tokens_per_block,
                                    g.bytes_per_block, g.blocks_total, g.blocks_in_use, g.blocks_cached,
                                    g.blocks_free, tokens_valid))
    known = state is not None
    sched = SchedRow(t_ns, manager, step, batch.get("batch_requests", 0), batch.get("prefill_tokens", 0),
                     batch.get("decode_tokens", 0), len(active), waiting, starved, max_batch_tokens,
                     state.pool_bytes if known else -1, state.free_bytes if known else -1,
                     valid_bytes if known else -1, in_use if known else -1, cached if known else -1, int(pos.sum()),
                     counts.prefix_hit_tokens, counts.prefix_hit_blocks, counts.evicted_blocks, counts.preempted)
    return sched, groups, blocks


class GroupBlocks(RowBlock):
    """One step's /blocks rows of one cache group, kept as arrays until the flusher converts them:
    a row per recorded request (rid >= 0) that holds blocks in the group."""

    __slots__ = ("group", "held", "lens", "manager", "rid", "shared", "step")

    def __init__(self, manager: int, step: int, group: int, rid: np.ndarray, lens: np.ndarray,
                 shared: np.ndarray | None, held: np.ndarray) -> None:
        self.manager, self.step, self.group = manager, step, group
        self.rid, self.lens, self.shared, self.held = rid, lens, shared, held

    def rows_array(self, dtype: np.dtype) -> np.ndarray:
        keep = (self.rid >= 0) & (self.lens > 0)
        out = np.zeros(int(keep.sum()), dtype=dtype)
        out["manager"], out["step"], out["group"] = self.manager, self.step, self.group
        out["request"], out["blocks"], out["tokens_valid"] = self.rid[keep], self.lens[keep], self.held[keep]
        if self.shared is not None:
            out["blocks_shared"] = self.shared[keep]
        return out


def scheduled_batch(processor: Any) -> Any:
    """The FutureRequestStates of the batch just prepared: ``inputs_and_outputs.requests_in_batch``, or
    with async batching (two IO pairs, 5.17 and 5.23) that of the pair being prepared."""
    io = getattr(processor, "inputs_and_outputs", None)
    batch = getattr(io, "requests_in_batch", None)
    pairs = getattr(io, "io_pairs", None)
    if batch is None and pairs is not None:
        batch = getattr(getattr(pairs[io.current_pair], "host_io", None), "requests_in_batch", None)
    return batch


def batch_tokens(batch: Any) -> dict[str, int]:
    """This step's query tokens split by phase, from the scheduled FutureRequestStates
    (``inputs_and_outputs.requests_in_batch`` in 5.17 and 5.23); empty when that is not there."""
    if not isinstance(batch, list):
        return {}
    try:  # the common case in one pass of plain attribute reads (CB's loop thread, every step)
        rows = [(f.query_length, f.state.position_offset, len(f.state.initial_tokens)) for f in batch]
    except (AttributeError, TypeError):
        rows = None
    if rows is not None:
        decode = sum(n for n, offset, initial in rows if offset - n >= initial)
        prefill = sum(n for n, _, _ in rows) - decode
        return {"batch_requests": len(batch), "prefill_tokens": int(prefill), "decode_tokens": int(decode)}
    prefill = decode = 0
    for future in batch:
        n = int(getattr(future, "query_length", 0))
        state = getattr(future, "state", None)
        # status is DECODING as soon as the whole prompt is scheduled, so it cannot say the phase; the
        # scheduler has already advanced position_offset by n: past = position_offset - n. Tokens of
        # initial_tokens (the prompt, plus earlier output after a soft reset) are prefill (or recompute).
        if getattr(state, "position_offset", 0) - n >= len(getattr(state, "initial_tokens", ())):
            decode += n
        else:
            prefill += n
    return {"batch_requests": len(batch), "prefill_tokens": prefill, "decode_tokens": decode}
