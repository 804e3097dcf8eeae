"""`kvtrace loadtest`: the four-phase KV-cache diagnosis against an OpenAI-compatible endpoint."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click

from kvtrace import exitcodes
from kvtrace.commands.common import fail, guarded
from kvtrace.commands.outputs import json_options
from kvtrace.errors import CannotWrite, Unavailable
from kvtrace.params import split_list

FAIL_LEVELS = ("warning", "critical")


def base_url(url: str) -> str:
    """http(s)://host[:port][/prefix] without a trailing slash or /v1 (the routes are added)."""
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # 'http://[::1': an unclosed IPv6 bracket
        raise click.BadParameter(f"{url!r} is not an http(s) URL: {exc}", param_hint="URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise click.BadParameter(f"{url!r} is not an http(s) URL (e.g. http://127.0.0.1:8000)", param_hint="URL")
    try:
        parts.port  # noqa: B018 - raises for a port that is not a number
    except ValueError as exc:
        raise click.BadParameter(f"{url!r}: {exc}", param_hint="URL") from None
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return f"{parts.scheme}://{parts.netloc}{path}"


def default_table(trace: str | None) -> str | None:
    """Beside the trace: run.kvt.h5 -> run.latency.csv."""
    if trace is None:
        return None
    name = Path(trace).name
    for suffix in (".kvt.h5", ".h5", ".hdf5"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return str(Path(trace).with_name(name + ".latency.csv"))


@click.command("loadtest")
@click.argument("url", metavar="URL")
@click.option("--phases", default="baseline,single,concurrent,long", show_default=True,
              help="Phases to run, comma-separated, always in protocol order.")
@click.option("--concurrency", type=click.IntRange(min=1), default=10, show_default=True,
              help="Requests sent at once in the concurrent phase.")
@click.option("--tokens", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Prompt length (words, about one token each) of the single and concurrent phases.")
@click.option("--long-tokens", type=click.IntRange(min=1), default=16384, show_default=True,
              help="Prompt length of the long-context phase.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="Tokens to generate per request at most (the request's max_tokens).")
@click.option("--baseline-s", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="How long the idle baseline phase lasts.")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True,
              help="Short requests (8 words, 2 tokens) before the first phase: what the server starts lazily "
                   "(transformers serve's batching manager and KV pool) is then not timed in a phase.")
@click.option("--api", type=click.Choice(["completions", "chat"]), default="completions", show_default=True,
              help="/v1/completions (the prompt as is) or /v1/chat/completions (one user message).")
@click.option("--model", default=None, metavar="NAME", help="The request's model field (default: omitted; "
              "servers pinned to one model, as kvtrace serve, need none).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=600.0,
              show_default=True, help="Seconds a request may wait for its next bytes (and 10 s at most to connect); "
                                      "/health, /kvtrace/status and /kvtrace/phase must answer in full within it.")
@click.option("--request-timeout", "request_s", type=click.FloatRange(min=0, min_open=True), default=1800.0,
              show_default=True, help="Seconds a completion request may take in all, from sending it to the last "
                                      "byte of its answer (a stream that never ends is cut here).")
@click.option("--max-line-bytes", type=click.IntRange(min=1024), default=1 << 20, show_default=True,
              help="Bytes one SSE line, or one JSON answer read whole (/kvtrace/status, /health, an error, a "
                   "non-streamed completion), may hold.")
@click.option("--max-answer-bytes", type=click.IntRange(min=1024), default=8 << 20, show_default=True,
              help="Bytes one answer may hold in all (a whole stream included).")
@click.option("--max-in-flight", type=click.IntRange(min=1), default=256, show_default=True,
              help="Requests sent and not yet answered, at once (--concurrency may not exceed it).")
@click.option("--poll", "poll_s", type=click.FloatRange(min=0.01), default=0.25, show_default=True,
              help="Seconds between live samples of GET /kvtrace/status (kvtrace serve only).")
@click.option("--trace", default=None, metavar="TRACE",
              help="The recording of this server (kvtrace serve -o TRACE): read after the run for the "
                   "recorder's numbers per phase (a running server's trace is read as of its last flush).")
@click.option("--attach", "attach_out", default=None, type=click.Path(dir_okay=False), metavar="ENGINE_TRACE",
              help="Record the engine (vLLM) while the phases run: kvtrace attach URL into ENGINE_TRACE, with a "
                   "phase marker before each phase; the verdicts then read it as --trace. Never an existing file.")
@click.option("--events", default=None, metavar="ENDPOINT",
              help="With --attach: the engine's KV-event endpoint to bind (as kvtrace attach --events).")
@click.option("--replay", default=None, metavar="ENDPOINT",
              help="With --attach: the engine's replay endpoint (as kvtrace attach --replay).")
@click.option("--topic", default="", help="With --attach: the engine's KV-event topic.")
@click.option("-o", "--output", default=None, type=click.Path(dir_okay=False), metavar="LATENCY_CSV",
              help="Per-request latency table (CSV). Default: beside --trace (run.kvt.h5 -> run.latency.csv); "
                   "without --trace, none is written.")
@click.option("--fail-on", type=click.Choice(FAIL_LEVELS), default=None,
              help="Exit 3 when a phase's verdict reaches this level.")
@json_options
@guarded
def loadtest(url: str, phases: str, concurrency: int, tokens: int, long_tokens: int, max_tokens: int,
             baseline_s: float, warmup: int, api: str, model: str | None, timeout_s: float, request_s: float,
             max_line_bytes: int, max_answer_bytes: int, max_in_flight: int, poll_s: float, trace: str | None,
             attach_out: str | None, events: str | None, replay: str | None, topic: str,
             output: str | None, fail_on: str | None, as_json: bool, json_out: str | None) -> None:
    """Drive URL (an OpenAI-compatible server) through the four-phase KV-cache diagnosis.

    \b
    Phases (seed 001's diagnostic steps): baseline (idle --baseline-s), single (one request of
    --tokens), concurrent (--concurrency requests of --tokens at once), long (one of --long-tokens).
    Requests stream, so TTFT and inter-token latency are what a client sees.
    \b
    Examples:
      kvtrace serve ./my-llama -o run.kvt.h5 --continuous-batching &
      kvtrace loadtest http://127.0.0.1:8000 --trace run.kvt.h5      # writes run.latency.csv
      kvtrace loadtest http://gpu-host:8000 --phases single,concurrent --concurrency 64 -o lat.csv
    \b
    Against kvtrace serve it posts a phase marker into the recording before each phase (POST
    /kvtrace/phase; any answer but kvtrace serve's means another server: latency table only) and
    samples GET /kvtrace/status. Each phase gets a verdict against the alert thresholds: KV pool
    use and device memory use (warning 80 %, critical 90 %), fragmentation (warning > 2 GiB),
    requests in flight (warning at 80 % of the requests that fit), context spikes (2x the typical
    context: reported with their KV, a warning only where the phase's memory warns too, as kvtrace
    analyze judges the long phase's probe); each check names its source or says "not measured".
    Every answer must parse as an OpenAI completion (streamed or not): one that does not (a web
    page, another API) is a failed request. A server is followed only so far: a request that
    outlasts --request-timeout, a line over --max-line-bytes or an answer over --max-answer-bytes
    fails with that reason (counted in the phase verdict); a /kvtrace/status answer that breaks a
    bound or has wrong types leaves the live numbers "not measured", saying why. Exit codes: 0 done (whatever the verdicts, unless
    --fail-on), 3 a verdict reached --fail-on, 64 bad option or URL, 2 a --trace that is missing
    or unreadable, 69 the server cannot be reached, is unhealthy or fails the warm-up before the
    first phase, or is not an OpenAI-compatible server (a 404 on the route or an answer that is
    not a completion before any request succeeded; or httpx is missing).
    """
    cfg_url = base_url(url)
    try:
        from kvtrace.serving.client import Bounds, ServerUnreachable
        from kvtrace.serving.drive import DriveConfig, ServerUnhealthy, drive
    except ImportError as exc:
        raise Unavailable(f"loadtest needs httpx ({exc}): pip install httpx (kvtrace[serve] has it)") from None
    from kvtrace.commands.outputs import check_json_out, check_output, write_json
    from kvtrace.serving.phases import build_phases

    try:
        plan = build_phases(split_list(phases), concurrency=concurrency,
                            tokens=tokens, long_tokens=long_tokens, baseline_s=baseline_s)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--phases") from None
    if not plan:
        raise click.BadParameter("no phase named", param_hint="--phases")
    if attach_out is not None and trace is not None:
        raise click.UsageError("--attach records the trace the verdicts read: give it or --trace, not both")
    if attach_out is None and (events or replay or topic):
        raise click.UsageError("--events, --replay and --topic go with --attach")
    if attach_out is not None:
        check_output(attach_out, option="--attach", refuse_existing=True)
    table = output or default_table(trace or attach_out)
    inputs = [trace] if trace else []
    if table is not None:
        check_output(table, option="-o", inputs=inputs, others=[("--json-out", json_out)])
    check_json_out(json_out, inputs=inputs)
    if trace is not None and not Path(trace).is_file():  # as every command that reads a trace: 2
        fail(f"{trace}: {'is a directory' if Path(trace).is_dir() else 'no such file'}", exitcodes.UNREADABLE)
    if concurrency > max_in_flight and "concurrent" in {p.name for p in plan}:
        raise click.BadParameter(f"{concurrency} requests at once is above --max-in-flight {max_in_flight}",
                                 param_hint="--concurrency")
    bounds = Bounds(request_s=request_s, gap_s=timeout_s, line_bytes=max_line_bytes, answer_bytes=max_answer_bytes,
                    in_flight=max_in_flight)
    from kvtrace.progress import Milestones
    from kvtrace.serving.report import LiveProgress

    # progress as the run goes, flushed line by line on stdout; with --json on stderr, and there only
    # for a person at a terminal (a program reading the JSON gets errors alone on stderr)
    steps = Milestones(err=as_json)
    steps.enabled = not as_json or steps.terminal
    cfg = DriveConfig(cfg_url, plan, api=api, max_tokens=max_tokens, model=model, bounds=bounds, poll_s=poll_s,
                      warmup=warmup, on_progress=LiveProgress(steps, max_tokens))
    steps.say(f"loadtest {cfg_url}: {', '.join(p.name for p in plan)}; checking /health"
              + (f", then {warmup} warm-up request(s)" if warmup else ""))
    finish = None
    if attach_out is not None:  # the engine recorded beside the load (kvtrace attach), phases marked in it
        try:
            from kvtrace.engines.attach import AttachOptions, EngineRecorder
        except ImportError as exc:
            raise Unavailable(f"--attach needs pyzmq and msgspec ({exc}): pip install 'kvtrace[engines]'") from None
        rec = EngineRecorder(attach_out, AttachOptions(url=cfg_url, events=events, replay=replay, topic=topic))
        finish = rec.run_in_thread()
        shown = cfg.on_progress

        def marked(what: str, run: Any, result: Any) -> None:
            if what == "phase_start" and run is not None:
                rec.mark_phase(run.phase.name)
            if shown is not None:
                shown(what, run, result)

        cfg.on_progress = marked
    try:
        result = asyncio.run(drive(cfg))
    except (ServerUnreachable, ServerUnhealthy) as exc:  # exit 69 (an Unavailable), said with the URL
        raise type(exc)(f"cannot load-test {cfg_url}: {exc}") from None
    finally:
        if finish is not None:
            time.sleep(1.0)  # the last KV-event batches and a last scrape after the load
            rec.mark_phase("end")
            finish()
            trace = attach_out
    facts = None
    if trace is not None:
        with steps.step(f"reading the recording {trace} for the phases' numbers"):
            time.sleep(1.5)  # the recorder flushes every second: let the last phase reach the file
            facts = read_facts(trace)
    from kvtrace.serving.latency import write_csv
    from kvtrace.serving.report import document, print_run
    from kvtrace.serving.verdict import judge

    verdicts = judge(result.runs, facts, max_tokens)
    rows = result.warmup + [r for run in result.runs for r in run.results]
    if table is not None:
        try:
            write_csv(rows, table)
        except OSError as exc:
            raise CannotWrite(f"cannot write {table}: {exc.strerror or exc}") from None
    if not as_json:
        print_run(result, verdicts, trace, table)
    write_json(document(result, verdicts, trace, table), json_out, as_json=as_json)
    if fail_on is not None:
        from kvtrace.serving.verdict import LEVELS

        if any(v.level in LEVELS and LEVELS.index(v.level) >= LEVELS.index(fail_on) for v in verdicts):
            raise SystemExit(exitcodes.FINDINGS)


def read_facts(trace: str) -> Any:
    from kvtrace.format.reader import Trace
    from kvtrace.serving.tracefacts import phase_facts

    with Trace(trace) as t:
        return phase_facts(t)
