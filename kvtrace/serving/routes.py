"""The routes ``kvtrace serve`` adds to transformers' FastAPI app:

* ``POST /kvtrace/phase`` ``{"name": "..."}``: a phase marker in the recording (the load test's
  phase boundaries), answered ``{"phase": name, "t_ns": ...}``;
* ``GET /kvtrace/status``: what the recorder and the continuous-batching cache say now (requests
  recorded, the paged pool's bytes and free bytes, running / waiting requests), read from the
  objects themselves; a number that cannot be read is absent with the reason, never guessed;
* ``POST /reset`` (transformers': unload the models) answers 409 with why: the model the trace
  records would be replaced by an unrecorded copy at the next request;
* ``POST /load_model`` (transformers': load any model into the server) answers 409 with why for a
  model other than the served one (it would serve unrecorded); for the served one it is
  transformers' own route (already loaded: it answers "ready"). A completion request naming
  another model is refused by transformers itself (400 "Server is pinned to ...": kvtrace serve
  passes the model as transformers serve's pinned ``force_model``), so it loads nothing either;
* ``GET /health`` (transformers') answers 503 with the reason when the continuous-batching worker
  died, on every transformers version (5.24 says only "cb_worker_dead"; older ones answered 200).

And one ASGI middleware in front of every route (:class:`RequestGuard`): request bodies are bounded
(413 above the limit, counted as they arrive, never read whole first), and a completion request
transformers cannot serve (no prompt or one of no token, no messages, max_tokens below 1 or above
the model's positions, a temperature or top_p that is not a number in range) is refused with 400
before it reaches the batching worker: an empty prompt used to kill that worker and every later
request got 503 until the server was restarted. Once the worker is dead, completions are refused
with 503 and the reason, and ``/health`` and ``/kvtrace/status`` say it.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvtrace.serving.openai_stream import one_line, parse_json

MAX_PHASE_NAME = 200
PHASE_NAME = re.compile(r"[A-Za-z0-9_.:,/+=@#-](?:[A-Za-z0-9 _.:,/+=@#-]*[A-Za-z0-9_.:,/+=@#-])?")
MAX_REQUEST_BYTES = 8 << 20  # default body limit of the completion routes (/v1/...): kvtrace serve --max-request-bytes
MAX_CONTROL_BYTES = 64 << 10  # body limit of every other POST (/kvtrace/phase, /load_model, /reset)
TOKENIZE_BELOW = 256  # a prompt this short is tokenized to check it has a token (longer ones have)
MAX_TOKENS_FIELDS = {"/v1/completions": ("max_tokens",), "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
                     "/v1/responses": ("max_output_tokens",)}


def phase_name_problem(name: Any) -> str | None:
    """Why ``name`` is not a phase name, or None: 1 to 200 characters of ASCII letters, digits,
    ``_.:,/+=@#-`` and inner spaces (no control character, markup bracket, quote or lone surrogate:
    a phase name is printed by every reader of the trace)."""
    if not isinstance(name, str):
        return "name must be a string"
    if not 1 <= len(name) <= MAX_PHASE_NAME:
        return f"name must hold 1 to {MAX_PHASE_NAME} characters, not {len(name)}"
    if PHASE_NAME.fullmatch(name) is None:
        bad = next((ch for ch in name if not re.fullmatch(r"[A-Za-z0-9 _.:,/+=@#-]", ch)), " ")
        return (f"name may hold only ASCII letters, digits, '_.:,/+=@#-' and inner spaces "
                f"({ascii(bad)} is not one)")
    return None


class PhaseMarker:
    """Writes phase markers through the recording's ``mark_phase`` (format 1.4 PHASE events) when
    the recorder has one, else as a NOTE event "phase: NAME" (the 1.3 fallback)."""

    def __init__(self, recording: Any) -> None:
        self.recording = recording
        self.current: str | None = None
        self.marks: list[tuple[str, int]] = []

    @property
    def kind(self) -> str:
        return "PHASE" if callable(getattr(self.recording, "mark_phase", None)) else "NOTE"

    def mark(self, name: str) -> int:
        t_ns = time.monotonic_ns()
        mark = getattr(self.recording, "mark_phase", None)
        if callable(mark):
            mark(name)
        else:  # recorder without phase events: the session context's NOTE is the one event it writes
            from kvtrace.format.schema import EventKind

            self.recording._ctx.event(EventKind.NOTE, text=f"phase: {name}")
        self.current = name
        self.marks.append((name, t_ns))
        return t_ns


def _read_cache(cache: Any, active: dict[str, Any]) -> dict[str, Any]:
    """The paged cache's own counters through the recorder's version adapter (format 1.4's
    ``serving_cache.adapter_for``), else the first floor's ``cache_occupancy``; never guessed."""
    try:
        from kvtrace.recorder.serving_cache import adapter_for
    except ImportError:
        adapter_for = None
    if adapter_for is not None:
        adapter = adapter_for()
        if adapter is None or not adapter.matches(cache):
            return {"unavailable": "unsupported transformers version (no paged-cache adapter for this layout)"}
        state = adapter.read(cache)
        groups = {f"{g.layer_type.name.lower()}_{g.group}": {
            "blocks_in_use": g.blocks_in_use, "blocks_total": g.blocks_total, "blocks_cached": g.blocks_cached,
            "tokens_per_block": g.tokens_per_block, "bytes_per_block": g.bytes_per_block, "window": g.window}
            for g in state.groups}
        return {"pool_bytes": state.pool_bytes, "free_bytes": state.free_bytes,
                "blocks_in_use": sum(g.blocks_in_use for g in state.groups), "allocators": groups,
                "tokens_cached": sum(int(getattr(r, "position_offset", 0)) for r in active.values())}
    from kvtrace.recorder.serving import cache_occupancy  # the first serving floor

    return cache_occupancy(cache, active)


def worker_problem(generation_state: Any) -> str | None:
    """Why transformers' continuous-batching worker cannot serve, or None (running, or not started
    yet: it starts at the first request). Read from the manager itself: its background status's
    ``fatal_error`` (5.24) or a generation thread that is no longer alive (any version)."""
    cb = getattr(getattr(generation_state, "_cb_manager", None), "_cb", None)
    if cb is None:
        return None
    fatal = getattr(getattr(cb, "background_thread_status", None), "fatal_error", None)
    if fatal is not None:
        return f"the continuous-batching worker died ({type(fatal).__name__}: {one_line(str(fatal))})"
    thread = getattr(cb, "_generation_thread", None)
    if thread is not None and not thread.is_alive():
        return "the continuous-batching worker's thread has exited"
    return None


DEAD_WORKER_HINT = ("every completion fails until kvtrace serve is restarted (stop it with Ctrl-C or SIGTERM: "
                    "the trace is closed complete)")


def live_status(recording: Any, generation_state: Any, marker: PhaseMarker) -> dict[str, Any]:
    """The recorder's and the paged cache's numbers now (transformers' CB manager as
    ``transformers serve`` 5.23 holds it: ``GenerationState._cb_manager._cb.batch_processor``)."""
    out: dict[str, Any] = {"recording": str(getattr(recording, "path", "")), "phase": marker.current,
                           "phase_events": marker.kind, "requests_recorded": int(recording.requests),
                           "recorder_errors": int(recording.recorder_errors)}
    dead = worker_problem(generation_state)
    started = getattr(getattr(generation_state, "_cb_manager", None), "_cb", None) is not None
    out["batching_worker"] = ({"state": "dead", "error": dead} if dead else
                              {"state": "running" if started else "not started"})
    if dead:
        out["error"] = f"{dead}; {DEAD_WORKER_HINT}"
    cb = getattr(getattr(generation_state, "_cb_manager", None), "_cb", None)
    processor = getattr(cb, "batch_processor", None)
    if processor is None:
        out["paged_cache"] = {"unavailable": "no continuous-batching cache (serve without --continuous-batching, "
                                             "or no request has started it yet)"}
        return out
    scheduler = getattr(processor, "scheduler", None)
    try:  # the CB loop mutates these on its own thread: a read can race; say so rather than guess
        active = dict(getattr(scheduler, "active_requests", {}))
        occupancy = _read_cache(getattr(processor, "cache", None), active)
        occupancy.update(running=len(active), waiting=len(getattr(scheduler, "waiting_requests", {})))
    except Exception as exc:  # noqa: BLE001 - a status read must not fail the route
        occupancy = {"unavailable": f"read failed, possibly racing the scheduler ({type(exc).__name__}: {exc}); "
                                    f"ask again"}
    out["paged_cache"] = occupancy
    return out


RESET_REFUSED = ("kvtrace serve records the model it loaded at start into one trace; /reset would unload it "
                 "and the next request would load a new copy that nothing records. Stop kvtrace serve "
                 "(Ctrl-C or SIGTERM: the trace is closed complete) and start it again for a fresh model and "
                 "a new trace")


def load_refused(served: str, requested: str) -> str:
    return (f"kvtrace serve records {served!r} into one trace; loading {requested!r} would serve a model that "
            f"nothing records. Start another kvtrace serve for it (its own trace)")


def add_routes(app: Any, recording: Any, generation_state: Any, marker: PhaseMarker, served: str = "", *,
               tokenizer: Any = None, max_positions: int | None = None,
               max_request_bytes: int = MAX_REQUEST_BYTES) -> None:
    """kvtrace's routes and :class:`RequestGuard`; transformers' ``POST /reset`` (5.17, 5.23: unload
    every model; the next request reloads it, unrecorded) replaced by a 409 refusal that says why and
    what to do, its ``POST /load_model`` (5.17, 5.23) refused the same way for any model but
    ``served`` (compared as transformers compares a request's model with the pinned one: the same
    string), and its ``GET /health`` by one that names a dead batching worker."""
    from fastapi import HTTPException
    from fastapi.responses import JSONResponse

    app.add_middleware(RequestGuard, generation_state=generation_state, tokenizer=tokenizer,
                       max_positions=max_positions, max_request_bytes=max_request_bytes)
    replaced = {"/reset", "/load_model", "/health"}
    load_model = next((r.endpoint for r in app.router.routes if getattr(r, "path", None) == "/load_model"), None)
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in replaced]

    @app.post("/reset")
    def reset() -> None:
        raise HTTPException(status_code=409, detail=RESET_REFUSED)

    if load_model is not None:
        @app.post("/load_model")
        async def load_served_model_only(body: dict) -> Any:
            requested = body.get("model") if isinstance(body, dict) else None
            if isinstance(requested, str) and requested != served:
                raise HTTPException(status_code=409, detail=load_refused(served, requested))
            return await load_model(body)  # the served model (answers "ready"), or transformers' own 422

    @app.get("/health")
    def health() -> Any:
        dead = worker_problem(generation_state)
        if dead:
            return JSONResponse({"status": "unhealthy", "reason": "cb_worker_dead",
                                 "detail": f"{dead}; {DEAD_WORKER_HINT}"}, status_code=503)
        return {"status": "ok"}

    @app.post("/kvtrace/phase")
    def phase(body: dict) -> dict[str, Any]:
        if not isinstance(body, dict) or "name" not in body:
            raise HTTPException(status_code=400, detail='body must be {"name": NAME}')
        problem = phase_name_problem(body["name"])
        if problem is not None:  # refused before anything is written to the trace
            raise HTTPException(status_code=400, detail=problem)
        name = body["name"]
        return {"phase": name, "t_ns": marker.mark(name), "event": marker.kind}

    @app.get("/kvtrace/status")
    def status() -> Any:
        out = live_status(recording, generation_state, marker)
        return JSONResponse(out, status_code=503) if "error" in out else out


Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]


class RequestGuard:
    """ASGI middleware in front of every route of kvtrace serve. POST bodies are bounded: a body of
    the completion routes (``/v1/...``) over ``max_request_bytes``, of any other route over
    :data:`MAX_CONTROL_BYTES`, is answered 413 from its Content-Length, or as soon as the bytes that
    arrived pass the limit (what came is dropped; the rest is not read). A completion request is
    then checked (:meth:`problem`) and refused with 400 when transformers cannot serve it, or with
    503 when the batching worker is dead; anything else goes on to transformers unchanged."""

    def __init__(self, app: Any, *, generation_state: Any, tokenizer: Any, max_positions: int | None,
                 max_request_bytes: int) -> None:
        self.app = app
        self.generation_state = generation_state
        self.tokenizer = tokenizer
        self.max_positions = max_positions if isinstance(max_positions, int) and max_positions > 0 else None
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        completion = path.startswith("/v1/")
        limit = self.max_request_bytes if completion else MAX_CONTROL_BYTES
        option = " (kvtrace serve --max-request-bytes)" if completion else ""
        too_large = f"request body over {limit} bytes{option}"
        declared = dict(scope.get("headers") or []).get(b"content-length", b"").strip()
        if declared.isdigit() and len(declared) < 20 and int(declared) > limit:
            await _answer(send, 413, too_large)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message.get("type") == "http.disconnect":
                return
            piece = message.get("body", b"")
            size += len(piece)
            if size > limit:
                chunks.clear()
                await _answer(send, 413, too_large)
                return
            chunks.append(piece)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if path in MAX_TOKENS_FIELDS:
            dead = worker_problem(self.generation_state)
            if dead:
                await _answer(send, 503, f"{dead}; {DEAD_WORKER_HINT}")
                return
            problem = self.problem(path, body)
            if problem is not None:
                await _answer(send, 400, problem)
                return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def problem(self, path: str, raw: bytes) -> str | None:
        """Why transformers cannot serve this completion request, or None."""
        try:
            body = parse_json(raw)
        except ValueError as exc:
            return f"the body is not JSON ({one_line(str(exc), 120)})"
        if not isinstance(body, dict):
            return "the body must be a JSON object"
        for key in MAX_TOKENS_FIELDS[path]:
            value = body.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                return f"{key} must be an integer of at least 1"
            if self.max_positions is not None and value > self.max_positions:
                return f"{key} {value} is above the model's {self.max_positions} positions"
        for key, ok, rule in (("temperature", lambda x: x >= 0, "a finite number of at least 0"),
                              ("top_p", lambda x: 0 < x <= 1, "a number in (0, 1]")):
            value = body.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or not ok(value)):
                return f"{key} must be {rule}"
        generation_config = body.get("generation_config")
        if generation_config is not None:
            why = _generation_config_problem(generation_config)
            if why:
                return why
        if path == "/v1/completions":
            return self._prompt_problem(body.get("prompt"))
        if path == "/v1/chat/completions":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                return "messages must be a non-empty list of message objects"
            return None
        value = body.get("input")  # /v1/responses
        if not (isinstance(value, str) and value.strip()) and not (isinstance(value, list) and value):
            return "input must be a non-empty string or list"
        return None

    def _prompt_problem(self, prompt: Any) -> str | None:
        if prompt is None:
            return "prompt is required (transformers serve would run an empty one)"
        if not isinstance(prompt, str):
            return "prompt must be a string"
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            return "prompt holds a lone surrogate (not UTF-8 text)"
        if not prompt.strip():
            return "prompt is empty: there is no token to start from"
        if self.tokenizer is not None and len(prompt) < TOKENIZE_BELOW:
            try:
                ids = self.tokenizer(prompt)["input_ids"]
            except Exception as exc:  # noqa: BLE001 - any tokenizer failure is the prompt's problem here
                return f"prompt cannot be tokenized ({type(exc).__name__})"
            if len(ids) == 0:
                return "prompt has no token for this model's tokenizer: there is no token to start from"
        return None


def _generation_config_problem(value: Any) -> str | None:
    try:
        config = parse_json(value) if isinstance(value, str) else None
    except ValueError:
        config = None
    if not isinstance(config, dict):
        return "generation_config must be a string holding a JSON object"
    new = config.get("max_new_tokens")
    if new is not None and (isinstance(new, bool) or not isinstance(new, int) or new < 1):
        return "generation_config.max_new_tokens must be an integer of at least 1"
    return None


async def _answer(send: Send, code: int, detail: str) -> None:
    """A JSON error answer in FastAPI's shape ({"detail": ...}); the connection is closed after it."""
    data = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": code,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": data})
