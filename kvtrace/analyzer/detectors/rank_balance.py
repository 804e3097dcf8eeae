"""rank_balance: a tensor-parallel run's rank traces against each other and against the model.

Runs over a set of rank traces (analyzer/ranks.py), not one trace, so it is not in the per-trace
registry: ``kvtrace analyze run.rank*.kvt.h5`` runs it once per run. What it finds, each naming
the rank(s) concerned:

* ``missing_ranks`` / ``inconsistent_ranks``: the set is not whole (a rank file not given, two
  files for one rank, ranks disagreeing on the world size): per-rank sums cannot be checked.
* ``kv_heads_mismatch``: a rank's recorded KV heads per layer differ from its share of the model's
  (ceil(heads / tp), one when there are fewer heads than ranks), or the ranks' heads do not add up.
* ``kv_bytes_mismatch``: a request's KV bytes summed over the ranks differ from the model's.
* ``kv_imbalance``: one request's KV bytes differ between ranks (a clean split holds equal shards).
* ``rank_retention``: KV storages of some ranks outlived their requests while others' did not.
* ``rank_outcome``: a request ended differently on different ranks (one rank's OOM or error).
* ``memory_imbalance``: the ranks' peak allocator bytes differ (GPU traces with allocator telemetry).
* ``balanced``: information, when none of the above.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtrace.analyzer.base import Finding, ev
from kvtrace.analyzer.ranks import RankSet, missing_message
from kvtrace.analyzer.stats import ramp
from kvtrace.units import format_bytes

NAME = "rank_balance"
# Spread between ranks = (max - min) / max. TP splits heads evenly: equal shards are the rule, so
# 5% is already suspicious and a 50% spread is one rank holding twice another's.
KV_SPREAD = (0.05, 0.5)
# Peak allocator bytes also hold weights and activations, which differ a little between ranks
# (rank 0 often holds the gathered logits): 10% -> 50%.
MEMORY_SPREAD = (0.10, 0.5)
# Retained KV on a rank / its peak KV: the post_eos ramp (2% noise, half the cache critical).
RETENTION = (0.02, 0.5)


@dataclass
class RankFinding(Finding):
    """A finding about a set of rank traces; ``ranks`` names the ranks it concerns."""

    ranks: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.ranks = sorted({int(r) for r in self.ranks})

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "ranks": self.ranks}


def _f(kind: str, score: float, message: str, ranks: list[int], **kw: Any) -> RankFinding:
    return RankFinding(NAME, kind, score, message, ranks=ranks, **kw)


def _spread(values: dict[int, int]) -> float:
    hi, lo = max(values.values()), min(values.values())
    return (hi - lo) / hi if hi > 0 else 0.0


class RankBalance:
    name = NAME
    summary = "tensor-parallel ranks against each other and the model: heads, KV bytes, retention, OOM"

    def run_set(self, rs: RankSet) -> list[RankFinding]:
        out: list[RankFinding] = []
        missing = missing_message(rs)
        if missing:
            out.append(_f("missing_ranks", 1.0, missing[0].upper() + missing[1:] + ".", rs.missing,
                          evidence={"world_size": ev(rs.world_size, "count"),
                                    "ranks_present": ev(len(rs.members), "count")}))
        for problem in rs.problems:
            out.append(_f("inconsistent_ranks", 1.0, f"Run {rs.run_id}: {problem}.", rs.ranks))
        out += self._heads(rs)
        out += self._requests(rs)
        out += self._memory(rs)
        if not out:
            heads, per_rank = rs.rank_heads()
            out.append(_f("balanced", 0.0,
                          f"Run {rs.run_id}: {len(rs.members)} ranks hold {per_rank} of {heads} KV heads each and "
                          "equal KV bytes per request; their sum is the model's.", rs.ranks))
        return out

    def _heads(self, rs: RankSet) -> list[RankFinding]:
        heads, per_rank = rs.rank_heads()
        if not heads:
            return []
        wrong = {m.rank: m.kv_heads_recorded for m in rs.members
                 if m.kv_heads_recorded is not None and m.kv_heads_recorded != per_rank}
        if not wrong:
            return []
        text = ", ".join(f"rank {r} {h}" for r, h in sorted(wrong.items()))
        return [_f("kv_heads_mismatch", 1.0,
                   f"Run {rs.run_id}: each of {rs.world_size or len(rs.members)} ranks should hold {per_rank} of the "
                   f"model's {heads} KV heads per layer, but the caches hold {text}.", sorted(wrong),
                   evidence={"model_kv_heads": ev(heads, "count"), "expected_per_rank": ev(per_rank, "count")})]

    def _requests(self, rs: RankSet) -> list[RankFinding]:
        out: list[RankFinding] = []
        reqs = sorted({r for m in rs.members for r in m.requests})
        worst_spread = 0.0
        worst: tuple[int, dict[int, int]] | None = None
        mismatch: list[tuple[int, int, int]] = []
        outcomes: dict[int, dict[int, str]] = {}
        for rid in reqs:
            final = {m.rank: m.requests[rid][3] for m in rs.members if rid in m.requests}
            ends = {m.rank: m.requests[rid][0] for m in rs.members if rid in m.requests}
            if len(set(ends.values())) > 1 or len(ends) < len(rs.members):
                outcomes[rid] = ends
            if len(final) == len(rs.members) and len(final) > 1:
                s = _spread(final)
                if s > worst_spread:
                    worst_spread, worst = s, (rid, final)
            model = rs.model_kv_bytes(rid)
            if model is not None and not rs.missing and not outcomes.get(rid) and sum(final.values()) != model:
                mismatch.append((rid, sum(final.values()), model))
        if worst is not None and ramp(worst_spread, *KV_SPREAD) > 0:
            rid, final = worst
            hi = max(final, key=lambda r: final[r])
            lo = min(final, key=lambda r: final[r])
            out.append(_f("kv_imbalance", ramp(worst_spread, *KV_SPREAD),
                          f"Request {rid}: rank {hi} holds {format_bytes(final[hi])} of KV and rank {lo} "
                          f"{format_bytes(final[lo])} ({worst_spread:.0%} apart); a tensor-parallel split holds "
                          "equal shards.", [hi, lo], requests=[rid],
                          evidence={"max_rank_kv_bytes": ev(final[hi], "bytes"),
                                    "min_rank_kv_bytes": ev(final[lo], "bytes"),
                                    "spread": ev(round(worst_spread, 4), "ratio")}))
        if mismatch:
            rid, got, model = mismatch[0]
            out.append(_f("kv_bytes_mismatch", 1.0,
                          f"Request {rid}: the ranks' KV adds up to {format_bytes(got)} ({got} B) where the "
                          f"model's geometry gives {format_bytes(model)} ({model} B) at the same tokens"
                          + (f" ({len(mismatch)} requests differ)" if len(mismatch) > 1 else "") + ".",
                          rs.ranks, requests=[r for r, _, _ in mismatch],
                          evidence={"ranks_sum_bytes": ev(got, "bytes"), "model_bytes": ev(model, "bytes")}))
        for rid, ends in sorted(outcomes.items()):
            odd = sorted(r for r, e in ends.items() if e != "ok")
            absent = sorted(set(rs.ranks) - set(ends))
            parts = [f"rank {r} {ends[r]}" for r in odd] + [f"rank {r} has no such request" for r in absent]
            if not parts:
                continue
            out.append(_f("rank_outcome", 1.0 if any(ends[r] in ("oom", "error") for r in odd) else 0.5,
                          f"Request {rid} ended differently on the ranks: {', '.join(parts)}; the other ranks "
                          "waited on it (collectives) or ran past it.", odd + absent, requests=[rid]))
        out += self._retention(rs)
        return out

    @staticmethod
    def _retention(rs: RankSet) -> list[RankFinding]:
        alive = {m.rank: m.kv_alive_bytes for m in rs.members}
        if not any(alive.values()):
            return []
        held = sorted(r for r, b in alive.items() if b)
        clean = sorted(r for r, b in alive.items() if not b)
        peak = {m.rank: m.peak_kv_bytes for m in rs.members}
        ratio = max(alive[r] / peak[r] for r in held if peak[r] > 0) if any(peak[r] for r in held) else 1.0
        rids = sorted({rid for m in rs.members if m.rank in held for rid, v in m.requests.items() if v[5]})
        where = ", ".join(f"rank {r} {format_bytes(alive[r])}" for r in held)
        others = (f"; rank(s) {', '.join(map(str, clean))} released theirs, so what keeps the KV alive runs on "
                  f"rank(s) {', '.join(map(str, held))} only" if clean else "; every rank kept its shard")
        return [_f("rank_retention", ramp(ratio, *RETENTION),
                   f"KV storages outlived their requests on {where} (requests {', '.join(map(str, rids))}){others}.",
                   held, requests=rids,
                   evidence={"kv_alive_bytes": ev(sum(alive.values()), "bytes"),
                             "ratio_of_peak": ev(round(ratio, 4), "ratio")})]

    @staticmethod
    def _memory(rs: RankSet) -> list[RankFinding]:
        peak = {m.rank: m.max_allocated_bytes for m in rs.members if m.max_allocated_bytes is not None}
        if len(peak) < 2:
            return []
        s = _spread(peak)  # type: ignore[arg-type]
        score = ramp(s, *MEMORY_SPREAD)
        if score <= 0:
            return []
        hi = max(peak, key=lambda r: peak[r])  # type: ignore[arg-type,return-value]
        lo = min(peak, key=lambda r: peak[r])  # type: ignore[arg-type,return-value]
        return [_f("memory_imbalance", score,
                   f"Rank {hi} peaked at {format_bytes(peak[hi])} allocated and rank {lo} at {format_bytes(peak[lo])} "
                   f"({s:.0%} apart): rank {hi} limits how much KV the run can hold.", [hi],
                   evidence={"max_rank_allocated_bytes": ev(peak[hi], "bytes"),
                             "min_rank_allocated_bytes": ev(peak[lo], "bytes"), "spread": ev(round(s, 4), "ratio")})]
