"""layer_anomaly: layers whose KV bytes are robust outliers among layers of the same type and
geometry (median and MAD), so that the sliding and full layers of a hybrid model are never
outliers of each other. Groups of fewer than three layers have no meaningful median; they are
compared with the config's expectation instead.
"""

from __future__ import annotations

import numpy as np

from kvtrace.analyzer.base import Detector, Finding, ev, register
from kvtrace.analyzer.detectors._common import CROSS, expected_grid, layer_kind, layers_phrase, verb
from kvtrace.analyzer.replay import ReplayContext, RequestTimeline
from kvtrace.analyzer.stats import median_mad, ramp, robust_z
from kvtrace.units import format_bytes

Z_MIN = 3.5  # robust z beyond which a layer is an outlier (Iglewicz & Hoaglin)
REL_RAMP = (0.1, 1.0)  # |x - center| / center -> score


@register
class LayerAnomaly(Detector):
    name = "layer_anomaly"
    needs = ("kv",)
    summary = "robust (median/MAD) outliers of per-layer KV bytes within groups of the same type and geometry"

    def run(self, ctx: ReplayContext) -> list[Finding]:
        merged: dict[tuple[str, tuple[int, ...]], Finding] = {}
        for req in ctx.requests:
            if req.kv.empty:
                continue
            for f in self._request(ctx, req):
                key = (f.kind, tuple(f.layers))
                if key in merged:
                    old = merged[key]
                    old.requests = sorted(set(old.requests) | set(f.requests))
                    if f.score > old.score:
                        f.requests = old.requests
                        merged[key] = f
                else:
                    merged[key] = f
        return list(merged.values())

    def _groups(self, ctx: ReplayContext, req: RequestTimeline, row: int) -> dict[tuple, list[int]]:
        g = req.kv
        groups: dict[tuple, list[int]] = {}
        for li, layer in enumerate(g.layers):
            if not g.present[row, li]:
                continue
            rtype = int(g["layer_type"][row, li])
            geom = ctx.expectation.get(int(layer)) if rtype != CROSS else None
            if geom is not None:
                key = (geom.kind, geom.num_kv_heads, geom.k_head_dim, geom.v_head_dim, geom.window,
                       int(g["k_dtype"][row, li]))
            else:  # no config geometry: group by what the recorder saw
                key = (layer_kind(ctx, int(layer), rtype), int(g["k_heads"][row, li]), int(g["k_dim"][row, li]),
                       int(g["v_dim"][row, li]), None, int(g["k_dtype"][row, li]))
            groups.setdefault(key, []).append(li)
        return groups

    def _request(self, ctx: ReplayContext, req: RequestTimeline) -> list[Finding]:
        g = req.kv
        row = g.last_row()
        _, exp_valid = expected_grid(ctx, req)
        out: list[Finding] = []
        for key, cols in self._groups(ctx, req, row).items():
            kind = key[0]
            x = g["bytes_valid"][row, cols].astype(np.float64)
            if len(cols) >= 3:
                center, mad = median_mad(x)
                z = robust_z(x, center, mad)
                basis = f"median of {len(cols)} {kind} layers"
                ref = np.full(x.shape, center)
            else:
                e = exp_valid[row, cols].astype(np.float64)
                if np.any(e < 0):
                    continue  # two layers and no expectation: no way to tell which one is odd
                ref, z = e, np.where(x == e, 0.0, np.inf)
                basis = "config expectation (too few layers of this kind for a median)"
            with np.errstate(divide="ignore", invalid="ignore"):
                rel = np.where(ref > 0, np.abs(x - ref) / ref, np.where(x > 0, np.inf, 0.0))
            bad = np.flatnonzero((np.abs(z) > Z_MIN) & (rel > REL_RAMP[0]))
            if bad.size == 0:
                continue
            worst = int(bad[np.argmax(rel[bad])])
            layers = [int(g.layers[cols[i]]) for i in bad]
            wl = int(g.layers[cols[worst]])
            direction = "more" if x[worst] > ref[worst] else "less"
            msg = (f"{layers_phrase(layers).capitalize()} {verb(layers, 'holds', 'hold')} {direction} KV than the other {kind} layers of the "
                   f"same geometry in request {req.request}: layer {wl} holds {format_bytes(x[worst])} "
                   f"({int(g['tokens_kept'][row, cols[worst]]):,} tokens) against {format_bytes(ref[worst])} "
                   f"({basis}).")
            out.append(self.finding(
                "outlier_layer", ramp(float(rel[worst]), *REL_RAMP), msg,
                evidence={
                    "layer_bytes": ev(int(x[worst]), "bytes"),
                    "reference_bytes": ev(int(ref[worst]), "bytes"),
                    "relative_deviation": ev(round(float(rel[worst]), 4) if np.isfinite(rel[worst]) else None,
                                             "ratio"),
                    "robust_z": ev(round(float(z[worst]), 2) if np.isfinite(z[worst]) else None, "ratio"),
                    "group_size": ev(len(cols), "count"),
                    "worst_layer": ev(wl, "layer"),
                },
                requests=[req.request], steps=[int(g.steps[row])], layers=layers,
            ))
        return out
