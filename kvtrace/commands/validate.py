"""`kvtrace validate TRACE`: exit 0 valid, 1 invalid (every problem listed), 2 unreadable."""

from __future__ import annotations

import sys

import click

from kvtrace import exitcodes
from kvtrace.commands.common import guarded
from kvtrace.commands.outputs import check_json_out, json_options, write_json


@click.command("validate")
@click.argument("trace", type=click.Path())  # a directory is "not a trace" (exit 2), not a usage error
@click.option("--no-payloads", is_flag=True, help="Skip decoding every payload chunk (faster).")
@json_options
@guarded
def validate(trace: str, no_payloads: bool, as_json: bool, json_out: str | None) -> None:
    """Check TRACE against the format spec.

    \b
    Exit codes: 0 valid, 1 invalid (every problem is listed),
    2 not a kvtrace trace or unreadable, 4 format version newer than this kvtrace.
    Examples:
      kvtrace validate run.kvt.h5
      kvtrace validate run.kvt.h5 --json      # {"valid": ..., "problems": [...], ...}
    """
    check_json_out(json_out, (trace,))
    from kvtrace.format.validate import validate as run_validation

    report = run_validation(trace, check_payloads=not no_payloads)
    write_json({"trace": trace, "valid": report.valid, "format_version": report.version,
                "problems": report.problems, "warnings": report.warnings}, json_out, as_json=as_json)
    if as_json:
        sys.exit(0 if report.valid else exitcodes.INVALID)
    from kvtrace.textsafe import visible  # problems quote the trace's own text: data, one line each

    for warning in report.warnings:
        click.echo(f"warning: {visible(warning)}", err=True)
    if report.valid:
        click.echo(visible(f"{trace}: valid kvtrace trace (format {report.version})"))
        return
    for problem in report.problems:
        click.echo(visible(f"{trace}: {problem}"), err=True)
    click.echo(visible(f"{trace}: INVALID ({len(report.problems)} problem(s))"), err=True)
    sys.exit(exitcodes.INVALID)
