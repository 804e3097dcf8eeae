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
_STATIC_TYPES = (int(schema.LayerType.STATIC), int(schema.LayerType.STATIC_SLIDING))


def cache_kind_of(recorded_type: int) -> str:
    """geometry cache kind for a recorded layer type."""
    if recorded_type in _STATIC_TYPES:
        return "static"
    if recorded_type == int(schema.LayerType.QUANTIZED):
        return "quantized"
    return "dynamic"


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
        if not g.stores_kv:
            return 0
        v = 0 if g.kv_same_tensor else g.v_head_dim * v_item
        return int(batch) * g.num_kv_heads * (g.k_head_dim * k_item + v)

    def expected(
        self, layer: int, tokens_seen: np.ndarray, last_step_tokens: np.ndarray, recorded_type: np.ndarray,
        k_item: np.ndarray, v_item: np.ndarray, batch: np.ndarray, static_len: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(allocated, valid) bytes `layer` should hold at each of a series of steps; -1 where no
        rule applies (unknown layer, cross-attention, non-fp8 quantized residual layouts).

        Vectorised form of kvtrace.geometry's kept_tokens / allocated_tokens rules (a test keeps
        the two in agreement): dynamic full layers hold every token seen; dynamic sliding layers
        keep window - 1 as a view into the tensor that concatenated them with the last forward's
        q tokens; static layers preallocate their capacity (min(window, length) when sliding).
        """
        seen = np.asarray(tokens_seen, dtype=np.int64)
        none = np.full(seen.shape, -1, dtype=np.int64)
        g = self.get(layer)
        if g is None or g.kind == "cross_attention":
            return none, none.copy()
        rtype = np.asarray(recorded_type, dtype=np.int64)
        k_item = np.asarray(k_item, dtype=np.int64)
        v_item = np.asarray(v_item, dtype=np.int64)
        batch = np.asarray(batch, dtype=np.int64)
        cap_len = np.asarray(static_len, dtype=np.int64)
        if not g.stores_kv:
            zero = np.zeros(seen.shape, dtype=np.int64)
            return zero, zero.copy()
        v_part = 0 if g.kv_same_tensor else g.v_head_dim * v_item
        per_token = batch * g.num_kv_heads * (g.k_head_dim * k_item + v_part)
        static = np.isin(rtype, _STATIC_TYPES)
        quant = rtype == int(schema.LayerType.QUANTIZED)
        q = np.clip(np.asarray(last_step_tokens, dtype=np.int64), 1, np.maximum(seen, 1))
        if g.window is None:
            kept_dyn = seen
            alloc_dyn = seen
            cap = cap_len
        else:
            kept_dyn = np.minimum(seen, g.window - 1)
            alloc_dyn = np.minimum(seen - q, g.window - 1) + q
            cap = np.minimum(cap_len, g.window)
        kept = np.where(static, np.minimum(seen, cap), kept_dyn)
        alloc_t = np.where(static, cap, alloc_dyn)
        alloc_t = np.where(seen > 0, alloc_t, 0)
        alloc = alloc_t * per_token + np.where(quant & (seen > 0), geo.FP8_SCALE_BYTES, 0)
        valid = kept * per_token
        # No closed form: quanto/hqq residual layouts, a static layer past its capacity, no dtype.
        unknown = (quant & (k_item != 1)) | (static & (g.window is None) & (seen > cap_len)) | (k_item <= 0)
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
            model = geo.model_geometry(model_config, mla_cache=_mla_mode(model_config, kv_sample))
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


def _mla_mode(model_config: dict[str, Any], kv_sample: np.ndarray | None) -> str:
    cfg = geo.text_config(model_config)
    if kv_sample is None or kv_sample.size == 0 or cfg.get("kv_lora_rank") is None:
        return "latent"
    heads = kv_sample["k_shape"][:, 1]
    heads = heads[heads > 0]
    return "expanded" if heads.size and int(np.median(heads)) > 1 else "latent"


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
