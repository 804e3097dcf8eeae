"""`kvtrace diff A B [--json] [--json-out FILE]`: what changed between two traces (or saved analysis reports)."""

from __future__ import annotations

import click

from kvtrace.commands.common import guarded
from kvtrace.commands.diff_whatif import whatif_options, whatif_part
from kvtrace.commands.outputs import check_json_out, json_options, write_json


@click.command("diff")
@click.argument("a", type=click.Path())  # a directory is "not a trace" (exit 2), not a usage error
@click.argument("b", type=click.Path())  # a directory is "not a trace" (exit 2), not a usage error
@json_options
@click.option("--all-layers", is_flag=True, help="List unchanged layers too.")
@whatif_options
@guarded
def diff(a: str, b: str, as_json: bool, json_out: str | None, all_layers: bool) -> None:
    """Compare two traces: per-request and per-layer KV deltas, peak and retained memory,
    fragmentation, findings that appeared, disappeared or changed severity.

    \b
    A and B are traces or JSON reports from `kvtrace analyze --json`. Requests are matched by id.
    Exit codes: 0 done, 1 invalid input, 2 unreadable / not a trace, 4 format too new.
    Examples:
      kvtrace diff before.kvt.h5 after.kvt.h5
      kvtrace diff baseline-report.json candidate.kvt.h5 --json
      kvtrace diff before.kvt.h5 after.kvt.h5 --json-out diff.json
      kvtrace diff before.kvt.h5 after.kvt.h5 --whatif knorm --whatif kivi:nbits=4
    Sizes are printed in binary units (KiB = 1024 bytes).
    """
    from kvtrace.analyzer.diff import diff as run_diff
    from kvtrace.analyzer.diff_terminal import render
    from kvtrace.analyzer.terminal import console_for

    check_json_out(json_out, (a, b))
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
