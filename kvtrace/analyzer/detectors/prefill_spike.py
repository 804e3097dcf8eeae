"""prefill_spike: the allocator's peak over a request against the memory resident after each
forward (weights + KV + whatever persists). The difference is transient working memory; when it
is large and matches the S x S score matrices of eager attention over the prompt, the prompt's
prefill is the cause (flash / SDPA kernels never materialise them).
"""

from __future__ import annotations

import numpy as np

from kvtrace import geometry as geo
from kvtrace.analyzer.base import Detector, Finding, ev, register
from kvtrace.analyzer.detectors._common import itemsize
from kvtrace.analyzer.replay import ReplayContext, RequestTimeline
from kvtrace.analyzer.stats import ramp
from kvtrace.format import schema
from kvtrace.units import format_bytes

SPIKE_RAMP = (0.5, 2.0)  # transient / resident -> score
EAGER_MATCH = 0.5  # transient >= this x one layer's S x S scores: consistent with eager attention


@register
class PrefillSpike(Detector):
    name = "prefill_spike"
    needs = ("allocator", "steps")
    summary = "transient peak (prefill) above resident weights + KV; eager attention's S x S matrices"

    def run(self, ctx: ReplayContext) -> list[Finding]:
        out = [f for req in ctx.requests if (f := self._request(ctx, req)) is not None]
        return out

    def _request(self, ctx: ReplayContext, req: RequestTimeline) -> Finding | None:
        peak_row = req.reading(schema.ReadingLabel.PEAK)
        s = req.steps[req.steps["allocated_bytes"] >= 0] if req.steps.size else req.steps
        if peak_row is None or int(peak_row["allocated_bytes"]) < 0 or s.size == 0:
            return None
        peak = int(peak_row["allocated_bytes"])
        resident = int(s["allocated_bytes"].max())
        transient = peak - resident
        if transient <= 0 or resident <= 0:
            return None
        ratio = transient / resident
        score = ramp(ratio, *SPIKE_RAMP)
        prompt = req.prompt_tokens
        heads = self._heads(ctx)
        item = self._act_itemsize(req)
        batch = max(req.batch_size, 1)
        eager_one_layer = batch * heads * prompt * prompt * item if heads and item else 0
        kv_after_prefill = int(req.steps["kv_bytes_unique"][0]) if req.steps.size else 0
        phase = self._phase_of_peak(ctx, req, peak)
        if eager_one_layer and transient >= EAGER_MATCH * eager_one_layer:
            cause = (f"consistent with eager attention materialising {heads}x{prompt:,}x{prompt:,} score "
                     f"matrices ({format_bytes(eager_one_layer)} per layer); use SDPA/flash attention or "
                     f"chunked prefill")
            kind = "eager_attention_spike"
        else:
            cause = "larger than the attention score matrices would be, so it is other working memory"
            kind = "transient_spike"
        if score == 0:
            msg = (f"Request {req.request}: peak {format_bytes(peak)} is {format_bytes(transient)} above the "
                   f"{format_bytes(resident)} resident after each forward ({ratio:.0%}); no prefill spike.")
            kind = "no_spike"
        else:
            msg = (f"Request {req.request} peaked at {format_bytes(peak)}, {format_bytes(transient)} "
                   f"({ratio:.1f}x) above the {format_bytes(resident)} resident{phase} with a {prompt:,}-token "
                   f"prompt: {cause}.")
        return self.finding(
            kind, score, msg,
            evidence={
                "peak_allocated_bytes": ev(peak, "bytes"),
                "resident_bytes": ev(resident, "bytes"),
                "transient_bytes": ev(transient, "bytes"),
                "ratio": ev(round(ratio, 4), "ratio"),
                "kv_after_prefill_bytes": ev(kv_after_prefill, "bytes"),
                "eager_scores_per_layer_bytes": ev(eager_one_layer, "bytes"),
                "prompt_tokens": ev(prompt, "tokens"),
            },
            requests=[req.request], steps=[0],
            device=int(peak_row["device"]),
        )

    @staticmethod
    def _heads(ctx: ReplayContext) -> int:
        if ctx.expectation.model is not None:
            return int(ctx.expectation.model.num_attention_heads)
        try:
            return int(geo.text_config(ctx.meta.model_config).get("num_attention_heads") or 0)
        except TypeError:
            return 0

    @staticmethod
    def _act_itemsize(req: RequestTimeline) -> int:
        g = req.kv
        if g.empty:
            return 0
        codes = g["k_dtype"][g.present]
        return itemsize(int(np.median(codes))) if codes.size else 0

    @staticmethod
    def _phase_of_peak(ctx: ReplayContext, req: RequestTimeline, peak: int) -> str:
        """Where the peak was caught, when the allocator sampler saw it."""
        ev_rows = req.events
        start = ev_rows[ev_rows["kind"] == int(schema.EventKind.PREFILL_START)]
        end = ev_rows[ev_rows["kind"] == int(schema.EventKind.PREFILL_END)]
        if start.size == 0 or end.size == 0 or ctx.allocator.size == 0:
            return ""
        inside = ctx.window(ctx.allocator, int(start["t_ns"][0]), int(end["t_ns"][0]))
        if inside.size and int(inside["allocated_bytes"].max()) >= 0.9 * peak:
            return " during prefill"
        return ""
