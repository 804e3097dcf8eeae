"""`kvtrace fleet DIR` (summary or --sql), `kvtrace fleet diff DIR --baseline K=V --candidate K=V`.

DIR is what `kvtrace export parquet TRACES -o DIR` wrote; spec/fleet.md documents its views.
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import Any

import click

from kvtrace import exitcodes
from kvtrace.commands.common import fail, guarded
from kvtrace.commands.outputs import check_json_out, check_output, json_options, write_json
from kvtrace.errors import CannotWrite, Unavailable
from kvtrace.fleet import FleetError, format_cell
from kvtrace.params import split_list
from kvtrace.units import format_bytes


def fleet_modules(*names: str) -> list[Any]:
    """Import kvtrace.fleet modules; a missing fleet extra is exit 69 with one line."""
    from kvtrace.fleet import missing_dependency

    try:
        return [importlib.import_module(f"kvtrace.fleet.{n}") for n in names]
    except ImportError as exc:
        raise Unavailable(missing_dependency(exc)) from None


def _outside(directory: str, *outputs: tuple[str, str | None]) -> None:
    """Outputs never go inside the fleet directory: its files are the command's input."""
    root = Path(directory).resolve()
    for option, path in outputs:
        if path is not None and Path(path).resolve().is_relative_to(root):
            raise click.UsageError(f"{option} {path} is inside the fleet directory {directory} (an input)")


def _connect(directory: str, tables: tuple[str, ...] | None = None) -> Any:
    """A connection onto DIRECTORY's exported tables; a directory that is not one is FleetError (2)."""
    (query,) = fleet_modules("query")
    return query.connect(directory, query.TABLE_NAMES if tables is None else tables)


class FleetGroup(click.Group):
    """`kvtrace fleet DIR ...` runs the summary; `kvtrace fleet diff ...` a subcommand."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            args = ["summary", *args]
        return super().parse_args(ctx, args)


@click.group("fleet", cls=FleetGroup)
def fleet() -> None:
    """Query a directory of exported traces (kvtrace export parquet) with DuckDB.

    \b
    Examples:
      kvtrace fleet fleet/                                   # summary of every trace
      kvtrace fleet fleet/ --group-by model_type,transformers_version
      kvtrace fleet fleet/ --sql "SELECT model_id, count(*) FROM traces GROUP BY 1"
      kvtrace fleet diff fleet/ --baseline transformers_version=5.17.0 \\
          --candidate transformers_version=5.23.0 --fail-on regressed
      kvtrace fleet report fleet/ -o fleet.html --group-by model_type
    """


def _read_only(sql: str) -> None:
    """--sql runs one query that reads: COPY, ATTACH, EXPORT, INSTALL, SET... could write files
    (the fleet directory's own Parquet included: no output may replace an input) or change the
    session, and several statements would print only the last result. Exit 64 otherwise. This is
    the first of two guards: the connection itself (kvtrace.fleet.query.connect) has no file
    system access, so a statement that passes here (EXPLAIN ANALYZE COPY ..., SELECT ... FROM
    read_csv('/etc/...')) fails there, exit 64 as well."""
    import duckdb

    try:
        statements = duckdb.extract_statements(sql)
        kinds = [s.type for s in statements]
    except duckdb.Error as exc:
        (query,) = fleet_modules("query")
        raise click.UsageError(f"query failed: {query.first_line(exc)}") from None
    except ValueError:  # a statement type this duckdb's Python client has no name for (UPDATE EXTENSIONS)
        raise click.BadParameter("only queries that read (SELECT, WITH, DESCRIBE, EXPLAIN ...) run here, not a "
                                 "statement of a type DuckDB's Python client cannot name", param_hint="--sql") from None
    if len(statements) != 1:
        raise click.BadParameter(f"give one SQL statement, got {len(statements)}", param_hint="--sql")
    kind = kinds[0]
    if kind not in (duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN):
        raise click.BadParameter(f"only queries that read (SELECT, WITH, DESCRIBE, EXPLAIN ...) run here, not "
                                 f"{kind.name}: kvtrace fleet writes no file", param_hint="--sql")


def _built_in(directory: str, exc: Exception) -> None:
    """A FleetError from a query kvtrace wrote itself (not --sql): "query failed" means the exported
    tables are not what the query reads (damaged, or of another schema), exit 2; other
    FleetErrors (an unknown key, no trace matching a selector) are the command line's, exit 64."""
    if str(exc).startswith("query failed"):
        raise _unreadable(directory, str(exc)) from None
    raise click.UsageError(str(exc)) from None


def _unreadable(directory: str, why: str) -> FleetError:
    """The exported tables of DIRECTORY cannot be read as this kvtrace wrote them: FleetError, exit 2."""
    return FleetError(f"{directory}: cannot read the exported tables ({why})")


def _print_table(title: str, columns: list[str], rows: list[tuple[Any, ...]]) -> None:
    from rich.table import Table

    from kvtrace.analyzer.terminal import console_for
    from kvtrace.textsafe import visible  # model ids, paths, SQL results: data, printed as written

    table = Table(title=visible(title), title_justify="left")
    for c in columns:
        table.add_column(visible(c))
    for r in rows:
        table.add_row(*(visible(format_cell(c, v)) for c, v in zip(columns, r, strict=True)))
    console_for().print(table)  # a closed stdout (`| head`) exits 141 quietly, as every command


@fleet.command("summary")
@click.argument("directory", type=click.Path())
@click.option("--group-by", "group_by", default="", metavar="KEYS",
              help="Comma-separated columns of the traces view, e.g. model_type,transformers_version.")
@click.option("--sql", default=None, metavar="QUERY",
              help="Run QUERY, one statement that reads (SELECT, WITH, DESCRIBE...; nothing that writes), against "
                   "the views (traces, requests, steps, kv, events, findings, telemetry, ...).")
@json_options
@guarded
def summary(directory: str, group_by: str, sql: str | None, as_json: bool, json_out: str | None) -> None:
    """Summarise DIRECTORY: traces, requests, tokens, findings by detector and severity,
    retention and fragmentation rates, KV bytes per token; or run --sql."""
    check_json_out(json_out, (directory,))
    _outside(directory, ("--json-out", json_out))
    (query,) = fleet_modules("query")
    if sql is not None:
        if group_by:  # was ignored without a word
            raise click.UsageError("--group-by groups the summary; with --sql, group in QUERY (GROUP BY)")
        _read_only(sql)
    con = _connect(directory, query.tables_named(sql) if sql is not None else query.SUMMARY_TABLES)
    keys = split_list(group_by)
    try:
        if sql is not None:
            results = {"result": query.run_sql(con, sql)}
        else:
            query.check_keys(con, keys)
            results = query.summary(con, keys)
        doc = {name: r.records() for name, r in results.items()} if (as_json or json_out) else {}
    except query.FleetError as exc:
        if sql is not None:  # the user's own query: a usage error
            raise click.UsageError(str(exc)) from None
        _built_in(directory, exc)
    write_json(doc, json_out, as_json=as_json)
    if not as_json:
        for name, r in results.items():
            _print_table(name.replace("_", " "), r.columns, r.rows)


def _finite(ctx: click.Context, param: click.Parameter, value: float) -> float:
    """click's FloatRange lets NaN through (every comparison with NaN is false): refuse it (64)."""
    if not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a number in range")
    return value


@fleet.command("diff")
@click.argument("directory", type=click.Path())
@click.option("--baseline", required=True, metavar="KEY=VALUE", help="Traces whose KEY (a traces column) is VALUE.")
@click.option("--candidate", required=True, metavar="KEY=VALUE", help="The traces compared against the baseline.")
@click.option("--fail-on", type=click.Choice(["regressed"]), default=None,
              help="Exit 3 when a metric regressed (for CI pipelines).")
@click.option("--alpha", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.05,
              show_default=True, callback=_finite, help="Significance level of the Mann-Whitney test.")
@click.option("--min-effect", type=click.FloatRange(0), default=0.05, show_default=True, callback=_finite,
              help="Smallest change called one: median shift as a fraction of the baseline median; "
                   "findings rates: rate points (0.05 = 5 points).")
@json_options
@guarded
def diff(directory: str, baseline: str, candidate: str, fail_on: str | None, alpha: float, min_effect: float,
         as_json: bool, json_out: str | None) -> None:
    """Compare two groups of traces of DIRECTORY per metric: exact KV bytes per token (per model
    type and layer type); noisy metrics (peak and retained allocation, fragmentation, findings,
    recorder overhead where recorded) with a Mann-Whitney test, Cliff's delta and a bootstrap CI
    of the median shift; findings rates per detector with Fisher's exact test. Verdict per
    metric: unchanged / regressed / improved (exact metrics may also be 'changed' or
    'not_compared'; too few observations: 'insufficient'; nothing recorded: 'absent')."""
    check_json_out(json_out, (directory,))
    _outside(directory, ("--json-out", json_out))
    query, compare = fleet_modules("query", "compare")
    try:
        a, b = compare.Selector.parse(baseline), compare.Selector.parse(candidate)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    con = _connect(directory, compare.DIFF_TABLES)
    try:
        doc = compare.fleet_diff(con, a, b, alpha=alpha, min_effect=min_effect)
    except query.FleetError as exc:
        raise click.UsageError(str(exc)) from None
    except query.DatabaseError as exc:
        raise _unreadable(directory, query.first_line(exc)) from None
    write_json(doc, json_out, as_json=as_json)
    if not as_json:
        rows = compare.metric_rows(doc, format_bytes)
        _print_table(f"{doc['candidate']['selector']} ({doc['candidate']['traces']} traces) vs "
                     f"{doc['baseline']['selector']} ({doc['baseline']['traces']} traces)",
                     ["metric", "baseline median", "candidate median", "test", "verdict"], rows)
    if fail_on == "regressed" and doc["regressed"]:
        fail(f"regressed: {', '.join(doc['regressed'])}", exitcodes.FINDINGS)


@fleet.command("report")
@click.argument("directory", type=click.Path())
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="HTML file to write.")
@click.option("--group-by", "group_by", default="", metavar="KEYS",
              help="Comma-separated columns of the traces view the distributions are drawn per.")
@click.option("--baseline", default=None, metavar="KEY=VALUE", help="With --candidate: add the regression table.")
@click.option("--candidate", default=None, metavar="KEY=VALUE", help="With --baseline: add the regression table.")
@click.option("--worst", type=click.IntRange(1, 1000), default=20, show_default=True,
              help="How many of the worst traces to list.")
@click.option("--quiet", "-q", is_flag=True, help="Print nothing (errors still go to stderr).")
@json_options
@guarded
def report(directory: str, output: str, group_by: str, baseline: str | None, candidate: str | None, worst: int,
           quiet: bool, as_json: bool, json_out: str | None) -> None:
    """Write one self-contained HTML page over DIRECTORY: the summary and the distributions per
    group (peak, retained bytes, KV bytes per token, findings), findings by detector, the
    regression table of `fleet diff` when --baseline and --candidate are given, and the worst
    traces with links to their own reports (or the command that makes them).

    \b
    Examples:
      kvtrace fleet report fleet/ -o fleet.html --group-by model_type,transformers_version
      kvtrace fleet report fleet/ -o fleet.html --baseline transformers_version=5.17.0 \\
          --candidate transformers_version=5.23.0
    """
    check_output(output, option="-o", inputs=(directory,), others=[("--json-out", json_out)])
    check_json_out(json_out, (directory,))
    _outside(directory, ("-o", output), ("--json-out", json_out))
    if (baseline is None) != (candidate is None):
        raise click.UsageError("--baseline and --candidate go together")
    query, compare, fleet_report = fleet_modules("query", "compare", "report")
    try:
        sel = [compare.Selector.parse(x) for x in (baseline, candidate) if x is not None]
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    tables = fleet_report.REPORT_TABLES + (compare.DIFF_TABLES if sel else ())
    con = _connect(directory, tables)
    keys = split_list(group_by)
    try:
        res = fleet_report.build_fleet_report(con, output, keys=keys, worst=worst, directory=directory,
                                              baseline=sel[0] if sel else None, candidate=sel[1] if sel else None)
    except query.FleetError as exc:
        _built_in(directory, exc)
    except query.DatabaseError as exc:
        raise _unreadable(directory, query.first_line(exc)) from None
    except CannotWrite:  # the page or a figure, said by the writer that failed
        raise
    except OSError as exc:
        raise CannotWrite(f"cannot write {output}: {exc.strerror}") from None
    write_json({"report": str(res.html), "traces": res.traces, "groups": res.groups, "figures": res.figures,
                "worst": [{k: w[k] for k in ("trace_id", "path", "max_severity", "report_link", "report_command")}
                          for w in res.worst], "regressed": res.regressed}, json_out, as_json=as_json)
    if not (quiet or as_json):
        from kvtrace.textsafe import visible

        click.echo(visible(f"fleet report written to {res.html} ({res.traces} traces, {res.groups} group(s))"))
