"""growth_curve: KV bytes against tokens, per layer type, against the config's expectation.

Flags (1) duplication: a layer holding more than the analytical expectation (linear for full
layers, saturating at the window for sliding ones, latent size for MLA), including a sliding layer
that does not slide; (2) superlinear growth of a layer's bytes per token; (3) device memory that
grows faster than the cache itself (copies the cache structure does not show); (4) static
over-allocation. There is no "plateau guard": a plain linear ramp is measured like anything else.
"""

from __future__ import annotations

import numpy as np

from kvtrace.analyzer.base import Detector, Finding, ev, register
from kvtrace.analyzer.detectors._common import CROSS, expected_grid, layer_kind, layers_phrase, verb
from kvtrace.analyzer.replay import ReplayContext, RequestTimeline
from kvtrace.analyzer.stats import ramp
from kvtrace.format import schema
from kvtrace.units import format_bytes

# Score ramps (documented in docs/detectors.md).
DUP_RATIO = (1.05, 2.0)  # measured / expected bytes
SUPERLINEAR_RATIO = (1.2, 2.0)  # growth per token, second half / first half
DEVICE_GROWTH_RATIO = (1.5, 3.0)  # allocated (or RSS) growth / KV growth over decode
STATIC_WASTE = (0.3, 0.9)  # fraction of a static allocation never holding a token
# Process RSS moves in pages and with the C allocator's arenas: excess growth below 4 MiB scores
# nothing, 16 MiB and more scores fully (only used on traces without allocator data).
RSS_EXCESS = (4 * 1024**2, 16 * 1024**2)
# RSS cannot tell live tensors from freed-but-kept heap: its evidence is at most "low".
RSS_MAX_SCORE = 0.25  # below the 0.3 "medium" boundary
MIN_DECODE_STEPS = 4  # fewer decode steps than this say nothing about the shape of growth
_STATIC = (int(schema.LayerType.STATIC), int(schema.LayerType.STATIC_SLIDING))


@register
class GrowthCurve(Detector):
    name = "growth_curve"
    needs = ("kv",)
    summary = "KV bytes vs tokens per layer type against the config: duplication, superlinear growth, static over-allocation"

    def run(self, ctx: ReplayContext) -> list[Finding]:
        out: list[Finding] = []
        for req in ctx.requests:
            if req.kv.empty:
                continue
            out += self._duplication(ctx, req)
            out += self._superlinear(ctx, req)
            out += self._static(ctx, req)
            out += self._device_growth(ctx, req)
        return out

    # ---- measured over expected ---------------------------------------------------------------

    def _duplication(self, ctx: ReplayContext, req: RequestTimeline) -> list[Finding]:
        g = req.kv
        exp_alloc, exp_valid = expected_grid(ctx, req)
        static = np.isin(g["layer_type"], _STATIC)
        with np.errstate(divide="ignore", invalid="ignore"):
            r_valid = np.where(exp_valid > 0, g["bytes_valid"] / exp_valid, np.nan)
            # Static layers preallocate by design: their allocation is judged by _static.
            r_alloc = np.where((exp_alloc > 0) & ~static, g["bytes_allocated"] / exp_alloc, np.nan)
        ratio = np.fmax(r_valid, r_alloc)
        if np.all(np.isnan(ratio)):
            return []
        findings: list[Finding] = []
        by_kind: dict[tuple[str, str], list[int]] = {}
        for li, layer in enumerate(g.layers):
            col = ratio[:, li]
            if np.all(np.isnan(col)) or np.nanmax(col) < DUP_RATIO[0]:
                continue
            geom = ctx.expectation.get(int(layer))
            slides = geom is not None and geom.window is not None and geom.kind in ("sliding", "chunked")
            overflow = slides and int(np.max(g["tokens_kept"][:, li])) > geom.window  # type: ignore[union-attr]
            what = "window_not_applied" if overflow else "duplication"
            by_kind.setdefault((what, layer_kind(ctx, int(layer), int(g["layer_type"][-1, li]))), []).append(li)
        for (what, kind), cols in by_kind.items():
            sub = ratio[:, cols]
            si, cj = np.unravel_index(int(np.nanargmax(sub)), sub.shape)
            li = cols[cj]
            layer = int(g.layers[li])
            worst = float(sub[si, cj])
            seen = int(g["tokens_seen"][si, li])
            kept = int(g["tokens_kept"][si, li])
            geom = ctx.expectation.get(layer)
            measured_v, measured_a = int(g["bytes_valid"][si, li]), int(g["bytes_allocated"][si, li])
            ev_v, ev_a = int(exp_valid[si, li]), int(exp_alloc[si, li])
            layers = [int(g.layers[c]) for c in cols]
            steps = [int(g.steps[s]) for s in np.flatnonzero(np.nanmax(sub, axis=1) >= DUP_RATIO[0])]
            window = geom.window if geom is not None else None
            expected_kept = min(seen, window - 1) if window else seen
            subject = layers_phrase(layers).capitalize()
            if what == "window_not_applied":
                who = "it" if len(layers) == 1 else f"layer {layer}"
                msg = (f"{subject} should slide (window {window:,}) but {who} holds {kept:,} tokens after "
                       f"{seen:,} seen in request {req.request} ({format_bytes(measured_v)} vs "
                       f"{format_bytes(ev_v)} expected): the window is not applied.")
            else:
                use_alloc = np.nan_to_num(r_alloc[si, li]) >= np.nan_to_num(r_valid[si, li])
                measured, expected = (measured_a, ev_a) if use_alloc else (measured_v, ev_v)
                msg = (f"{subject} ({kind}) {verb(layers, 'holds', 'hold')} up to {worst:.1f}x the KV bytes the "
                       f"config predicts ({format_bytes(measured)} vs {format_bytes(expected)} at {seen:,} "
                       f"tokens, request {req.request}): the cache keeps copies it should not.")
            findings.append(self.finding(
                what, ramp(worst, *DUP_RATIO), msg,
                evidence={
                    "ratio": ev(round(worst, 4), "ratio"),
                    "measured_valid_bytes": ev(measured_v, "bytes"),
                    "expected_valid_bytes": ev(ev_v, "bytes"),
                    "measured_allocated_bytes": ev(measured_a, "bytes"),
                    "expected_allocated_bytes": ev(ev_a, "bytes"),
                    "tokens_seen": ev(seen, "tokens"),
                    "tokens_kept": ev(kept, "tokens"),
                    "expected_tokens_kept": ev(expected_kept, "tokens"),
                    "worst_layer": ev(layer, "layer"),
                },
                requests=[req.request], steps=steps[:64], layers=layers,
            ))
        return findings

    # ---- shape of growth ----------------------------------------------------------------------

    def _superlinear(self, ctx: ReplayContext, req: RequestTimeline) -> list[Finding]:
        g = req.kv
        decode = g.steps >= 1
        if int(decode.sum()) < MIN_DECODE_STEPS:
            return []
        rows = np.flatnonzero(decode)
        worst: tuple[float, int, float, float] | None = None
        flagged: list[int] = []
        for li, layer in enumerate(g.layers):
            if g["layer_type"][rows[0], li] == CROSS:
                continue
            ok = g.present[rows, li]
            r = rows[ok]
            if r.size < MIN_DECODE_STEPS:
                continue
            t = g["tokens_seen"][r, li].astype(np.float64)
            b = g["bytes_allocated"][r, li].astype(np.float64)
            mid = r.size // 2
            dt1, dt2 = t[mid] - t[0], t[-1] - t[mid]
            if dt1 <= 0 or dt2 <= 0:
                continue
            g1, g2 = (b[mid] - b[0]) / dt1, (b[-1] - b[mid]) / dt2
            if g1 <= 0 or g2 <= 0:
                continue  # flat (saturated window, static) or shrinking: not superlinear
            ratio = g2 / g1
            if ratio >= SUPERLINEAR_RATIO[0]:
                flagged.append(int(layer))
                if worst is None or ratio > worst[0]:
                    worst = (ratio, int(layer), g1, g2)
        if worst is None:
            return []
        ratio, layer, g1, g2 = worst
        msg = (f"KV bytes of {layers_phrase(flagged)} grow {ratio:.1f}x faster per token in the second "
               f"half of request {req.request}'s decode than in the first ({format_bytes(g2)}/token vs "
               f"{format_bytes(g1)}/token): growth is superlinear, not linear.")
        return [self.finding(
            "superlinear_growth", ramp(ratio, *SUPERLINEAR_RATIO), msg,
            evidence={
                "growth_ratio": ev(round(ratio, 4), "ratio"),
                "first_half_bytes_per_token": ev(round(g1, 1), "bytes/token"),
                "second_half_bytes_per_token": ev(round(g2, 1), "bytes/token"),
                "worst_layer": ev(layer, "layer"),
            },
            requests=[req.request], layers=flagged,
        )]

    def _device_growth(self, ctx: ReplayContext, req: RequestTimeline) -> list[Finding]:
        """Memory grown over decode against the cache's own growth: copies that the cache
        structure does not show (e.g. old tensors kept alive in a list) appear only here.
        The allocator's allocated bytes when the trace has them, else the process RSS."""
        s = req.steps
        if s.size == 0:
            return []
        s = s[s["phase"] == int(schema.Phase.DECODE)]
        if (s["allocated_bytes"] >= 0).sum() >= MIN_DECODE_STEPS:
            s, column, source = s[s["allocated_bytes"] >= 0], "allocated_bytes", "Allocated memory"
            # Allocator blocks are rounded to 512 B: one block per cached tensor of slack.
            floor = (2 * 512 * max(1, req.kv.layers.size), 2 * 512 * max(1, req.kv.layers.size) + 1)
            cap = 1.0
        elif (s["rss_bytes"] >= 0).sum() >= MIN_DECODE_STEPS:
            s, column, source = s[s["rss_bytes"] >= 0], "rss_bytes", "Process RSS"
            floor = RSS_EXCESS
            cap = RSS_MAX_SCORE
        else:
            return []
        if s.size < MIN_DECODE_STEPS:
            return []
        d_mem = int(s[column][-1]) - int(s[column][0])
        d_kv = int(s["kv_bytes_unique"][-1]) - int(s["kv_bytes_unique"][0])
        d_tokens = int(s["tokens_seen"][-1]) - int(s["tokens_seen"][0])
        if d_mem <= 0 or d_tokens <= 0:
            return []
        excess = d_mem - max(d_kv, 0)
        ratio = d_mem / max(d_kv, 1)
        score = min(ramp(ratio, *DEVICE_GROWTH_RATIO), ramp(excess, *floor), cap)
        if score == 0:
            return []
        span = int(s["step"][-1]) - int(s["step"][0])  # steps spanned (rows may be every N-th step)
        msg = (f"{source} grew {format_bytes(d_mem)} over {span:,} decode steps of request "
               f"{req.request} while the KV cache grew {format_bytes(max(d_kv, 0))} ({ratio:.1f}x): something "
               f"besides the cache grows with every token (e.g. old cache copies kept alive)")
        if column == "rss_bytes":
            msg += ("; RSS also counts memory the C allocator keeps after frees, so this may be heap "
                    "fragmentation rather than a leak (a GPU trace's allocator bytes tell them apart).")
        else:
            msg += "."
        return [self.finding(
            "unexplained_memory_growth", score, msg,
            evidence={
                "memory_growth_bytes": ev(d_mem, "bytes"),
                "kv_growth_bytes": ev(d_kv, "bytes"),
                "excess_bytes": ev(excess, "bytes"),
                "ratio": ev(round(ratio, 4), "ratio"),
                "tokens": ev(d_tokens, "tokens"),
            },
            requests=[req.request], steps=[int(s["step"][0]), int(s["step"][-1])],
        )]

    # ---- static preallocation -------------------------------------------------------------------

    def _static(self, ctx: ReplayContext, req: RequestTimeline) -> list[Finding]:
        g = req.kv
        last = g.last_row()
        cols = [li for li in range(g.layers.size)
                if g.present[last, li] and int(g["layer_type"][last, li]) in _STATIC]
        if not cols:
            return []
        # Valid bytes peak at the end for full layers; use each layer's largest over the request.
        valid = np.where(g.present[:, cols], g["bytes_valid"][:, cols], 0).max(axis=0)
        alloc = g["bytes_allocated"][last, cols]
        full_cols = [c for c in cols if int(g["layer_type"][last, c]) == int(schema.LayerType.STATIC)]
        total_alloc, total_valid = int(alloc.sum()), int(valid.sum())
        if total_alloc <= 0:
            return []
        waste = 1.0 - total_valid / total_alloc
        score = ramp(waste, *STATIC_WASTE)
        if waste <= 0:
            return []
        cap = int(g["k_len"][last, full_cols[0]]) if full_cols else int(g["k_len"][last, cols[0]])
        used = int(g["tokens_kept"][:, full_cols].max()) if full_cols else int(g["tokens_kept"][:, cols].max())
        layers = [int(g.layers[c]) for c in cols]
        eos = f" (stopped at EOS after step {req.eos_step})" if req.eos_step >= 0 else ""
        msg = (f"Static cache of request {req.request} preallocates {format_bytes(total_alloc)} "
               f"({cap:,} tokens per full layer) but held at most {format_bytes(total_valid)} ({used:,} tokens)"
               f"{eos}: {waste:.0%} of the allocation never held a token.")
        return [self.finding(
            "static_over_allocation", score, msg,
            evidence={
                "allocated_bytes": ev(total_alloc, "bytes"),
                "valid_bytes": ev(total_valid, "bytes"),
                "wasted_bytes": ev(total_alloc - total_valid, "bytes"),
                "waste_fraction": ev(round(waste, 4), "ratio"),
                "capacity_tokens": ev(cap, "tokens"),
                "used_tokens": ev(used, "tokens"),
            },
            requests=[req.request], layers=layers,
        )]
