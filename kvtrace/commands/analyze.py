"""`kvtrace analyze TRACE... [--json] [--json-out FILE] [--fail-on SEVERITY] [--detector NAME...] [--gpu | --contents]`."""

from __future__ import annotations

import sys
from typing import Any

import click

from kvtrace import exitcodes
from kvtrace.analyzer.base import SEVERITY_NAMES
from kvtrace.commands.common import exit_code_for, guarded, require_cuda
from kvtrace.commands.outputs import check_json_out, json_options, write_json
from kvtrace.format.errors import TraceError
from kvtrace.textsafe import visible


@click.command("analyze")
@click.argument("traces", nargs=-1, type=click.Path())  # a directory is "not a trace" (exit 2), not a usage error
@json_options
@click.option("--fail-on", type=click.Choice(SEVERITY_NAMES, case_sensitive=False), default=None,
              help="Exit 3 when any finding reaches this severity (CI gating).")
@click.option("--detector", "detectors", multiple=True, metavar="NAME",
              help="Run only this detector (repeatable). See --list-detectors.")
@click.option("--list-detectors", is_flag=True, help="List the detectors and exit.")
@click.option("--quiet", "-q", is_flag=True, help="Print only findings above info.")
@click.option("--gpu", is_flag=True,
              help="Also analyse the sampled tensors (dead heads, attention entropy, eviction what-ifs, MLA "
                   "latents) with the Triton kernels on the GPU; no CUDA device: exit 69 (use --contents).")
@click.option("--contents", is_flag=True,
              help="Also analyse the sampled tensors, on the GPU when there is one, else on the CPU.")
@guarded
def analyze(traces: tuple[str, ...], as_json: bool, json_out: str | None, fail_on: str | None,
            detectors: tuple[str, ...], list_detectors: bool, quiet: bool, gpu: bool, contents: bool) -> None:
    """Replay each of TRACES through the detectors and report findings.

    \b
    Exit codes: 0 done (no finding reached --fail-on), 3 a finding reached --fail-on,
    1 invalid trace (or rank traces that contradict each other: one rank given twice...),
    2 unreadable / not a trace, 4 trace format newer than this kvtrace,
    69 --gpu without a CUDA device.
    Examples:
      kvtrace analyze run.kvt.h5
      kvtrace analyze run.kvt.h5 --json-out report.json --fail-on high
      kvtrace analyze run.kvt.h5 --json | jq '.reports[0].findings'
      kvtrace analyze run.kvt.h5 --detector growth_curve --detector post_eos
      kvtrace analyze run.kvt.h5 --gpu       # on the GPU: needs torch and CUDA (Triton for the kernels)
      kvtrace analyze run.kvt.h5 --contents  # the same analyses, on the GPU when there is one, else the CPU
    --json prints the report as JSON (spec/analysis-json.md) instead of the terminal view;
    --json-out FILE also writes it to FILE. Sizes are printed in binary units (KiB = 1024 bytes).
    """
    from kvtrace.analyzer import analyze as run_analysis
    from kvtrace.analyzer import detector_names, document, get_detectors, rankset
    from kvtrace.analyzer.base import Severity
    from kvtrace.analyzer.terminal import console_for, render
    from kvtrace.format.reader import Trace

    if list_detectors:
        for name in detector_names():
            det = get_detectors([name])[0]
            click.echo(f"{name:18s} {det.summary}")
        return
    if as_json and "-" in traces:  # the old spelling `--json -` (stdout) still works
        traces = tuple(t for t in traces if t != "-")
    if not traces:
        raise click.UsageError("give at least one TRACE")
    for path in traces:  # `--json FILE` took a file before: never read (or write) it as a trace
        if path.lower().endswith(".json"):
            raise click.UsageError(f"{path}: analyze reads traces, not JSON; --json is a flag (JSON on "
                                   f"stdout): write a file with --json-out {path}")
    check_json_out(json_out, traces)
    try:
        get_detectors(detectors or None)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if gpu:  # an explicit GPU request: 69 where there is none, before any work (--contents falls back)
        require_cuda("--gpu", "--contents analyses the sampled tensors on the CPU")
    to_stdout_json = as_json
    console = console_for(sys.stderr if to_stdout_json else None)
    reports = []
    ranks = rankset.RankCollector()  # tensor-parallel rank traces of one run are also read as one
    error_code = 0
    for path in traces:
        try:
            with Trace(path) as t:  # opened once: the detectors and the content analyses read it
                report = run_analysis(t, detectors or None)
                ranks.add(t, report)
                if gpu or contents:
                    report.contents = _contents(t, gpu)
        except TraceError as exc:
            click.echo(f"kvtrace: {visible(exc)}", err=True)
            error_code = error_code or exit_code_for(exc)
            continue
        reports.append(report)
        if not to_stdout_json:
            render(report, console, show_info=not quiet)
    rank_sets = ranks.finish()
    for note in ranks.notes:
        click.echo(f"kvtrace: note: {visible(note)}", err=True)
    for rs in rank_sets:
        if rs.ranks.missing and not rs.ranks.problems:  # a broken set: one error line below names both
            click.echo(f"kvtrace: warning: {visible(rankset.missing_message(rs.ranks))}", err=True)
        if not to_stdout_json:
            rankset.render(rs, console, show_info=not quiet)
    if as_json or json_out is not None:
        doc = document(reports)
        if rank_sets:  # spec/analysis-json.md: RANK_SET
            doc["rank_sets"] = [rs.to_dict() for rs in rank_sets]
        write_json(doc, json_out, as_json=as_json)
    if error_code:
        sys.exit(error_code)
    rankset.refuse_broken(rank_sets)  # two files claiming one rank...: exit 1 naming it, after the reports
    threshold = Severity.parse(fail_on) if fail_on else None
    if threshold is not None and (any(r.reaches(threshold) for r in reports)
                                  or any(rs.reaches(threshold) for rs in rank_sets)):
        sys.exit(exitcodes.FINDINGS)


def _contents(trace: Any, gpu: bool) -> dict[str, Any]:
    """The content analyses of sampled tensors (needs torch), on the trace already open."""
    from kvtrace.analyzer.contents import analyze_contents, refuse_denied_payloads

    refuse_denied_payloads(trace)  # tensors the trace's privacy flag denies: exit 1, not read
    try:
        return analyze_contents(trace, device="cuda" if gpu else "auto").to_dict()
    except TraceError as exc:  # a payload that does not decode: the rest of the report stands
        return {"status": "skipped", "reason": f"unreadable payloads: {exc}"}
