"""The report's verdict, and the one copy-paste fix for each kind of finding.

One table, keyed by (detector, kind) with a per-detector fallback, so that the verdict panel,
the findings table and anything else that suggests a fix say the same thing. The kinds are the
ones kvtrace.analyzer.detectors emit (docs/detectors.md explains each); a kind missing here gets
the detector's fallback, or no fix rather than a guess. Informational kinds (released,
no_sharing, density, bimodal_by_design, ...) have no fix: nothing is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtrace.report.findings import SEVERITY_ORDER, FindingRow

# Severity rank of "medium" in findings.SEVERITY_ORDER (lower rank = worse): the verdict lists
# findings at this rank or worse, the bound docs/detectors.md gives for "worth acting on".
VERDICT_RANK = SEVERITY_ORDER["medium"]

_SDPA = 'AutoModelForCausalLM.from_pretrained(..., attn_implementation="sdpa")'
_EXPANDABLE = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
# Version-neutral on purpose: the cache argument and output field were renamed in transformers 5.24
# (past_key_values -> cache), and either spelling is wrong on one side of that release.
_FRESH_CACHE = "model.generate(ids)  # pass no cache object: generate builds a fresh one per request"
_DROP_OUTPUT_CACHE = "out = out.sequences; gc.collect()  # keep the tokens, not the output that holds the cache"

# (detector, kind) -> the fix; (detector, "") -> the detector's fallback.
FIXES: dict[tuple[str, str], str] = {
    # A generate output (or a hook, a list) keeps the cache alive after the request.
    ("post_eos", "retained_after_request"): _DROP_OUTPUT_CACHE,
    ("post_eos", "non_kv_growth"): "keep no per-request tensors (outputs, logits, hidden states) past the request",
    ("post_eos", ""): _DROP_OUTPUT_CACHE,
    # The cache holds copies (a custom update that concatenates) or ignores its window.
    ("growth_curve", "duplication"): "update the cache only through Cache.update() (a stock DynamicCache); "
                                     "never torch.cat into cache tensors",
    ("growth_curve", "window_not_applied"): _FRESH_CACHE,
    ("growth_curve", "superlinear_growth"): _FRESH_CACHE,
    ("growth_curve", "unexplained_memory_growth"): "generate(..., output_scores=False, output_logits=False, "
                                                   "output_hidden_states=False)  # keep nothing per step",
    ("growth_curve", "static_over_allocation"): 'generate(..., cache_implementation="static", '
                                                "max_length=prompt_len + max_new_tokens)  # size it to the request",
    ("growth_curve", ""): _FRESH_CACHE,
    # Split blocks inside segments: expandable segments map memory instead of splitting.
    ("fragmentation", ""): _EXPANDABLE,
    ("prefill_spike", "eager_attention_spike"): _SDPA,
    ("prefill_spike", ""): "generate(..., prefill_chunk_size=512)  # prefill long prompts in chunks",
    ("capacity", ""): 'generate(..., cache_implementation="quantized")  # or fewer concurrent sequences',
    ("oom", "oom_fragmentation"): _EXPANDABLE,
    ("oom", "oom_prefill"): _SDPA,
    ("oom", "oom_memory_cap"): "torch.cuda.set_per_process_memory_fraction(...)  # raise the cap that bound",
    ("oom", "oom_kv_growth"): 'generate(..., cache_implementation="quantized")  # or a lower max_new_tokens',
    ("aliasing", "unexpected_sharing"): "give every layer its own K/V tensors: never hand one tensor to two layers' "
                                        "cache",
    ("layer_anomaly", ""): "compare the outlier layer's cache class and config (num_key_value_heads, head_dim, "
                           "sliding_window) with its peers",
    ("cache_density", "density_mismatch"): "load the model in the dtype the config names "
                                           "(from_pretrained(..., dtype=\"auto\")) and check num_key_value_heads",
    ("layer_uniformity", ""): "compare the layers' cache classes: one layer type should hold one size",
}


def fix_for(detector: str, kind: str) -> str | None:
    """The copy-paste fix of a finding, or None when there is nothing to fix or no fix is known."""
    return FIXES.get((detector, kind)) or FIXES.get((detector, ""))


def is_actionable(row: FindingRow) -> bool:
    """A finding the verdict lists: severity medium or worse."""
    return SEVERITY_ORDER.get(row.severity, 5) <= VERDICT_RANK


@dataclass
class Verdict:
    healthy: bool | None  # None: no analysis, so no verdict
    headline: str
    findings: list[FindingRow]  # the actionable ones, worst first
    below: int  # findings under medium


def verdict(rows: Sequence[FindingRow] | None, ran: int, total: int, note: str) -> Verdict:
    """Healthy, or the findings at medium and above; `ran` of `total` detectors ran."""
    if rows is None:
        return Verdict(None, f"No verdict: {note}.", [], 0)
    bad = [r for r in rows if is_actionable(r)]
    below = len(rows) - len(bad)
    scope = f"{ran} of {total} detectors ran" if total else "the analyser ran"
    if total and ran < total:
        scope += f"; {total - ran} could not run, listed under Findings with why"
    if bad:
        worst = bad[0].severity
        return Verdict(False, f"Needs attention: {len(bad)} finding{'s' if len(bad) > 1 else ''} at medium "
                              f"or above (worst: {worst}); {scope}.", bad, below)
    return Verdict(True, f"Healthy: no finding at medium or above ({below} below medium; {scope}).",
                   [], below)
