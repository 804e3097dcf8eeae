"""Terminal report (rich): what was analysed, a summary per request, a findings table and the
detectors that could not run and why. Every size in binary units."""

from __future__ import annotations

import os
from typing import IO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvtrace.analyzer.notes import note_lines
from kvtrace.analyzer.report import AnalysisReport
from kvtrace.labels import device_text
from kvtrace.textsafe import SafeConsoleMixin, visible
from kvtrace.units import format_bytes, format_ns

_STYLE = {"info": "dim", "low": "cyan", "medium": "yellow", "high": "bold red", "critical": "bold white on red"}


def _b(value: int | None) -> str:
    return "-" if value is None else format_bytes(value)


class _PipeConsole(SafeConsoleMixin, Console):
    """A closed stdout (`| head`) raises BrokenPipeError for the CLI to exit quietly with its
    documented code, instead of rich's SystemExit(1) (1 means an invalid trace here). Text from
    traces is data (kvtrace.textsafe): no control character reaches the terminal, no emoji codes."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError("stdout closed")


def console_for(file: IO[str] | None = None, width: int | None = None) -> Console:
    """The console every command prints through. Markup is off: a string is printed as it is
    written (a model id of ``[/bold]x`` included); a line that styles text says so with
    ``markup=True`` and escapes what it interpolates (kvtrace.textsafe.markup), or uses ``style=``."""
    c = _PipeConsole(file=file, highlight=False, soft_wrap=False, markup=False)
    if not c.is_terminal:
        # Pipes and CI logs: plain text, as wide as COLUMNS says (140 by default).
        cols = os.environ.get("COLUMNS", "")
        c = _PipeConsole(file=file, highlight=False, width=width or (int(cols) if cols.isdigit() else 140),
                         no_color=True, markup=False)
    return c


def render(report: AnalysisReport, console: Console, *, show_info: bool = True) -> None:
    t = report.trace
    state = "complete" if t["complete"] else "INCOMPLETE (writer did not close it)"
    console.print(Text(f"kvtrace analysis of {visible(t['path'])}", style="bold"))
    devices = "; ".join(
        visible(device_text(d["index"], d["name"]))
        + (f" ({format_bytes(d['total_memory_bytes'])})" if d["total_memory_bytes"] > 0 else "")
        for d in report.devices
    ) or "unknown"
    console.print(f"model   {visible(report.model['id'])} ({visible(report.model['type'])})")
    console.print(f"device  {devices}")
    sw = report.software
    console.print(f"trace   format {visible(t['format_version'])}, {state}; recorded with torch {visible(sw['torch'])}, "
                  f"transformers {visible(sw['transformers'])}")
    exp = report.expectation
    note = f" ({'; '.join(visible(n) for n in exp['notes'])})" if exp["notes"] else ""
    console.print(f"expect  from the {exp['source']}{note}")
    for i, line in enumerate(note_lines(report.notes, report.notes_unlisted)):
        console.print(f"{'notes' if i == 0 else '':<8}{visible(line)}")

    _requests_tables(report, console)

    findings = [f for f in report.findings if show_info or f.score > 0.1]
    ft = Table(title="Findings", title_justify="left", show_lines=True)
    ft.add_column("severity")
    ft.add_column("score", justify="right")
    ft.add_column("detector")
    ft.add_column("finding", ratio=1)
    for f in findings:
        sev = f.severity.label
        ft.add_row(Text(sev, style=_STYLE[sev]), f"{f.score:.2f}", Text(f"{visible(f.detector)}\n{visible(f.kind)}"),
                   Text(visible(f.message, multiline=True)))
    if findings:
        console.print(ft)
    else:
        console.print("Findings: none")
    skipped = [r for r in report.results if r.status != "ran"]
    groups: dict[tuple[str, str], list[str]] = {}  # one line per reason (8 serving detectors share one)
    for r in skipped:
        groups.setdefault((r.status, r.reason), []).append(r.name)
    for (status, reason), names in groups.items():
        console.print(f"{status:8s}{', '.join(names)}: {visible(reason)}")
    if report.contents is not None:
        render_contents(report.contents, console)
    worst = report.max_severity
    console.print(f"{len(report.findings)} finding(s), worst: {worst.label if worst is not None else 'none'}; "
                  f"{sum(r.status == 'ran' for r in report.results)} detector(s) ran, {len(skipped)} did not. "
                  "Sizes in binary units (KiB = 1024 B).")


# Requests table columns: (header, cell of one request, part). Part 0 is the request and its
# tokens, part 1 its memory; at 80 columns the two parts print as two tables.
_REQUEST_COLUMNS = (
    ("req", lambda r: str(r["request"]), 0),
    ("outcome", lambda r: r["outcome"], 0),
    ("batch", lambda r: str(r["batch_size"]), 0),
    ("prompt", lambda r: f"{r['prompt_tokens']:,}", 0),
    ("new", lambda r: f"{r['new_tokens']:,}", 0),
    ("tokens", lambda r: f"{r['final_tokens']:,}", 0),
    ("time", lambda r: format_ns(r["duration_ns"]) if r["duration_ns"] is not None else "-", 0),
    ("peak KV", lambda r: _b(r["peak_kv_bytes"]), 1),
    ("state", lambda r: _b(r.get("state_bytes")), 1),  # hybrid models only (drawn when a request has it)
    ("baseline", lambda r: _b(r["baseline_allocated_bytes"]), 1),
    ("peak alloc", lambda r: _b(r["peak_allocated_bytes"]), 1),
    ("retained", lambda r: _b(r["retained_allocated_bytes"]), 1),
    ("KV alive after", lambda r: _b(r["kv_alive_after_request_bytes"]), 1),
)


def _requests_tables(report: AnalysisReport, console: Console) -> None:
    """The Requests table, folded to the console's width: columns no request has a value for
    are named below instead of drawn as dashes, and when one table would not fit the tokens
    and the memory columns print as two tables (cells never wrap or get cut)."""
    columns = [c for c in _REQUEST_COLUMNS if c[0] != "state" or any("state_bytes" in r for r in report.requests)]
    cells = {h: [get(r) for r in report.requests] for h, get, _ in columns}
    empty = [h for h, _, part in columns if part and report.requests and all(v == "-" for v in cells[h])]
    cols = [(h, part) for h, _, part in columns if h not in empty]
    # rich's default box: 1 border + 2 padding per column, plus the closing border
    need = 1 + sum(3 + max(len(h), *(len(v) for v in cells[h]), 0) for h, _ in cols)
    parts = [[h for h, _ in cols]] if need <= console.width else [
        [h for h, p in cols if p == 0], ["req", *(h for h, p in cols if p == 1)]]
    for i, headers in enumerate(parts):
        title = "Requests" if len(parts) == 1 else ("Requests: tokens", "Requests: memory")[i]
        t = Table(title=title, title_justify="left", show_lines=False)
        for h in headers:
            t.add_column(h, justify="left" if h == "outcome" else "right", no_wrap=True)
        for k in range(len(report.requests)):
            t.add_row(*(cells[h][k] for h in headers))
        console.print(t)
    if empty:
        console.print(f"not measured (no allocator readings in this trace): {', '.join(empty)}")


def _ratio_list(values: list[float | None]) -> str:
    return " ".join("-" if v is None else f"{v:.2f}" for v in values)


def render_contents(contents: dict, console: Console) -> None:
    """The "Contents" section: analyses of sampled K/V/Q/latents (kvtrace.analyzer.contents)."""
    if contents["status"] != "ran":
        console.print(f"Contents: skipped: {visible(contents['reason'])}")
        return
    console.print(Text(f"Contents of {contents['payloads']} sampled tensor(s), backend {visible(contents['backend'])}",
                       style="bold"))
    if contents["device_note"]:
        console.print(f"note    {visible(contents['device_note'])}")
    if contents["dead_heads"]:
        t = Table(title="KV heads (V mean norm / layer median; dead < threshold)", title_justify="left")
        for col in ("req", "step", "layer", "type", "heads", "tokens", "V ratio", "K ratio", "dead", "bytes/head",
                    "dead bytes"):
            t.add_column(col, justify="left" if col in ("type", "V ratio", "K ratio", "dead") else "right")
        for d in contents["dead_heads"]:
            t.add_row(str(d["request"]), str(d["step"]), str(d["layer"]), d["layer_type"],
                      f"{len(d['heads'])}/{d['kv_heads']}", f"{d['tokens']:,}", _ratio_list(d["value_ratio"]),
                      _ratio_list(d["key_ratio"]), ",".join(map(str, d["dead"])) or "none",
                      _b(d["bytes_per_head"]), _b(d["bytes_dead"]))
        console.print(t)
    if contents["entropy"]:
        t = Table(title="Attention entropy per query head (mean normalised; low < 0.3 streaming, high >= 0.7)",
                  title_justify="left")
        for col in ("req", "layer", "type", "queries used", "entropy", "low (streaming)", "high", "KV heads all low"):
            t.add_column(col, justify="right" if col in ("req", "layer", "queries used") else "left")
        for e in contents["entropy"]:
            t.add_row(str(e["request"]), str(e["layer"]), e["layer_type"],
                      f"{e['queries_used']}/{e['queries_sampled']}", _ratio_list(e["mean_norm_entropy"]),
                      ",".join(str(e["query_heads"][i]) for i in e["low"]) or "none",
                      ",".join(str(e["query_heads"][i]) for i in e["high"]) or "none",
                      ",".join(map(str, e["kv_low"])) or "none")
        console.print(t)
    if contents["eviction"]:
        t = Table(title="Eviction what-ifs (bytes freed count K and V, all KV heads)", title_justify="left")
        for col in ("req", "step", "layer", "policy", "tokens", "kept", "evicted", "freed", "of", "mass kept"):
            t.add_column(col, justify="left" if col == "policy" else "right")
        for v in contents["eviction"]:
            p = v["params"]
            pol = (f"h2o {p['heavy']}+{p['recent']}" if v["policy"] == "h2o"
                   else f"streaming {p['sinks']}+{p['window']}")
            mass = ("-" if v["mass_retained_mean"] is None
                    else f"{v['mass_retained_mean']:.1%} (min {v['mass_retained_min']:.1%})")
            t.add_row(str(v["request"]), str(v["step"]), str(v["layer"]), pol, f"{v['tokens']:,}", f"{v['kept']:,}",
                      f"{v['evicted']:,}", _b(v["bytes_freed"]), _b(v["bytes_total"]), mass)
        console.print(t)
    if contents["mla"]:
        t = Table(title="MLA latents (c_KV spectrum)", title_justify="left")
        for col in ("req", "step", "layer", "tokens", "rank r", "eff. rank", "90%", "99%", "structural", "effective"):
            t.add_column(col, justify="right")
        for m in contents["mla"]:
            eff = m["effective_ratio"]
            t.add_row(str(m["request"]), str(m["step"]), str(m["layer"]), f"{m['num_tokens']:,}",
                      str(m["kv_lora_rank"]), f"{m['effective_rank']:.1f}", str(m["energy_rank_90"]),
                      str(m["energy_rank_99"]), f"{m['structural_ratio']:.1f}x",
                      "-" if eff is None else f"{eff:.1f}x")
        console.print(t)
    reasons: dict[tuple[str, str], list[str]] = {}
    for s in contents["skipped"]:
        reasons.setdefault((s["analysis"], s["reason"]), []).append(f"{s['request']}/{s['layer']}")
    for (analysis, reason), where in reasons.items():
        console.print(f"not run {analysis} (request/layer {', '.join(where)}): {visible(reason)}")
