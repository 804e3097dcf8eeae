"""Terminal report (rich): what was analysed, a summary per request, a findings table and the
detectors that could not run and why. Every size in binary units."""

from __future__ import annotations

import os
from typing import IO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvtrace.analyzer.report import AnalysisReport
from kvtrace.units import format_bytes, format_ns

_STYLE = {"info": "dim", "low": "cyan", "medium": "yellow", "high": "bold red", "critical": "bold white on red"}


def _b(value: int | None) -> str:
    return "-" if value is None else format_bytes(value)


def console_for(file: IO[str] | None = None, width: int | None = None) -> Console:
    c = Console(file=file, highlight=False, soft_wrap=False)
    if not c.is_terminal:
        # Pipes and CI logs: plain text, as wide as COLUMNS says (140 by default).
        cols = os.environ.get("COLUMNS", "")
        c = Console(file=file, highlight=False, width=width or (int(cols) if cols.isdigit() else 140),
                    no_color=True)
    return c


def render(report: AnalysisReport, console: Console, *, show_info: bool = True) -> None:
    t = report.trace
    state = "complete" if t["complete"] else "INCOMPLETE (writer did not close it)"
    console.print(Text(f"kvtrace analysis of {t['path']}", style="bold"))
    devices = "; ".join(
        f"{d['label']} {d['name']}" + (f" ({format_bytes(d['total_memory_bytes'])})" if d["total_memory_bytes"] > 0 else "")
        for d in report.devices
    ) or "unknown"
    console.print(f"model   {report.model['id']} ({report.model['type']})")
    console.print(f"device  {devices}")
    sw = report.software
    console.print(f"trace   format {t['format_version']}, {state}; recorded with torch {sw['torch']}, "
                  f"transformers {sw['transformers']}")
    exp = report.expectation
    note = f" ({'; '.join(exp['notes'])})" if exp["notes"] else ""
    console.print(f"expect  from the {exp['source']}{note}")

    req = Table(title="Requests", title_justify="left", show_lines=False)
    for col in ("req", "outcome", "batch", "prompt", "new", "tokens", "peak KV", "baseline", "peak alloc",
                "retained", "KV alive after", "time"):
        req.add_column(col, justify="right" if col not in ("outcome",) else "left")
    for r in report.requests:
        req.add_row(
            str(r["request"]), r["outcome"], str(r["batch_size"]), f"{r['prompt_tokens']:,}",
            f"{r['new_tokens']:,}", f"{r['final_tokens']:,}", _b(r["peak_kv_bytes"]),
            _b(r["baseline_allocated_bytes"]), _b(r["peak_allocated_bytes"]), _b(r["retained_allocated_bytes"]),
            _b(r["kv_alive_after_request_bytes"]),
            format_ns(r["duration_ns"]) if r["duration_ns"] is not None else "-",
        )
    console.print(req)

    findings = [f for f in report.findings if show_info or f.score > 0.1]
    ft = Table(title="Findings", title_justify="left", show_lines=True)
    ft.add_column("severity")
    ft.add_column("score", justify="right")
    ft.add_column("detector")
    ft.add_column("finding", ratio=1)
    for f in findings:
        sev = f.severity.label
        ft.add_row(Text(sev, style=_STYLE[sev]), f"{f.score:.2f}", f"{f.detector}\n{f.kind}", f.message)
    if findings:
        console.print(ft)
    else:
        console.print("Findings: none")
    skipped = [r for r in report.results if r.status != "ran"]
    for r in skipped:
        console.print(f"{r.status:8s}{r.name}: {r.reason}")
    worst = report.max_severity
    console.print(f"{len(report.findings)} finding(s), worst: {worst.label if worst is not None else 'none'}; "
                  f"{sum(r.status == 'ran' for r in report.results)} detector(s) ran, {len(skipped)} did not. "
                  "Sizes in binary units (KiB = 1024 B).")
