"""prefix_cache: how much of the prompts the paged cache served from shared blocks (hits vs
lookups, in tokens, as vLLM counts prefix_cache_hits / prefix_cache_queries), and whether it
missed prefixes it should have had.

The trace holds a salted sha256 of each whole prompt, not of its prefixes, so the expected hits
are proven only for repeated prompts: a request whose prompt equals one that had already
finished when it was admitted should find that prompt's complete blocks, floor((L - 1) / page)
x page tokens (the last prompt token is always computed). On the share of those tokens missed:
0.1 at 50% (a partial hit rate is the cache working under pressure), high at 80%, critical at
95% (practically no repeat hit: sharing off, `allow_block_sharing=False`, or evicted: evictions
are counted and named). At most low when the repeats are under a tenth of the prompt tokens
looked up (they cost too little compute to matter). Otherwise the hit rate is reported as info.

A manager with a sliding-window group that never hit at all is a cache that cannot share
(transformers' sliding allocators do not support block sharing, so prefix sharing is off for
hybrid and sliding models whatever the configuration): nothing can be switched on, the missed
tokens are reported as info.
"""

from __future__ import annotations

import numpy as np

from kvtrace.analyzer.base import Finding, ev, register
from kvtrace.analyzer.detectors._common import plural
from kvtrace.analyzer.detectors._serving import FULL, ServingDetector, admitted, alert, groups
from kvtrace.analyzer.replay import ReplayContext
from kvtrace.format import schema

MISSED_ALERT = ((0.5, 0.8, 0.95), (0.1, 0.5, 0.8))
SLIDING = int(schema.LayerType.SLIDING)
MIN_REPEAT_SHARE = 0.1  # repeats below a tenth of the lookups cost too little to be more than low


@register
class PrefixCache(ServingDetector):
    name = "prefix_cache"
    summary = "prefix-cache hits vs lookups (tokens); repeated prompts that found no cached blocks"

    def run(self, ctx: ReplayContext) -> list[Finding]:
        cb = admitted(ctx)
        if not cb.size:
            return []
        sched = ctx.trace.sched[:]
        # Looked up = prefilled + served from cache, per scheduled step (a prompt recomputed after a
        # soft reset is looked up again), as the live kvtrace_serving_prefix_cache_* counters count.
        hits = int(sched["prefix_hit_tokens"].clip(min=0).sum())
        lookups = int(sched["prefill_tokens"].sum()) + hits
        sha = {int(r["request"]): bytes(r["prompt_sha256"]) for r in ctx.trace.requests[:]}
        evicted = int(sched["evicted_blocks"].clip(min=0).sum())
        expected = missed = repeats = 0
        repeat_ids: list[int] = []
        # Per (manager, prompt): when the first request with that prompt finished. A request admitted
        # after it repeats a finished prompt (its own end is after its admission, so it never counts).
        first_end: dict[tuple[int, bytes], int] = {}
        for r in cb:
            key = (int(r["manager"]), sha.get(int(r["request"]), b""))
            if int(r["end_ns"]) > 0:
                first_end[key] = min(first_end.get(key, int(r["end_ns"])), int(r["end_ns"]))
        pages = {m: _page(ctx, m) for m in {int(x) for x in cb["manager"]}}
        for r in cb:
            page = pages[int(r["manager"])]
            done = first_end.get((int(r["manager"]), sha.get(int(r["request"]), b"")))
            if page <= 0 or done is None or done >= int(r["admitted_ns"]):
                continue
            want = (max(int(r["prompt_tokens"]) - 1, 0) // page) * page
            if want <= 0:
                continue
            repeats += 1
            repeat_ids.append(int(r["request"]))
            expected += want
            missed += max(want - int(r["prefix_hit_tokens"]), 0)
        rate = hits / lookups if lookups else 0.0
        cannot_share = not hits and any(_sliding(ctx, m) for m in pages)
        evidence = {
            "lookup_tokens": ev(lookups, "tokens"),
            "hit_tokens": ev(hits, "tokens"),
            "hit_rate": ev(round(rate, 4), "ratio"),
            "repeated_prompts": ev(repeats, "count"),
            "expected_hit_tokens": ev(expected, "tokens"),
            "missed_hit_tokens": ev(missed, "tokens"),
            "evicted_blocks": ev(evicted, "count"),
        }
        if not expected:
            return [self.finding(
                "hit_rate", 0.0,
                f"Prefix cache: {hits:,} of {lookups:,} prompt tokens looked up ({rate:.0%}) served from cached blocks "
                f"over {cb.size:,} admissions; no prompt repeated one that had finished, so no hit is proven missing.",
                evidence=evidence)]
        share = missed / expected
        score = alert(share, *MISSED_ALERT)
        if expected / lookups < MIN_REPEAT_SHARE:
            score = min(score, 0.29)
        if cannot_share:
            score = min(score, 0.1)
        why = ("the cache has a sliding-window group, and transformers' sliding allocators cannot share blocks: "
               "prefix sharing is off for this model whatever the configuration (info)" if cannot_share
               else f"{evicted:,} cached blocks were evicted to make room" if evicted
               else "no cached block was evicted, so sharing is off (allow_block_sharing=False) or unsupported"
               if not hits else "")
        msg = (f"Prefix cache: {plural(repeats, 'request')} repeated a prompt that had already finished, yet found "
               f"{expected - missed:,} of the {expected:,} tokens its complete blocks held ({1 - share:.0%}); overall "
               f"{hits:,} of {lookups:,} prompt tokens looked up ({rate:.0%}) hit" + (f"; {why}." if why else "."))
        return [self.finding("missed_prefix_hits", score, msg, evidence=evidence, requests=repeat_ids)]


def _sliding(ctx: ReplayContext, manager: int) -> bool:
    """Whether the manager's cache has a sliding-window group."""
    return bool(np.any(groups(ctx, manager)["layer_type"] == SLIDING))


def _page(ctx: ReplayContext, manager: int) -> int:
    """Tokens per block of the manager's full-attention group (0 when it has none)."""
    g = groups(ctx, manager)
    g = g[g["layer_type"] == FULL]
    return int(g["tokens_per_block"][0]) if g.size else 0
