"""`kvtrace serve`: transformers' OpenAI-compatible server, in-process, recorded into a trace."""

from __future__ import annotations

import os
from typing import Any

import click

from kvtrace.commands.common import guarded
from kvtrace.commands.metrics_options import check_metrics_options, metrics_options
from kvtrace.commands.record import DTYPES
from kvtrace.errors import KvtraceError, TraceIncomplete, Unavailable
from kvtrace.modelspec import PRESET, preset_name, tiny_shrink
from kvtrace.progress import Milestones

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def check_model(model: str) -> None:
    """A path must be a model directory; a preset must exist. Anything else is a hub id, which
    transformers resolves from the local cache (offline it never downloads)."""
    name = preset_name(model)
    if name is not None:
        from kvtrace import presets

        try:
            presets.get_preset(name)
        except KeyError as exc:
            raise click.BadParameter(str(exc).strip("'\""), param_hint="MODEL") from None
        return
    looks_like_path = model.startswith((".", "/", "~")) or os.path.exists(model)
    if looks_like_path:
        path = os.path.expanduser(model)
        if not os.path.isdir(path):
            raise click.BadParameter(f"{model}: no such model directory", param_hint="MODEL")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise click.BadParameter(f"{model}: not a model directory (no config.json)", param_hint="MODEL")


def serve_option(args: tuple[str, ...], name: str, default: str) -> str:
    """The value of ``--name VALUE`` / ``--name=VALUE`` among the transformers serve options."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return default


def load_preset(model: str, serve_args: tuple[str, ...], tiny: bool, layers: int | None, width: float | None,
                vocab: int | None) -> tuple[Any, Any]:
    """A preset's random-weight model (on transformers serve's --device, in its --dtype) and a
    word-level tokenizer built for it (kvtrace.serving.wordtok)."""
    from kvtrace.loading import load_model
    from kvtrace.serving.wordtok import tokenizer_for

    if tiny:
        layers, width, vocab = tiny_shrink(model.removeprefix(PRESET), layers, width, vocab)
    dtype = serve_option(serve_args, "--dtype", "auto")
    if dtype not in DTYPES:
        raise click.BadParameter(f"presets are built in one of {', '.join(DTYPES)}, not {dtype!r}",
                                 param_hint="--dtype")
    loaded = load_model(model, device=serve_option(serve_args, "--device", "auto"), dtype=dtype, layers=layers,
                        width=width, vocab=vocab)
    return loaded.model, tokenizer_for(loaded.model)


def check_port(host: str, port: int) -> None:
    """Bind and release ``host:port`` as uvicorn will (SO_REUSEADDR), before the model loads."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        socket.create_server((host, port), family=family).close()
    except OSError as exc:
        raise Unavailable(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None


@click.command("serve", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("model", metavar="MODEL")
@click.option("-o", "--output", required=True, type=click.Path(), metavar="TRACE", help="Trace file to write.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind (loopback unless clients on other hosts must reach it).")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True, help="Port to bind.")
@click.option("--telemetry-hz", type=click.FloatRange(min=0, min_open=True, max=1000), default=5.0,
              show_default=True, help="Rate of the recorder's background sampler (NVML, allocator, RSS).")
@click.option("--no-nvml", is_flag=True, help="Do not poll NVML.")
@click.option("--tiny", is_flag=True, help="Presets: shrink to a few layers showing every layer kind, hidden ~256, "
              "vocab 512 (serves on a CPU); --layers/--width/--vocab override it.")
@click.option("--layers", type=click.IntRange(min=1), default=None, help="Presets: keep the first N layers.")
@click.option("--width", type=click.FloatRange(min=0, min_open=True, max=1), default=None,
              help="Presets: scale hidden/MLP/expert widths (KV geometry kept).")
@click.option("--vocab", type=click.IntRange(min=256), default=None, help="Presets: vocabulary size.")
@click.option("--force", is_flag=True, help="Replace an existing -o file (never one of the inputs).")
@click.option("--max-request-bytes", type=click.IntRange(min=1024), default=8 << 20, show_default=True,
              help="Largest request body of the completion routes (/v1/...): a larger one is answered 413 "
                   "without being read; kvtrace's own routes take 64 KiB.")
@click.option("--log-status-polls", is_flag=True,
              help="Keep uvicorn's access-log lines of GET /kvtrace/status answered 200 (kvtrace loadtest polls it "
                   "every 0.25 s; left out by default).")
@metrics_options
@click.option("--quiet", "-q", is_flag=True, help="Print only errors (transformers and uvicorn still log).")
@click.argument("serve_args", nargs=-1, type=click.UNPROCESSED, metavar="[SERVE_OPTIONS]...")
@guarded
def serve(model: str, output: str, host: str, port: int, telemetry_hz: float, no_nvml: bool, tiny: bool,
          layers: int | None, width: float | None, vocab: int | None, force: bool, max_request_bytes: int,
          log_status_polls: bool, prometheus: str | None, prometheus_textfile: str | None, prometheus_linger: float, quiet: bool,
          serve_args: tuple[str, ...]) -> None:
    """Serve MODEL with transformers' own server (`transformers serve`) and record it into TRACE.

    \b
    Examples:
      kvtrace serve ./my-llama -o serve.kvt.h5 --continuous-batching
      kvtrace serve ./my-llama -o serve.kvt.h5 --port 8011 --continuous-batching --cb-num-blocks 256
      kvtrace serve preset:gpt-oss-20b --tiny -o serve.kvt.h5 --continuous-batching --device cpu
      kvtrace loadtest http://127.0.0.1:8000 --trace serve.kvt.h5    # in another shell
    [SERVE_OPTIONS]...: options kvtrace does not know go to `transformers serve` unchanged
    (--continuous-batching, --device, --dtype, --attn-implementation, --cb-*). The server binds
    127.0.0.1 unless --host says otherwise. MODEL is a model directory with its tokenizer, a hub id
    in the local cache, or preset:NAME (random weights, real KV geometry, with a word-level tokenizer
    built for it: one prompt word, one token; nothing is downloaded). Besides the OpenAI-compatible routes (/v1/chat/completions,
    /v1/completions, /health) it answers POST /kvtrace/phase {"name": ...} (a phase marker in the
    trace) and GET /kvtrace/status (requests recorded, paged-cache pool and free bytes, running and
    waiting requests, the batching worker's state). Request bodies are bounded (--max-request-bytes:
    413), phase names checked (400), and completions transformers cannot serve (an empty prompt,
    no messages, max_tokens below 1) refused with 400 before they reach the batching worker; a dead
    worker makes /health and /kvtrace/status answer 503 with the reason. Ctrl-C or SIGTERM stops
    it: open requests are drained, the trace is closed complete, and the exit code is 0. Needs
    kvtrace[serve]. An existing -o file is refused (exit 64)
    unless --force. --prometheus HOST:PORT serves live serving metrics (pool usage, running and
    waiting requests, preemptions, prefix-cache hits, TTFT/ITL histograms: spec/prometheus-serving.md)
    on a port of its own.
    """
    check_model(model)
    if preset_name(model) is None and (tiny or any(v is not None for v in (layers, width, vocab))):
        raise click.UsageError("--tiny/--layers/--width/--vocab only apply to preset:NAME models")
    from kvtrace.commands.outputs import check_output

    check_output(output, option="-o", inputs=[model] if os.path.exists(model) else [], refuse_existing=True,
                 force=force, others=[("--prometheus-textfile", prometheus_textfile)])
    steps = Milestones(err=True, enabled=not quiet)  # stderr: the server's log, line by line
    say = steps.say
    try:
        with steps.step("importing torch and transformers"):
            from transformers.utils.import_utils import is_serve_available

            from kvtrace.recorder.session import check_writable
    except ImportError as exc:
        raise Unavailable(f"serving needs torch and transformers ({exc}); install kvtrace[serve]") from None
    if not is_serve_available():
        raise Unavailable("transformers serve needs fastapi, uvicorn and openai: install kvtrace[serve]")
    check_writable(output)  # CannotWrite: exit 73 (guarded)
    check_port(host, port)  # a busy port fails now, not after the model load (exit 69)
    metrics_at = check_metrics_options(prometheus, prometheus_textfile, [model] if os.path.exists(model) else [])
    if metrics_at is not None and metrics_at[1] == port:
        raise click.BadParameter(f"port {port} is the server's own (--port): give the metrics another",
                                 param_hint="--prometheus")

    if host not in LOOPBACK:
        say(f"warning: binding {host}: the server (no authentication) is reachable from other hosts")
    from kvtrace.serving.runner import serve as run_server

    settings = {"cli": {"command": "serve", "model": model, "host": host, "port": port,
                        "serve_args": list(serve_args), "tiny": tiny, "layers": layers, "width": width,
                        "vocab": vocab, "max_request_bytes": max_request_bytes}}
    preloaded = None
    if preset_name(model) is not None:
        with steps.step(f"loading {model} (random weights, real KV geometry{', shrunk' if tiny else ''}; "
                        "nothing downloaded)"):
            preloaded = load_preset(model, serve_args, tiny, layers, width, vocab)
    options = {"telemetry_hz": telemetry_hz, "nvml": not no_nvml, "settings_extra": settings,
               "prometheus": prometheus, "prometheus_textfile": prometheus_textfile,
               "prometheus_linger_s": prometheus_linger}
    say("starting transformers serve: importing its server"
        + ("" if preloaded is not None else f" and loading {model}") + f"; the trace goes to {output}")
    try:
        outcome = run_server(model, output, host=host, port=port, serve_args=list(serve_args),
                             record_options=options,
                             on_ready=lambda url: say(f"serving {model} at {url} (phase markers: POST "
                                                      f"{url}/kvtrace/phase); recording to {output}; "
                                                      f"Ctrl-C or SIGTERM stops"),
                             preloaded=preloaded, max_request_bytes=max_request_bytes,
                             log_status_polls=log_status_polls)
    except (click.exceptions.ClickException, click.exceptions.Exit, KvtraceError):
        raise  # each with its own exit code: Stopped 130, CannotServeMetrics 69, CannotWrite 73 ...
    except (OSError, ValueError, RuntimeError, ImportError) as exc:
        # transformers could not load the model (missing files, not cached offline, bad --dtype...)
        raise Unavailable(f"cannot serve {model}: {type(exc).__name__}: {exc}") from None
    if not outcome.recording_started:  # uvicorn gave up (it logs why) before the model was served
        raise Unavailable(f"the server did not start (see the log above); no trace written to {output}")
    if outcome.storage_failure is not None:
        raise TraceIncomplete(f"{output}: trace incomplete, writing stopped early "
                              f"({outcome.storage_failure.describe()}); it holds everything up to its last flush")
    phases = ", ".join(name for name, _ in outcome.phases) or "none"
    say(f"stopped by {outcome.stopped_by or 'the server'}; trace {output}: {outcome.requests} request(s), "
        f"phase markers ({outcome.phase_events}): {phases}")
    if outcome.recorder_errors:
        say(f"warning: {outcome.recorder_errors} recorder error(s) were caught and recorded (RECORDER_ERROR events)")
