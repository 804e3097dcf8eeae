"""block_waste: pool bytes held in the unfilled tails of blocks (allocated page tokens minus the
tokens whose KV they hold), and what other page sizes would have wasted on the same requests.

Per scheduler step the waste is the sum over /blocks rows of (blocks x tokens_per_block -
tokens_valid) x bytes per token. Prefix-shared blocks are complete blocks, so they add no tail;
a request's tail lives in its own last block. The score is the waste's share of the pool, held
over two steps at least: high at 20%, critical at 40%, or critical from 2 GiB on (the issue's
fragmentation alert) when that is 5% of the pool or more. Waste only costs something when the
pool needs the room: while the pool stayed under half full the finding is info, under 80%
at most medium.
"""

from __future__ import annotations

import numpy as np

from kvtrace.analyzer.base import Finding, ev, register
from kvtrace.analyzer.detectors._serving import (
    ServingDetector,
    alert,
    block_rows,
    block_usage,
    held,
    known_pool,
)
from kvtrace.analyzer.replay import ReplayContext
from kvtrace.units import format_bytes

PAGE_SIZES = (16, 32, 64, 128, 256)
SHARE_ALERT = ((0.1, 0.2, 0.4), (0.1, 0.5, 0.8))
ABSOLUTE_CRITICAL = 2 << 30  # 2 GiB
ABSOLUTE_MIN_SHARE = 0.05


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
        waste = tail_bytes(b["blocks"].astype(np.int64), tokens, tpb, bpt)
        steps = rows["step"].astype(np.int64)
        idx = np.searchsorted(steps, b["step"].astype(np.int64))
        idx = np.clip(idx, 0, steps.size - 1)
        keep = steps[idx] == b["step"]
        per_step = np.bincount(idx[keep], weights=waste[keep], minlength=steps.size)
        pool = rows["pool_bytes"].astype(np.float64)
        share = per_step / pool
        level = held(share)
        i = int(np.argmax(per_step))
        peak_usage = float(block_usage(rows).max())
        score = alert(level, *SHARE_ALERT)
        if per_step[i] >= ABSOLUTE_CRITICAL and level >= ABSOLUTE_MIN_SHARE:
            score = max(score, 0.8)
        if peak_usage < 0.5:
            score = min(score, 0.1)
        elif peak_usage < 0.8:
            score = min(score, 0.45)
        # The same requests at other page sizes, at the step that wasted the most.
        at = keep & (idx == i)
        alternatives = {}
        for page in sorted({*PAGE_SIZES, *(int(x) for x in np.unique(tpb[at]))}):
            blocks = -(-tokens[at] // page)
            alternatives[page] = float(tail_bytes(blocks, tokens[at], page, bpt[at]).sum())
        current = sorted({int(x) for x in np.unique(tpb[at])})
        best = min(alternatives, key=lambda p: (alternatives[p], -p))
        table = ", ".join(f"{p}: {format_bytes(alternatives[p])}" for p in alternatives)
        msg = (f"Manager {manager}: at step {int(steps[i])}, {format_bytes(per_step[i])} of the "
               f"{format_bytes(pool[i])} pool ({share[i]:.0%}) sat in unfilled tails of "
               f"{'/'.join(map(str, current))}-token blocks ({share[i] / max(peak_usage, 1e-9):.0%} of the pool's "
               f"peak use of {peak_usage:.0%}); the same requests would waste, by page size, {table}"
               + (f" (smallest at {best} tokens per block)." if best not in current else "."))
        evidence = {
            "waste_bytes": ev(int(per_step[i]), "bytes"),
            "waste_share_of_pool": ev(round(float(share[i]), 4), "ratio"),
            "held_waste_share": ev(round(level, 4), "ratio"),
            "peak_block_usage": ev(round(peak_usage, 4), "ratio"),
            "pool_bytes": ev(int(pool[i]), "bytes"),
            "tokens_per_block": ev(current[0] if len(current) == 1 else None, "tokens"),
        }
        for page, nbytes in alternatives.items():
            evidence[f"waste_bytes_page_{page}"] = ev(int(nbytes), "bytes")
        return self.finding("block_tail_waste", score, msg, evidence=evidence, steps=[int(steps[i])],
                            requests=sorted({int(r) for r in b["request"][at]}))
