"""The one adapter between the what-if replay and a trace: recorded sizes from /kv and sampled
K/V/Q through the reader (``Trace`` tables and ``ContentsAssembler``, as kvtrace.analyzer.contents
reads them). /kv is read whole once for the sizes (every row is used); a unit's own /kv rows are
read by its request.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from kvtrace.format import schema
from kvtrace.format.assemble import ContentsAssembler
from kvtrace.format.reader import Trace
from kvtrace.geometry.bounds import checked_config

PK = schema.PayloadKind
LT = schema.LayerType

__all__ = ["MAX_EVAL_QUERIES", "Sizes", "Unit", "sizes", "units"]

# Evaluation queries per unit: a prefill sample can hold thousands; the attention measures are
# means over queries, and each query costs a pass over every key.
MAX_EVAL_QUERIES = 256
MAX_STEPS = 8  # sampled steps per (request, layer) with steps="all"


@dataclass
class Sizes:
    """One entry per /kv row: what the cache held of a layer at a step (whole batch)."""

    request: np.ndarray
    step: np.ndarray
    layer: np.ndarray
    batch: np.ndarray
    kv_heads: np.ndarray
    tokens: np.ndarray  # tokens_kept
    k_dim: np.ndarray
    v_dim: np.ndarray
    k_bytes: np.ndarray  # element bytes
    v_bytes: np.ndarray
    valid: np.ndarray  # bytes_valid
    allocated: np.ndarray  # bytes_allocated (the trace's own layout)
    sliding: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))  # a sliding-window layer's row

    @property
    def per_token(self) -> np.ndarray:
        """Bytes per cached token of the whole batch (bytes_valid / tokens_kept)."""
        return np.divide(self.valid, self.tokens, out=np.zeros(len(self.tokens)), where=self.tokens > 0)

    def __len__(self) -> int:
        return len(self.request)


def _itemsize(codes: np.ndarray) -> np.ndarray:
    out = []
    for c in codes:
        try:
            out.append(schema.DTYPE_ITEMSIZE.get(schema.CacheDType(int(c)), 0))
        except ValueError:
            out.append(0)
    return np.array(out, dtype=np.int64)


def sizes(trace: Trace) -> Sizes:
    kv = trace.kv[:]
    ks, vs = kv["k_shape"].astype(np.int64), kv["v_shape"].astype(np.int64)
    return Sizes(kv["request"].astype(np.int64), kv["step"].astype(np.int64), kv["layer"].astype(np.int64),
                 ks[:, 0] if len(kv) else np.zeros(0, np.int64), ks[:, 1] if len(kv) else np.zeros(0, np.int64),
                 kv["tokens_kept"].astype(np.int64), ks[:, 3] if len(kv) else np.zeros(0, np.int64),
                 vs[:, 3] if len(kv) else np.zeros(0, np.int64), _itemsize(kv["k_dtype"]), _itemsize(kv["v_dtype"]),
                 kv["bytes_valid"].astype(np.float64), kv["bytes_allocated"].astype(np.float64),
                 np.isin(kv["layer_type"], [int(LT.SLIDING), int(LT.STATIC_SLIDING)]))


@dataclass
class Unit:
    """One (request, layer) at its last sampled step with K and V: what the cache held then, and
    the sampled queries split into ``eval`` (queries of that step) and ``obs`` (earlier ones)."""

    request: int
    layer: int
    step: int
    layer_type: str
    k: np.ndarray  # [B, Hk, T, Dk] float32
    v: np.ndarray
    k_pos: np.ndarray
    kv_heads: list[int]  # absolute KV head numbers
    window: int | None
    scale: float
    latent: bool
    eval_q: np.ndarray | None = None
    eval_pos: np.ndarray | None = None
    obs_q: np.ndarray | None = None
    obs_pos: np.ndarray | None = None
    no_queries: str = ""  # why eval queries are missing
    notes: list[str] = field(default_factory=list)


def _scale(cfg: dict, dim: int) -> float:
    v = cfg.get("query_pre_attn_scalar")  # gemma: softmax scale is not 1/sqrt(head_dim)
    return float(v) ** -0.5 if isinstance(v, (int, float)) and v > 0 else 1 / math.sqrt(dim)


def units(trace: Trace, steps: str = "last") -> Iterator[Unit]:
    """Every (request, layer) with sampled K and V at its last sampled step (``steps="all"``: at up
    to MAX_STEPS of its sampled steps, evenly spaced, the last included); nothing when the trace
    holds no payloads."""
    if not trace.has("payloads/index"):
        return
    index = trace.payload_index[:]
    if index.size == 0:
        return
    table = trace.layers[:] if trace.has("layers") else None
    cfg = checked_config(trace, table)  # sizes within bounds before they size anything (exit 1)
    cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    layers = {int(r["layer"]): r for r in table} if table is not None else {}
    asm = ContentsAssembler(trace, index)
    kv, kv_request = np.zeros(0, schema.KV), None  # /kv rows of the request being read
    rows: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    for i, r in enumerate(index):
        rows.setdefault((int(r["request"]), int(r["layer"]), int(r["kind"])), []).append((int(r["step"]), i))
    for request, layer in sorted({(rq, ly) for rq, ly, _ in rows}):
        # MLA caches (transformers 5.x) hold a latent and a RoPE key part instead of K and V:
        # they stand in as "keys" and "values" (reconstruction and key-only plans; no attention)
        kk, vk = (PK.KEY, PK.VALUE) if (request, layer, int(PK.KEY)) in rows else (PK.LATENT, PK.ROPE_KEY)
        ksteps = {s for s, _ in rows.get((request, layer, int(kk)), [])}
        vsteps = {s for s, _ in rows.get((request, layer, int(vk)), [])}
        both = sorted(ksteps & vsteps)
        if not both:
            continue
        if request != kv_request:  # units come in request order: its rows are read once, by its runs
            kv, kv_request = trace.kv.where(request=request), request
        for step in _chosen(both, steps):
            u = _unit(asm, kv, layers, rows, cfg, request, layer, step, kk, vk)
            if u is not None:
                yield u
        asm.clear()


def _chosen(both: list[int], steps: str) -> list[int]:
    if steps == "last" or len(both) == 1:
        return both[-1:]
    if steps != "all":
        raise ValueError(f"steps must be 'last' or 'all', got {steps!r}")
    picks = np.unique(np.round(np.linspace(0, len(both) - 1, min(MAX_STEPS, len(both)))).astype(int))
    return [both[i] for i in picks]


def _unit(asm: ContentsAssembler, kv: np.ndarray, layers: dict, rows: dict, cfg: dict,
          request: int, layer: int, step: int, kk: PK, vk: PK) -> Unit | None:
    """The unit of (request, layer) at ``step``: what the cache held then and the queries.
    ``kv``: the request's /kv rows."""
    sel = kv[(kv["step"] == step) & (kv["layer"] == layer)]
    first = int(sel[0]["tokens_seen"]) - int(sel[0]["tokens_kept"]) if sel.size else None
    code = int(sel[0]["layer_type"]) if sel.size else int(layers[layer]["layer_type"]) if layer in layers else 0
    lt = LT(code) if code in LT._value2member_map_ else LT.UNKNOWN
    kp = asm.at(request, layer, int(kk), step, first=first)
    vp = asm.at(request, layer, int(vk), step, first=first)
    if kp is None or vp is None or len(kp.shape) != 4 or len(vp.shape) != 4 or kp.shape[:3] != vp.shape[:3] \
            or kp.shape[2] == 0:  # no sampled position among those /kv says the cache held then
        return None
    k, v = kp.to_float32(), vp.to_float32()
    window = int(layers[layer]["window"]) if layer in layers and lt in (LT.SLIDING, LT.STATIC_SLIDING) \
        and int(layers[layer]["window"]) > 0 else None
    latent = lt == LT.LATENT or (request, layer, int(PK.LATENT)) in rows
    u = Unit(request, layer, step, lt.name.lower(), k, v, kp.token_start + np.arange(k.shape[2]),
             [kp.head_start + i * kp.head_stride for i in range(k.shape[1])], window,
             _scale(cfg, k.shape[3]), latent)
    _queries(asm.trace, u, rows.get((request, layer, int(PK.QUERY)), []), cfg, layers.get(layer))
    return u


def _queries(trace: Trace, u: Unit, qrows: list[tuple[int, int]], cfg: dict, lrow: np.void | None) -> None:
    if u.latent:
        u.no_queries = "MLA layer: cached keys are a latent shared by all heads; per-head attention needs the up-projections"
        return
    if not qrows:
        u.no_queries = "no sampled queries (record with sampling={..., 'queries': True})"
        return
    hq_total = cfg.get("num_attention_heads")
    hk_total = int(lrow["num_kv_heads"]) if lrow is not None else u.k.shape[1]
    if u.kv_heads != list(range(hk_total)):
        u.no_queries = "K/V sampled for a subset of heads: queries cannot be paired with their KV heads"
        return
    qs: list[tuple[int, np.ndarray, np.ndarray]] = []
    for step, row in qrows:
        if step > u.step:
            continue
        p = trace.payload(row)
        if len(p.shape) != 4 or p.shape[0] != u.k.shape[0] or p.shape[3] != u.k.shape[3] \
                or p.head_start != 0 or p.head_stride != 1 or p.shape[1] != hq_total or hq_total % hk_total:
            u.notes.append(f"query payload at step {step} is not [B, all query heads, T, D]: not used")
            continue
        qs.append((step, p.to_float32(), p.token_start + np.arange(p.shape[2])))
    k0, k1 = int(u.k_pos[0]), int(u.k_pos[-1])
    ev = [(q, pos) for s, q, pos in qs if s == u.step]
    obs = [(q, pos) for s, q, pos in qs if s < u.step]
    if ev:
        q = np.concatenate([a for a, _ in ev], axis=2)
        pos = np.concatenate([b for _, b in ev])
        # every key the query attends to is in the sample; a sliding layer keeps window - 1
        # tokens after the step, so its query's oldest window key is already gone: measured over
        # the keys the cache holds (spec/whatif-json.md)
        lo = np.maximum(pos - u.window + 2, 0) if u.window else np.zeros_like(pos)
        ok = (lo >= k0) & (pos <= k1)
        if ok.any():
            u.eval_q, u.eval_pos = q[:, :, ok], pos[ok]
            if len(u.eval_pos) > MAX_EVAL_QUERIES:  # a long prefill: its most recent queries
                u.notes.append(f"evaluated with the last {MAX_EVAL_QUERIES} of the {len(u.eval_pos)} queries "
                               f"sampled at step {u.step}")
                last = np.argsort(u.eval_pos, kind="stable")[-MAX_EVAL_QUERIES:]
                u.eval_q, u.eval_pos = u.eval_q[:, :, last], u.eval_pos[last]
        else:
            u.no_queries = "the last step's sampled queries attend to keys outside the sample"
    else:
        u.no_queries = f"no query sampled at step {u.step}, the last step with K and V"
    if obs:
        u.obs_q = np.concatenate([a for a, _ in obs], axis=2)
        u.obs_pos = np.concatenate([b for _, b in obs])
