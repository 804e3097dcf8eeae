"""`kvtrace attach URL --events tcp://... -o TRACE`: record a running vLLM engine (spec §10)."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import click

from kvtrace.commands.common import guarded
from kvtrace.errors import Unavailable


@click.command("attach")
@click.argument("url", metavar="URL")
@click.option("-o", "--out", "output", required=True, type=click.Path(dir_okay=False), metavar="TRACE",
              help="Trace file to write (never an existing trace).")
@click.option("--events", default=None, metavar="ENDPOINT",
              help="ZMQ endpoint of the engine's KV-event publisher, e.g. tcp://127.0.0.1:5557: kvtrace binds "
                   "it (vLLM's --kv-events-config endpoint; its PUB socket connects there).")
@click.option("--replay", default=None, metavar="ENDPOINT",
              help="The engine's ROUTER replay endpoint (vLLM's replay_endpoint), asked for batches missed live.")
@click.option("--topic", default="", show_default=True, help="The engine's KV-event topic.")
@click.option("--history", is_flag=True,
              help="At the first event, replay what the engine still buffers from before the attach (vLLM keeps "
                   "its last 10,000 batches), so that blocks cached before it are known. Needs --replay.")
@click.option("--interval", "interval_s", type=click.FloatRange(min=0.05, max=3600), default=1.0, show_default=True,
              help="Seconds between /metrics scrapes (one /sched row each).")
@click.option("--duration", "duration_s", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Stop after this many seconds (default: at SIGINT or SIGTERM).")
@click.option("--until-signal", is_flag=True, help="Stop at SIGINT or SIGTERM (the default without --duration).")
@click.option("--http-timeout", "http_timeout_s", type=click.FloatRange(min=0.1, max=600), default=5.0,
              show_default=True, help="Seconds to wait for one /metrics answer.")
@guarded
def attach(url: str, output: str, events: str | None, replay: str | None, topic: str, history: bool,
           interval_s: float, duration_s: float | None, until_signal: bool, http_timeout_s: float) -> None:
    """Record a running vLLM engine at URL into TRACE: its KV-cache events and its /metrics.

    \b
    Start vLLM with --kv-cache-metrics --enable-prefix-caching and
      --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558", "topic": "kv"}'
    then:
      kvtrace attach http://127.0.0.1:8000 --events tcp://127.0.0.1:5557 \\
          --replay tcp://127.0.0.1:5558 --topic kv -o night.kvt.h5
    \b
    It writes one /sched row per scrape, the block stores, reuses and evictions as /events with their
    block hashes, gaps in the event stream (replayed or lost), and the engine's cache configuration.
    Exit codes: 0 stopped (signal or --duration), 64 bad option, 69 the engine cannot be reached or is
    not a vLLM engine, or the --events endpoint cannot be bound, 73 TRACE cannot be written, 74 the
    disk failed while recording (what was written before stays readable).
    """
    from kvtrace.commands.outputs import check_output

    if until_signal and duration_s is not None:
        raise click.UsageError("--until-signal and --duration exclude each other")
    check_output(output, option="-o", refuse_existing=True)
    try:
        from kvtrace.engines.attach import AttachOptions, EngineRecorder
    except ImportError as exc:
        raise Unavailable(f"attach needs pyzmq, msgspec and httpx ({exc}): pip install 'kvtrace[engines]'") from None
    opts = AttachOptions(url=url, events=events, replay=replay, topic=topic, interval_s=interval_s,
                         http_timeout_s=http_timeout_s, history=history)
    stop = threading.Event()
    previous: dict[int, Any] = {}

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, on_signal)
    try:
        rec = EngineRecorder(output, opts)
        cfg = rec.config
        click.echo(f"kvtrace: attached to {rec.base} (vLLM {rec.version.get('version', '?') if isinstance(rec.version, dict) else '?'}"
                   f", block size {cfg['block_size']}, {cfg['pool_blocks']} blocks, {cfg['pool_tokens']} tokens)"
                   f"{'; KV events on ' + events if events else '; no KV events (--events not given)'}; "
                   f"writing {output}", err=True)
        deadline = None if duration_s is None else time.monotonic() + duration_s
        try:
            rec.run(lambda: stop.is_set() or (deadline is not None and time.monotonic() >= deadline))
        finally:
            summary = rec.close()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    ev = summary.get("kv_events", {})
    c = summary["counters"]
    click.echo(f"{output}: {summary['ticks']} ticks; preemptions {c.get('preemptions', 0)}, prefix-cache hits "
               f"{c.get('prefix_cache_hits', 0)} tokens; "
               + (f"{ev.get('batches', 0)} event batches ({ev.get('stored_blocks', 0)} blocks stored, "
                  f"{ev.get('removed_blocks', 0)} removed, {ev.get('replayed_batches', 0)} replayed, "
                  f"{ev.get('lost_batches', 0)} lost)" if ev else "no KV events"))
