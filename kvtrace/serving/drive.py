"""Run the phase protocol against one endpoint: markers, requests, live samples, health.

Per phase: post the phase marker (``POST /kvtrace/phase``; a 404, or a 200 that is not kvtrace
serve's answer, means the server is not ``kvtrace serve`` and no marker is tried again), send the phase's requests (at most ``concurrency``
in flight), meanwhile poll ``GET /kvtrace/status`` every ``poll_s`` when the server has it (the
paged cache's pool, free bytes, running and waiting requests), then read ``/health``. After the
last phase an "end" marker closes the last window in the trace. Before the first phase,
``warmup`` short requests (8 words, 2 tokens) start what the server builds lazily (transformers
serve creates its continuous-batching manager and pool at the first request): they belong to no
phase and no verdict; the latency table lists them as phase "warmup". They are also the pre-flight
check (:func:`refuse_unless_openai`): a server whose warm-up fails, or that does not answer as an
OpenAI-compatible server, is refused before the first phase (ServerUnhealthy, exit 69).

Every answer is bounded (:class:`kvtrace.serving.client.Bounds`: whole time, bytes per line and per
answer, requests in flight): a server that breaks a bound fails that request, its status naming
the bound, and the phase verdict counts it; a /kvtrace/status answer that breaks one, or is
kvtrace-shaped JSON of wrong types (:func:`kvtrace.serving.tracefacts.occupancy_problem`), leaves
the live numbers "not measured" with that reason."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from kvtrace.errors import Unavailable
from kvtrace.serving.client import (
    API_PATHS,
    BoundBroken,
    Bounds,
    RequestResult,
    ServerUnreachable,
    get_json,
    post_json,
    request_body,
    stream_request,
)
from kvtrace.serving.openai_stream import NOT_OPENAI, brief
from kvtrace.serving.phases import END_MARKER, Phase, prompt
from kvtrace.serving.tracefacts import Group, groups_from_occupancy, occupancy_problem, sample_from_occupancy

WARMUP_WORDS = 8


class ServerUnhealthy(Unavailable):
    """The server answers but /health is not 200 before the first phase: exit 69."""


@dataclass
class DriveConfig:
    url: str  # base URL, no trailing slash
    phases: list[Phase]
    api: str = "completions"
    max_tokens: int = 64
    model: str | None = None
    bounds: Bounds = Bounds()  # what a server is followed into, at most
    poll_s: float = 0.25
    warmup: int = 1  # short requests before the first phase and its marker (lazy start-up: CB manager, pool)
    # told as the run goes (the CLI prints a line for each): ("warmup", None, result) per warm-up
    # request, ("phase_start", run, None), ("request", run, result) per answered request,
    # ("phase_end", run, None) once the phase's health check is done
    on_progress: Callable[[str, PhaseRun | None, RequestResult | None], None] | None = None


@dataclass
class PhaseRun:
    phase: Phase
    start_s: float
    end_s: float = 0.0
    results: list[RequestResult] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)  # live /kvtrace/status samples
    groups: list[Group] = field(default_factory=list)
    after: dict[str, Any] | None = None  # the live sample taken once the phase's requests ended
    status_unavailable: str | None = None  # why the live paged-cache numbers are absent
    marker: str = "not sent"  # "PHASE", "NOTE", "unsupported (404)", "failed: ..."
    health: int | None = None  # /health status code after the phase (None: no answer)
    health_error: str = ""  # why there was no answer


@dataclass
class DriveResult:
    url: str
    runs: list[PhaseRun]
    markers: bool  # the server took phase markers
    live_status: bool  # the server offered /kvtrace/status
    started_unix: float
    warmup: list[RequestResult] = field(default_factory=list)  # outside every phase and verdict
    bounds: Bounds = Bounds()
    live_unavailable: str | None = None  # why /kvtrace/status is not sampled, when it is not


async def _sample_status(client: httpx.AsyncClient, url: str, run: PhaseRun, bounds: Bounds, *,
                         after: bool = False) -> None:
    """One live sample into ``run``, or the reason there is none in ``run.status_unavailable``:
    the server going away, breaking a bound, or answering what is not kvtrace serve's status."""
    try:
        code, body = await get_json(client, url + "/kvtrace/status", bounds)
    except (ServerUnreachable, BoundBroken) as exc:
        run.status_unavailable = f"GET /kvtrace/status: {exc}"
        return
    if code != 200 or not isinstance(body, dict):
        why = body.get("error") or body.get("detail") if isinstance(body, dict) else None
        run.status_unavailable = f"/kvtrace/status answered {code}" + (f": {brief(why)}" if why else "")
        return
    occ = body.get("paged_cache") or {}
    problem = occupancy_problem(occ)
    if problem is not None:
        run.status_unavailable = f"/kvtrace/status answered JSON that is not kvtrace serve's: {problem}"
        return
    sample = sample_from_occupancy(time.monotonic_ns(), occ)
    if sample is None:
        run.status_unavailable = brief(occ.get("unavailable", "no paged-cache numbers"))
        return
    run.samples.append(sample)
    if after:
        run.after = sample
    run.groups = groups_from_occupancy(occ)
    run.status_unavailable = None


async def _poll(client: httpx.AsyncClient, url: str, run: PhaseRun, every: float, stop: asyncio.Event,
                bounds: Bounds) -> None:
    while not stop.is_set():
        await _sample_status(client, url, run, bounds)
        try:
            await asyncio.wait_for(stop.wait(), timeout=every)
        except asyncio.TimeoutError:
            pass


async def _mark(client: httpx.AsyncClient, url: str, name: str, bounds: Bounds) -> str:
    """The marker's event kind ("PHASE" / "NOTE") when kvtrace serve took it; "unsupported ..." when
    the server is another one (no marker is tried again): a 404, or a 200 that is not kvtrace serve's
    answer ({"phase": name, "t_ns": int, "event": ...}, kvtrace.serving.routes), which a catch-all
    route or a web page gives; "failed: ..." when the answer broke a bound."""
    try:
        code, body = await post_json(client, url + "/kvtrace/phase", {"name": name}, bounds)
    except BoundBroken as exc:
        return f"failed: {exc}"
    if code == 200:
        if is_marker_answer(body, name):
            return str(body["event"])
        return "unsupported (HTTP 200, not kvtrace serve's answer)"
    if code in (404, 405):
        return "unsupported (404)"
    return f"failed: HTTP {code}"


def is_marker_answer(body: Any, name: str) -> bool:
    """kvtrace serve's answer to POST /kvtrace/phase (routes.add_routes)."""
    return (isinstance(body, dict) and body.get("phase") == name and isinstance(body.get("t_ns"), int)
            and body.get("event") in ("PHASE", "NOTE"))


def is_status_answer(body: Any) -> bool:
    """kvtrace serve's answer to GET /kvtrace/status (routes.live_status)."""
    return (isinstance(body, dict) and isinstance(body.get("requests_recorded"), int)
            and isinstance(body.get("paged_cache"), dict))


def refuse_unless_openai(rows: list[RequestResult], cfg: DriveConfig, *, warmup: bool) -> bool:
    """Pre-flight: True once a request got an OpenAI completion. A warm-up request that failed, or
    (with --warmup 0) a first phase whose requests all failed because the answers are not OpenAI
    completions or the route does not exist, stops the run: ServerUnhealthy, one line, exit 69."""
    if any(r.ok for r in rows):
        return True
    path = API_PATHS[cfg.api]
    for r in rows:
        if r.status.startswith(("http 404", "http 405")):
            other = "chat" if cfg.api == "completions" else "completions"
            raise ServerUnhealthy(f"not an OpenAI-compatible server: POST {path} answered HTTP {r.status[5:]} "
                                  f"(--api {other} posts to {API_PATHS[other]})")
        if r.status.startswith(f"error: {NOT_OPENAI}: "):
            raise ServerUnhealthy(f"not an OpenAI-compatible server: POST {path} answered "
                                  f"{r.status.removeprefix(f'error: {NOT_OPENAI}: ')}, {NOT_OPENAI}")
    if warmup and rows:
        raise ServerUnhealthy(f"the warm-up request to POST {path} failed ({rows[0].status}); a server that "
                              f"fails it cannot be load-tested")
    return False


async def drive(cfg: DriveConfig) -> DriveResult:
    """Run every phase; raises ServerUnreachable / ServerUnhealthy before the first one."""
    bounds = cfg.bounds
    concurrency = min(max([p.concurrency for p in cfg.phases] + [1]), bounds.in_flight)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    timeout = httpx.Timeout(bounds.gap_s, connect=min(bounds.gap_s, 10.0))
    t0 = time.perf_counter()
    started = time.time()
    # a proxy from the environment must not carry loopback traffic (CI sets HTTP(S)_PROXY for registries)
    loopback = (urlsplit(cfg.url).hostname or "") in ("127.0.0.1", "localhost", "::1")
    # identity: a compressed answer's decoded size is not bounded by the bytes that arrive
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=not loopback,
                                 headers={"Accept-Encoding": "identity"}) as client:
        try:
            code, body = await get_json(client, cfg.url + "/health", bounds)
        except BoundBroken as exc:
            raise ServerUnhealthy(f"GET /health: {exc}") from None
        if code != 200:
            why = (body.get("detail") or body.get("reason")) if isinstance(body, dict) else None
            raise ServerUnhealthy(f"{cfg.url}/health answered HTTP {code}" + (f": {brief(why)}" if why else ""))
        live_unavailable: str | None = "the server has no /kvtrace/status (not kvtrace serve)"
        try:
            code, body = await get_json(client, cfg.url + "/kvtrace/status", bounds)
            live = code == 200 and is_status_answer(body)
            if not live and code == 200 and isinstance(body, dict) and "paged_cache" in body:
                live_unavailable = ("/kvtrace/status answered JSON that is not kvtrace serve's: "
                                    f"{occupancy_problem(body['paged_cache']) or 'requests_recorded is not an integer'}")
        except BoundBroken as exc:
            live, live_unavailable = False, f"GET /kvtrace/status: {exc}"
        if live:
            live_unavailable = None
        markers = True
        runs: list[PhaseRun] = []
        warm: list[RequestResult] = []
        proven = False  # a request got an OpenAI completion
        tell = cfg.on_progress or (lambda what, run, result: None)
        for i in range(cfg.warmup):
            warm.append(await stream_request(client, cfg.url, cfg.api,
                                             request_body(cfg.api, prompt(WARMUP_WORDS, 10_000 + i), 2, cfg.model),
                                             phase="warmup", index=i, prompt_words=WARMUP_WORDS, t0=t0,
                                             bounds=bounds))
            proven = proven or refuse_unless_openai(warm[-1:], cfg, warmup=True)
            tell("warmup", None, warm[-1])
        seq = 0
        for phase in cfg.phases:
            run = PhaseRun(phase, time.perf_counter() - t0)
            tell("phase_start", run, None)
            if markers:
                run.marker = await _mark(client, cfg.url, phase.name, bounds)
                markers = not run.marker.startswith("unsupported")
            stop = asyncio.Event()
            poller = asyncio.create_task(_poll(client, cfg.url, run, cfg.poll_s, stop, bounds)) if live else None
            if not live:
                run.status_unavailable = live_unavailable
            if phase.requests == 0:
                await asyncio.sleep(phase.idle_s)
            else:
                gate = asyncio.Semaphore(min(phase.concurrency, bounds.in_flight))

                async def one(i: int, seed: int, phase: Phase = phase, gate: asyncio.Semaphore = gate,
                              run: PhaseRun = run) -> RequestResult:
                    async with gate:
                        body = request_body(cfg.api, prompt(phase.prompt_tokens, seed), cfg.max_tokens, cfg.model)
                        result = await stream_request(client, cfg.url, cfg.api, body, phase=phase.name, index=i,
                                                      prompt_words=phase.prompt_tokens, t0=t0, bounds=bounds)
                    tell("request", run, result)
                    return result

                run.results = list(await asyncio.gather(*(one(i, seq + i) for i in range(phase.requests))))
                seq += phase.requests
                try:
                    proven = proven or refuse_unless_openai(run.results, cfg, warmup=False)
                except ServerUnhealthy:
                    if poller is not None:
                        stop.set()
                        await poller
                    raise
            if poller is not None:
                stop.set()
                await poller
                await _sample_status(client, cfg.url, run, bounds, after=True)  # what the phase left behind
            try:
                run.health, body = await get_json(client, cfg.url + "/health", bounds)
                why = (body.get("detail") or body.get("reason")) if isinstance(body, dict) else None
                if run.health != 200 and why:
                    run.health_error = brief(why)
            except (ServerUnreachable, BoundBroken) as exc:
                run.health, run.health_error = None, str(exc)
            run.end_s = time.perf_counter() - t0
            runs.append(run)
            tell("phase_end", run, None)
        if markers and runs:
            try:
                await _mark(client, cfg.url, END_MARKER, bounds)
            except ServerUnreachable:
                pass
    return DriveResult(cfg.url, runs, markers, live, started, warm, bounds, live_unavailable)
