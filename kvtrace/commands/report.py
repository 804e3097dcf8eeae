"""`kvtrace report TRACE -o report.html [--figures DIR]`."""

from __future__ import annotations

from pathlib import Path

import click

from kvtrace.commands.common import guarded
from kvtrace.commands.outputs import (
    check_json_out,
    check_output,
    check_output_dir,
    json_options,
    remove_empty_dirs,
    write_json,
)
from kvtrace.errors import CannotWrite


@click.command("report")
@click.argument("traces", nargs=-1, required=True, type=click.Path())  # a directory: "not a trace" (exit 2)
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False), default="report.html",
              show_default=True, help="HTML file to write (self-contained: figures embedded).")
@click.option("--figures", "figures_dir", type=click.Path(file_okay=False), default=None,
              help="Also write every figure into this directory as PNG and SVG.")
@click.option("--no-analysis", is_flag=True, help="Do not run the analyser (no findings table).")
@click.option("--quiet", "-q", is_flag=True, help="Print nothing (errors still go to stderr).")
@click.option("--whatif", "whatif_policies", multiple=True, metavar="NAME[:k=v,...]",
              help="What-if section with these policies (repeatable; see 'kvtrace whatif'). Default: a "
              "standard set when the trace holds sampled contents.")
@click.option("--whatif-ratio", "whatif_ratio", default=None, metavar="R[,R...]",
              help="Eviction ratios of the what-if section (default 0.25,0.5,0.75; the heatmap uses the middle one).")
@click.option("--no-whatif", is_flag=True, help="No what-if section.")
@json_options
@guarded
def report(traces: tuple[str, ...], output: str, figures_dir: str | None, no_analysis: bool, quiet: bool,
           whatif_policies: tuple[str, ...], whatif_ratio: str | None, no_whatif: bool,
           as_json: bool, json_out: str | None) -> None:
    """Write an HTML report of TRACE: memory timeline per device, per-layer KV footprint, growth
    against the analytical expectation, post-EOS memory per request, allocator state at the
    end of generation, the analyser's findings, head-norm / entropy heatmaps and a what-if section
    (KV policies: memory saved vs attention error) when the trace holds sampled contents.
    Sections a trace cannot fill say why.

    Needs matplotlib (pip install 'kvtrace[report]'). Sizes are binary units (KiB = 1024 B).

    \b
    Examples:
      kvtrace report run.kvt.h5 -o report.html
      kvtrace report run.kvt.h5 -o report.html --figures figs/   # + PNG and SVG files
      kvtrace report run.kvt.h5 -o r.html --json | jq .figures
      kvtrace report run.rank*.kvt.h5 -o run.html   # a tensor-parallel run: index + a page per rank
    --json prints only a JSON summary of what was written; --json-out FILE also writes it to FILE.
    No output may be TRACE or an existing trace. Several TRACES must be the rank traces of one
    tensor-parallel run: -o is then the run's page, and each rank's page is written next to it
    (run.rank0.html, ...; figures under --figures/rank0/, ...).
    """
    if len(traces) > 1:
        _rank_set(traces, output, figures_dir, no_analysis, quiet, as_json, json_out)
        return
    trace = traces[0]
    check_output(output, option="-o", inputs=(trace,), others=[("--json-out", json_out)])
    if figures_dir is not None:
        check_output_dir(figures_dir, option="--figures", inputs=(trace,))
    check_json_out(json_out, (trace,))
    whatif = _whatif_options(whatif_policies, whatif_ratio, no_whatif)
    from kvtrace.progress import progress_bar
    from kvtrace.report import STAGES, build_report

    created = figures_dir is not None and not Path(figures_dir).exists()
    with progress_bar("report", len(STAGES), enabled=not (quiet or as_json)) as steps:
        try:
            result = build_report(trace, output, figures_dir, run_analyzer=not no_analysis, progress=steps,
                                  whatif=whatif)
        except CannotWrite:  # a full disk: the --figures directory this run created goes when left empty
            if created:
                remove_empty_dirs(Path(figures_dir))
            raise
    write_json({
        "report": str(result.html), "figures": [str(p) for p in result.figures],
        "sections": result.sections, "absent": result.absent, "findings": result.findings,
    }, json_out, as_json=as_json)
    if not (quiet or as_json):
        from kvtrace.textsafe import visible  # reasons may quote the trace: data, one line each

        click.echo(visible(f"report written to {result.html}"))
        if result.figures:
            click.echo(visible(f"{len(result.figures)} figure files written to {figures_dir}"))
        for section, reason in result.absent.items():
            click.echo(visible(f"  {section}: not shown ({reason})"))


def _whatif_options(policies: tuple[str, ...], ratio_text: str | None, off: bool) -> object:
    """--whatif / --whatif-ratio / --no-whatif -> build_report's ``whatif`` (usage errors first)."""
    if off:
        if policies or ratio_text:
            raise click.UsageError("--no-whatif contradicts --whatif/--whatif-ratio")
        return False
    if not (policies or ratio_text):
        return None
    from kvtrace.commands.whatif import _ratios
    from kvtrace.report.whatif_section import WhatIfOptions
    from kvtrace.whatif import PolicyError, parse_policy

    try:
        for p in policies:
            parse_policy(p)
    except PolicyError as exc:
        raise click.BadParameter(str(exc), param_hint="--whatif") from None
    ratios = tuple(_ratios(ratio_text)) if ratio_text else None
    return WhatIfOptions(policies=policies or None, ratios=ratios)


def _rank_set(traces: tuple[str, ...], output: str, figures_dir: str | None, no_analysis: bool, quiet: bool,
              as_json: bool, json_out: str | None) -> None:
    """One page per rank (each trace opened once) and the run's index page at ``output``."""
    from kvtrace.analyzer.rankset import RankCollector, refuse_claimed_twice
    from kvtrace.format.reader import Trace
    from kvtrace.report import build, rank_page

    check_output(output, option="-o", inputs=traces, others=[("--json-out", json_out)])
    check_json_out(json_out, traces)
    collector = RankCollector()
    opened: list[tuple[str, int]] = []
    for path in traces:
        with Trace(path) as t:
            member = collector.add(t)
        if member is None:
            raise click.UsageError(f"{path} is not a tensor-parallel rank trace: report takes one trace, or the "
                                   "rank traces of one run")
        opened.append((path, member.rank))
    results = collector.finish()
    refuse_claimed_twice(results)  # two files claiming one rank: exit 1 naming it and the ranks missing
    if len(results) != 1 or len(results[0].ranks.members) != len(traces):
        raise click.UsageError("the rank traces belong to more than one run (or give one rank twice); "
                               "report one run at a time")
    if results[0].ranks.problems:  # world sizes that disagree, a rank outside the world: as calc --trace refuses them
        raise click.UsageError(f"the rank traces do not make one run: {'; '.join(results[0].ranks.problems[:4])}")
    pages: dict[int, Path] = {}
    written_figures: list[str] = []
    for path, rank in opened:
        page = rank_page.rank_page_path(output, rank)
        check_output(str(page), option="-o", inputs=traces)
        figs = str(Path(figures_dir) / f"rank{rank}") if figures_dir is not None else None
        if figs is not None:
            check_output_dir(figs, option="--figures", inputs=traces)
        with Trace(path) as t:
            result = build.render(t, None, page, figs, run_analyzer=not no_analysis)
        pages[rank] = result.html
        written_figures += [str(p) for p in result.figures]
    index = rank_page.render(results[0], pages, output)
    write_json({"report": str(index), "rank_pages": {str(r): str(p) for r, p in sorted(pages.items())},
                "figures": written_figures, "rank_findings": len(results[0].findings)}, json_out, as_json=as_json)
    if not (quiet or as_json):
        from kvtrace.textsafe import visible

        click.echo(visible(f"run page written to {index}; rank pages: {', '.join(str(p) for p in pages.values())}"))
        if results[0].ranks.missing:
            click.echo(f"  missing rank trace(s): {', '.join(map(str, results[0].ranks.missing))}")
