"""What ``kvtrace loadtest`` prints and its JSON document (spec/cli.md, "kvtrace loadtest")."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import click

from kvtrace.serving.drive import DriveResult, PhaseRun
from kvtrace.serving.latency import summary
from kvtrace.serving.verdict import PhaseVerdict


def _seconds(x: float) -> str:
    return "-" if x < 0 else (f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s")


def _phase_line(run: PhaseRun) -> str:
    p = run.phase
    if p.requests == 0:
        return f"idle {p.idle_s:g} s"
    return f"{p.requests} request(s), {p.concurrency} at once, {p.prompt_tokens} prompt words"


def print_run(result: DriveResult, verdicts: list[PhaseVerdict], trace: str | None, table: str | None) -> None:
    click.echo(f"loadtest {result.url}: phase markers {'posted' if result.markers else 'not taken (not kvtrace serve)'}, "
               f"live status {'sampled' if result.live_status else f'not sampled ({result.live_unavailable})'}"
               + (f", trace {trace}" if trace else ""))
    if result.warmup:
        ok = sum(r.ok for r in result.warmup)
        click.echo(f"warm-up   {ok}/{len(result.warmup)} ok (not judged; first status: {result.warmup[0].status})")
    for run, verdict in zip(result.runs, verdicts, strict=True):
        click.echo(f"\nphase {run.phase.name} ({_phase_line(run)}, {run.end_s - run.start_s:.1f} s): "
                   f"{verdict.level.upper()}")
        if run.results:
            s = summary(run.results, run.end_s - run.start_s)
            rate = f"{s['output_tokens_per_s']:.1f} output tokens/s" if s["output_tokens_per_s"] >= 0 else ""
            click.echo(f"  latency   {s['ok']}/{s['requests']} ok, TTFT p50 {_seconds(s['ttft_p50_s'])} "
                       f"p95 {_seconds(s['ttft_p95_s'])}, ITL p50 {_seconds(s['itl_p50_s'])}, end-to-end p50 "
                       f"{_seconds(s['e2e_p50_s'])}, {rate}")
        for c in verdict.checks:
            value = c.value or "-"
            click.echo(f"  {c.name:<18} {c.level:<13} {value}  [{c.rule}; {c.source}]")
    if table:
        click.echo(f"\nlatency table: {table} (one row per request, seconds)")
    if trace:
        click.echo(f"the serving detectors over the whole recording: kvtrace analyze {trace}")


def document(result: DriveResult, verdicts: list[PhaseVerdict], trace: str | None, table: str | None) -> dict[str, Any]:
    phases = []
    for run, verdict in zip(result.runs, verdicts, strict=True):
        phases.append({
            "phase": asdict(run.phase), "start_s": run.start_s, "end_s": run.end_s, "marker": run.marker,
            "health": run.health, "live_samples": len(run.samples), "live_unavailable": run.status_unavailable,
            "latency": summary(run.results, run.end_s - run.start_s) if run.results else None,
            "verdict": verdict.level, "checks": [asdict(c) for c in verdict.checks],
            "requests": [asdict(r) for r in run.results],
        })
    return {"url": result.url, "started_unix": result.started_unix, "warmup": [asdict(r) for r in result.warmup],
            "markers": result.markers, "bounds": asdict(result.bounds), "live_status": result.live_status,
            "live_unavailable": result.live_unavailable, "trace": trace, "latency_table": table, "phases": phases}
