"""`kvtrace diff A B [--json] [--json-out FILE]`: what changed between two traces (or saved analysis reports)."""

from __future__ import annotations

import click

from kvtrace.commands.common import guarded
from kvtrace.commands.diff_whatif import whatif_asked, whatif_options, whatif_part
from kvtrace.commands.outputs import check_json_out, json_options, write_json


@click.command("diff")
@click.argument("traces", nargs=-1, type=click.Path())  # a directory is "not a trace" (exit 2), not a usage error
@json_options
@click.option("--all-layers", is_flag=True, help="List unchanged layers too.")
@whatif_options
@guarded
def diff(traces: tuple[str, ...], as_json: bool, json_out: str | None, all_layers: bool) -> None:
    """Compare two traces: per-request and per-layer KV deltas, peak and retained memory,
    fragmentation, findings that appeared, disappeared or changed severity.

    \b
    TRACES are two, A and B: traces or JSON reports from `kvtrace analyze --json`; requests are
    matched by id. Or the rank traces of two tensor-parallel runs (A's ranks, then B's), compared
    rank by rank, with the runs' rank_balance findings.
    Exit codes: 0 done, 1 invalid input, 2 unreadable / not a trace, 4 format too new.
    Examples:
      kvtrace diff before.kvt.h5 after.kvt.h5
      kvtrace diff baseline-report.json candidate.kvt.h5 --json
      kvtrace diff before.kvt.h5 after.kvt.h5 --json-out diff.json
      kvtrace diff before.kvt.h5 after.kvt.h5 --whatif knorm --whatif kivi:nbits=4
      kvtrace diff a.rank*.kvt.h5 b.rank*.kvt.h5   # two tensor-parallel runs, rank by rank
    Sizes are printed in binary units (KiB = 1024 bytes).
    """
    from kvtrace.analyzer.diff import diff as run_diff
    from kvtrace.analyzer.diff_terminal import render
    from kvtrace.analyzer.terminal import console_for

    if len(traces) < 2:
        raise click.UsageError("give two traces A B (or the rank traces of two tensor-parallel runs)")
    check_json_out(json_out, traces)
    from kvtrace.analyzer import rank_diff

    if rank_diff.is_rank_diff(traces):
        if whatif_asked():  # was ignored without a word
            raise click.UsageError("--whatif/--whatif-ratio compare two traces (or saved what-if documents), not "
                                   "the rank traces of tensor-parallel runs; give one rank trace of each run")
        ranked = rank_diff.diff_rank_sets(traces)
        write_json(ranked.to_dict(), json_out, as_json=as_json)
        if not as_json:
            _render_ranks(ranked, all_layers)
        return
    a, b = traces
    wi = whatif_part(a, b)  # None unless --whatif, or A and B are what-if documents
    if wi is not None and wi.only:
        write_json(wi.doc, json_out, as_json=as_json)
        if not as_json:
            wi.render()
        return
    result = run_diff(a, b)
    write_json(result.to_dict() if wi is None else {**result.to_dict(), "whatif": wi.doc}, json_out, as_json=as_json)
    if as_json:
        return
    render(result, console_for(), all_layers=all_layers)
    if wi is not None:
        wi.render()


def _render_ranks(d: object, all_layers: bool) -> None:
    """Rank by rank as two traces, then the runs' rank_balance findings that changed."""
    from kvtrace.analyzer.diff_terminal import render
    from kvtrace.analyzer.ranks import ranks_text
    from kvtrace.analyzer.terminal import console_for
    from kvtrace.textsafe import visible

    console = console_for()
    for rank, rd in sorted(d.ranks.items()):  # type: ignore[attr-defined]
        console.print(f"rank {rank}", style="bold")
        render(rd, console, all_layers=all_layers)
    un = d.unmatched  # type: ignore[attr-defined]
    for side in ("a", "b"):
        if un[side]:
            console.print(f"rank(s) {ranks_text(un[side])} only in {side.upper()}: not compared")
    for word, items in (("appeared", d.appeared), ("disappeared", d.disappeared)):  # type: ignore[attr-defined]
        for f in items:  # ranks_text: a missing_ranks finding of a world of 2^16 names 65,534 ranks
            console.print(f"rank_balance {word}: {f['severity']} {f['kind']} ranks [{ranks_text(f['ranks'])}]: "
                          f"{visible(f['message'])}")
    for c in d.changed:  # type: ignore[attr-defined]
        console.print(f"rank_balance changed: {c['kind']} ranks [{ranks_text(c['ranks'])}]: {c['a']['severity']} -> "
                      f"{c['b']['severity']}")
