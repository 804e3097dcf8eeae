"""``kvtrace serve``: transformers' own ``transformers serve`` (its typer command
``transformers.cli.serve.Serve``; the same structure in transformers 5.17 and 5.23: read in both) run
in this process with ``kvtrace.record``
attached to the model it loads.

How it attaches: ``Serve`` preloads the pinned model (``force_model``) in its ``ModelManager`` and
then calls ``transformers.cli.serving.server.build_server``. For the duration of the run that
function is wrapped: the wrapper starts the recording on the loaded model (before uvicorn accepts a
connection, so no request is missed) and adds kvtrace's routes (:mod:`kvtrace.serving.routes`).

How it ends: uvicorn catches SIGINT and SIGTERM, drains open connections, runs the app's shutdown
and then re-raises the signal it caught; the handlers installed here take that re-raise as "stop
requested", so :func:`serve` returns normally, after stopping transformers' continuous-batching
worker and closing the recording (requests still in flight end INTERRUPTED). The trace is then
complete. A signal before the recording starts aborts the load (:class:`Stopped`); one after it
started but before uvicorn installed its handlers is handed to uvicorn as soon as it has (it then
starts and shuts down at once), so no signal is lost and the trace is complete either way.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvtrace import exitcodes
from kvtrace.errors import BadOption, KvtraceError, Unavailable
from kvtrace.serving.routes import MAX_REQUEST_BYTES, PhaseMarker, add_routes

_USAGE_ERRORS = {"UsageError", "NoSuchOption", "BadParameter", "MissingParameter", "BadOptionUsage",
                 "BadArgumentUsage"}


class Stopped(KvtraceError):
    """SIGINT / SIGTERM arrived before the server was serving (during the model load): no trace
    was written; exit 130, as Ctrl-C."""

    exit_code: ClassVar[int] = exitcodes.INTERRUPTED


@dataclass
class ServeOutcome:
    """What a finished :func:`serve` run did."""

    stopped_by: str | None = None  # "SIGTERM" / "SIGINT", or None when uvicorn stopped on its own
    requests: int = 0  # requests the recording holds
    recorder_errors: int = 0
    storage_failure: Any = None  # kvtrace.format.storage.StorageFault when the trace stopped early
    phases: list[tuple[str, int]] = field(default_factory=list)  # (name, monotonic ns) marked
    phase_events: str = ""  # "PHASE" or "NOTE" (how the markers were written)
    recording_started: bool = False


# kvtrace's own polling of a server, left out of uvicorn's access log unless asked for (loadtest polls
# GET /kvtrace/status every 0.25 s: 139 of 190 log lines of a load test were those)
STATUS_POLL = ("GET", "/kvtrace/status")


class QuietStatusPolls(logging.Filter):
    """Drops uvicorn's access-log line of a successful ``GET /kvtrace/status`` (uvicorn logs
    ``(client, method, path, http_version, status)`` as the record's args); every other line, and a
    status poll that did not answer 200, is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5:
            _, method, path, _, status = args
            if (method, str(path).split("?", 1)[0]) == STATUS_POLL and status == 200:
                return False
        return True


def serve_command() -> Any:
    """transformers' ``serve`` as a click command (typer builds it from ``Serve``'s signature)."""
    import typer
    from transformers.cli.serve import Serve

    app = typer.Typer(add_completion=False)
    app.command(name="serve")(Serve)
    return typer.main.get_command(app)


def serve(model: str, trace: str, *, host: str = "127.0.0.1", port: int = 8000,
          serve_args: Sequence[str] = (), record_options: dict[str, Any] | None = None,
          on_ready: Callable[[str], None] | None = None, preloaded: tuple[Any, Any] | None = None,
          max_request_bytes: int = MAX_REQUEST_BYTES, log_status_polls: bool = False) -> ServeOutcome:
    """Run the server until SIGINT/SIGTERM, recording into ``trace``. ``serve_args``: further
    ``transformers serve`` options (``--continuous-batching``, ``--cb-num-blocks 64``, ...).
    ``on_ready(url)`` is called once the recording runs, just before uvicorn binds.
    ``preloaded``: (model, tokenizer) already built for ``model`` (a kvtrace preset), handed to
    transformers' model manager in place of loading ``model`` from disk. ``max_request_bytes``: the
    body limit of the completion routes (:class:`kvtrace.serving.routes.RequestGuard`).
    ``log_status_polls``: keep uvicorn's access-log lines of ``GET /kvtrace/status`` answered 200
    (:class:`QuietStatusPolls` drops them by default)."""
    import transformers

    import kvtrace

    try:
        from transformers.cli.serve import Serve  # noqa: F401 - the command serve_command builds
        from transformers.cli.serving import server as server_module

        original_build = server_module.build_server
    except (ImportError, AttributeError) as exc:
        raise Unavailable(f"kvtrace serve attaches to transformers' serving app factory "
                          f"(transformers.cli.serving.server.build_server, as in 5.17 and 5.23); transformers "
                          f"{transformers.__version__} has none ({exc})") from None

    outcome = ServeOutcome()
    # serving: the recording runs; uvicorn: uvicorn's own signal handlers are in place; pending: a
    # signal that came between the two
    state: dict[str, Any] = {"serving": False, "uvicorn": False, "pending": None}
    recording: dict[str, Any] = {}

    def build_server(model_manager: Any, *args: Any, **kwargs: Any) -> Any:
        app = original_build(model_manager, *args, **kwargs)
        loaded = list(model_manager.loaded_models.values())
        if len(loaded) != 1:  # force_model preloads exactly one
            raise RuntimeError(f"expected the one pinned model to be loaded, found {len(loaded)}")
        timed = loaded[0]
        opts = dict(record_options or {})
        opts.setdefault("model_id", model)
        opts.setdefault("tokenizer", getattr(timed.processor, "tokenizer", timed.processor))
        rec = kvtrace.record(timed.model, trace, **opts)
        rec.start()
        recording["rec"] = rec
        recording["generation_state"] = kwargs.get("generation_state")
        marker = PhaseMarker(rec)
        recording["marker"] = marker
        outcome.recording_started = True
        add_routes(app, rec, kwargs.get("generation_state"), marker, served=model, tokenizer=opts["tokenizer"],
                   max_positions=getattr(getattr(timed.model, "config", None), "max_position_embeddings", None),
                   max_request_bytes=max_request_bytes)
        state["serving"] = True
        if on_ready is not None:
            on_ready(f"http://{host}:{port}")
        return app

    def on_signal(signum: int, _frame: Any) -> None:
        outcome.stopped_by = signal.Signals(signum).name
        if not state["serving"]:
            raise Stopped(f"stopped by {outcome.stopped_by} before the server was up; no trace written")
        if not state["uvicorn"]:
            # the recording runs but uvicorn has not installed its handlers yet: handed to uvicorn as
            # soon as it does (it then starts, shuts down at once and the trace is closed complete)
            state["pending"] = signum
        # else uvicorn re-raises the signal it handled after its graceful shutdown: nothing left to do

    in_main = threading.current_thread() is threading.main_thread()
    previous = {}
    if in_main:
        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    server_module.build_server = build_server
    access = logging.getLogger("uvicorn.access")
    quiet = None if log_status_polls else QuietStatusPolls()
    if quiet is not None:
        access.addFilter(quiet)
    restore_uvicorn = _hand_signals_to_uvicorn(state)
    restore_loaders = _hand_over(model, preloaded) if preloaded is not None else None
    try:
        command = serve_command()
        try:
            command.main(args=[model, "--host", host, "--port", str(port), *serve_args],
                         prog_name="kvtrace serve", standalone_mode=False)
        except SystemExit as exc:  # uvicorn exits 3 when it cannot bind or start the app (it logs why)
            raise Unavailable(f"the server did not start (uvicorn exited {exc.code}; see its log above)"
                              + ("; the trace holds no request" if outcome.recording_started else "")) from None
        except Exception as exc:
            # typer carries its own copy of click: its usage errors are not click's classes
            if type(exc).__name__ in _USAGE_ERRORS and hasattr(exc, "format_message"):
                raise BadOption(f"transformers serve: {exc.format_message()}", "[SERVE_OPTIONS]...") from None
            raise
    finally:
        server_module.build_server = original_build
        if quiet is not None:
            access.removeFilter(quiet)
        restore_uvicorn()
        if restore_loaders is not None:
            restore_loaders()
        _finish(recording, outcome)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return outcome


def _hand_signals_to_uvicorn(state: dict[str, Any]) -> Callable[[], None]:
    """Wrap ``uvicorn.Server.capture_signals`` (where uvicorn installs its SIGINT/SIGTERM handlers,
    0.2x to 0.54) for the run: once its handlers are in, a signal that arrived while uvicorn was being
    set up (``state["pending"]``) is given to its ``handle_exit``, so it starts and shuts down at once,
    gracefully, rather than the signal being lost. Returns the undo."""
    import contextlib

    try:
        import uvicorn
    except ImportError:
        return lambda: None
    original = uvicorn.Server.__dict__.get("capture_signals")
    if original is None:
        return lambda: None

    @contextlib.contextmanager
    def capture_signals(server: Any) -> Any:
        with original(server):
            state["uvicorn"] = True
            pending, state["pending"] = state["pending"], None
            if pending is not None:
                server.handle_exit(pending, None)
            yield

    uvicorn.Server.capture_signals = capture_signals

    def undo() -> None:
        uvicorn.Server.capture_signals = original
    return undo


def _hand_over(name: str, preloaded: tuple[Any, Any]) -> Callable[[], None]:
    """Make transformers' ModelManager return ``preloaded`` (model, tokenizer) for ``name`` instead of
    reading it from disk (its ``_load_model`` / ``_load_processor``, 5.23); returns the undo."""
    from transformers.cli.serving.model_manager import ModelManager

    originals = {attr: ModelManager.__dict__[attr] for attr in ("_load_model", "_load_processor")}
    built = {"_load_model": preloaded[0], "_load_processor": preloaded[1]}

    def wrap(attr: str) -> Any:
        def load(self: Any, model_id_and_revision: str, *args: Any, **kwargs: Any) -> Any:
            if model_id_and_revision.split("@", 1)[0] == name:
                return built[attr]
            return originals[attr](self, model_id_and_revision, *args, **kwargs)
        return load

    for attr in originals:
        setattr(ModelManager, attr, wrap(attr))

    def undo() -> None:
        for attr, fn in originals.items():
            setattr(ModelManager, attr, fn)
    return undo


def _finish(recording: dict[str, Any], outcome: ServeOutcome) -> None:
    """Stop transformers' CB worker (its in-flight requests are then cancelled), close the trace."""
    rec = recording.get("rec")
    if rec is None:
        return
    generation_state = recording.get("generation_state")
    try:
        if generation_state is not None:
            generation_state.shutdown()
    finally:
        rec.close()
        marker = recording["marker"]
        outcome.phases = list(marker.marks)
        outcome.phase_events = marker.kind
        outcome.requests = rec.requests
        outcome.recorder_errors = rec.recorder_errors
        outcome.storage_failure = rec.storage_failure
