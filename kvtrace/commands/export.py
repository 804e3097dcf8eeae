"""`kvtrace export perfetto | zenodo | prometheus-textfile | parquet`."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
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
from kvtrace.errors import CannotWrite, Unavailable
from kvtrace.textsafe import visible  # notes and errors quote traces: data, one line each


@click.group("export")
def export() -> None:
    """Export traces to Perfetto, Zenodo, or a Prometheus textfile.

    \b
    Examples:
      kvtrace export perfetto run.kvt.h5 -o run.json        # open in ui.perfetto.dev
      kvtrace export zenodo a.kvt.h5 b.kvt.h5 -o bundle/ --creator "Doe, Jane; Uni X"
      kvtrace export prometheus-textfile run.kvt.h5 -o /var/lib/node_exporter/kvtrace.prom
    """


def _quiet_options(fn):
    fn = json_options(fn)  # --json: print only a JSON summary; --json-out FILE: also write it there
    return click.option("--quiet", "-q", is_flag=True, help="Print nothing (errors still go to stderr).")(fn)


@export.command("perfetto")
@click.argument("trace", type=click.Path())  # a directory is "not a trace" (exit 2), not a usage error
@click.option("-o", "--output", type=click.Path(dir_okay=False), default="trace.json", show_default=True,
              help="Chrome trace-event JSON file to write.")
@click.option("--no-analysis", is_flag=True, help="Do not run the analyser (no finding instants).")
@_quiet_options
@guarded
def perfetto(trace: str, output: str, no_analysis: bool, quiet: bool, as_json: bool, json_out: str | None) -> None:
    """Write TRACE as Chrome trace-event JSON for ui.perfetto.dev or chrome://tracing.

    One process per device with a counter track (bytes) for every memory series: NVML used,
    allocator reserved / allocated / inactive split, KV cache. A host process holds request,
    prefill and decode spans, phase instants (EOS, gc, empty_cache, OOM, ...) and the analyser's
    findings. Timestamps: microseconds since the trace's start.

    \b
    Examples:
      kvtrace export perfetto run.kvt.h5 -o run.json
      kvtrace export perfetto run.kvt.h5 -o run.json --no-analysis --json
    """
    from kvtrace.export.perfetto import write_perfetto
    from kvtrace.progress import progress_bar

    check_output(output, option="-o", inputs=(trace,), others=[("--json-out", json_out)])
    check_json_out(json_out, (trace,))
    with progress_bar("perfetto", 3, enabled=not (quiet or as_json)) as steps:
        path, info = write_perfetto(trace, output, run_analyzer=not no_analysis, progress=steps)
    write_json({"output": str(path), **info}, json_out, as_json=as_json)
    if not (quiet or as_json):
        click.echo(f"wrote {path} ({info['events']} events); open it in https://ui.perfetto.dev")
        if info["findings"] is None:
            click.echo(f"  no finding instants: {visible(info['note'])}")


@export.command("zenodo")
@click.argument("traces", nargs=-1, required=True, type=click.Path())  # a directory is "not a trace" (exit 2), not a usage error
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False),
              help="Bundle directory to create (must not exist, or be empty).")
@click.option("--creator", "creators", multiple=True, required=True,
              help="'Family, Given[; affiliation[; ORCID]]'. Repeat for several; at least one is needed.")
@click.option("--title", default=None, help="Dataset title (default: generated from the models).")
@click.option("--description", default=None, help="Dataset description (default: generated from the traces).")
@click.option("--license", "license_", default="cc-by-4.0", show_default=True,
              type=click.Choice(["cc-by-4.0", "cc0-1.0", "cc-by-sa-4.0", "cc-by-nc-4.0", "odc-by-1.0",
                                 "odbl-1.0", "pddl-1.0"]), help="Zenodo license id.")
@click.option("--keyword", "keywords", multiple=True, help="Extra keyword; repeat for several.")
@click.option("--version", "version", default="1.0", show_default=True, help="Dataset version.")
@click.option("--related", "related", multiple=True,
              help="RELATION:IDENTIFIER, e.g. isSupplementTo:10.5281/zenodo.123; repeat for several.")
@click.option("--allow-content", is_flag=True,
              help="Archive traces that hold prompt text or sampled tensor contents (refused otherwise).")
@_quiet_options
@guarded
def zenodo(traces: tuple[str, ...], output: str, creators: tuple[str, ...], title: str | None,
           description: str | None, license_: str, keywords: tuple[str, ...], version: str,
           related: tuple[str, ...], allow_content: bool, quiet: bool, as_json: bool, json_out: str | None) -> None:
    """Make an upload-ready Zenodo dataset bundle from TRACES: the traces under data/,
    .zenodo.json, CITATION.cff, a README data card (models, devices, software, requests, steps,
    data quality) and SHA256SUMS.

    Traces that hold prompt text or tensor contents are refused unless --allow-content is
    given; invalid traces are refused.

    \b
    Examples:
      kvtrace export zenodo runs/*.kvt.h5 -o bundle/ --creator "Doe, Jane; Uni X; 0000-0002-1825-0097"
      kvtrace export zenodo a.kvt.h5 -o bundle/ --creator "Doe, Jane" --title "gpt-oss KV traces" \\
          --related isSupplementTo:10.5281/zenodo.19871039 --json
    """
    from kvtrace.export import zenodo as z
    from kvtrace.progress import progress_bar

    try:
        parsed_creators = [z.Creator.parse(c) for c in creators]
        parsed_related = [z.Related.parse(r) for r in related]
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    if not parsed_creators:
        raise click.UsageError("--creator is required (Zenodo needs at least one creator)")
    check_output_dir(output, option="-o", inputs=traces)
    check_json_out(json_out, traces)
    if json_out is not None and Path(json_out).resolve().is_relative_to(Path(output).resolve()):
        raise click.UsageError(f"--json-out {json_out} is inside the bundle directory {output}")
    options = z.BundleOptions(title, parsed_creators, description, license_, keywords, version,
                              parsed_related, allow_content)
    total = 2 * sum(Path(p).stat().st_size for p in traces if Path(p).is_file()) + 1
    with progress_bar("zenodo", total, enabled=not (quiet or as_json)) as steps:
        # ContentRefused (77) and BundleError (64, 1 or 73 by its kind) carry their exit codes (guarded)
        bundle = z.export_zenodo(traces, output, options, progress=lambda what, n: steps.advance(n, what))
    write_json({
        "directory": str(bundle.directory),
        "files": [str(p.relative_to(bundle.directory)) for p in bundle.files if p.is_file()],
        "traces": [{"file": c.file, "sha256": c.sha256, "bytes": c.bytes,
                    "problems": c.quality.problems} for c in bundle.traces],
    }, json_out, as_json=as_json)
    if not (quiet or as_json):
        click.echo(f"bundle written to {bundle.directory} ({len(bundle.traces)} traces)")
        for c in bundle.traces:
            flag = f"{len(c.quality.problems)} data-quality notes" if c.quality.problems else "clean"
            click.echo(f"  {visible(c.file)}: {visible(flag)}")
        click.echo(f"check with: (cd {bundle.directory} && sha256sum -c SHA256SUMS)")


@export.command("prometheus-textfile")
@click.argument("trace", type=click.Path())  # a directory is "not a trace" (exit 2), not a usage error
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="Textfile to write (node_exporter textfile collector; name it *.prom).")
@_quiet_options
@guarded
def prometheus_textfile(trace: str, output: str, quiet: bool, as_json: bool, json_out: str | None) -> None:
    """Write the final state of a recorded TRACE as Prometheus metrics for node_exporter's
    textfile collector (batch jobs that cannot be scraped while they run).

    Same metric names as the live endpoint of 'kvtrace record --prometheus HOST:PORT'.

    \b
    Examples:
      kvtrace export prometheus-textfile run.kvt.h5 -o /var/lib/node_exporter/textfile/kvtrace.prom
    """
    from kvtrace.export import prometheus
    from kvtrace.format.reader import Trace

    out = check_output(output, option="-o", inputs=(trace,), others=[("--json-out", json_out)])
    check_json_out(json_out, (trace,))
    with Trace(trace) as t:
        try:
            exp = prometheus.render(t, None, out)
        except ImportError as exc:  # prometheus_client is in the record extra, not the base install
            raise Unavailable(str(exc)) from None
    try:
        exp.write_textfile()
    except OSError as exc:
        raise CannotWrite(f"{out}: cannot write ({exc.strerror})") from None
    text = exp.render()
    series = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
    write_json({"output": str(out), "series": series}, json_out, as_json=as_json)
    if not (quiet or as_json):
        click.echo(f"wrote {out} ({series} series)")


@contextlib.contextmanager
def _terminated_cleanly() -> Iterator[None]:
    """SIGTERM (``kill``, a job scheduler's time limit) as Ctrl-C is: an exception, so the export
    removes its temporaries and the files of traces it did not record before it exits (143)."""
    def stop(signum: int, _frame: object) -> None:
        click.echo("kvtrace: terminated", err=True)
        sys.exit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread (an embedding application): its own handling stands
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@export.command("parquet")
@click.argument("traces", nargs=-1, required=True, type=click.Path())  # a directory is "not a trace" (exit 2)
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False),
              help="Fleet directory to create or update (kvtrace fleet DIR queries it).")
@click.option("-j", "--jobs", type=click.IntRange(1), default=1, show_default=True,
              help="Worker processes (spawn) for the per-trace work.")
@click.option("--workers", type=click.IntRange(1), default=None,
              help="Run the per-trace work on a dask.distributed LocalCluster of N worker processes.")
@click.option("--dask", "dask_address", default=None, metavar="SCHEDULER_ADDRESS",
              help="Run the per-trace work on an existing dask.distributed scheduler (workers must see the paths).")
@click.option("--force", is_flag=True, help="Export every trace again, even unchanged ones.")
@_quiet_options
@guarded
def parquet(traces: tuple[str, ...], output: str, jobs: int, workers: int | None, dask_address: str | None,
            force: bool, quiet: bool, as_json: bool, json_out: str | None) -> None:
    """Export TRACES as Parquet tables (requests, steps, kv, events, telemetry, findings, ...,
    and a traces table of /meta fields), every row keyed by trace_id; payloads stay in the
    traces (only their index is exported). Traces already exported and unchanged are skipped.
    A trace that cannot be read is reported and the others are still exported; the exit code
    is then that of the worst failure (4, 1, then 2). spec/fleet.md documents the tables.

    \b
    Examples:
      kvtrace export parquet runs/*.kvt.h5 -o fleet/ -j 2
      kvtrace export parquet /shared/runs/*.kvt.h5 -o /shared/fleet --dask tcp://scheduler:8786
    """
    from kvtrace.commands.fleet import fleet_modules
    from kvtrace.progress import progress_bar

    if workers is not None and dask_address is not None:
        raise click.UsageError("--workers starts a local dask cluster; --dask uses an existing one: pick one")
    check_output_dir(output, option="-o", inputs=traces)
    check_json_out(json_out, traces)
    if json_out is not None and Path(json_out).resolve().is_relative_to(Path(output).resolve()):
        raise click.UsageError(f"--json-out {json_out} is inside the fleet directory {output}")
    if workers is not None or dask_address is not None:
        try:
            import dask.distributed  # noqa: F401 - fail before any work when the extra is absent
        except ImportError as exc:
            raise Unavailable(f"--workers/--dask need dask.distributed ({exc.name}); pip install 'kvtrace[fleet]'") \
                from None
    (fx,) = fleet_modules("export")
    created = not Path(output).exists()
    try:
        Path(output).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CannotWrite(f"cannot create -o {output}: {exc.strerror}") from None
    with progress_bar("parquet", len(traces), enabled=not (quiet or as_json) and len(traces) > 1) as steps, \
            _terminated_cleanly():
        try:
            result = fx.export_parquet(traces, output, jobs=jobs, dask_address=dask_address,
                                       dask_workers=workers or 0, force=force,
                                       progress=lambda path: steps.advance(1, Path(path).name))
        except ConnectionError as exc:  # the dask scheduler cannot be reached, or its link broke
            raise Unavailable(str(exc)) from None
        except CannotWrite:  # a full disk: the tables written whole stay; a new, empty -o goes
            if created:
                remove_empty_dirs(Path(output))
            raise
    write_json(result.to_dict(), json_out, as_json=as_json)
    for f in result.failed:
        click.echo(f"kvtrace: {visible(f['error'])}", err=True)
    if not (quiet or as_json):
        click.echo(f"{output}: {len(result.exported)} exported, {len(result.skipped)} skipped, "
                   f"{len(result.failed)} failed in {result.seconds:.1f} s ({result.engine})")
    if result.exit_code:
        raise SystemExit(result.exit_code)


@export.command("memory-viz")
@click.argument("trace", type=click.Path())  # a directory is "not a trace" (exit 2), not a usage error
@click.option("-o", "--output", type=click.Path(dir_okay=False), default="snapshot.pickle", show_default=True,
              help="Snapshot pickle to write (open it in https://pytorch.org/memory_viz).")
@click.option("--request", type=int, default=None, help="The reading of this request (default: the OOM one, "
              "else the one holding the most memory).")
@click.option("--moment", type=click.Choice(["request_end", "oom", "growth_peak", "tick"]), default=None,
              help="The reading taken at this moment.")
@click.option("--device", type=int, default=None, help="The reading of this CUDA device (-1: a CPU census).")
@_quiet_options
@guarded
def memory_viz(trace: str, output: str, request: int | None, moment: str | None, device: int | None,
               quiet: bool, as_json: bool, json_out: str | None) -> None:
    """Write one owner reading of TRACE (format 1.5 /owners) as a PyTorch memory snapshot that
    https://pytorch.org/memory_viz opens: one segment per owner class (KV of the request, earlier
    requests' KV, weights, generate outputs, workspaces, copies of KV, unknown, free), its largest
    blocks with their allocation sites when the trace was recorded with --memory-history.

    \b
    Examples:
      kvtrace export memory-viz run.kvt.h5 -o oom.pickle                 # owners at the OOM, if any
      kvtrace export memory-viz run.kvt.h5 --request 3 --moment request_end -o r3.pickle
    """
    from kvtrace.export.memory_viz import write_memory_viz

    check_output(output, option="-o", inputs=(trace,), others=[("--json-out", json_out)])
    check_json_out(json_out, (trace,))
    path, info = write_memory_viz(trace, output, request=request, moment=moment, device=device)  # 64: none matches
    write_json({"output": str(path), **info}, json_out, as_json=as_json)
    if not (quiet or as_json):
        where = "CPU census" if info["device"] < 0 else f"device {info['device']}"
        click.echo(f"wrote {path}: request {info['request']}, {info['moment']}, {where}: {visible(info['owners'])}; "
                   "open it in https://pytorch.org/memory_viz")
