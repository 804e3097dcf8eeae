"""`kvtrace diff A B [--json]`: what changed between two traces (or saved analysis reports)."""

from __future__ import annotations

import click

from kvtrace.commands.common import guarded, json_dump


@click.command("diff")
@click.argument("a", type=click.Path(dir_okay=False))
@click.argument("b", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the diff as JSON (spec/analysis-json.md).")
@click.option("--all-layers", is_flag=True, help="List unchanged layers too.")
@guarded
def diff(a: str, b: str, as_json: bool, all_layers: bool) -> None:
    """Compare two traces: per-request and per-layer KV deltas, peak and retained memory,
    fragmentation, findings that appeared, disappeared or changed severity.

    \b
    A and B are traces or JSON reports from `kvtrace analyze --json`. Requests are matched by id.
    Exit codes: 0 done, 1 invalid input, 2 unreadable / not a trace, 4 format too new.
    Examples:
      kvtrace diff before.kvt.h5 after.kvt.h5
      kvtrace diff baseline-report.json candidate.kvt.h5 --json
    Sizes are printed in binary units (KiB = 1024 bytes).
    """
    from kvtrace.analyzer.diff import diff as run_diff
    from kvtrace.analyzer.diff_terminal import render
    from kvtrace.analyzer.terminal import console_for

    result = run_diff(a, b)
    if as_json:
        click.echo(json_dump(result.to_dict()))
        return
    render(result, console_for(), all_layers=all_layers)
