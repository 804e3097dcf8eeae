"""layer_uniformity: coefficient of variation of per-layer KV bytes, with a plain-words
classification that names the split. A hybrid model whose variation is fully explained by its
layer types (sliding vs full) is "bimodal by design", not an anomaly; variation left inside a
layer type is scored.
"""

from __future__ import annotations

import numpy as np

from kvtrace.analyzer.base import Detector, Finding, ev, register
from kvtrace.analyzer.detectors._common import CROSS, layer_kind
from kvtrace.analyzer.replay import ReplayContext
from kvtrace.analyzer.stats import cv, ramp
from kvtrace.format import schema
from kvtrace.units import format_bytes

UNIFORM_CV = 0.1  # below this the layers are uniform; also the within-type bound of "by design"
WITHIN_RAMP = (0.1, 0.5)  # within-type CV -> score


@register
class LayerUniformity(Detector):
    name = "layer_uniformity"
    needs = ("kv",)
    summary = "coefficient of variation of per-layer KV bytes, classified (uniform, bimodal by design, non-uniform)"

    def run(self, ctx: ReplayContext) -> list[Finding]:
        reqs = [r for r in ctx.requests if not r.kv.empty]
        if not reqs:
            return []
        req = max(reqs, key=lambda r: (r.final_tokens, -r.request))
        g = req.kv
        row = g.last_row()
        groups: dict[str, list[int]] = {}
        consumers = 0
        for li, layer in enumerate(g.layers):
            if not g.present[row, li] or g["layer_type"][row, li] == CROSS:
                continue
            kind = layer_kind(ctx, int(layer), int(g["layer_type"][row, li]))
            if kind == "shared_consumer" or int(g["layer_type"][row, li]) == int(schema.LayerType.SHARED_CONSUMER):
                consumers += 1  # holds nothing by design; would only drag the mean down
                continue
            groups.setdefault(kind, []).append(li)
        cols = [c for cs in groups.values() for c in cs]
        if len(cols) < 2:
            return []
        x = g["bytes_valid"][row, cols].astype(np.float64)
        total_cv = cv(x)
        within = {k: cv(g["bytes_valid"][row, cs].astype(np.float64)) for k, cs in groups.items()}
        worst_within = max(within.values())
        parts = []
        for k, cs in sorted(groups.items(), key=lambda kv: float(np.median(g["bytes_valid"][row, kv[1]]))):
            tokens = int(np.median(g["tokens_kept"][row, cs]))
            size = float(np.median(g["bytes_valid"][row, cs]))
            noun = f"{k} layer holds" if len(cs) == 1 else f"{k} layers hold"
            each = "" if len(cs) == 1 else " each"
            parts.append(f"{len(cs):,} {noun} {tokens:,} tokens ({format_bytes(size)}{each})")
        split = ", ".join(parts)
        shared = f"; {consumers:,} KV-sharing layers hold none" if consumers else ""
        if req.state_layers:  # hybrid models: a constant state per layer is by design, not variation
            sizes = list(req.state_layers.values())
            shared += (f"; {len(sizes):,} layers hold conv/recurrent state instead of (or beside) KV "
                       f"({format_bytes(float(np.median(sizes)))} each, constant in tokens: by design, not in the CV)")
        if total_cv < UNIFORM_CV:
            cls, score = "uniform", 0.0
            msg = f"{split}; CV {total_cv:.2f}: uniform{shared}."
        elif worst_within < UNIFORM_CV:
            cls = "bimodal by design" if len(groups) == 2 else f"{len(groups)}-modal by design"
            score = 0.0
            msg = f"{split}; CV {total_cv:.2f}: {cls}{shared}."
        else:
            cls = "non-uniform"
            score = ramp(worst_within, *WITHIN_RAMP)
            bad = max(within, key=within.get)  # type: ignore[arg-type]
            msg = (f"{split}; CV {total_cv:.2f}, and {worst_within:.2f} among the {bad} layers alone: "
                   f"layers of the same type do not hold the same KV{shared}.")
        evidence = {
            "cv": ev(round(total_cv, 4), "ratio"),
            "max_within_type_cv": ev(round(worst_within, 4), "ratio"),
            "layers": ev(len(cols), "count"),
            "sharing_consumers": ev(consumers, "count"),
            "tokens_seen": ev(req.final_tokens, "tokens"),
        }
        if req.state_layers:
            evidence["state_layers"] = ev(len(req.state_layers), "count")
            evidence["state_median_bytes"] = ev(float(np.median(list(req.state_layers.values()))), "bytes")
        for k, cs in groups.items():
            evidence[f"{k}_layers"] = ev(len(cs), "count")
            evidence[f"{k}_median_bytes"] = ev(float(np.median(g["bytes_valid"][row, cs])), "bytes")
            evidence[f"{k}_median_tokens"] = ev(int(np.median(g["tokens_kept"][row, cs])), "tokens")
        f = self.finding(cls.replace(" ", "_").replace("-", "_"), score, msg, evidence=evidence,
                         requests=[req.request], steps=[int(g.steps[row])])
        return [f]
