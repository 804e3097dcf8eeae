"""Who owns the memory: /owners readings (format 1.5, spec §4.19).

At the moments verdicts are decided (a request's retention verdict, an OOM, the peak of a growth the
KV does not explain, a slow periodic tick) the recorder names an owner for every live byte it can
see. On a GPU that is the caching allocator's own snapshot (``torch.cuda.memory_snapshot()``:
segments and blocks, no stacks unless memory history records them): every active block is
classified once, by identity first (this request's KV storages, earlier requests' KV still alive,
parameters and buffers, the generate output's tensors), then by size (a known library workspace,
counted once per device; score rows the call asked for; blocks sized like one cache layer's K or V:
copies of KV), and the rest is unknown, with its largest blocks kept. Without CUDA a census of the
tensors the garbage collector tracks does the same, each storage once, copies of KV recognised by
shape. One row per class per reading; the analyser reads them (kvtrace.analyzer.owners).

Everything here is pure and testable on the CPU with a synthetic snapshot
(:func:`classify_segments`, :func:`classify_tensors`), except :class:`OwnerRecorder`, the part that
decides when to read and writes the rows. Cost: a reading is taken only when something is to be
explained (storage survived, the allocator stayed above the baseline, an OOM, a growth past the
live KV, the tick), never per step; bench/owners_gpu_check.py measures the snapshot at realistic
block counts.
"""

from __future__ import annotations

import bisect
import gc
import itertools
import json
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvtrace.format.schema import Owner, OwnerMoment, OwnerRow
from kvtrace.format.writer import monotonic_ns

MiB = 1 << 20
ACTIVE = frozenset({"active_allocated", "active_awaiting_free", "active_pending_free"})
MAX_LARGEST = 8  # blocks kept per class in the detail
KV_COPY_MIN_BLOCK = 64 << 10  # a GPU block smaller than this is never called a KV copy (noise)
CENSUS_MAX_OBJECTS = 1 << 20  # objects a CPU census walks at most
VERDICT_NOISE = 2 * MiB  # allocator bytes above the baseline that need no explaining
CPU_RSS_FLOOR = 16 * MiB  # RSS moves in pages and arenas: growth below this needs no explaining
GROWTH_FLOOR = 16 * MiB  # first growth_peak level
# Blocks of segments in a private memory pool (segment_pool_id other than (0, 0)) belong to CUDA graphs
# (transformers' compiled static path captures them): a reservation for replay, named as a workspace.
GRAPH_POOL = "CUDA graph pool"
POOL = "paged KV pool"  # the tag of a continuous-batching manager's preallocated KV pool
MAX_GROWTH_READINGS = 8  # growth_peak readings per request (the level doubles after each)
# Frames of these packages are the machinery, not the allocation site a user wants named (their
# install directories, found from the imported modules), nor the standard library's wrappers.
_MACHINERY_PACKAGES = ("torch", "transformers", "kvtrace", "accelerate")
_MACHINERY_FILES = ("/contextlib.py", "/functools.py", "/threading.py", "<frozen ")


def _machinery_roots() -> tuple[str, ...]:
    import sys

    roots = []
    for name in _MACHINERY_PACKAGES:
        mod = sys.modules.get(name)
        f = getattr(mod, "__file__", None)
        if isinstance(f, str):
            roots.append(os.path.dirname(os.path.abspath(f)) + os.sep)
    return tuple(roots)


def _is_machinery(filename: str, roots: tuple[str, ...]) -> bool:
    return filename.startswith(roots) or any(m in filename for m in _MACHINERY_FILES)


# ---- what a reading matches against ---------------------------------------------------------------

@dataclass
class DeviceKnown:
    """Identities on one device: storage data pointer -> size (or request, or output field)."""

    kv_request: dict[int, int] = field(default_factory=dict)
    # a continuous-batching manager's paged KV pool (ptr -> bytes): KV of the requests running on it,
    # classed kv_request with the detail naming the pool and those requests
    kv_pool: dict[int, int] = field(default_factory=dict)
    kv_earlier: dict[int, int] = field(default_factory=dict)  # ptr -> request
    weights: dict[int, int] = field(default_factory=dict)
    outputs: dict[int, str] = field(default_factory=dict)  # ptr -> output field


@dataclass
class KnownMemory:
    """What a reading classifies against (spec §4.19, in its order)."""

    devices: dict[int, DeviceKnown] = field(default_factory=dict)
    output_sizes: dict[int, str] = field(default_factory=dict)  # exact bytes -> field (during decode)
    workspaces: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)  # name, candidate sizes
    kv_units: set[int] = field(default_factory=set)  # per-token bytes of one layer's K or V
    kv_max_multiple: int = 0  # tokens x layers x 2: a stacked copy of every layer's K and V
    kv_shapes: set[tuple[int, int]] = field(default_factory=set)  # (kv heads, head dim) of the layers
    pool_detail: dict[str, Any] = field(default_factory=dict)  # managers and running requests of the pools
    retained_pool: dict[str, Any] = field(default_factory=dict)  # a pool alive after its manager: kv_earlier

    def on(self, device: int) -> DeviceKnown:
        return self.devices.setdefault(device, DeviceKnown())


@dataclass
class OwnerTotal:
    bytes: int = 0
    blocks: int = 0
    largest: int = 0
    top: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def add(self, nbytes: int, item: dict[str, Any] | None = None) -> None:
        self.bytes += nbytes
        self.blocks += 1
        if nbytes > self.largest:
            self.largest = nbytes
        if item is not None:
            top = self.top
            if len(top) < MAX_LARGEST or nbytes > top[-1]["bytes"]:
                top.append(item)
                top.sort(key=lambda x: -x["bytes"])
                del top[MAX_LARGEST:]

    def detail(self) -> dict[str, Any]:
        out = dict(self.extra)
        if self.top:
            out["largest"] = self.top
        return out


Totals = dict[Owner, OwnerTotal]


def _total(totals: Totals, owner: Owner) -> OwnerTotal:
    t = totals.get(owner)
    if t is None:
        t = totals[owner] = OwnerTotal()
    return t


# ---- known sizes ----------------------------------------------------------------------------------

def cublas_workspace_bytes(cc_major: int, config: str | None) -> int:
    """torch's cuBLAS workspace per handle and stream: ``CUBLAS_WORKSPACE_CONFIG`` (":SIZE_KiB:COUNT"
    pairs, summed) when set, else torch's default (32 MiB from Hopper on; 4096 KiB x 2 + 16 KiB x 8
    before)."""
    if config:
        total, parts = 0, [p for p in config.split(":") if p]
        try:
            for size, count in zip(parts[0::2], parts[1::2], strict=False):
                total += int(size) * 1024 * int(count)
        except ValueError:
            total = 0
        if total > 0:
            return total
    return 32 * MiB if cc_major >= 9 else 4096 * 1024 * 2 + 16 * 1024 * 8


def workspace_candidates(cc_major: int, env: dict[str, str] | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """(name, sizes it may have) of the library workspaces torch allocates through the caching
    allocator on a device of compute capability ``cc_major``; each is counted at most once."""
    env = dict(os.environ) if env is None else env
    cublas = cublas_workspace_bytes(cc_major, env.get("CUBLAS_WORKSPACE_CONFIG"))
    out = [("cuBLAS workspace", (cublas,))]
    lt = env.get("CUBLASLT_WORKSPACE_SIZE")
    try:
        lt_sizes: tuple[int, ...] = (int(lt) * 1024,) if lt else (cublas, 1 * MiB)
    except ValueError:
        lt_sizes = (cublas, 1 * MiB)
    out.append(("cuBLASLt workspace", lt_sizes))
    return out


def allocation_site(frames: list[dict[str, Any]] | None) -> str:
    """``file:line (function)`` of the innermost frame outside torch/transformers/kvtrace (the user's
    line), else of the innermost Python frame; "" without frames (memory history off)."""
    if not frames:
        return ""
    py = [f for f in frames if str(f.get("filename", "")).endswith(".py")]
    roots = _machinery_roots()
    pick = next((f for f in py if not _is_machinery(str(f.get("filename", "")), roots)), None)
    if pick is None:
        pick = py[0] if py else frames[0]
    name = str(pick.get("filename", "?"))
    short = "/".join(name.rsplit("/", 2)[-2:])
    return f"{short}:{pick.get('line', 0)} ({pick.get('name', '?')})"


# ---- classification: a GPU snapshot -----------------------------------------------------------------

def classify_segments(segments: Iterable[dict[str, Any]], known: KnownMemory, device: int) -> Totals:
    """Owner totals of one device's allocator snapshot (torch.cuda.memory_snapshot() segments whose
    ``device`` is ``device``). Every active block lands in exactly one class; inactive blocks in
    INACTIVE. A known storage owns the block its data pointer lies in (views count as the storage)."""
    dk = known.devices.get(device, DeviceKnown())
    blocks: list[tuple[int, int, int, list, bool]] = []  # (address, size, requested, frames, private pool)
    totals: Totals = {}
    for seg in segments:
        addr = int(seg.get("address", 0))
        pool = seg.get("segment_pool_id")
        private = isinstance(pool, (tuple, list)) and any(int(x) for x in pool)  # (0, 0): the default pool
        for b in seg.get("blocks", ()):
            size = int(b.get("size", 0))
            a = int(b.get("address", addr))
            addr = a + size
            if b.get("state") in ACTIVE:
                blocks.append((a, size, int(b.get("requested_size", size) or size), b.get("frames") or [], private))
            elif size > 0:
                _total(totals, Owner.INACTIVE).add(size)
    blocks.sort()
    starts = [b[0] for b in blocks]
    owner_of: dict[int, tuple[Owner, Any]] = {}  # block index -> (owner, tag)

    def claim(ptrs: dict[int, Any], owner: Owner) -> None:
        for ptr, tag in ptrs.items():
            i = bisect.bisect_right(starts, ptr) - 1
            if i >= 0 and ptr < blocks[i][0] + blocks[i][1] and i not in owner_of:
                owner_of[i] = (owner, tag)

    claim(dk.kv_request, Owner.KV_REQUEST)
    claim({ptr: POOL for ptr in dk.kv_pool}, Owner.KV_REQUEST)
    claim(dk.kv_earlier, Owner.KV_EARLIER)
    claim(dk.weights, Owner.WEIGHTS)
    claim(dk.outputs, Owner.GENERATE_OUTPUT)
    # Tens of thousands of blocks at a reading: what does not depend on the block is computed once,
    # and a block's detail item is built only for the classes that keep one.
    workspaces = list(known.workspaces)
    workspace_sizes = {n for _, sizes in workspaces for n in sizes}
    units = sorted((u for u in known.kv_units if u > 0), reverse=True)
    max_multiple = max(known.kv_max_multiple, 1)
    output_sizes = known.output_sizes
    detailed = (Owner.UNKNOWN, Owner.KV_COPIES, Owner.GENERATE_OUTPUT)
    for i, (_, size, req, frames, private) in enumerate(blocks):
        owner, tag = owner_of.get(i, (None, None))
        if owner is None:
            ws = None
            if req in workspace_sizes or size in workspace_sizes:
                ws = next((w for w in workspaces if req in w[1] or size in w[1]), None)
            if private:  # a CUDA graph's (torch.compile reduce-overhead, cudagraph trees) private pool
                owner, tag = Owner.WORKSPACE, GRAPH_POOL
            elif ws is not None:
                workspaces.remove(ws)  # once per device
                workspace_sizes = {n for _, sizes in workspaces for n in sizes}
                owner, tag = Owner.WORKSPACE, ws[0]
            elif req in output_sizes:
                owner, tag = Owner.GENERATE_OUTPUT, output_sizes[req]
            else:
                unit = _copy_unit(req, units, max_multiple) if req >= KV_COPY_MIN_BLOCK else 0
                owner, tag = (Owner.KV_COPIES, unit) if unit else (Owner.UNKNOWN, None)
        item = None
        if owner in detailed:
            item = {"bytes": size, "requested_bytes": req}
            site = allocation_site(frames)
            if site:
                item["at"] = site
        t = totals.get(owner) or _total(totals, owner)
        t.add(size, item)
        if tag is not None:
            _tag(t, owner, tag)
        if tag == GRAPH_POOL:
            t.extra["graph_pool_bytes"] = int(t.extra.get("graph_pool_bytes", 0)) + size
        elif tag is POOL:
            t.extra["pool_bytes"] = int(t.extra.get("pool_bytes", 0)) + size
    _name_pools(totals, known)
    return totals


def _name_pools(totals: Totals, known: KnownMemory) -> None:
    """The kv_request detail of a reading that found a paged pool: which pool, whose requests."""
    t = totals.get(Owner.KV_REQUEST)
    if t is not None and t.extra.get("pool_bytes"):
        t.extra.update({"pool": "paged", **known.pool_detail})
    t = totals.get(Owner.KV_EARLIER)
    if t is not None and known.retained_pool:
        t.extra.update({"pool": "paged", **known.retained_pool})


def kv_copy_unit(nbytes: int, known: KnownMemory) -> int:
    """The per-token K/V size ``nbytes`` is a whole multiple of (one token up to tokens x layers x 2),
    0 when none: the size signature of a copy of (part of) the cache."""
    units = sorted((u for u in known.kv_units if u > 0), reverse=True)
    return _copy_unit(nbytes, units, max(known.kv_max_multiple, 1))


def _copy_unit(nbytes: int, units_descending: list[int], max_multiple: int) -> int:
    for unit in units_descending:
        if nbytes % unit == 0 and 1 <= nbytes // unit <= max_multiple:
            return unit
    return 0


def _tag(t: OwnerTotal, owner: Owner, tag: Any) -> None:
    if tag is None:
        return
    key = {Owner.KV_EARLIER: "requests", Owner.WORKSPACE: "names", Owner.GENERATE_OUTPUT: "fields",
           Owner.KV_COPIES: "unit_bytes"}.get(owner)
    if key is None:
        return
    vals = t.extra.setdefault(key, [])
    if tag not in vals and len(vals) < 64:
        vals.append(tag)
        vals.sort(key=str)


# ---- classification: a CPU census -------------------------------------------------------------------

def classify_tensors(tensors: Iterable[Any], known: KnownMemory, device: int = -1) -> Totals:
    """Owner totals of the tensors given (a census: each storage once). Copies of KV are tensors of
    the cache's dtype-agnostic K/V shape ``[..., kv_heads, T, head_dim]`` (any T) that are not the
    cache's own storages; score rows the call asked for are matched by size."""
    dk = known.devices.get(device, DeviceKnown())
    seen: set[int] = set()
    totals: Totals = {}
    for t in tensors:
        try:
            st = t.untyped_storage()
            ptr, nbytes = int(st.data_ptr()), int(st.nbytes())
            shape = tuple(int(s) for s in t.shape)
            dtype = str(t.dtype).removeprefix("torch.")
        except Exception:  # noqa: BLE001, S112 - meta/sparse/subclass tensors without a plain storage
            continue
        if ptr == 0 or nbytes == 0 or ptr in seen:
            continue
        seen.add(ptr)
        tag: Any = None
        if ptr in dk.kv_request:
            owner = Owner.KV_REQUEST
        elif ptr in dk.kv_pool:
            owner = Owner.KV_REQUEST
            pool = _total(totals, owner).extra
            pool["pool_bytes"] = int(pool.get("pool_bytes", 0)) + nbytes
        elif ptr in dk.kv_earlier:
            owner, tag = Owner.KV_EARLIER, dk.kv_earlier[ptr]
        elif ptr in dk.weights:
            owner = Owner.WEIGHTS
        elif ptr in dk.outputs:
            owner, tag = Owner.GENERATE_OUTPUT, dk.outputs[ptr]
        elif nbytes in known.output_sizes:
            owner, tag = Owner.GENERATE_OUTPUT, known.output_sizes[nbytes]
        elif len(shape) >= 3 and (shape[-3], shape[-1]) in known.kv_shapes:
            owner, tag = Owner.KV_COPIES, f"{shape[-3]}x{shape[-1]}"
        else:
            owner = Owner.UNKNOWN
        total = _total(totals, owner)
        total.add(nbytes, {"bytes": nbytes, "shape": list(shape)[:6], "dtype": dtype}
                  if owner in (Owner.UNKNOWN, Owner.KV_COPIES, Owner.GENERATE_OUTPUT) else None)
        _tag(total, owner, tag)
    _name_pools(totals, known)
    return totals


def gc_tensors(limit: int = CENSUS_MAX_OBJECTS) -> list[Any]:
    """CPU tensors the garbage collector tracks (at most ``limit`` objects walked)."""
    from kvtrace.recorder.retention import tensor_types

    kinds = tensor_types()
    objs = gc.get_objects()
    try:
        found = [o for o in itertools.islice(objs, limit) if type(o) in kinds]
    finally:
        del objs
    return [t for t in found if getattr(t, "device", None) is not None and t.device.type == "cpu"]


def owner_rows(totals: Totals, *, request: int, step: int, moment: OwnerMoment, device: int, t_ns: int,
               add_text: Callable[[str], tuple[int, int]]) -> list[Any]:
    """The /owners rows of one reading, in Owner order."""
    rows = []
    for owner in sorted(totals):
        tot = totals[owner]
        if tot.blocks == 0:
            continue
        detail = tot.detail()
        off, length = add_text(json.dumps(detail, sort_keys=True, separators=(",", ":"))) if detail else (0, 0)
        rows.append(OwnerRow(int(request), int(step), int(moment), int(device), int(owner), int(tot.bytes),
                             int(tot.blocks), int(tot.largest), off, length, int(t_ns)))
    return rows


# ---- the request's geometry: what copies of its KV and its outputs look like ------------------------

@dataclass
class Geometry:
    kv_units: set[int] = field(default_factory=set)
    kv_shapes: set[tuple[int, int]] = field(default_factory=set)
    batch: int = 0
    layers: int = 0


def cache_geometry(cache: Any) -> Geometry:
    """Per-token K/V bytes and (heads, dim) of every layer of a transformers Cache."""
    g = Geometry()
    for layer in getattr(cache, "layers", ()) or ():
        for name in ("keys", "values"):
            x = getattr(layer, name, None)
            shape = getattr(x, "shape", None)
            if shape is None or len(shape) != 4:
                continue
            b, h, _, d = (int(s) for s in shape)
            g.kv_units.add(b * h * d * int(x.element_size()))
            g.kv_shapes.add((h, d))
            g.batch = max(g.batch, b)
        g.layers += 1
    return g


def output_sizes(effective: dict[str, Any], batch: int, vocab: int, hidden: int, heads: int, item: int,
                 prompt: int, tokens: int) -> dict[int, str]:
    """Exact bytes of the per-step tensors generate keeps when asked (float32 score/logit rows,
    hidden-state rows, attention rows up to ``tokens``), by field."""
    out: dict[int, str] = {}
    if not effective.get("return_dict_in_generate") or batch <= 0:
        return out
    if vocab and (effective.get("output_scores") or effective.get("output_logits")):
        out[batch * vocab * 4] = "scores/logits"
    if hidden and effective.get("output_hidden_states"):
        out.setdefault(batch * hidden * item, "hidden_states")
        if prompt > 1:
            out.setdefault(batch * prompt * hidden * item, "hidden_states")
    if heads and effective.get("output_attentions"):
        for t in range(1, min(tokens, 8192) + 1):  # one row per decode step: [batch, heads, 1, t]
            out.setdefault(batch * heads * t * item, "attentions")
        if prompt > 1:
            out.setdefault(batch * heads * prompt * prompt * item, "attentions")
    return out


def output_tensors(out: Any) -> list[tuple[str, Any]]:
    """(field, tensor) of a generate output (a tensor, or a ModelOutput with sequences, scores,
    logits, hidden states, attentions: nested tuples walked, the cache left out)."""
    import torch

    found: list[tuple[str, Any]] = []
    if isinstance(out, torch.Tensor):
        return [("sequences", out)]
    for name in ("sequences", "scores", "logits", "hidden_states", "attentions", "decoder_hidden_states",
                 "decoder_attentions", "encoder_hidden_states", "encoder_attentions", "cross_attentions",
                 "beam_indices", "sequences_scores"):
        stack = [getattr(out, name, None)]
        while stack and len(found) < 1 << 16:
            x = stack.pop()
            if isinstance(x, torch.Tensor):
                found.append((name, x))
            elif isinstance(x, (tuple, list)):
                stack.extend(x)
    return found


# ---- the recorder part ------------------------------------------------------------------------------

@dataclass
class _RequestOwners:
    rid: int
    effective: dict[str, Any]
    prompt: int
    base_alloc: dict[int, int] = field(default_factory=dict)
    base_rss: int = -1
    level: int = GROWTH_FLOOR
    growth_readings: int = 0
    geometry: Geometry | None = None
    outputs: dict[int, dict[int, str]] = field(default_factory=dict)  # device -> ptr -> field
    kv_peak: int = 0
    tokens: int = 0


class OwnerRecorder:
    """Decides when to read who owns the memory, reads it and writes the /owners rows. Never raises
    into the model: failures are recorder errors."""

    def __init__(self, model: Any, ctx: Any, devices: Callable[[], list[int]], tracker: Any) -> None:
        self.model = model
        self.ctx = ctx
        self._model_devices = devices
        self.tracker = tracker
        # retained storage key -> (request, storage weakref, seen alive at a later verdict yet)
        self.earlier: dict[tuple[int, int, int], tuple[int, Any, bool]] = {}
        self.req: _RequestOwners | None = None
        self._history = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cc: dict[int, int] = {}
        self._lock = threading.Lock()
        # the continuous-batching managers' paged KV pools, set by the session from the serving recorder:
        # () -> [(manager index, the pool's tensors, trace ids of the requests running on it)]
        self.pools: Callable[[], list[tuple[int, list[Any], list[int]]]] | None = None
        self._retained: tuple[int, list[tuple[int, int, int]], list[int], str] | None = None

    def _devices(self) -> list[int]:
        """The model's CUDA devices whose allocator can be read ([] without CUDA: a CPU census)."""
        devices = self._model_devices()
        if not devices:
            return []
        import torch

        return devices if torch.cuda.is_available() and torch.cuda.is_initialized() else []

    @property
    def enabled(self) -> bool:
        return bool(getattr(self.ctx.options, "owners", True))

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        if not self.enabled or not self._devices():
            return
        opts = self.ctx.options
        if getattr(opts, "memory_history", False):
            try:
                import torch

                torch.cuda.memory._record_memory_history(
                    enabled="state", context="alloc", stacks="python",
                    max_entries=int(getattr(opts, "memory_history_entries", 100_000)))
                self._history = True
            except Exception as exc:  # noqa: BLE001
                self.ctx.error("memory-history", exc)
        every = float(getattr(opts, "owners_every_s", 0.0) or 0.0)
        if every > 0:
            self._thread = threading.Thread(target=self._tick_loop, args=(every,), name="kvtrace-owners",
                                            daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        if self._history:
            self._history = False
            try:
                import torch

                torch.cuda.memory._record_memory_history(enabled=None)
            except Exception as exc:  # noqa: BLE001
                self.ctx.error("memory-history", exc)

    def _tick_loop(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                active = self.ctx.active
                self.reading(OwnerMoment.TICK, active.id if active is not None else -1, -1, tick=True)
            except Exception as exc:  # noqa: BLE001
                self.ctx.error("owners-tick", exc)

    # ---- per request --------------------------------------------------------------------------

    def begin(self, rid: int, effective: dict[str, Any], prompt: int) -> None:
        if not self.enabled:
            return
        try:
            r = _RequestOwners(rid, dict(effective), prompt)
            devices = self._devices()
            if devices:
                import torch

                r.base_alloc = {d: int(torch.cuda.memory_allocated(d)) for d in devices}
            else:
                r.base_rss = _rss()
            self.req = r
        except Exception as exc:  # noqa: BLE001
            self.ctx.error("owners-begin", exc)

    def on_step_memory(self, step: int, alloc: int, rss: int) -> None:
        """A recorded step's memory (allocator bytes summed over devices, or RSS): a growth_peak reading
        when growth since the request's start exceeds the live KV by more than the current level."""
        r = self.req
        active = self.ctx.active
        if r is None or active is None or active.id != r.rid or step < 1:
            if r is not None and active is not None and active.id == r.rid and r.geometry is None:
                self._learn_geometry(r, active)
            return
        if r.geometry is None:
            self._learn_geometry(r, active)
        if alloc >= 0 and r.base_alloc:
            grown = alloc - sum(r.base_alloc.values())
        elif rss >= 0 and r.base_rss >= 0:
            grown = rss - r.base_rss
        else:
            return
        if grown <= r.level or r.growth_readings >= MAX_GROWTH_READINGS:
            return
        kv = self._live_kv_bytes()
        r.kv_peak = max(r.kv_peak, kv)
        r.tokens = max(r.tokens, active.tokens_seen)
        excess = grown - kv
        if excess <= max(r.level, kv // 2):
            return
        r.growth_readings += 1
        r.level = max(2 * r.level, excess)
        self.reading(OwnerMoment.GROWTH_PEAK, r.rid, step)

    def finish(self, req: Any, out: Any) -> None:
        """Generate returned: the output's tensors are known by identity from now on."""
        r = self.req
        if r is None or r.rid != req.id:
            return
        try:
            if r.geometry is None:
                self._learn_geometry(r, req)
            r.tokens = max(r.tokens, req.tokens_seen)
            for name, t in output_tensors(out):
                try:
                    dev = -1 if t.device.type == "cpu" else int(t.device.index or 0)
                    r.outputs.setdefault(dev, {})[int(t.untyped_storage().data_ptr())] = name
                except Exception:  # noqa: BLE001, S112
                    continue
            r.kv_peak = max(r.kv_peak, self._live_kv_bytes())
        except Exception as exc:  # noqa: BLE001
            self.ctx.error("owners-finish", exc)

    def at_oom(self, req: Any) -> None:
        """An OOM: who filled the device, read while the failing frames still hold their tensors."""
        if not self.enabled:
            return
        r = self.req
        if r is not None and r.rid == req.id and r.geometry is None:
            self._learn_geometry(r, req)
        self.reading(OwnerMoment.OOM, req.id, req.step)

    def at_serving_oom(self, step: int) -> None:
        """An OOM inside continuous batching (a batch's forward raised): who filled the device, read as
        transformers fails the batch's requests (request -1: the pool and the step are the manager's;
        the detail names the requests running on it)."""
        if self.enabled:
            self.reading(OwnerMoment.OOM, -1, step)

    def at_pool_retained(self, manager: int, storages: list[tuple[int, int, int]], requests: list[int],
                         held_by: str) -> None:
        """A paged pool alive after its manager is gone: a reading (moment request_end, request -1) where
        its storages are KV of the manager's earlier requests."""
        if not self.enabled:
            return
        self._retained = (manager, storages, requests, held_by)
        try:
            self.reading(OwnerMoment.REQUEST_END, -1, -1)
        finally:
            self._retained = None

    def at_verdict(self, rid: int, outcome: int, survivors: list[Any], collect: Callable[[], None]) -> None:
        """The request's retention verdict: read who owns what is left when something is to explain
        (storage survived, an earlier retention is still alive, the request failed, or the allocator
        / RSS stayed above the baseline), after a collection (``collect`` runs one when none ran)."""
        if not self.enabled:
            return
        try:
            r = self.req if self.req is not None and self.req.rid == rid else None
            # an earlier retention still alive is proven persisting once (one collection), not at every verdict
            unproven = self._prune_earlier()
            why = bool(survivors) or unproven or outcome not in (0, 1)
            devices = self._devices()
            if not why and r is not None:
                if devices and r.base_alloc:
                    import torch

                    now = sum(int(torch.cuda.memory_allocated(d)) for d in devices)
                    why = now - sum(r.base_alloc.values()) > VERDICT_NOISE
                elif not devices and r.base_rss >= 0:
                    why = _rss() - r.base_rss > CPU_RSS_FLOOR + r.kv_peak // 2
            if why:
                if not survivors:
                    collect()
                self.reading(OwnerMoment.REQUEST_END, rid, -1, survivors=survivors)
                self.earlier = {k: (r, ref, True) for k, (r, ref, _) in self.earlier.items()}
            for s in survivors:  # what a later reading calls earlier requests' KV
                if getattr(s, "ref", None) is not None:
                    self.earlier[(s.device, s.storage, s.nbytes)] = (rid, s.ref, False)
        except Exception as exc:  # noqa: BLE001
            self.ctx.error("owners-verdict", exc)

    # ---- a reading ----------------------------------------------------------------------------

    def reading(self, moment: OwnerMoment, rid: int, step: int, *, survivors: list[Any] = (),  # type: ignore[assignment]
                tick: bool = False) -> None:
        w = self.ctx.writer
        if w is None or w.closed:
            return
        with self._lock:
            try:
                known = self._known(survivors)
                devices = self._devices()
                rows: list[Any] = []
                t = monotonic_ns()
                if devices:
                    import torch

                    segments = torch.cuda.memory_snapshot()
                    for d in devices:
                        known.workspaces = self._workspaces(d)
                        mine = [s for s in segments if int(s.get("device", 0)) == d]
                        totals = classify_segments(mine, known, d)
                        rows += owner_rows(totals, request=rid, step=step, moment=moment, device=d, t_ns=t,
                                           add_text=w.add_text)
                    del segments
                elif not tick:
                    tensors = gc_tensors()
                    try:
                        totals = classify_tensors(tensors, known, -1)
                    finally:
                        tensors.clear()
                    rows += owner_rows(totals, request=rid, step=step, moment=moment, device=-1, t_ns=t,
                                       add_text=w.add_text)
                if rows:
                    w.append("owners", rows)
            except Exception as exc:  # noqa: BLE001
                self.ctx.error(f"owners-{moment.name.lower()}", exc)

    def _known(self, survivors: Iterable[Any]) -> KnownMemory:
        known = KnownMemory()
        for key, (_, swr, _) in list(self.tracker.live.items()):
            if swr() is not None:
                known.on(key[0]).kv_request[key[1]] = key[2]
        for s in survivors:
            known.on(s.device).kv_request[s.storage] = s.nbytes
        for (dev, ptr, _), (rid, ref, _) in list(self.earlier.items()):
            if ref() is not None and ptr not in known.on(dev).kv_request:
                known.on(dev).kv_earlier[ptr] = rid
        for tensors in (self.model.parameters(), self.model.buffers()):
            _known_storages(known, tensors, "weights")
        self._known_pools(known)
        if self._retained is not None:
            manager, storages, requests, held_by = self._retained
            for dev, ptr, _ in storages:
                known.on(dev).kv_earlier[ptr] = requests[0] if requests else -1
            known.retained_pool = {"managers": [manager], "requests": list(requests), "held_by": held_by[:400]}
        r = self.req
        if r is not None:
            for dev, ptrs in r.outputs.items():
                known.on(dev).outputs.update(ptrs)
            g = r.geometry
            if g is not None:
                known.kv_units = set(g.kv_units)
                known.kv_shapes = set(g.kv_shapes)
                tokens = max(r.tokens, r.prompt, 1)
                known.kv_max_multiple = tokens * max(g.layers, 1) * 2
                known.output_sizes = output_sizes(r.effective, g.batch, *self._model_sizes(), r.prompt, tokens)
        return known

    def _known_pools(self, known: KnownMemory) -> None:
        """Every live paged pool's storages as kv_pool, and the detail naming the managers and the
        requests running on them."""
        if self.pools is None:
            return
        managers: list[int] = []
        running: list[int] = []
        for index, tensors, rids in self.pools():
            _known_storages(known, tensors, "kv_pool")
            managers.append(int(index))
            running.extend(int(r) for r in rids)
        if managers:
            known.pool_detail = {"managers": sorted(managers), "requests": sorted(running)[:256],
                                 "running": len(running)}

    def _model_sizes(self) -> tuple[int, int, int, int]:
        """(vocabulary rows of the output head, hidden size, attention heads, activation item size)."""
        cfg = getattr(self.model, "config", None)
        try:
            cfg = cfg.get_text_config(decoder=True) if cfg is not None else None
        except (AttributeError, TypeError):
            pass
        vocab = int(getattr(cfg, "vocab_size", 0) or 0)
        try:
            head = self.model.get_output_embeddings()
            vocab = int(head.weight.shape[0]) if head is not None else vocab
        except Exception:  # noqa: BLE001, S110
            pass
        hidden = int(getattr(cfg, "hidden_size", 0) or 0)
        heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
        try:
            item = int(next(self.model.parameters()).element_size())
        except Exception:  # noqa: BLE001
            item = 4
        return vocab, hidden, heads, item

    def _learn_geometry(self, r: _RequestOwners, req: Any) -> None:
        ref = getattr(req, "last_cache", None)
        cache = ref() if ref is not None else None
        if cache is not None:
            try:
                g = cache_geometry(cache)
                if g.kv_units:
                    r.geometry = g
            finally:
                cache = None

    def _live_kv_bytes(self) -> int:
        return sum(key[2] for key, (_, swr, _) in list(self.tracker.live.items()) if swr() is not None)

    def _prune_earlier(self) -> bool:
        """Drop earlier retentions that died; whether one still alive was never seen at a later verdict."""
        self.earlier = {k: v for k, v in self.earlier.items() if v[1]() is not None}
        return any(not v[2] for v in self.earlier.values())

    def _workspaces(self, device: int) -> list[tuple[str, tuple[int, ...]]]:
        cc = self._cc.get(device)
        if cc is None:
            try:
                import torch

                cc = self._cc[device] = int(torch.cuda.get_device_capability(device)[0])
            except Exception:  # noqa: BLE001
                cc = self._cc[device] = 9
        return workspace_candidates(cc)


def _known_storages(known: KnownMemory, tensors: Iterable[Any], table: str) -> None:
    """Each tensor's untyped storage (data pointer -> bytes) into ``table`` of its device's identities."""
    for x in tensors:
        try:
            dev = -1 if x.device.type == "cpu" else int(x.device.index or 0)
            st = x.untyped_storage()
            getattr(known.on(dev), table)[int(st.data_ptr())] = int(st.nbytes())
        except Exception:  # noqa: BLE001, S112 - meta/sparse/subclass tensors without a plain storage
            continue


def _rss() -> int:
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return -1

