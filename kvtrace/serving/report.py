"""What ``kvtrace loadtest`` prints and its JSON document (spec/cli.md, "kvtrace loadtest")."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import click

from kvtrace.progress import Milestones
from kvtrace.serving.client import RequestResult
from kvtrace.serving.drive import DriveResult, PhaseRun
from kvtrace.serving.latency import summary
from kvtrace.serving.verdict import PhaseVerdict, judge_phase, worst

# Within a phase, a "requests answered" line at most this often (a 64-request phase is one line per
# batch of answers, not 64 lines); a phase's start and end always get theirs.
REQUEST_LINE_EVERY_S = 5.0


def _seconds(x: float) -> str:
    return "-" if x < 0 else (f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s")


def _phase_line(run: PhaseRun) -> str:
    p = run.phase
    if p.requests == 0:
        return f"idle {p.idle_s:g} s"
    return f"{p.requests} request(s), {p.concurrency} at once, {p.prompt_tokens} prompt words"


class LiveProgress:
    """``DriveConfig.on_progress`` of the CLI: a line as each phase starts, answered requests in
    batches, and each phase's verdict as it ends (from the live numbers: the trace's are read once
    the run is over, and the closing report judges with them). Lines are flushed as written, so a
    pipe sees them as they happen; with --json they go to stderr."""

    def __init__(self, steps: Milestones, max_tokens: int, clock: Any = time.monotonic) -> None:
        self.steps = steps
        self.max_tokens = max_tokens
        self._clock = clock
        self._history: list[int] = []  # context tokens of the run's answered requests (the verdict's)
        self._done = 0
        self._last_line = 0.0

    def __call__(self, what: str, run: PhaseRun | None, result: RequestResult | None) -> None:
        say = self.steps.say
        if what == "warmup" and result is not None:
            say(f"warm-up request {result.index}: {result.status}" + (
                f", end-to-end {_seconds(result.e2e_s)}" if result.ok else ""))
        elif what == "phase_start" and run is not None:
            self._done, self._last_line = 0, self._clock()
            say(f"phase {run.phase.name}: {_phase_line(run)} ...")
        elif what == "request" and run is not None and result is not None:
            self._done += 1
            if result.ok:
                self._history.append(result.context_tokens)
            now = self._clock()
            if self._done < run.phase.requests and now - self._last_line >= REQUEST_LINE_EVERY_S:
                self._last_line = now
                say(f"  {self._done}/{run.phase.requests} requests answered")
        elif what == "phase_end" and run is not None:
            verdict = judge_phase(run, None, list(self._history), self.max_tokens)
            ok = sum(r.ok for r in run.results)
            answered = f"{ok}/{len(run.results)} ok, " if run.results else ""
            say(f"phase {run.phase.name} done in {run.end_s - run.start_s:.1f} s: {answered}"
                f"verdict {verdict.level.upper()} (live numbers; the closing report adds the trace's)")


def overall_line(verdicts: list[PhaseVerdict]) -> str:
    """One line: the worst phase verdict, and which checks of which phases made it."""
    level = worst([v.level for v in verdicts])
    why = [f"{v.phase}: {c.name} {c.value}".rstrip() for v in verdicts for c in v.checks
           if level in ("warning", "critical") and c.level == level]
    return f"overall verdict: {level.upper()}" + (f" ({'; '.join(why[:4])}"
                                                   + (f"; +{len(why) - 4} more" if len(why) > 4 else "") + ")"
                                                   if why else "")


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
    click.echo(overall_line(verdicts))


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
