"""``kvtrace diff`` of two tensor-parallel runs: ``kvtrace diff a.rank*.kvt.h5 b.rank*.kvt.h5``.

The traces are grouped by run (``run_id``, analyzer/ranks.py) in the order given: the first run is
A, the second B. Rank r of A is diffed with rank r of B as two single traces are
(analyzer/diff.py), and the runs' rank_balance findings are compared (appeared, disappeared,
changed severity), so a retention that moved from one rank to another is visible.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtrace.analyzer.diff import DIFF_SCHEMA_NAME, DIFF_SCHEMA_VERSION, ReportDiff, diff_reports
from kvtrace.analyzer.rankset import RankCollector, RankSetResult, refuse_broken
from kvtrace.errors import BadOption


@dataclass
class RankSetDiff:
    a: RankSetResult
    b: RankSetResult
    ranks: dict[int, ReportDiff] = field(default_factory=dict)
    appeared: list[dict[str, Any]] = field(default_factory=list)
    disappeared: list[dict[str, Any]] = field(default_factory=list)
    changed: list[dict[str, Any]] = field(default_factory=list)

    @property
    def unmatched(self) -> dict[str, list[int]]:
        ra, rb = set(self.a.ranks.ranks), set(self.b.ranks.ranks)
        return {"a": sorted(ra - rb), "b": sorted(rb - ra)}

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": DIFF_SCHEMA_NAME,
            "schema_version": DIFF_SCHEMA_VERSION,
            "rank_sets": {"a": self.a.to_dict(), "b": self.b.to_dict()},
            "unmatched_ranks": self.unmatched,
            "ranks": [{"rank": r, "diff": d.to_dict()} for r, d in sorted(self.ranks.items())],
            "rank_findings": {"appeared": self.appeared, "disappeared": self.disappeared, "changed": self.changed},
        }


def is_rank_diff(paths: tuple[str, ...]) -> bool:
    """Whether ``kvtrace diff`` got more than the two traces of a plain diff."""
    return len(paths) > 2


def diff_rank_sets(paths: tuple[str, ...]) -> RankSetDiff:
    """Diff the two tensor-parallel runs the rank traces in ``paths`` belong to. Raises BadOption
    when the traces are not the ranks of exactly two runs, BrokenRankSet (exit 1) when a run's rank
    traces contradict each other (a rank given twice...)."""
    from kvtrace.analyzer import analyze
    from kvtrace.format.reader import Trace

    collector = RankCollector()
    reports: dict[str, dict[str, Any]] = {}
    for path in paths:
        with Trace(path) as t:
            report = analyze(t)
            if collector.add(t, report) is None:
                raise BadOption(f"{path} is not a tensor-parallel rank trace: diff takes two traces, or the rank "
                                "traces of two runs (kvtrace diff a.rank*.kvt.h5 b.rank*.kvt.h5)")
            reports[str(t.path)] = report.to_dict()
    results = collector.finish()
    refuse_broken(results, repeats=False)  # rank traces that contradict each other: exit 1 naming it
    runs = [r.ranks.run_id for r in results]
    if len(results) != 2 or len(collector.members) != sum(len(r.ranks.members) for r in results):
        raise BadOption(f"the rank traces belong to {len(set(m.run_id for m in collector.members))} run(s) "
                        f"({', '.join(runs) or 'none with two or more ranks'}); diff needs two runs of two or "
                        "more ranks each")
    a, b = results
    out = RankSetDiff(a, b)
    by_rank_b = {m.rank: m.path for m in b.ranks.members}
    for m in a.ranks.members:
        if m.rank in by_rank_b:
            out.ranks[m.rank] = diff_reports(reports[m.path], reports[by_rank_b[m.rank]])
    fa = {(f.kind, tuple(f.ranks)): f for f in a.findings}
    fb = {(f.kind, tuple(f.ranks)): f for f in b.findings}
    for key in fb.keys() - fa.keys():
        out.appeared.append(fb[key].to_dict())
    for key in fa.keys() - fb.keys():
        out.disappeared.append(fa[key].to_dict())
    for key in fa.keys() & fb.keys():
        if fa[key].severity != fb[key].severity:
            out.changed.append({"kind": key[0], "ranks": list(key[1]), "a": fa[key].to_dict(), "b": fb[key].to_dict()})
    return out
