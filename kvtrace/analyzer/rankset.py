"""Several rank traces of one tensor-parallel run, analysed as one recording.

The commands (analyze, report, info, diff) open each trace once as usual; for every trace that is a
tensor-parallel rank they hand its open trace to :meth:`RankCollector.add`, and at the end
:meth:`RankCollector.finish` groups the ranks by run (analyzer/ranks.py) and runs the
``rank_balance`` detector on every run given with two or more ranks. A run given with one rank is
not a set: it is analysed as one trace and :attr:`RankCollector.notes` says what else to pass.
Rank traces that contradict each other (two files claiming one rank, world sizes that disagree,
a rank outside its world) are reported as a set too, and the commands then exit 1 naming the
problem and the ranks it leaves missing (:func:`refuse_broken`); a set that only lacks ranks is
analysed, with a critical ``missing_ranks`` finding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from kvtrace.analyzer.base import Severity
from kvtrace.analyzer.detectors.rank_balance import RankBalance, RankFinding
from kvtrace.analyzer.ranks import (
    RankSet,
    RankTrace,
    group,
    missing_message,
    parallel_of,
    rank_trace,
    ranks_text,
)
from kvtrace.errors import BadOption
from kvtrace.format.errors import InvalidTrace
from kvtrace.textsafe import markup, visible
from kvtrace.units import format_bytes

__all__ = ["BrokenRankSet", "RankCollector", "RankSetResult", "broken_message", "missing_message", "refuse_broken",
           "refuse_claimed_twice", "render"]


class BrokenRankSet(InvalidTrace):
    """Rank traces that cannot be one run: a rank given twice (two files claiming it), world sizes
    that disagree, a rank outside its world. Exit 1 (invalid input), naming the problem."""


@dataclass
class RankSetResult:
    """One run's rank set and what rank_balance found in it."""

    ranks: RankSet
    findings: list[RankFinding]

    def to_dict(self) -> dict[str, Any]:
        return {**self.ranks.to_dict(), "findings": [f.to_dict() for f in
                                                     sorted(self.findings, key=lambda f: -f.score)]}

    def reaches(self, threshold: Severity) -> bool:
        return any(f.severity >= threshold for f in self.findings)


@dataclass
class RankCollector:
    """Collects rank traces while a command walks its traces; see the module docstring."""

    members: list[RankTrace] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, trace: Any, report: Any = None) -> RankTrace | None:
        """Note the trace if it is a tensor-parallel rank; tag ``report`` (an AnalysisReport) with
        its rank so that each rank's findings are attributed to it."""
        member = rank_trace(trace)
        if member is None:
            return None
        self.members.append(member)
        if report is not None:
            par = parallel_of(trace.meta) or {}
            report.trace["parallel"] = {k: par.get(k) for k in ("mode", "rank", "world_size", "run_id")}
        return member

    def finish(self) -> list[RankSetResult]:
        """The rank set of every run given with two or more rank traces (a run whose traces
        contradict each other, e.g. two files claiming rank 0, is a set too: :func:`refuse_broken`)."""
        out = []
        for rs in group(self.members):
            if len(rs.members) < 2 and not rs.problems:
                m = rs.members[0]
                if m.world_size and m.world_size > 1:
                    self.notes.append(f"{m.path} is rank {m.rank} of {m.world_size} of run {rs.run_id}: analysed alone; "
                                      "give every rank's trace (run.rank*.kvt.h5) to analyse the run as one")
                continue
            out.append(RankSetResult(rs, RankBalance().run_set(rs)))
        return out


def render(result: RankSetResult, console: Console, *, show_info: bool = True) -> None:
    """The terminal view of one run's rank set: a row per rank, the sums, the findings."""
    rs = result.ranks
    d = rs.to_dict()
    console.print(f"[bold]tensor-parallel run {markup(rs.run_id)}[/bold]: world size {rs.world_size}, ranks "
                  f"{ranks_text(rs.ranks) or 'none'}"
                  + (f" ([red]missing {ranks_text(rs.missing)}[/red])" if rs.missing else ""), markup=True)
    for problem in rs.problems:  # a rank given twice, world sizes that disagree: the set is not one run
        console.print(f"problem: {visible(problem)}", style="red")
    t = Table(title=None)
    for col in ("rank", "trace", "KV heads/layer", "peak KV", "KV alive after", "peak allocated", "requests"):
        t.add_column(col, justify="right" if col not in ("trace",) else "left")
    for m in rs.members:
        t.add_row(str(m.rank), visible(m.path), str(m.kv_heads_recorded if m.kv_heads_recorded is not None else "-"),
                  format_bytes(m.peak_kv_bytes), format_bytes(m.kv_alive_bytes),
                  format_bytes(m.max_allocated_bytes) if m.max_allocated_bytes is not None else "not recorded",
                  str(len(m.requests)))
    console.print(t)
    heads = d["model_kv_heads_per_layer"]
    if heads:
        console.print(f"KV heads per layer: ranks sum to {d['kv_heads_sum']}, the model has {heads} "
                      f"({d['expected_kv_heads_per_rank']} per rank expected)")
    for r in d["requests"][:8]:
        model = r["model_kv_bytes"]
        verdict = {True: "adds up", False: "DOES NOT add up", None: "not checked"}[r["adds_up"]]
        console.print(f"request {r['request']}: final KV "
                      + " + ".join(format_bytes(v) for v in r["final_kv_bytes_by_rank"].values())
                      + f" = {format_bytes(r['final_kv_bytes_sum'])}; model {format_bytes(model) if model else '?'}: "
                      + verdict)
    for f in sorted(result.findings, key=lambda f: -f.score):
        if f.severity == Severity.INFO and not show_info:
            continue
        console.print(f"{f.severity.label:8s} {f.score:.2f} {f.detector}/{f.kind} ranks [{ranks_text(f.ranks)}]: "
                      f"{visible(f.message)}")


def broken_message(rs: RankSet) -> str | None:
    """One line naming what makes a run's rank traces contradict each other, and the ranks that
    are then missing (None when the set has no such problem; a set that only lacks ranks is
    analysed, with a missing_ranks finding)."""
    if not rs.problems:
        return None
    problems = "; ".join(rs.problems[:4]) + (f"; and {len(rs.problems) - 4} more" if len(rs.problems) > 4 else "")
    missing = f"; rank(s) {ranks_text(rs.missing)} of world size {rs.world_size} not given" if rs.missing else ""
    return f"run {rs.run_id}: the rank traces do not make one run: {problems}{missing}"


def refuse_claimed_twice(results: list[RankSetResult] | list[RankSet]) -> None:
    """:func:`refuse_broken` for sets where two different files claim one rank only (``report`` and
    ``calc --trace`` refuse the other problems as usage errors, exit 64)."""
    refuse_broken([r for r in results if (r.ranks if isinstance(r, RankSetResult) else r).claimed_twice])


def refuse_broken(results: list[RankSetResult] | list[RankSet], *, repeats: bool = True) -> None:
    """Raise :class:`BrokenRankSet` (exit 1) naming the first run whose rank traces contradict
    each other; return when every set is sound. One file given twice on the command line is the
    caller's slip, not the data's: BadOption (exit 64), or left to the caller (``repeats=False``)."""
    for r in results:
        rs = r.ranks if isinstance(r, RankSetResult) else r
        if rs.repeated and len(rs.repeated) == len(rs.problems):
            if repeats:
                raise BadOption(f"{rs.repeated[0]} is given twice: give each rank trace once")
            continue
        msg = broken_message(rs)
        if msg is not None:
            raise BrokenRankSet(msg)
