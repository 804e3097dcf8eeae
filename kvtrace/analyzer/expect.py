"""What each cache layer should hold, from the model config recorded in the trace.

The expectation comes from `meta.model_config` through kvtrace.geometry, independently of how the
recorder classified the layers: a sliding layer that the config declares sliding must slide even
if the recorder saw it as a plain dynamic layer. Only when the config is absent or not understood
does it fall back to the recorder's /layers table, and says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtrace import geometry as geo
from kvtrace.format import schema

_KIND_OF_RECORDED = {
    schema.LayerType.FULL: "full",
    schema.LayerType.SLIDING: "sliding",
    schema.LayerType.CHUNKED: "chunked",
    schema.LayerType.SHARED_CONSUMER: "shared_consumer",
    schema.LayerType.LATENT: "latent",
    schema.LayerType.QUANTIZED: "full",
    schema.LayerType.STATIC: "full",
    schema.LayerType.CROSS_ATTENTION: "cross_attention",
    schema.LayerType.STATIC_SLIDING: "sliding",
    schema.LayerType.UNKNOWN: "full",
}
# Recorded layer types of a static cache (preallocated to max_cache_len).
STATIC_TYPES = (int(schema.LayerType.STATIC), int(schema.LayerType.STATIC_SLIDING))


@dataclass
class Expectation:
    """Per-layer geometry the analyser measures against."""

    source: str  # "config" or "layers table"
    layers: dict[int, geo.LayerGeometry]
    model: geo.ModelGeometry | None = None
    notes: list[str] = field(default_factory=list)

    def get(self, layer: int) -> geo.LayerGeometry | None:
        return self.layers.get(int(layer))

    def per_token_bytes(self, layer: int, k_item: int, v_item: int, batch: int) -> int | None:
        """Bytes one token adds to `layer` (0 for consumers), or None when unknown."""
        g = self.get(layer)
        if g is None:
            return None
        return int(geo.per_token_bytes(g, k_item, v_item, batch))

    def expected(
        self, layer: int, tokens_seen: np.ndarray, last_step_tokens: np.ndarray, recorded_type: np.ndarray,
        k_item: np.ndarray, v_item: np.ndarray, batch: np.ndarray, static_len: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(allocated, valid) bytes `layer` should hold at each of a series of steps; -1 where no
        rule applies (unknown layer, cross-attention, non-fp8 quantized residual layouts).

        The bytes come from kvtrace.geometry's cache rule (geometry.layer_bytes, the same rule
        `kvtrace calc` and the report's KV check use); what is decided here is which recorded steps
        it applies to.
        """
        seen = np.asarray(tokens_seen, dtype=np.int64)
        none = np.full(seen.shape, -1, dtype=np.int64)
        g = self.get(layer)
        if g is None or g.kind == "cross_attention":
            return none, none.copy()
        if not g.stores_kv:
            zero = np.zeros(seen.shape, dtype=np.int64)
            return zero, zero.copy()
        rtype = np.asarray(recorded_type, dtype=np.int64)
        k_item = np.asarray(k_item, dtype=np.int64)
        static = np.isin(rtype, STATIC_TYPES)
        quant = rtype == int(schema.LayerType.QUANTIZED)
        alloc, valid, overflow = geo.layer_bytes(
            g, seen, k_item, v_item, batch, static=static, capacity=static_len,
            last_step_tokens=last_step_tokens, fp8=quant)
        # No closed form: quanto/hqq residual layouts, a static layer past its capacity, no dtype.
        unknown = (quant & (k_item != 1)) | overflow | (k_item <= 0)
        return np.where(unknown, -1, alloc), np.where(unknown, -1, valid)

    def mha_bytes_per_token(self, itemsize: int, batch: int = 1) -> int | None:
        if self.model is None:
            return None
        return geo.mha_equivalent_bytes_per_token(self.model.decoder_layers, itemsize, batch=batch)


def build_expectation(model_config: dict[str, Any], layers_table: np.ndarray,
                      kv_sample: np.ndarray | None = None) -> Expectation:
    """Expectation from the config; the recorder's /layers table only as a stated fallback.

    `kv_sample` (a few /kv rows) tells which MLA layout the cache used: the latent (transformers
    5.x) or the older per-head expansion.
    """
    notes: list[str] = []
    if model_config:
        try:
            model = geo.model_geometry(model_config, mla_cache=geo.mla_cache_mode(model_config, recorded_k_heads(kv_sample)))
        except (ValueError, TypeError, KeyError) as exc:
            notes.append(f"model config not understood ({exc}); using the recorded /layers table")
        else:
            exp = Expectation("config", {g.index: g for g in model.decoder_layers}, model, notes)
            cross = int(schema.LayerType.CROSS_ATTENTION)
            recorded = {int(r["layer"]) for r in layers_table if int(r["layer_type"]) != cross}
            if recorded and recorded - set(exp.layers):
                notes.append(f"trace has layers {sorted(recorded - set(exp.layers))[:8]} the config does not")
            return exp
    else:
        notes.append("the trace holds no model config; using the recorded /layers table")
    return Expectation("layers table", _from_layers_table(layers_table), None, notes)


def recorded_k_heads(kv_rows: np.ndarray | None) -> np.ndarray | None:
    """Head counts of the recorded keys in some /kv rows (None without rows): what tells
    geometry.mla_cache_mode which MLA layout the recorded cache used."""
    if kv_rows is None or kv_rows.size == 0:
        return None
    return np.asarray(kv_rows["k_shape"])[:, 1]


def _from_layers_table(layers: np.ndarray) -> dict[int, geo.LayerGeometry]:
    out: dict[int, geo.LayerGeometry] = {}
    for r in layers:
        try:
            rtype = schema.LayerType(int(r["layer_type"]))
        except ValueError:
            rtype = schema.LayerType.UNKNOWN
        kind = _KIND_OF_RECORDED[rtype]
        window = int(r["window"]) if int(r["window"]) > 0 else None
        if kind in ("sliding", "chunked") and window is None:
            kind = "full"
        shared = int(r["shared_from"]) if int(r["shared_from"]) >= 0 else None
        attention = {"sliding": "sliding", "chunked": "chunked", "cross_attention": "cross"}.get(kind, "full")
        out[int(r["layer"])] = geo.LayerGeometry(
            int(r["layer"]), kind, attention, int(r["num_kv_heads"]), int(r["k_head_dim"]),
            int(r["v_head_dim"]), window, 0, shares_kv_with=shared,
        )
    return out
