"""block_waste: pool bytes held in the unfilled tails of blocks (allocated page tokens minus the
tokens whose KV they hold), and what other page sizes would have wasted on the same requests.

Per scheduler step the waste is the sum over /blocks rows of (blocks x tokens_per_block -
tokens_valid) x bytes per token. Prefix-shared blocks are complete blocks, so they add no tail;
a request's tail lives in its own last block. Some tail is the price of paging: the score is on the
avoidable part, the waste above what the best page size of 16..256 tokens (16 is vLLM's default
and about the smallest page kernels run well on) would have left on the same requests over the
run. Its share of the pool, held over two steps at least: 0.1 at 10% (noise of a few short
requests), high at 20% (a fifth of the pool is capacity lost to configuration), critical at 40%,
or critical from 2 GiB on (the issue's fragmentation alert) when that is 5% of the pool or more
(under a twentieth of a very large pool, 2 GiB is rounding, not capacity lost).
Waste only costs something when the pool needs the room: while the pool stayed under 70% (the
knee where serving_capacity starts to score) the finding is info, under 80% (the capacity warning)
at most medium.
"""

from __future__ import annotations

import numpy as np

from kvtrace.analyzer.base import Finding, ev, register
from kvtrace.analyzer.detectors._serving import (
    ServingDetector,
    alert,
    block_rows,
    held,
    in_use,
    known_pool,
)
from kvtrace.analyzer.replay import ReplayContext
from kvtrace.units import format_bytes

PAGE_SIZES = (16, 32, 64, 128, 256)
SHARE_ALERT = ((0.1, 0.2, 0.4), (0.1, 0.5, 0.8))
ABSOLUTE_CRITICAL = 2 << 30  # 2 GiB
ABSOLUTE_MIN_SHARE = 0.05
QUIET_BELOW = 0.7  # serving_capacity's info knee: a pool that never reached it had no use for the room


def tail_bytes(blocks: np.ndarray, tokens: np.ndarray, page: np.ndarray | int, bpt: np.ndarray) -> np.ndarray:
    """Bytes of the unfilled block tails of each row."""
    return np.maximum(blocks * page - tokens, 0) * bpt


@register
class BlockWaste(ServingDetector):
    name = "block_waste"
    summary = "pool bytes in unfilled block tails, and what other page sizes (16..256) would waste"

    def per_manager(self, ctx: ReplayContext, manager: int, rows: np.ndarray) -> Finding | None:
        rows = known_pool(rows)
        b, tpb, bpt = block_rows(ctx, manager)
        ok = tpb > 0
        b, tpb, bpt = b[ok], tpb[ok], bpt[ok]
        if not rows.size or not b.size:
            return None
        tokens = b["tokens_valid"].astype(np.int64)
        steps = rows["step"].astype(np.int64)
        idx = np.clip(np.searchsorted(steps, b["step"].astype(np.int64)), 0, steps.size - 1)
        keep = steps[idx] == b["step"]

        def per_step(nbytes: np.ndarray) -> np.ndarray:
            return np.bincount(idx[keep], weights=nbytes[keep], minlength=steps.size)

        waste = per_step(tail_bytes(b["blocks"].astype(np.int64), tokens, tpb, bpt))
        # The same requests at each page size, step by step: the page that wastes least over the run
        # is what the configuration could have had; only the waste above it is avoidable.
        pages = sorted({*PAGE_SIZES, *(int(x) for x in np.unique(tpb))})
        at_page = {p: per_step(tail_bytes(-(-tokens // p), tokens, p, bpt)) for p in pages}
        best_run = min(pages, key=lambda p: (float(at_page[p].sum()), -p))
        avoidable = np.maximum(waste - at_page[best_run], 0)
        pool = rows["pool_bytes"].astype(np.float64)
        share = waste / pool
        level = held(avoidable / pool)
        i = int(np.argmax(waste))
        peak_usage = float(in_use(ctx, manager, rows).max())
        score = alert(level, *SHARE_ALERT)
        if held(avoidable) >= ABSOLUTE_CRITICAL and level >= ABSOLUTE_MIN_SHARE:
            score = max(score, 0.8)
        if peak_usage < QUIET_BELOW:
            score = min(score, 0.1)
        elif peak_usage < 0.8:
            score = min(score, 0.45)
        # The same requests at other page sizes, at the step that wasted the most.
        at = keep & (idx == i)
        alternatives = {p: float(v[i]) for p, v in at_page.items()}
        current = sorted({int(x) for x in np.unique(tpb[at])})
        best = min(alternatives, key=lambda p: (alternatives[p], p not in current, -p))  # ties: keep the page
        table = ", ".join(f"{p}: {format_bytes(alternatives[p])}" for p in alternatives)
        msg = (f"Manager {manager}: at step {int(steps[i])}, {format_bytes(waste[i])} of the "
               f"{format_bytes(pool[i])} pool ({share[i]:.0%}) sat in unfilled tails of "
               f"{'/'.join(map(str, current))}-token blocks ({share[i] / max(peak_usage, 1e-9):.0%} of the pool's "
               f"peak use of {peak_usage:.0%}); the same requests would waste, by page size, {table}"
               + (f" (smallest at {best} tokens per block; {format_bytes(avoidable[i])} avoidable)." if best not in current
                  else ": no page size would waste less, so none of it is avoidable."))
        evidence = {
            "waste_bytes": ev(int(waste[i]), "bytes"),
            "waste_share_of_pool": ev(round(float(share[i]), 4), "ratio"),
            "avoidable_waste_bytes": ev(int(avoidable[i]), "bytes"),
            "held_avoidable_share": ev(round(level, 4), "ratio"),
            "peak_block_usage": ev(round(peak_usage, 4), "ratio"),
            "pool_bytes": ev(int(pool[i]), "bytes"),
            "tokens_per_block": ev(current[0] if len(current) == 1 else None, "tokens"),
        }
        for page, nbytes in alternatives.items():
            evidence[f"waste_bytes_page_{page}"] = ev(int(nbytes), "bytes")
        return self.finding("block_tail_waste", score, msg, evidence=evidence, steps=[int(steps[i])],
                            requests=sorted({int(r) for r in b["request"][at]}))
