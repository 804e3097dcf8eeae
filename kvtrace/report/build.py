"""`write_report`: a trace in, one self-contained HTML page (and optionally PNG/SVG files) out."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

import numpy as np

from kvtrace._version import __version__
from kvtrace.analyzer.report import AnalysisReport
from kvtrace.errors import CannotWrite
from kvtrace.format.reader import Trace
from kvtrace.format.summary import summarize
from kvtrace.report import contents, data, figures, findings, fixes, html, quality, whatif_section
from kvtrace.units import format_bytes
from kvtrace.wholefile import create_in_dir

# Stages reported to the progress callback, in order.
STAGES = ("overview", "memory-timeline", "layer-footprint", "growth-curves", "post-eos",
          "allocator-state", "findings", "heatmaps", "whatif", "data-quality", "write")

Progress = Callable[[str], None]
WhatIf = whatif_section.WhatIfOptions | bool | None
MAX_HEATMAP_REQUESTS = 8  # heatmaps of the last 8 sampled requests: bounds the page's size


@dataclass
class ReportResult:
    html: Path
    figures: list[Path] = field(default_factory=list)  # PNG and SVG files written
    sections: list[str] = field(default_factory=list)
    absent: dict[str, str] = field(default_factory=dict)  # section -> why it has no figure
    findings: int | None = None


def _span(name: str, values: list[int], limit: int = 6) -> str:
    """'requests 0, 1, 2' / 'layer 3' / '' for the findings table."""
    if not values:
        return ""
    shown = ", ".join(str(v) for v in values[:limit]) + (f" (+{len(values) - limit})" if len(values) > limit else "")
    return f"{name}{'s' if len(values) > 1 else ''} {shown}"


def _code(fix: str | None) -> str:
    """A fix as a copy-paste code block, or a dash when none is known. A block, not inline code:
    an inline background wrapped over two lines in a narrow cell painted over the line above
    (underscores and descenders hidden)."""
    return "-" if fix is None else f'<pre class="fix"><code>{escape(fix)}</code></pre>'


def _fmt(n: int | None) -> str:
    return "n/a" if n is None else format_bytes(n)


class _FigureFiles:
    """The --figures files of one report, all or none: written fresh into a hidden staging
    directory inside the figures directory (:func:`kvtrace.wholefile.create_in_dir`: a symlink or
    hard link already there is never written through) and renamed into place by :meth:`commit`
    once the page is written; :meth:`discard` (any failure midway: a full disk, Ctrl-C, a bug)
    removes the staging directory, so no partial set of figures is left behind and an earlier
    run's figures stay as they were."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        try:
            self.stage = Path(tempfile.mkdtemp(prefix=".kvtrace-figures.", dir=directory))
        except OSError as exc:
            raise CannotWrite(f"{directory}: cannot write figures ({exc.strerror or exc})") from None
        self.names: list[str] = []

    def write(self, name: str, blob: bytes) -> Path:
        try:  # whole or not at all; a full disk is 73, not an internal error
            create_in_dir(self.stage, (name,), lambda fh: fh.write(blob))
        except OSError as exc:
            raise CannotWrite(f"{self.directory / name}: cannot write figure ({exc.strerror or exc})") from None
        self.names.append(name)
        return self.directory / name

    def commit(self) -> None:
        flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
        src, dst = os.open(self.stage, flags), os.open(self.directory, flags)
        try:
            for name in self.names:  # a rename replaces a symlink at the name, never follows it
                os.replace(name, name, src_dir_fd=src, dst_dir_fd=dst)
        finally:
            os.close(src)
            os.close(dst)
        self.discard()

    def discard(self) -> None:
        shutil.rmtree(self.stage, ignore_errors=True)


class _Builder:
    def __init__(self, trace: Trace, figure_files: _FigureFiles | None, progress: Progress | None) -> None:
        self.trace = trace  # shared with the analyser: one /kv request index per report
        self.figure_files = figure_files
        self.progress = progress or (lambda _stage: None)
        self.sections: list[html.Section] = []
        self.written: list[Path] = []
        self.absent: dict[str, str] = {}

    def section(self, id_: str, title: str) -> html.Section:
        s = html.Section(id_, title)
        self.sections.append(s)
        return s

    def add_figure(self, section: html.Section, name: str, fig: Any, caption: str) -> None:
        try:
            svg = figures.to_svg(fig)
            if self.figure_files is not None:
                for ext, blob in (("svg", svg), ("png", figures.to_png(fig))):
                    self.written.append(self.figure_files.write(f"{name}.{ext}", blob))
        finally:
            figures.close(fig)
        section.figures.append(html.Figure(name, caption, svg))

    def none(self, section: html.Section, reason: str) -> None:
        self.absent[section.id] = reason
        section.body.append(html.absent(reason))

    # ---- sections ------------------------------------------------------------------------------

    def overview(self, summary: dict[str, Any]) -> None:
        s = self.section("overview", "Overview")
        rows = [
            ("model", f"{summary['model']['id']} ({summary['model']['type']})"),
            ("trace", f"{summary['path']} (format {summary['format_version']}, "
                      f"{'complete' if summary['complete'] else 'INCOMPLETE'}, {format_bytes(summary['file_bytes'])})"),
            ("requests", f"{summary['requests']['count']} "
                         f"({', '.join(f'{n} {k}' for k, n in sorted(summary['requests']['outcomes'].items())) or 'none'}), "
                         f"{summary['requests']['new_tokens']} new tokens"),
            ("layers", f"{summary['layers']['count']} "
                       f"({', '.join(f'{n} {k}' for k, n in sorted(summary['layers']['types'].items())) or 'none'})"),
            ("devices", "; ".join(f"{data.device_text(d['index'], d['name'])} "
                                  f"({_fmt(d['total_memory_bytes'] if d['total_memory_bytes'] >= 0 else None)})"
                                  for d in summary["devices"]) or "none recorded"),
            ("software", ", ".join(f"{k} {v}" for k, v in summary["software"].items())),
            ("privacy", f"prompt text {'stored' if summary['contains_prompt_text'] else 'not stored'}, "
                        f"tensor contents {'stored' if summary['contains_tensor_payloads'] else 'not stored'}"
                        + "".join(f"; {m}" for m in summary.get("privacy_mismatches", ()))),
        ]
        s.body.append(html.fields(rows))
        s.body.append(html.para("Sizes are binary units: 1 KiB = 1024 bytes, 1 MiB = 2^20, 1 GiB = 2^30."))

    def memory_timeline(self) -> None:
        s = self.section("memory-timeline", "Memory timeline per device")
        t0 = data.time_zero_ns(self.trace)
        timelines = data.memory_timelines(self.trace)
        markers = data.phase_markers(self.trace)
        if not timelines:
            self.none(s, "the trace has no memory telemetry and no KV rows")
            return
        for tl in timelines:
            fig = figures.memory_timeline(tl, markers, t0)
            names = ", ".join(figures.SERIES_STYLE.get(x.name, (x.name,))[0] for x in tl.series)
            self.add_figure(s, f"memory_timeline_device{tl.device}", fig,
                            f"{tl.label}: {names}; dashed lines mark prefill, decode start, EOS, gc, "
                            f"empty_cache and OOM events.")
            rows = [(figures.SERIES_STYLE.get(x.name, (x.name,))[0], x.source, x.values.size,
                     format_bytes(int(x.values.min())), format_bytes(int(x.values.max())),
                     format_bytes(int(x.values[-1]))) for x in tl.series]
            s.body.append(html.table(["series", "table", "samples", "min", "max", "last"], rows, (2, 3, 4, 5)))
        missing = [name for name, info in sorted(self.trace.meta.sources.items())
                   if not (info.get("available") if isinstance(info, dict) else info)]
        if missing:
            s.body.append(html.para(f"Sources absent from this trace (not drawn): {', '.join(missing)}."))

    def layer_footprint(self) -> None:
        s = self.section("layer-footprint", "Per-layer KV footprint")
        fp = data.layer_footprint(self.trace)
        if fp is None:
            self.none(s, "the trace has no KV rows")
            return
        state = (" Green hatched: the conv/recurrent state of hybrid layers at that step (constant in tokens; "
                 "stacked on the KV where a layer holds both)." if fp.state_layers.size else "")
        self.add_figure(s, "layer_footprint", figures.layer_footprint(fp),
                        "Bytes of each layer's K and V storage at the step where the KV total peaked, "
                        "coloured by layer type; black ticks: bytes of the tokens actually held." + state)
        by_type: dict[str, list[int]] = {}
        for code, a, v, u in zip(fp.layer_types, fp.bytes_allocated, fp.bytes_valid, fp.bytes_unique, strict=True):
            acc = by_type.setdefault(data.layer_type_name(code), [0, 0, 0, 0])
            acc[0] += 1
            acc[1] += int(a)
            acc[2] += int(v)
            acc[3] += int(u)
        rows = [(k, n, format_bytes(a), format_bytes(v), format_bytes(u)) for k, (n, a, v, u) in sorted(by_type.items())]
        if fp.state_layers.size:  # hybrid models (format 1.5 /state)
            total = int(fp.state_bytes.sum())
            rows.append(("conv/recurrent state", fp.state_layers.size, format_bytes(total), format_bytes(total), "-"))
        s.body.append(html.table(["layer type", "layers", "allocated", "valid", "unique"], rows, (1, 2, 3, 4)))

    def growth(self) -> None:
        s = self.section("growth-curves", "Growth against the analytical expectation")
        gc = data.growth_curves(self.trace)
        if gc is None:
            self.none(s, "the trace has no step rows")
            return
        self.add_figure(s, "growth_curves", figures.growth(gc),
                        f"Valid KV bytes per layer type against tokens seen (solid: measured; dashed: "
                        f"{gc.expectation_note}).")
        if gc.expected is None:
            s.body.append(html.absent(f"no expectation drawn: {gc.expectation_note}"))
            return
        m, e = gc.measured["total"], gc.expected["total"]
        equal = int(np.sum(m == e))
        worst = int(np.max(np.abs(m - e))) if m.size else 0
        cls = "ok" if equal == m.size else "sev-warning"
        s.body.append(
            f'<p class="{cls}">Measured valid KV bytes equal the expectation at {equal} of {m.size} steps '
            f"of request {gc.request}; largest difference {escape(format_bytes(worst))}.</p>"
        )

    def post_eos(self, mems: list[data.RequestMemory]) -> None:
        s = self.section("post-eos", "Post-EOS memory per request")
        fig = figures.post_eos(mems)
        if fig is None:
            self.none(s, "the trace has no labelled readings (baseline, after gc, after empty_cache)")
            return
        drawn, missing = figures.post_eos_bars(mems)
        self.add_figure(s, "post_eos", fig,
                        f"Drawn: {', '.join(drawn)}. KV alive after the request = its KV storages the recorder "
                        "still found alive (weak references, after gc.collect()) once the caller could drop the "
                        "output: proof of retention. Residual = what stays above the request's own baseline "
                        "after gc.collect() then torch.cuda.empty_cache(); process RSS also counts memory the C "
                        "allocator keeps after frees, so an RSS residual is a hint, not proof of retention.")
        if missing:
            self.absent_bars(s, missing)
        cols = [("baseline", lambda m: m.baseline_allocated), ("peak allocated", lambda m: m.peak_allocated),
                ("peak KV", lambda m: m.peak_kv), ("KV alive after", lambda m: m.kv_alive_after),
                ("after return", lambda m: m.after_return_allocated),
                ("after gc", lambda m: m.after_gc_allocated),
                ("after empty_cache", lambda m: m.after_empty_cache_allocated),
                ("residual (allocator)", lambda m: m.residual_allocated),
                ("residual (NVML)", lambda m: m.residual_nvml), ("baseline RSS", lambda m: m.baseline_rss),
                ("RSS after", lambda m: m.after_rss), ("residual (RSS)", lambda m: m.residual_rss)]
        cols = [(name, get) for name, get in cols if any(get(m) is not None for m in mems)]  # no all-n/a column
        holders = any(m.holders for m in mems)  # who keeps the retained KV, where the trace names it
        rows = [(m.request, data.device_text(m.device) if m.device >= -1 else "-",  # -2: no readings
                 *(_fmt(get(m)) for _, get in cols), *((", ".join(m.holders) or "-",) if holders else ()))
                for m in mems]
        s.body.append(html.table(["request", "device", *(name for name, _ in cols),
                                  *(("KV held by (types referring to it)",) if holders else ())], rows,
                                 tuple(range(2, 2 + len(cols)))))

    def absent_bars(self, s: html.Section, missing: list[str]) -> None:
        """Name what the post-EOS chart could not draw, and why (the sources the trace lacks)."""
        why = [f"{name} ({info.get('reason') or 'not recorded'})" for name, info in sorted(self.trace.meta.sources.items())
               if name in ("allocator", "nvml", "process_rss") and isinstance(info, dict) and not info.get("available")]
        s.body.append(html.absent(f"{'; '.join(missing)}. Absent sources: {'; '.join(why)}." if why else
                                  f"{'; '.join(missing)}: the trace has no labelled readings for them."))

    def allocator_state(self, mems: list[data.RequestMemory]) -> None:
        s = self.section("allocator-state", "Allocator state at end of generation")
        fig = figures.allocator_end(mems)
        if fig is None:
            self.none(s, "no allocator reading at the end of any request (CUDA allocator absent or not sampled)")
            return
        self.add_figure(s, "allocator_end", fig,
                        "reserved - allocated (memory the caching allocator holds but no tensor uses) and "
                        "inactive split bytes, when generate returned.")
        rows = [(m.request, m.device, _fmt(m.end_reserved), _fmt(m.end_allocated), _fmt(m.end_gap),
                 _fmt(m.end_inactive_split)) for m in mems if m.end_gap is not None]
        s.body.append(html.table(["request", "device", "reserved", "allocated", "reserved - allocated",
                                  "inactive split"], rows, (2, 3, 4, 5)))

    def findings(self, rows: list[findings.FindingRow] | None, note: str,
                 statuses: list[findings.DetectorStatus]) -> None:
        s = self.section("findings", "Findings")
        if rows is None:
            self.none(s, note)
            return
        if not rows:
            ran = sum(st.status == "ran" for st in statuses)
            s.body.append(f'<p class="ok">No findings ({ran} of {len(statuses)} detectors ran; '
                          "the others are listed below with why).</p>" if statuses else
                          '<p class="ok">The analyser reported no findings.</p>')
        else:
            cells = []
            for r in rows:
                where = ", ".join(x for x in (
                    _span("request", r.requests), _span("step", r.steps), _span("layer", r.layers)) if x)
                cells.append([
                    f'<span class="sev-{escape(r.severity)}">{escape(r.severity)}</span>',
                    escape(r.detector) + (f"<br><small>{escape(r.kind)}</small>" if r.kind else ""),
                    "" if r.score is None else f"{r.score:.2f}", escape(where), escape(r.message),
                    escape(r.evidence_text()),
                    _code(fixes.fix_for(r.detector, r.kind)) if fixes.is_actionable(r) else "",
                ])
            s.body.append(html.raw_table(["severity", "detector", "score", "where", "message", "evidence",
                                          "fix"], cells))
        not_run = [st for st in statuses if st.status != "ran"]
        if not_run:
            s.body.append(html.table(["detector", "status", "why"], [(st.name, st.status, st.reason)
                                                                   for st in not_run]))
        if note:
            s.body.append(html.para(note))

    def verdict(self, rows: list[findings.FindingRow] | None, note: str,
                statuses: list[findings.DetectorStatus]) -> None:
        """The first section: healthy, or the findings at medium and above with their fixes."""
        s = html.Section("verdict", "Verdict")
        self.sections.insert(0, s)
        v = fixes.verdict(rows, sum(st.status == "ran" for st in statuses), len(statuses), note)
        cls = {True: "ok", False: "sev-high", None: "absent"}[v.healthy]
        s.body.append(f'<p class="verdict {cls}" data-verdict="'
                      f'{ {True: "healthy", False: "attention", None: "none"}[v.healthy] }">{escape(v.headline)}</p>')
        if v.findings:
            s.body.append(html.raw_table(["severity", "finding", "fix"], [[
                f'<span class="sev-{escape(r.severity)}">{escape(r.severity)}</span>',
                f"<b>{escape(r.detector)}</b> {escape(r.kind)}<br>{escape(r.message)}",
                _code(fixes.fix_for(r.detector, r.kind)),
            ] for r in v.findings]))

    def heatmaps(self) -> None:
        s = self.section("heatmaps", "Sampled contents: head norms and attention entropy")
        if self.trace.nrows("payloads/index") == 0:  # the contents decide, not the /meta flag
            self.none(s, "this trace holds no sampled tensor contents (record with payload sampling to get them)")
            return
        requests = contents.sampled_requests(self.trace)
        shown = requests[-MAX_HEATMAP_REQUESTS:]
        per_request = {r: contents.head_norm_heatmaps(self.trace, r) for r in shown}
        contents.shared_scale([hm for maps in per_request.values() for hm in maps])
        entropies = {r: contents.entropy_heatmap(self.trace, request=r) for r in shown}
        first: dict[int, str] = {}
        for r in shown:
            for hm in per_request[r]:
                name = f"heatmap_{hm.title.split()[0]}_norms_r{r}"
                first.setdefault(r, name)
                self.add_figure(s, name, figures.heatmap(hm), f"{hm.title}, request {r}: {hm.note}; {hm.scale_note}.")
            ent = entropies[r]
            if ent is not None:
                name = f"heatmap_attention_entropy_r{r}"
                first.setdefault(r, name)
                self.add_figure(s, name, figures.heatmap(ent), f"{ent.title}, request {r}: {ent.note}; no mask "
                                f"or attention sinks applied; {ent.scale_note}.")
        if first:  # the selection: a link to each request's pictures (the page runs no scripts)
            links = " · ".join(f'<a href="#fig-{escape(name)}">request {r}</a>' for r, name in first.items())
            more = (f" (the last {len(shown)} of {len(requests)} requests with samples)"
                    if len(shown) < len(requests) else "")
            s.lead.append(f'<p class="select">Jump to: {links}{escape(more)}</p>')
        if not any(per_request.values()):
            s.body.append(html.absent("no sampled keys or values in a shape the report reads ([B, H, T, D])"))
        if not any(e is not None for e in entropies.values()):
            s.body.append(html.absent("attention entropy needs sampled queries with the keys of the same "
                                      "layer and step; this trace has none"))

    def data_quality(self) -> None:
        s = self.section("data-quality", "Data quality")
        q = quality.assess(self.trace)
        problems = q.problems
        if not problems:
            s.body.append('<p class="ok">No dropped samples, no unavailable sources, no recorder errors, '
                          'no telemetry clock gaps; the trace was closed cleanly.</p>')
        else:
            s.body.append("<ul>" + "".join(f"<li>{escape(p)}</li>" for p in problems) + "</ul>")
        if q.recorder_error_messages:
            s.body.append(html.table(["recorder error"], [(m,) for m in q.recorder_error_messages]))
        if q.clock_gap_list:
            s.body.append(html.table(
                ["table", "device", "at (s since anchor)", "gap (s)", "sampling period (s)"],
                [(g.table, g.device, f"{(g.start_ns - self.trace.meta.clock_anchor_mono_ns) / 1e9:.3f}",
                  f"{g.gap_ns / 1e9:.3f}", f"{g.period_ns / 1e9:.4f}") for g in q.clock_gap_list],
                (2, 3, 4)))


def write_report(
    trace_path: str | os.PathLike[str],
    out_html: str | os.PathLike[str],
    figures_dir: str | os.PathLike[str] | None = None,
    *,
    analysis: AnalysisReport | None = None,
    run_analyzer: bool = True,
    progress: Progress | None = None,
    whatif: WhatIf = None,
) -> Path:
    """Write the HTML report of `trace_path` to `out_html`; returns its path.

    `figures_dir`: also write every figure there as PNG and SVG. `analysis`: an analyser report
    already computed (else kvtrace.analyze runs unless `run_analyzer` is False). `progress` is
    called with each stage name of STAGES as it starts.
    """
    return build_report(trace_path, out_html, figures_dir, analysis=analysis,
                        run_analyzer=run_analyzer, progress=progress, whatif=whatif).html


def build_report(
    trace_path: str | os.PathLike[str],
    out_html: str | os.PathLike[str],
    figures_dir: str | os.PathLike[str] | None = None,
    *,
    analysis: AnalysisReport | None = None,
    run_analyzer: bool = True,
    progress: Progress | None = None,
    whatif: WhatIf = None,
) -> ReportResult:
    """write_report, returning what was written and which sections had nothing to draw."""
    out = Path(out_html)
    fig_dir = Path(figures_dir) if figures_dir is not None else None
    made = _prepare_output(out, fig_dir)
    try:
        figures._plt()  # fail early, before reading the trace, when matplotlib is missing
        with Trace(trace_path) as trace:
            return render(trace, analysis, out, fig_dir, run_analyzer=run_analyzer, progress=progress,
                          whatif=whatif)
    except BaseException:  # the figures directory this call made goes with its failure (render empties it)
        if made is not None:
            with contextlib.suppress(OSError):
                made.rmdir()
        raise


def render(
    trace: Trace,
    analysis: AnalysisReport | None,
    out_html: str | os.PathLike[str],
    figures_dir: str | os.PathLike[str] | None = None,
    *,
    run_analyzer: bool = True,
    progress: Progress | None = None,
    whatif: WhatIf = None,
) -> ReportResult:
    """The HTML renderer: the page of an open trace and its analysis. Without `analysis`,
    kvtrace.analyze runs on the same trace (unless `run_analyzer` is False). `whatif`: the what-if
    section's policies and ratios, True for the defaults, False for none; None: the defaults when
    the trace holds sampled contents."""
    out = Path(out_html)
    fig_dir = Path(figures_dir) if figures_dir is not None else None
    made = _prepare_output(out, fig_dir)
    figures._plt()
    figure_files = _FigureFiles(fig_dir) if fig_dir is not None else None
    try:
        b = _Builder(trace, figure_files, progress)
        b.progress("overview")
        summary = summarize(trace)
        b.overview(summary)
        b.progress("memory-timeline")
        b.memory_timeline()
        b.progress("layer-footprint")
        b.layer_footprint()
        b.progress("growth-curves")
        b.growth()
        b.progress("post-eos")
        mems = data.request_memory(trace)
        b.post_eos(mems)
        b.progress("allocator-state")
        b.allocator_state(mems)
        b.progress("findings")
        note = ""
        if analysis is None and run_analyzer:
            analysis, note = findings.run_analysis(trace)
            note = "" if analysis is not None else note  # the table is the analyser's; no caption
        elif analysis is None:
            note = "analysis skipped (--no-analysis)"
        rows = None if analysis is None else findings.flatten(analysis)
        statuses = [] if analysis is None else findings.detector_statuses(analysis)
        b.findings(rows, note, statuses)
        b.verdict(rows, note, statuses)
        b.progress("heatmaps")
        b.heatmaps()
        b.progress("whatif")
        whatif_section.add(b, whatif)
        b.progress("data-quality")
        b.data_quality()
        b.progress("write")
        title = f"kvtrace report: {summary['model']['id']}"
        header = [f"trace {summary['path']}",
                  f"{summary['requests']['count']} requests, {summary['layers']['count']} layers, "
                  f"format {summary['format_version']}"]
        page = html.render(title, header, b.sections,
                           f"Generated by kvtrace {__version__}. Self-contained: no network access needed. "
                           "Sizes in binary units (KiB = 1024 B).")
        html.write_page(out, page)
        if figure_files is not None:
            figure_files.commit()
    except BaseException:  # no partial --figures: the staged files go, and the directory if this made it
        if figure_files is not None:
            figure_files.discard()
        if made is not None:
            with contextlib.suppress(OSError):
                made.rmdir()  # only when empty
        raise
    return ReportResult(out, b.written, [s.id for s in b.sections], b.absent,
                        None if rows is None else len(rows))


def _prepare_output(out: Path, fig_dir: Path | None) -> Path | None:
    """Check the page's path and make the figures directory; returns it when this call made it."""
    if out.exists() and out.is_dir():
        raise CannotWrite(f"{out}: is a directory")
    if not out.parent.exists():
        raise CannotWrite(f"{out.parent}: directory does not exist")
    if fig_dir is not None:
        existed = fig_dir.exists()
        try:
            fig_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CannotWrite(f"{fig_dir}: cannot create figures directory ({exc.strerror})") from None
        return None if existed else fig_dir
    return None
