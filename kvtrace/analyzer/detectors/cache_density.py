"""cache_density: bytes per cached token per layer and per type, against the formula
(batch x kv_heads x (k_dim x k_itemsize + v_dim x v_itemsize)), and what the architecture saves
against a plain multi-head-attention equivalent, split into GQA/MQA (fewer KV heads), MLA (a
latent instead of per-head K/V), sliding windows and cross-layer sharing.
"""

from __future__ import annotations

import numpy as np

from kvtrace.analyzer.base import Detector, Finding, ev, register
from kvtrace.analyzer.detectors._common import (
    CROSS,
    dynamic_kept_tokens,
    itemsize,
    layers_phrase,
    quantized_opaque,
    verb,
)
from kvtrace.analyzer.replay import ReplayContext, RequestTimeline
from kvtrace.analyzer.stats import ramp
from kvtrace.units import format_bytes

MISMATCH_RAMP = (0.05, 0.5)  # |measured/formula - 1| -> score


@register
class CacheDensity(Detector):
    name = "cache_density"
    needs = ("kv", "config")
    summary = "bytes per token per layer and type against the formula; saving against an MHA equivalent"

    def run(self, ctx: ReplayContext) -> list[Finding]:
        reqs = [r for r in ctx.requests if not r.kv.empty]
        if not reqs:
            return []
        out = self._mismatch(ctx, reqs)
        longest = max(reqs, key=lambda r: r.final_tokens)
        info = self._saving(ctx, longest)
        if info is not None:
            out.append(info)
        return out

    def _mismatch(self, ctx: ReplayContext, reqs: list[RequestTimeline]) -> list[Finding]:
        worst: tuple[float, int, int, float, float] | None = None
        bad_layers: set[int] = set()
        bad_reqs: set[int] = set()
        for req in reqs:
            g = req.kv
            row = g.last_row()
            for li, layer in enumerate(g.layers):
                kept = int(g["tokens_kept"][row, li])
                if (not g.present[row, li] or kept <= 0 or g["layer_type"][row, li] == CROSS
                        or quantized_opaque(g["layer_type"][row, li], g["k_dtype"][row, li])):
                    continue
                k_item, v_item = itemsize(g["k_dtype"][row, li]), itemsize(g["v_dtype"][row, li])
                batch = int(g["batch"][row, li]) if g["batch"][row, li] > 0 else max(req.batch_size, 1)
                formula = ctx.expectation.per_token_bytes(int(layer), k_item, v_item or k_item, batch)
                if not formula or k_item == 0:
                    continue
                density = int(g["bytes_valid"][row, li]) / kept
                dev = abs(density / formula - 1.0)
                if dev > MISMATCH_RAMP[0]:
                    bad_layers.add(int(layer))
                    bad_reqs.add(req.request)
                    if worst is None or dev > worst[0]:
                        worst = (dev, req.request, int(layer), density, float(formula))
        if worst is None:
            return []
        dev, rid, layer, density, formula = worst
        msg = (f"{layers_phrase(bad_layers).capitalize()} {verb(bad_layers, 'stores', 'store')} {format_bytes(density)} per token where the "
               f"config's geometry gives {format_bytes(formula)} (layer {layer}, request {rid}): heads, head "
               f"size or element type differ from the model config.")
        return [self.finding(
            "density_mismatch", ramp(dev, *MISMATCH_RAMP), msg,
            evidence={"measured_bytes_per_token": ev(round(density, 2), "bytes/token"),
                      "formula_bytes_per_token": ev(round(formula, 2), "bytes/token"),
                      "relative_deviation": ev(round(dev, 4), "ratio"),
                      "worst_layer": ev(layer, "layer")},
            requests=sorted(bad_reqs), layers=sorted(bad_layers),
        )]

    def _saving(self, ctx: ReplayContext, req: RequestTimeline) -> Finding | None:
        g = req.kv
        row = g.last_row()
        exp = ctx.expectation
        tokens = req.final_tokens
        if tokens <= 0:
            return None
        per_kind: dict[str, list[float]] = {}
        mha = heads = latent = window = sharing = 0
        measured = 0
        item = 0
        batch = 1
        for li, layer in enumerate(g.layers):
            geom = exp.get(int(layer))
            if geom is None or not g.present[row, li] or g["layer_type"][row, li] == CROSS:
                continue
            item = itemsize(g["k_dtype"][row, li]) or item
            batch = int(g["batch"][row, li]) if g["batch"][row, li] > 0 else max(req.batch_size, 1)
            unit = item * batch
            measured += int(g["bytes_valid"][row, li])
            kept = int(g["tokens_kept"][row, li])
            if kept > 0:
                per_kind.setdefault(geom.kind, []).append(int(g["bytes_valid"][row, li]) / kept)
            full_mha = geom.mha_elements_per_token * unit * tokens
            mha += full_mha
            own = geom.num_kv_heads * (geom.k_head_dim + geom.v_head_dim) * unit
            # Sequential attribution: heads/latent first, then the window, then sharing.
            if geom.mla is not None:
                latent += full_mha - own * tokens
            else:
                heads += full_mha - own * tokens
            kept_expected = dynamic_kept_tokens(geom, tokens)
            window += own * (tokens - kept_expected)
            if not geom.stores_kv:
                sharing += own * kept_expected
        if mha <= 0:
            return None
        parts = [(name, val) for name, val in (("fewer KV heads (GQA/MQA)", heads), ("MLA latent", latent),
                                               ("sliding windows", window), ("KV sharing", sharing)) if val > 0]
        saving = 1.0 - measured / mha
        kinds = "; ".join(f"{k} {format_bytes(float(np.median(v)))}/token/layer" for k, v in sorted(per_kind.items()))
        split = ", ".join(f"{name} {format_bytes(val)}" for name, val in parts) or "nothing"
        msg = (f"At {tokens:,} tokens (request {req.request}) the cache holds {format_bytes(measured)} where a "
               f"multi-head-attention equivalent would hold {format_bytes(mha)} ({saving:.0%} saved: {split}); "
               f"{kinds}.") + _state_phrase(req, measured)
        evidence = {
            "tokens": ev(tokens, "tokens"),
            "measured_bytes": ev(measured, "bytes"),
            "mha_equivalent_bytes": ev(mha, "bytes"),
            "saving_ratio": ev(round(saving, 4), "ratio"),
            "saved_by_kv_heads_bytes": ev(heads, "bytes"),
            "saved_by_mla_bytes": ev(latent, "bytes"),
            "saved_by_window_bytes": ev(window, "bytes"),
            "saved_by_sharing_bytes": ev(sharing, "bytes"),
        }
        for k, v in sorted(per_kind.items()):
            evidence[f"{k}_bytes_per_token_per_layer"] = ev(round(float(np.median(v)), 2), "bytes/token")
        if req.state_bytes:
            evidence["state_bytes"] = ev(req.state_bytes, "bytes")
            evidence["state_layers"] = ev(len(req.state_layers), "count")
        return self.finding("density", 0.0, msg, evidence=evidence, requests=[req.request])


def _state_phrase(req: RequestTimeline, kv: int) -> str:
    """A hybrid model's conv/recurrent state beside its KV (format 1.5): cache memory too, but not
    per token; nothing for attention-only models."""
    if not req.state_bytes:
        return ""
    return (f" Beside the KV, {len(req.state_layers):,} layers hold {format_bytes(req.state_bytes)} of "
            f"conv/recurrent state, constant in tokens ({req.state_bytes / max(kv + req.state_bytes, 1):.0%} of "
            f"the {format_bytes(kv + req.state_bytes)} the cache holds); it is not per-token data and not "
            "counted above.")
