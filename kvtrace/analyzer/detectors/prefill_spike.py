"""prefill_spike: the allocator's peak over a request against the memory resident after each
forward (weights + KV + whatever persists). The difference is transient working memory; when it
matches the S x S score matrices of eager attention over the prompt, the prompt's prefill is the
cause (flash / SDPA kernels never materialise them).

Severity follows the contract: a transient costs nothing once released, so it is scored on how
close it took the process to the memory it may use (the per-process cap when one binds, else the
device): an ordinary long eager prefill far from the limit is information with its cause named;
a prefill that peaks within 10% of the limit is critical (the next longer prompt is an OOM).
"""

from __future__ import annotations

from kvtrace.analyzer.base import Detector, Finding, ev, register
from kvtrace.analyzer.detectors._common import allowed_memory, eager_scores_bytes
from kvtrace.analyzer.replay import ReplayContext, RequestTimeline
from kvtrace.analyzer.stats import ramp
from kvtrace.format import schema
from kvtrace.units import format_bytes

# peak / allowed memory -> score: at half the limit a prefill spike starts to matter, at 90% the
# next longer prompt fails. Clean control: a 3,840-token eager prefill of the gpt-oss-120b geometry
# and a 4,096-token one of an 8-layer 2048-wide model peak at a few % of an 80 GiB H100.
HEADROOM_RAMP = (0.5, 0.9)
# transient / resident: below 0.25 the peak is resident memory (weights, KV), capacity's business.
SPIKE_GATE = (0.25, 0.5)
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
        limit, limit_name = allowed_memory(ctx, int(peak_row["device"]))
        near = peak / limit if limit > 0 else 0.0
        score = min(ramp(near, *HEADROOM_RAMP), ramp(ratio, *SPIKE_GATE))
        prompt = req.prompt_tokens
        eager_one_layer = eager_scores_bytes(ctx, req)
        kv_after_prefill = int(req.steps["kv_bytes_unique"][0]) if req.steps.size else 0
        phase = self._phase_of_peak(ctx, req, peak)
        if eager_one_layer and transient >= EAGER_MATCH * eager_one_layer:
            cause = (f"consistent with eager attention materialising the prompt's {prompt:,}x{prompt:,} score "
                     f"matrices ({format_bytes(eager_one_layer)} per layer); SDPA/flash attention or chunked "
                     f"prefill would not")
            kind = "eager_attention_spike"
        else:
            cause = "larger than the attention score matrices would be, so it is other working memory"
            kind = "transient_spike"
        headroom = (f"{near:.0%} of the {format_bytes(limit)} {limit_name}" if limit > 0
                    else "an unknown share of the device")
        if ratio < SPIKE_GATE[0]:
            msg = (f"Request {req.request}: peak {format_bytes(peak)} is {format_bytes(transient)} above the "
                   f"{format_bytes(resident)} resident after each forward ({ratio:.0%}); no prefill spike.")
            kind = "no_spike"
        else:
            verdict = ("a longer prompt would not fit" if score >= 0.8 else
                       "it was released again and left headroom" if score <= 0.1 else "headroom is getting thin")
            msg = (f"Request {req.request} peaked at {format_bytes(peak)} ({headroom}), {format_bytes(transient)} "
                   f"({ratio:.1f}x) above the {format_bytes(resident)} resident{phase} with a {prompt:,}-token "
                   f"prompt: {cause}; {verdict}.")
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
                "limit_bytes": ev(limit, "bytes"),
                "peak_share_of_limit": ev(round(near, 4), "ratio"),
            },
            requests=[req.request], steps=[0],
            device=int(peak_row["device"]),
        )

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

