"""Heatmaps from sampled tensor contents (only traces recorded with payload sampling).

Head norms: the mean over batch and tokens of the per-token L2 norm of each sampled head, at the
last sampled step of each layer. Attention entropy: softmax(q . k / sqrt(d)) of every sampled
query token against the sampled keys of the same layer and step, its Shannon entropy divided by
log(number of keys) (1 = uniform attention, 0 = one key takes everything). It is computed from
the tensors as stored (no causal or window mask beyond what the cache already holds, no
attention sinks) and needs the key head each query head reads to be sampled.
Pure numpy: the report must not need torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtrace.format import schema
from kvtrace.format.reader import Trace

MAX_PAYLOAD_ELEMENTS = 64 * 1024 * 1024  # larger samples are skipped for the picture


@dataclass
class Heatmap:
    title: str
    values: np.ndarray  # [layers, heads], NaN where not sampled
    layers: list[int]
    heads: list[int]
    unit: str
    request: int
    note: str
    # Fixed colour scale (None: from the data). Entropy is always [0, 1]; head norms share one
    # 0-based scale across requests so that two requests' pictures compare.
    vmin: float | None = None
    vmax: float | None = None
    scale_note: str = ""


def _as_bhtd(p_shape: tuple[int, ...]) -> tuple[int, int, int, int] | None:
    if len(p_shape) == 4:
        return p_shape  # type: ignore[return-value]
    if len(p_shape) == 3:
        return (1, *p_shape)  # type: ignore[return-value]
    return None


def _latest(index: np.ndarray, request: int, kind: schema.PayloadKind) -> dict[int, int]:
    """layer -> row of the last sampled step of `kind` for `request`."""
    out: dict[int, tuple[int, int]] = {}
    for i, row in enumerate(index):
        if int(row["request"]) != request or int(row["kind"]) != int(kind):
            continue
        layer, step = int(row["layer"]), int(row["step"])
        if layer not in out or step >= out[layer][0]:
            out[layer] = (step, i)
    return {k: v[1] for k, v in out.items()}


def _pick_request(index: np.ndarray) -> int | None:
    """The request with the most sampled keys (ties: the latest)."""
    keys = index[index["kind"] == int(schema.PayloadKind.KEY)]
    if not keys.size:
        return None
    ids, counts = np.unique(keys["request"], return_counts=True)
    best = np.flatnonzero(counts == counts.max())
    return int(ids[best[-1]])


def sampled_requests(trace: Trace) -> list[int]:
    """Requests with sampled keys, values or latents, in id order (the heatmaps' selection)."""
    index = trace.payload_index[:]
    kinds = [int(k) for k in (schema.PayloadKind.KEY, schema.PayloadKind.VALUE, schema.PayloadKind.LATENT)]
    return sorted({int(r) for r in index["request"][np.isin(index["kind"], kinds)]})


def shared_scale(maps: list[Heatmap]) -> None:
    """Give heatmaps of one quantity one colour scale from 0 to their common maximum."""
    by_title: dict[str, list[Heatmap]] = {}
    for hm in maps:
        by_title.setdefault(hm.title, []).append(hm)
    for group in by_title.values():
        if group[0].vmax is not None:  # already fixed (entropy)
            continue
        top = max((float(np.nanmax(h.values)) for h in group if np.isfinite(h.values).any()), default=1.0)
        for h in group:
            h.vmin, h.vmax = 0.0, top if top > 0 else 1.0
            h.scale_note = (f"colour scale 0 to {h.vmax:.3g}, the largest {h.unit} of "
                            f"{'the ' + str(len(group)) + ' requests shown' if len(group) > 1 else 'this request'}")


def _head_ids(row: np.void, n: int) -> list[int]:
    return [int(row["head_start"]) + i * max(1, int(row["head_stride"])) for i in range(n)]


def head_norm_heatmaps(trace: Trace, request: int | None = None) -> list[Heatmap]:
    """Key/value/latent head norms of `request` (default: the one with the most sampled keys)."""
    index = trace.payload_index[:]
    request = _pick_request(index) if request is None else request
    if request is None:
        return []
    out = []
    for kind in (schema.PayloadKind.KEY, schema.PayloadKind.VALUE, schema.PayloadKind.LATENT):
        rows = _latest(index, request, kind)
        cells: dict[tuple[int, int], float] = {}
        for layer, i in sorted(rows.items()):
            row = index[i]
            if int(row["n_elements"]) > MAX_PAYLOAD_ELEMENTS:
                continue
            p = trace.payload(row)
            shape = _as_bhtd(p.shape)
            if shape is None or shape[2] == 0:
                continue
            x = p.to_float32().reshape(shape).astype(np.float64)
            norms = np.sqrt(np.square(x).sum(axis=-1)).mean(axis=(0, 2))  # [H]
            for h, value in zip(_head_ids(row, shape[1]), norms, strict=True):
                cells[(layer, h)] = float(value)
        if cells:
            out.append(_grid(cells, f"{kind.name.lower()} head norms (mean L2 per token)",
                             "L2 norm", request, "last sampled step of each layer"))
    return out


def entropy_heatmap(trace: Trace, num_attention_heads: int | None = None, request: int | None = None
                    ) -> Heatmap | None:
    """Normalised attention entropy per (layer, query head) of `request` (default: the one with
    the most sampled keys); None without sampled queries."""
    index = trace.payload_index[:]
    request = _pick_request(index) if request is None else request
    if request is None:
        return None
    queries = _latest(index, request, schema.PayloadKind.QUERY)
    if not queries:
        return None
    kv_heads = {int(r["layer"]): int(r["num_kv_heads"]) for r in trace.layers[:]}
    if num_attention_heads is None:
        from kvtrace.geometry.bounds import checked_config

        heads = checked_config(trace, trace.layers[:]).get("num_attention_heads")  # bounded sizes (exit 1)
        num_attention_heads = heads if isinstance(heads, int) and heads > 0 else None  # a list: vision configs
    cells: dict[tuple[int, int], float] = {}
    for layer, qi in sorted(queries.items()):
        qrow = index[qi]
        step = int(qrow["step"])
        krow = _row_at(index, request, step, layer, schema.PayloadKind.KEY)
        if krow is None or max(int(qrow["n_elements"]), int(krow["n_elements"])) > MAX_PAYLOAD_ELEMENTS:
            continue
        qp, kp = trace.payload(qrow), trace.payload(krow)
        qs, ks = _as_bhtd(qp.shape), _as_bhtd(kp.shape)
        if qs is None or ks is None or qs[3] != ks[3] or ks[2] < 2 or qs[0] != ks[0]:
            continue
        q = qp.to_float32().reshape(qs).astype(np.float64)
        k = kp.to_float32().reshape(ks).astype(np.float64)
        k_ids = _head_ids(krow, ks[1])
        n_kv = kv_heads.get(layer) or (max(k_ids) + 1)
        group = max(1, (num_attention_heads or n_kv) // max(1, n_kv))
        for qh_pos, qh in enumerate(_head_ids(qrow, qs[1])):
            kvh = qh // group
            if kvh not in k_ids:
                continue
            kk = k[:, k_ids.index(kvh)]  # [B, T, D]
            scores = np.einsum("btd,bsd->bts", q[:, qh_pos], kk) / np.sqrt(qs[3])
            scores -= scores.max(axis=-1, keepdims=True)
            prob = np.exp(scores)
            prob /= prob.sum(axis=-1, keepdims=True)
            ent = -(prob * np.log(np.where(prob > 0, prob, 1.0))).sum(axis=-1)
            cells[(layer, qh)] = float(ent.mean() / np.log(ks[2]))
    if not cells:
        return None
    hm = _grid(cells, "attention entropy per query head (normalised)", "entropy / log(keys)",
               request, "sampled queries against sampled keys, same layer and step")
    # Fixed [0, 1]: auto-ranging 0.993-0.999 would paint near-uniform attention as varied.
    hm.vmin, hm.vmax = 0.0, 1.0
    hm.scale_note = "colour scale fixed to [0, 1]: 0 = one key takes all attention, 1 = uniform over the keys"
    return hm


def _row_at(index: np.ndarray, request: int, step: int, layer: int, kind: schema.PayloadKind
            ) -> np.void | None:
    sel = np.flatnonzero((index["request"] == request) & (index["step"] == step)
                         & (index["layer"] == layer) & (index["kind"] == int(kind)))
    return index[sel[-1]] if sel.size else None


def _grid(cells: dict[tuple[int, int], float], title: str, unit: str, request: int, note: str) -> Heatmap:
    layers = sorted({k[0] for k in cells})
    heads = sorted({k[1] for k in cells})
    values = np.full((len(layers), len(heads)), np.nan)
    for (layer, h), v in cells.items():
        values[layers.index(layer), heads.index(h)] = v
    return Heatmap(title, values, layers, heads, unit, request, note)
