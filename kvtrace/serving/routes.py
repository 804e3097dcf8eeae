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
  passes the model as transformers serve's pinned ``force_model``), so it loads nothing either.
"""

from __future__ import annotations

import time
from typing import Any

MAX_PHASE_NAME = 200


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


def live_status(recording: Any, generation_state: Any, marker: PhaseMarker) -> dict[str, Any]:
    """The recorder's and the paged cache's numbers now (transformers' CB manager as
    ``transformers serve`` 5.23 holds it: ``GenerationState._cb_manager._cb.batch_processor``)."""
    out: dict[str, Any] = {"recording": str(getattr(recording, "path", "")), "phase": marker.current,
                           "phase_events": marker.kind, "requests_recorded": int(recording.requests),
                           "recorder_errors": int(recording.recorder_errors)}
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


def add_routes(app: Any, recording: Any, generation_state: Any, marker: PhaseMarker, served: str = "") -> None:
    """kvtrace's routes; transformers' ``POST /reset`` (5.17, 5.23: unload every model; the next
    request reloads it, unrecorded) replaced by a 409 refusal that says why and what to do, and its
    ``POST /load_model`` (5.17, 5.23) refused the same way for any model but ``served`` (compared as
    transformers compares a request's model with the pinned one: the same string)."""
    from fastapi import HTTPException

    replaced = {"/reset", "/load_model"}
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

    @app.post("/kvtrace/phase")
    def phase(body: dict) -> dict[str, Any]:
        name = body.get("name") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name.strip() or len(name) > MAX_PHASE_NAME:
            raise HTTPException(status_code=422, detail=f"body must be {{\"name\": a non-empty string of at most "
                                                        f"{MAX_PHASE_NAME} characters}}")
        return {"phase": name, "t_ns": marker.mark(name), "event": marker.kind}

    @app.get("/kvtrace/status")
    def status() -> dict[str, Any]:
        return live_status(recording, generation_state, marker)
