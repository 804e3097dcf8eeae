"""growth_curve: KV bytes against tokens, per layer type, against the config's expectation.

Flags (1) duplication: a layer holding more than the analytical expectation (linear for full
layers, saturating at the window for sliding ones, latent size for MLA), including a sliding layer
that does not slide; (2) superlinear growth of a layer's bytes per token; (3) device memory that
grows faster than the cache itself (copies the cache structure does not show); (4) static
over-allocation. There is no "plateau guard": a plain linear ramp is measured like anything else.

Who owns the growth decides what (3) is called, when the trace has owner readings at the growth's
peak (/owners growth_peak, format 1.5): blocks or tensors sized like the cache's K/V are copies of the
cache (`duplication`, with the curve signature when it also fits); the generate output the call asked
for (output_scores/output_logits rows, hidden states, attentions) is growth by design
(`requested_outputs`, information); anything else is `unexplained_memory_growth` named by its owner
class and largest blocks, never duplication. Without owner readings the by-design outputs recorded in
the call's arguments are subtracted first, then the curve signatures decide as before.
"""

from __future__ import annotations

import numpy as np

from kvtrace.analyzer import owners as own
from kvtrace.analyzer.base import Detector, Finding, ev, register
from kvtrace.analyzer.detectors._common import (
    CROSS,
    dynamic_kept_tokens,
    expected_grid,
    layer_kind,
    layers_phrase,
    verb,
)
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
# RSS growth that fits no duplication signature is information only (it cannot tell live tensors
# from freed-but-kept heap): 3 of 9 clean CPU traces once scored low/medium on RSS alone.
RSS_MAX_SCORE = 0.1
# Duplication signatures (evidence "signature"): 2 = the excess over the cache grows as the sum of
# earlier cache sizes, 1 = as a multiple of the cache's growth.
SIG_MULTIPLE_OF_GROWTH, SIG_SUM_OF_EARLIER = 1, 2
# Plausible fitted multiples: kept copies of K and V come in whole numbers of caches (1 = each
# earlier version kept once). Outside these, the growth is not KV copies (e.g. a user's buffers
# growing 5,000x the cache in the GPU fragmentation fixture).
MULTIPLE_RANGE = {SIG_SUM_OF_EARLIER: (0.3, 8.0), SIG_MULTIPLE_OF_GROWTH: (0.5, 8.0)}
# The fit must explain the excess: r^2 over the decode samples. RSS moves in pages and arenas, so
# it needs more samples and a tighter fit than the exact allocator bytes.
ALLOC_MIN_R2, RSS_MIN_R2 = 0.9, 0.95
MIN_FIT_SAMPLES = 6
# Allocator excess floor: one 512 B block of rounding per cached tensor, and at least 1 MiB.
ALLOC_SLACK_PER_LAYER = 2 * 512
ALLOC_EXCESS_MIN = 1 << 20
# Score of a fitted signature: its excess over the peak KV (0.1x -> 1x: copies as large as the
# cache itself double its cost: critical, and they grow without bound with the tokens).
SIGNATURE_EXCESS = (0.1, 1.0)
# Growth the call asked for (generate's output_* flags): named, at most information.
REQUESTED_MAX_SCORE = 0.1
# An owner class explains the growth when it holds at least this share of the non-KV bytes at its peak.
OWNER_SHARE = 0.5
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
            expected_kept = dynamic_kept_tokens(geom, seen)
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
        """Memory grown over decode against the cache's own growth. Copies that the cache structure
        does not show (old tensors kept alive in a list, a layer subclass that keeps each torch.cat
        input) appear only here; they have a signature: the excess over the cache grows as the sum
        of the earlier cache sizes (each step keeps the previous cache: quadratic in tokens) or as a
        multiple of the cache's growth (each step keeps extra copies of its new tokens). A fitted
        signature is named `duplication` with the fitted multiple; growth that fits neither is
        `unexplained_memory_growth`. The allocator's allocated bytes when the trace has them (exact,
        per step), else process RSS samples (which also move with the C allocator's free lists)."""
        series = memory_series(ctx, req)
        if series is None:
            return []
        x, mem, column = series
        kv_at, _ = _kv_interpolators(req)
        if kv_at is None:
            return []
        kv = kv_at(x)
        d_mem = float(mem[-1] - mem[0])
        d_kv = float(kv[-1] - kv[0])
        if d_mem <= 0 or x[-1] - x[0] < MIN_DECODE_STEPS:
            return []
        excess = (mem - mem[0]) - (kv - kv[0])
        cum = _cumulative_kv(kv_at, x)  # bytes of every earlier cache version since the first sample
        rss = column == "rss_bytes"
        floor = RSS_EXCESS[1] if rss else max(ALLOC_EXCESS_MIN, ALLOC_SLACK_PER_LAYER * max(1, req.kv.layers.size))
        wobble = RSS_EXCESS[0] if rss else floor  # how far a persistent excess may dip between samples
        by_owner = self._by_owner(ctx, req, x, excess, cum, kv, d_mem, d_kv, column, floor)
        if by_owner is not None:
            return by_owner
        design, phrases = own.by_design_bytes(ctx, req)
        if design > 0 and float(excess[-1]) > floor and design >= OWNER_SHARE * float(excess[-1]):
            return [self._requested(req, d_mem, d_kv, float(excess[-1]), design, phrases, x, column, None)]
        fits = []
        for sig, basis in ((SIG_SUM_OF_EARLIER, cum), (SIG_MULTIPLE_OF_GROWTH, kv - kv[0])):
            m, r2 = _fit_through_origin(basis, excess)
            fits.append((r2, sig, m))
        r2, sig, m = max(fits)
        lo, hi = MULTIPLE_RANGE[sig]
        final_excess = float(excess[-1])
        span = int(round(x[-1] - x[0]))
        peak_kv = max(float(kv.max()), 1.0)
        source = "Process RSS" if rss else "Allocated memory"
        min_r2 = RSS_MIN_R2 if rss else ALLOC_MIN_R2
        if (x.size >= MIN_FIT_SAMPLES and r2 >= min_r2 and lo <= m <= hi and final_excess > floor
                and _monotone(excess, wobble)):
            score = ramp(final_excess / peak_kv, *SIGNATURE_EXCESS)
            what = ("the sum of earlier cache sizes (each step keeps the previous cache: quadratic in tokens)"
                    if sig == SIG_SUM_OF_EARLIER else "a multiple of the cache's own growth (extra copies of each new token)")
            msg = (f"{source} grew {format_bytes(d_mem)} over {span:,} decode steps of request {req.request} while "
                   f"the KV cache grew {format_bytes(max(d_kv, 0))}: the excess {format_bytes(final_excess)} grows as "
                   f"{m:.2f}x {what} (r^2 {r2:.3f} over {x.size} samples), so copies of the cache are kept alive "
                   f"outside the cache's own storages.")
            return [self.finding(
                "duplication", score, msg,
                evidence={
                    "signature": ev(sig, "count"),
                    "fitted_multiple": ev(round(m, 4), "ratio"),
                    "fit_r2": ev(round(r2, 4), "ratio"),
                    "memory_growth_bytes": ev(int(d_mem), "bytes"),
                    "kv_growth_bytes": ev(int(d_kv), "bytes"),
                    "excess_bytes": ev(int(final_excess), "bytes"),
                    "peak_kv_bytes": ev(int(peak_kv), "bytes"),
                    "samples": ev(int(x.size), "count"),
                },
                requests=[req.request], steps=[int(round(x[0])), int(round(x[-1]))],
            )]
        ratio = d_mem / max(d_kv, 1.0)
        if rss:
            # RSS cannot tell live tensors from freed memory the C allocator keeps: without a fitted
            # signature this is information, with what would decide it.
            score = min(ramp(ratio, *DEVICE_GROWTH_RATIO), ramp(final_excess, *RSS_EXCESS), RSS_MAX_SCORE)
            if score == 0:
                return []
            tail = ("; RSS also counts memory the C allocator keeps after frees, and this growth fits no duplication "
                    "signature, so it is not evidence of a leak: the allocator bytes of a GPU trace, or a longer "
                    "decode whose excess keeps growing with the tokens, would decide it.")
        else:
            score = min(ramp(ratio, *DEVICE_GROWTH_RATIO), ramp(final_excess, floor, 2 * floor))
            if score == 0:
                return []
            tail = ("; it fits neither duplication signature (sum of earlier cache sizes, multiple of the cache "
                    f"growth; best r^2 {r2:.2f} at {m:.2g}x), so it is other memory growing during decode.")
        msg = (f"{source} grew {format_bytes(d_mem)} over {span:,} decode steps of request {req.request} while the KV "
               f"cache grew {format_bytes(max(d_kv, 0))} ({ratio:.1f}x){tail}")
        return [self.finding(
            "unexplained_memory_growth", score, msg,
            evidence={
                "memory_growth_bytes": ev(int(d_mem), "bytes"),
                "kv_growth_bytes": ev(int(d_kv), "bytes"),
                "excess_bytes": ev(int(final_excess), "bytes"),
                "ratio": ev(round(ratio, 4), "ratio"),
                "best_fit_r2": ev(round(r2, 4), "ratio"),
                "samples": ev(int(x.size), "count"),
            },
            requests=[req.request], steps=[int(round(x[0])), int(round(x[-1]))],
        )]

    def _by_owner(self, ctx: ReplayContext, req: RequestTimeline, x: np.ndarray, excess: np.ndarray,
                  cum: np.ndarray, kv: np.ndarray, d_mem: float, d_kv: float, column: str,
                  floor: float) -> list[Finding] | None:
        """The growth named by the owner reading at its peak (None without one: the curve decides)."""
        peaks = own.of_request(ctx, req.request, schema.OwnerMoment.GROWTH_PEAK)
        if not peaks:
            return None
        t_last = max(r.t_ns for r in peaks)
        rd = own.merged([r for r in peaks if r.t_ns == t_last])
        assert rd is not None
        OW = schema.Owner  # noqa: N806
        copies, outputs, unknown = rd.bytes(OW.KV_COPIES), rd.bytes(OW.GENERATE_OUTPUT), rd.bytes(OW.UNKNOWN)
        other = copies + outputs + unknown
        final_excess = float(excess[-1])
        if other <= floor or final_excess <= floor:
            return None if final_excess > floor else []
        peak_kv = max(float(kv.max()), 1.0)
        span = int(round(x[-1] - x[0]))
        source = "Process RSS" if column == "rss_bytes" else "Allocated memory"
        at_step = f"step {rd.step}" if rd.step >= 0 else "its peak"
        evidence = {
            "memory_growth_bytes": ev(int(d_mem), "bytes"),
            "kv_growth_bytes": ev(int(d_kv), "bytes"),
            "excess_bytes": ev(int(final_excess), "bytes"),
            "kv_copies_bytes": ev(copies, "bytes"),
            "generate_output_bytes": ev(outputs, "bytes"),
            "unknown_bytes": ev(unknown, "bytes"),
            "peak_kv_bytes": ev(int(peak_kv), "bytes"),
            "owner_reading_step": ev(rd.step, "step"),
        }
        head = (f"{source} grew {format_bytes(d_mem)} over {span:,} decode steps of request {req.request} while the "
                f"KV cache grew {format_bytes(max(d_kv, 0))}")
        if copies >= OWNER_SHARE * other:
            c = rd.classes[OW.KV_COPIES]
            sites = rd.largest_sites(OW.KV_COPIES)
            fit = ""
            for sig, basis in ((SIG_SUM_OF_EARLIER, cum), (SIG_MULTIPLE_OF_GROWTH, kv - kv[0])):
                m, r2 = _fit_through_origin(basis, excess)
                lo, hi = MULTIPLE_RANGE[sig]
                if r2 >= (RSS_MIN_R2 if column == "rss_bytes" else ALLOC_MIN_R2) and lo <= m <= hi:
                    evidence.update(signature=ev(sig, "count"), fitted_multiple=ev(round(m, 4), "ratio"),
                                    fit_r2=ev(round(r2, 4), "ratio"))
                    fit = (f"; the excess grows as {m:.2f}x "
                           + ("the sum of earlier cache sizes (each step keeps the previous cache)"
                              if sig == SIG_SUM_OF_EARLIER else "a multiple of the cache's own growth")
                           + f" (r^2 {r2:.3f})")
                    break
            at = f", allocated at {'; '.join(sites)}" if sites else ""
            msg = (f"{head}: at {at_step} the owner reading finds {format_bytes(copies)} in {c.blocks:,} "
                   f"{'blocks' if rd.device >= 0 else 'tensors'} sized like the cache's own K/V tensors but not "
                   f"the cache's ({copies / peak_kv:.1f}x its peak KV){at}{fit}, so copies of the cache are kept "
                   "alive outside its own storages.")
            return [self.finding("duplication", ramp(copies / peak_kv, *SIGNATURE_EXCESS), msg, evidence=evidence,
                                 requests=[req.request], steps=[int(round(x[0])), int(round(x[-1]))])]
        asked = own.asked_outputs(ctx, req.request)
        if outputs >= OWNER_SHARE * other and asked:
            _, phrases = own.by_design_bytes(ctx, req)
            return [self._requested(req, d_mem, d_kv, final_excess, outputs, phrases, x, column, rd)]
        ratio = d_mem / max(d_kv, 1.0)
        score = min(ramp(ratio, *DEVICE_GROWTH_RATIO), ramp(float(unknown), floor, 2 * floor))
        sites = rd.largest_sites(OW.UNKNOWN)
        at = (f"; largest: {'; '.join(sites)}" if sites else
              "; record with memory_history=True (--memory-history) to name their allocation sites"
              if rd.device >= 0 else "")
        if sites and rd.device >= 0 and not any(" at " in x for x in sites):
            at += "; record with memory_history=True (--memory-history) to name their allocation sites"
        msg = (f"{head} ({ratio:.1f}x): at {at_step} the owner reading finds {own.describe(rd)}; the growth is held "
               f"by owners no rule names ({format_bytes(unknown)} unknown, not shaped like the cache's K/V, "
               f"so not copies of the cache){at}.")
        evidence["ratio"] = ev(round(ratio, 4), "ratio")
        return [self.finding("unexplained_memory_growth", score, msg, evidence=evidence, requests=[req.request],
                             steps=[int(round(x[0])), int(round(x[-1]))])]

    def _requested(self, req: RequestTimeline, d_mem: float, d_kv: float, final_excess: float, design: int,
                   phrases: list[str], x: np.ndarray, column: str, rd: own.Reading | None) -> Finding:
        """Growth the call asked for: generate's output_* tensors, per step, kept until it returns."""
        source = "Process RSS" if column == "rss_bytes" else "Allocated memory"
        span = int(round(x[-1] - x[0]))
        what = "; ".join(phrases) or "the per-step output tensors the call asked for"
        seen = f" (the owner reading at step {rd.step} finds {format_bytes(design)} of them)" if rd is not None else ""
        msg = (f"{source} grew {format_bytes(d_mem)} over {span:,} decode steps of request {req.request} while the "
               f"KV cache grew {format_bytes(max(d_kv, 0))}: by design, the generate outputs the call asked for "
               f"({what}){seen}; ask for fewer (output_scores=False, output_logits=False) if they are not needed.")
        score = min(REQUESTED_MAX_SCORE, ramp(final_excess, 1 << 30, 16 << 30))
        return self.finding("requested_outputs", score, msg, evidence={
            "memory_growth_bytes": ev(int(d_mem), "bytes"),
            "kv_growth_bytes": ev(int(d_kv), "bytes"),
            "excess_bytes": ev(int(final_excess), "bytes"),
            "requested_output_bytes": ev(int(design), "bytes"),
        }, requests=[req.request], steps=[int(round(x[0])), int(round(x[-1]))])

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


# ---- series helpers ---------------------------------------------------------------------------------

def _kv_interpolators(req: RequestTimeline):  # noqa: ANN202 - two small closures
    """(kv bytes at fractional step, tokens at fractional step) from the request's /steps rows."""
    s = req.steps
    if s.size < 2:
        return None, None
    steps = s["step"].astype(np.float64)
    kv = s["kv_bytes_unique"].astype(np.float64)
    tok = s["tokens_seen"].astype(np.float64)
    return (lambda x: np.interp(x, steps, kv)), (lambda x: np.interp(x, steps, tok))


def _cumulative_kv(kv_at, x: np.ndarray) -> np.ndarray:  # noqa: ANN001
    """Sum over whole steps from x[0] to each x of the cache size one step earlier: the bytes of
    every earlier cache version a step-by-step torch.cat would leave behind."""
    s0 = int(np.floor(x[0]))
    grid = np.arange(s0, int(np.ceil(x[-1])) + 2, dtype=np.float64)
    per_step = kv_at(grid - 1)
    cum = np.concatenate([[0.0], np.cumsum(per_step[1:])])
    return np.interp(x, grid, cum) - np.interp(x[0], grid, cum)


def _fit_through_origin(basis: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(m, r^2) of y = m * basis; r^2 against y's own mean (0 when y does not vary)."""
    den = float(np.dot(basis, basis))
    if den <= 0:
        return 0.0, 0.0
    m = float(np.dot(basis, y)) / den
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    if ss_tot <= 0:
        return m, 0.0
    return m, 1.0 - float(np.sum((y - m * basis) ** 2)) / ss_tot


def _monotone(y: np.ndarray, tol: float) -> bool:
    """Persistent: the series never falls more than `tol` below its running maximum."""
    return bool(np.all(np.maximum.accumulate(y) - y <= tol))


def memory_series(ctx: ReplayContext, req: RequestTimeline) -> tuple[np.ndarray, np.ndarray, str] | None:
    """(fractional decode step, memory bytes, column) over the request's decode: the step-synchronous
    allocator readings plus the allocator telemetry when the trace has them, else the process RSS
    samples. Sample times map to steps through the decode_step events (every step has one)."""
    ev_rows = req.events
    dec = ev_rows[ev_rows["kind"] == int(schema.EventKind.DECODE_STEP)] if ev_rows.size else ev_rows
    s = req.steps
    if dec.size < MIN_DECODE_STEPS or s.size < 2:
        return None
    t_ev = dec["t_ns"].astype(np.float64)
    st_ev = dec["value"].astype(np.float64)
    order = np.argsort(t_ev, kind="stable")
    t_ev, st_ev = t_ev[order], st_ev[order]
    t0, t1 = t_ev[0], t_ev[-1]
    alloc_steps = s[(s["allocated_bytes"] >= 0) & (s["step"] >= 1)]
    if alloc_steps.size >= 2 or ctx.allocator.size:
        xs = [alloc_steps["step"].astype(np.float64)]
        ys = [alloc_steps["allocated_bytes"].astype(np.float64)]
        a = ctx.window(ctx.allocator, int(t0), int(t1))
        devices = {int(d) for d in a["device"]} if a.size else set()
        # Step-synchronous readings are exact; telemetry samples may land mid-forward (activations),
        # so they only fill in when the steps are too few. Several devices: the per-step sums only.
        if alloc_steps.size < MIN_FIT_SAMPLES and a.size and len(devices) == 1:
            a = a[a["allocated_bytes"] >= 0]
            xs.append(np.interp(a["t_ns"].astype(np.float64), t_ev, st_ev))
            ys.append(a["allocated_bytes"].astype(np.float64))
        column = "allocated_bytes"
    else:
        p = ctx.window(ctx.process, int(t0), int(t1))
        p = p[p["rss_bytes"] >= 0] if p.size else p
        xs = [np.interp(p["t_ns"].astype(np.float64), t_ev, st_ev)] if p.size else []
        ys = [p["rss_bytes"].astype(np.float64)] if p.size else []
        column = "rss_bytes"
    if not xs:
        return None
    x, y = np.concatenate(xs), np.concatenate(ys)
    if x.size < 2:
        return None
    order = np.argsort(x, kind="stable")
    return x[order], y[order], column
