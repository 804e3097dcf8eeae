"""`kvtrace validate TRACE`: exit 0 valid, 1 invalid (every problem listed), 2 unreadable."""

from __future__ import annotations

import sys

import click

from kvtrace import exitcodes
from kvtrace.commands.common import guarded


@click.command("validate")
@click.argument("trace", type=click.Path(dir_okay=False))
@click.option("--no-payloads", is_flag=True, help="Skip decoding every payload chunk (faster).")
@guarded
def validate(trace: str, no_payloads: bool) -> None:
    """Check a trace against the format spec.

    \b
    Exit codes: 0 valid, 1 invalid (every problem is listed),
    2 not a kvtrace trace or unreadable, 4 format version newer than this kvtrace.
    Example:
      kvtrace validate run.kvt.h5
    """
    from kvtrace.format.validate import validate as run_validation

    report = run_validation(trace, check_payloads=not no_payloads)
    for warning in report.warnings:
        click.echo(f"warning: {warning}", err=True)
    if report.valid:
        click.echo(f"{trace}: valid kvtrace trace (format {report.version})")
        return
    for problem in report.problems:
        click.echo(f"{trace}: {problem}", err=True)
    click.echo(f"{trace}: INVALID ({len(report.problems)} problem(s))", err=True)
    sys.exit(exitcodes.INVALID)
