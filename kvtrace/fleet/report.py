"""`kvtrace fleet report DIR -o fleet.html`: one self-contained page over an exported fleet.

Sections: the summary per group, the distributions per group (matplotlib, one figure per metric),
findings by detector and severity, the regression table of `fleet diff` when a baseline and a
candidate are given, and the worst traces with links to their own reports. Everything is read
from the `traces` table's per-trace aggregates, except the worst traces' top findings and the
diff (which reads its own tables). The page is assembled by kvtrace.report.html (Jinja2 with
autoescape): model names, paths and messages from traces are text, never markup.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np

from kvtrace._version import __version__
from kvtrace.fleet import format_cell
from kvtrace.fleet.compare import Selector, fleet_diff, metric_rows
from kvtrace.fleet.query import QueryResult, run_sql, sql_ident, summary
from kvtrace.report import figures, html
from kvtrace.units import format_bytes
from kvtrace.wholefile import write_text_whole

MAX_GROUPS = 24  # groups drawn per figure (the most traces first); the table lists them all
TRACE_SUFFIXES = (".kvt.h5", ".h5", ".hdf5")

# The views the report reads (plus compare.DIFF_TABLES with a baseline and a candidate).
REPORT_TABLES = ("traces", "findings")

# (figure name, title, SQL value over traces t, unit): one value per trace.
DISTRIBUTIONS: tuple[tuple[str, str, str, str], ...] = (
    ("peak", "Largest peak allocation of a request, per trace", "t.max_peak_allocated_bytes", "bytes"),
    ("retained", "Bytes still allocated after requests (sum over requests), per trace",
     "t.retained_allocated_bytes", "bytes"),
    ("kv_per_token", "KV bytes per token and layer, per trace", "t.kv_bytes_valid::DOUBLE / nullif(t.kv_tokens, 0)",
     "bytes"),
    ("findings", "Findings at or above low, per trace", "t.findings_low", "count"),
)


@dataclass
class FleetReport:
    html: Path
    groups: int = 0
    traces: int = 0
    figures: list[str] = field(default_factory=list)
    worst: list[dict[str, Any]] = field(default_factory=list)
    regressed: list[str] | None = None  # None: no diff asked for


def _label(row: tuple[Any, ...]) -> str:
    return " / ".join("-" if v is None else str(v) for v in row) or "all traces"


def _group_values(con: Any, keys: list[str], expr: str) -> list[tuple[str, np.ndarray]]:
    k = ", ".join(f"t.{sql_ident(key)}" for key in keys)
    sel, order = (f"{k}, ", f", {k}") if keys else ("", "")
    rows = con.execute(f"SELECT {sel}list({expr}) FILTER (WHERE {expr} IS NOT NULL), count(*) FROM traces t "
                       f"GROUP BY ALL ORDER BY count(*) DESC{order}").fetchall()
    return [(_label(r[:-2]), np.array(r[-2] or [], np.float64)) for r in rows]


def _distribution(title: str, unit: str, groups: list[tuple[str, np.ndarray]]) -> Any:
    """Per group: the 25-75 % box, the median, a 10-90 % whisker, and every trace as a point
    (small groups show their values). Drawn from quantiles, not ax.boxplot, whose arguments
    changed across the matplotlib versions we support."""
    plt = figures._plt()
    shown = groups[:MAX_GROUPS]
    top = max((float(v.max()) for _, v in shown if v.size), default=0.0)
    name, scale = figures.byte_unit(top) if unit == "bytes" else ("", 1.0)
    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.32 * len(shown)))
    rng = np.random.default_rng(0)  # fixed jitter: the same fleet draws the same page
    for i, (_, v) in enumerate(shown):
        if v.size:
            p10, p25, p50, p75, p90 = np.quantile(v / scale, [0.1, 0.25, 0.5, 0.75, 0.9])
            ax.hlines(i, p10, p90, color="#555", linewidth=1)
            ax.barh(i, p75 - p25, left=p25, height=0.5, color="#dbe6f1", edgecolor="#1d4f80")
            ax.vlines(p50, i - 0.25, i + 0.25, color="#b00020", linewidth=2)
            ax.scatter(v / scale, i + rng.uniform(-0.18, 0.18, v.size), s=6, alpha=0.45, color="#1f77b4")
    # "$" would start matplotlib mathtext: a model called "$\\frac{" must not break the page
    ax.set_yticks(range(len(shown)), [f"{g} (n={v.size})".replace("$", r"\$") for g, v in shown])
    ax.invert_yaxis()
    label = name if unit == "bytes" else unit
    values = np.concatenate([v for _, v in shown if v.size]) / scale
    positive = values[values > 0]
    if positive.size and positive.max() > 100 * positive.min():  # spread over decades: log, zeros kept
        ax.set_xscale("symlog", linthresh=float(positive.min()))
        label += " (log scale above the smallest non-zero value)"
    ax.set_xlabel(label)
    ax.set_title(title + ("" if len(groups) <= MAX_GROUPS else f" ({MAX_GROUPS} largest of {len(groups)} groups)"))
    ax.grid(axis="x", alpha=0.3)
    return fig


def _result_table(r: QueryResult) -> Any:
    numeric = [i for i, c in enumerate(r.columns) if c not in ("detector", "severity", "layer_type")]
    return html.table(r.columns, [[format_cell(c, v) for c, v in zip(r.columns, row, strict=True)] for row in r.rows],
                      numeric=numeric)


def own_report(trace_path: str, out_dir: Path) -> tuple[str | None, str]:
    """(relative link to the trace's own HTML report if one exists, the command that makes it).
    Looked for next to the trace and next to the fleet report, named after the trace."""
    p = Path(trace_path)
    stem = p.name
    for suffix in TRACE_SUFFIXES:
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
            break
    target = f"{stem}.html"
    for candidate in (p.with_name(target), out_dir / target):
        if candidate.is_file():
            rel = os.path.relpath(candidate.resolve(), out_dir.resolve())
            # quoted, and never a bare scheme: a file named "javascript:x.html" stays a path
            return ("" if rel.startswith("..") else "./") + quote(rel), _command(p, candidate)
    return None, _command(p, p.with_name(target))


def _command(trace: Path, page: Path) -> str:
    """The command that writes a trace's report, quoted for a POSIX shell (paths may hold spaces)."""
    return f"kvtrace report {shlex.quote(str(trace))} -o {shlex.quote(str(page))}"


def _worst(con: Any, n: int, out_dir: Path) -> list[dict[str, Any]]:
    rows = con.execute(f"""
        SELECT trace_id, path, model_id, model_type, transformers_version, host, device, max_severity,
               findings_low, retained_allocated_bytes, max_peak_allocated_bytes
        FROM traces ORDER BY max_severity_rank DESC NULLS LAST, retained_allocated_bytes DESC NULLS LAST,
                             max_peak_allocated_bytes DESC NULLS LAST, trace_id
        LIMIT {int(n)}""").fetchall()
    cols = ("trace_id", "path", "model_id", "model_type", "transformers_version", "host", "device",
            "max_severity", "findings_low", "retained_allocated_bytes", "max_peak_allocated_bytes")
    out = [dict(zip(cols, r, strict=True)) for r in rows]
    top: dict[str, str] = {}
    if out:
        for tid, msg in con.execute(
                "SELECT trace_id, arg_max(message, severity_rank * 10 + score) FROM findings "
                "WHERE trace_id IN (SELECT unnest($ids)) AND severity_rank >= 1 GROUP BY trace_id",
                {"ids": [w["trace_id"] for w in out]}).fetchall():
            top[tid] = msg
    for w in out:
        w["top_finding"] = top.get(w["trace_id"], "")
        w["report_link"], w["report_command"] = own_report(w["path"], out_dir)
    return out


def _worst_table(worst: list[dict[str, Any]]) -> Any:
    rows = []
    for w in worst:
        name = escape(Path(w["path"]).name)
        link = (f'<a href="{escape(w["report_link"])}">{name}</a>' if w["report_link"]
                else f"{name}<br><code>{escape(w['report_command'])}</code>")
        rows.append([link] + [escape(format_cell(c, w[c])) for c in (
            "model_id", "transformers_version", "host", "max_severity", "findings_low",
            "retained_allocated_bytes", "max_peak_allocated_bytes", "top_finding")])
    return html.raw_table(["trace (its report, or the command that makes it)", "model", "transformers", "host",
                           "max severity", "findings ≥ low", "retained after requests", "largest peak",
                           "top finding"], rows)


def build_fleet_report(con: Any, out: str | os.PathLike[str], *, keys: list[str], worst: int = 20,
                       baseline: Selector | None = None, candidate: Selector | None = None,
                       directory: str = "") -> FleetReport:
    """Write the page to ``out``; ``con`` has the traces view (and the diff's tables when asked)."""
    out_path = Path(out)
    result = FleetReport(out_path)
    sections: list[html.Section] = []
    s = summary(con, keys)
    result.groups, result.traces = len(s["groups"].rows), int(run_sql(con, "SELECT count(*) FROM traces").rows[0][0])

    overview = html.Section("summary", "Summary per group")
    overview.lead.append(html.para(f"{result.traces} traces in {result.groups} group(s)"
                                   + (f" by {', '.join(keys)}" if keys else "") + "."))
    overview.body.append(_result_table(s["groups"]))
    failed = con.execute("SELECT path, analysis_error FROM traces WHERE NOT analysed OR analysis_error <> '' "
                         "ORDER BY path").fetchall()
    if failed:  # their findings columns are empty: say so rather than count them as clean
        overview.body.append(html.absent(
            f"{len(failed)} trace(s) could not be analysed, so their findings are missing from every table: "
            + "; ".join(f"{Path(p).name}: {e}" for p, e in failed[:5]) + (" ..." if len(failed) > 5 else "")))
    sections.append(overview)

    dist = html.Section("distributions", "Distributions per group")
    dist.lead.append(html.para("One point per trace; the box spans the middle half (25-75 %), the red mark is "
                               "the median, the line 10-90 %. n counts the traces that have the measurement."))
    for name, title, expr, unit in DISTRIBUTIONS:
        groups = _group_values(con, keys, expr)
        if not any(v.size for _, v in groups):
            dist.body.append(html.absent(f"{title}: no trace has this measurement"))
            continue
        fig = _distribution(title, unit, groups)
        try:
            dist.figures.append(html.Figure(f"fleet_{name}", title, figures.to_svg(fig)))
        finally:
            figures.close(fig)
        result.figures.append(f"fleet_{name}")
    sections.append(dist)

    found = html.Section("findings", "Findings by detector and severity")
    found.body.append(_result_table(s["findings"]) if s["findings"].rows else html.para("No findings."))
    found.body.append(html.para("KV bytes per token by layer type (min = max when the geometry is fixed):"))
    found.body.append(_result_table(s["kv_bytes_per_token"]))
    sections.append(found)

    if baseline is not None and candidate is not None:
        doc = fleet_diff(con, baseline, candidate)
        result.regressed = doc["regressed"]
        reg = html.Section("regressions", "Regression table")
        reg.lead.append(html.para(
            f"{doc['candidate']['selector']} ({doc['candidate']['traces']} traces) against "
            f"{doc['baseline']['selector']} ({doc['baseline']['traces']} traces): "
            + (f"{len(doc['regressed'])} metric(s) regressed." if doc["regressed"] else "no metric regressed.")))
        reg.body.append(html.table(["metric", "baseline", "candidate", "test", "verdict"],
                                   metric_rows(doc, format_bytes)))
        sections.append(reg)

    result.worst = _worst(con, worst, out_path.parent)
    bad = html.Section("worst", f"Worst {len(result.worst)} traces")
    bad.lead.append(html.para("Ordered by highest finding severity, then bytes retained after requests, "
                              "then the largest peak allocation."))
    bad.body.append(_worst_table(result.worst))
    sections.append(bad)

    page = html.render(f"kvtrace fleet report: {directory or 'fleet'}",
                       [f"{result.traces} traces, {result.groups} group(s)"], sections,
                       f"kvtrace {__version__} · fleet report · sizes in binary units (KiB = 1024 B)")
    write_text_whole(out_path, page)  # OSError (a full disk): nothing left behind, the command says 73
    return result
