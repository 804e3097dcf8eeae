"""kvtrace serve guards what it forwards: request bodies bounded (413, counted as
they arrive), phase names checked (400, nothing recorded), completions transformers cannot serve
refused with 400 before the batching worker sees them (an empty prompt killed it: every later
request got 503 until a restart), and a dead worker named by /health and /kvtrace/status.

The routes and the guard run here on a FastAPI app shaped like transformers serve's (its completion
routes, /health, /reset, /load_model) with a fake recording and a fake continuous-batching manager,
so each case takes milliseconds; test_kvtrace_serve_refuses_what_would_kill_its_worker runs the real
server on the tiny model once."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import threading
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the serving packages (kvtrace[serve]) are not installed")
pytest.importorskip("httpx", reason="the serving packages (kvtrace[serve]) are not installed")

from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from kvtrace.serving.routes import (  # noqa: E402
    MAX_CONTROL_BYTES,
    PhaseMarker,
    RequestGuard,
    add_routes,
    phase_name_problem,
)


class FakeRecording:
    path = "fake.kvt.h5"
    requests = 0
    recorder_errors = 0

    def __init__(self) -> None:
        self.phases: list[str] = []

    def mark_phase(self, name: str) -> int:
        name.encode("utf-8")  # as the trace writer: a lone surrogate raises here
        self.phases.append(name)
        return len(self.phases) - 1


class FakeTokenizer:
    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [1 for w in text.split() if w != "ignored"]}


def fake_state(fatal: BaseException | None = None, thread_alive: bool | None = None, started: bool = True) -> Any:
    thread = None if thread_alive is None else SimpleNamespace(is_alive=lambda: thread_alive)
    cb = SimpleNamespace(background_thread_status=SimpleNamespace(fatal_error=fatal), _generation_thread=thread,
                         batch_processor=None)
    return SimpleNamespace(_cb_manager=SimpleNamespace(_cb=cb if started else None))


def make_app(state: Any = None, max_request_bytes: int = 4096, max_positions: int | None = 1024):
    """transformers serve's shape: completion routes that record what reached them, its /health."""
    app = FastAPI()
    reached: list[tuple[str, dict]] = []

    @app.post("/v1/completions")
    async def completions(body: dict) -> dict:
        reached.append(("completions", body))
        return {"choices": [{"text": "ok"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: dict) -> dict:
        reached.append(("chat", body))
        return {"choices": [{"message": {"content": "ok"}}]}

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}  # transformers 5.23's: 200 whatever the worker

    rec = FakeRecording()
    state = state if state is not None else fake_state(started=False)
    add_routes(app, rec, state, PhaseMarker(rec), served="tiny", tokenizer=FakeTokenizer(),
               max_positions=max_positions, max_request_bytes=max_request_bytes)
    return TestClient(app), rec, reached


def post_raw(client: TestClient, path: str, raw: bytes) -> Any:
    return client.post(path, content=raw, headers={"content-type": "application/json"})


# ---- bodies ---------------------------------------------------------------------------------------------


def _drive_guard(limit: int, pieces: int, piece: bytes, declared: int | None) -> tuple[int, int, list[dict]]:
    """The guard alone, fed ``pieces`` x ``piece``: (pieces read, status sent, messages sent)."""
    read = 0
    sent: list[dict] = []

    async def app(scope, receive, send):  # pragma: no cover - never reached when refused
        raise AssertionError("the app saw a body over the limit")

    async def receive() -> dict:
        nonlocal read
        read += 1
        return {"type": "http.request", "body": piece, "more_body": read < pieces}

    async def send(message: dict) -> None:
        sent.append(message)

    guard = RequestGuard(app, generation_state=None, tokenizer=None, max_positions=None, max_request_bytes=limit)
    headers = [(b"content-type", b"application/json")]
    if declared is not None:
        headers.append((b"content-length", str(declared).encode()))
    asyncio.run(guard({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers},
                      receive, send))
    return read, sent[0]["status"], sent


def test_a_body_over_the_limit_is_413_without_being_read_whole():
    piece = b"x" * 65536
    # 300 MiB sent chunked (no Content-Length): refused once the bytes passed the limit
    read, status, sent = _drive_guard(1 << 20, 300 * 16, piece, None)
    assert status == 413 and read == 17, read  # 16 pieces fit in 1 MiB; the 17th passes it
    assert json.loads(sent[1]["body"]) == {"detail": f"request body over {1 << 20} bytes (kvtrace serve "
                                                     "--max-request-bytes)"}
    # declared: refused from the header, not one byte read
    read, status, _ = _drive_guard(1 << 20, 300 * 16, piece, 300 << 20)
    assert status == 413 and read == 0


def test_body_limits_on_the_routes():
    client, rec, reached = make_app(max_request_bytes=4096)
    big = json.dumps({"prompt": "the " * 2000, "max_tokens": 2}).encode()
    assert post_raw(client, "/v1/completions", big).status_code == 413 and not reached
    phase = json.dumps({"name": "a", "pad": "x" * MAX_CONTROL_BYTES}).encode()
    r = post_raw(client, "/kvtrace/phase", phase)
    assert r.status_code == 413 and r.json()["detail"] == f"request body over {MAX_CONTROL_BYTES} bytes"
    assert rec.phases == []
    assert post_raw(client, "/v1/completions", b'{"prompt": "the of", "max_tokens": 2}').status_code == 200


# ---- phase names ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw, why", [
    (b'{"name": "\\ud800"}', "'\\ud800' is not one"),
    (b'{"name": "a\\u001b[31m"}', "'\\x1b' is not one"),
    (b'{"name": "[/bold]x"}', "'[' is not one"),
    (b'{"name": "\\u202eevil"}', "'\\u202e' is not one"),
    (b'{"name": " padded"}', "inner spaces"),
    (b'{"name": ""}', "1 to 200 characters, not 0"),
    (b'{"name": "' + b"a" * 201 + b'"}', "not 201"),
    (b'{"name": 5}', "must be a string"),
    (b'{"other": "x"}', 'body must be {"name": NAME}'),
])
def test_bad_phase_names_are_400_and_not_recorded(raw, why):
    client, rec, _ = make_app()
    r = post_raw(client, "/kvtrace/phase", raw)
    assert r.status_code == 400 and why in r.json()["detail"], r.text
    assert rec.phases == []


def test_good_phase_names_are_recorded():
    client, rec, _ = make_app()
    for name in ("baseline", "end", "run 2: long-context/16k", "a"):
        r = client.post("/kvtrace/phase", json={"name": name})
        assert r.status_code == 200 and r.json()["phase"] == name, r.text
    assert rec.phases == ["baseline", "end", "run 2: long-context/16k", "a"]
    assert phase_name_problem("x" * 200) is None


# ---- completions transformers cannot serve -------------------------------------------------------------


@pytest.mark.parametrize("path, raw, why", [
    ("/v1/completions", b'{"prompt": "", "max_tokens": 2}', "prompt is empty"),
    ("/v1/completions", b'{"prompt": " \\n\\t", "max_tokens": 2}', "prompt is empty"),
    ("/v1/completions", b'{"max_tokens": 2}', "prompt is required"),
    ("/v1/completions", b'{"prompt": "ignored", "max_tokens": 2}', "prompt has no token"),
    ("/v1/completions", b'{"prompt": ["a"], "max_tokens": 2}', "prompt must be a string"),
    ("/v1/completions", b'{"prompt": "a\\udc80", "max_tokens": 2}', "lone surrogate"),
    ("/v1/completions", b'{"prompt": "the", "max_tokens": 0}', "max_tokens must be an integer of at least 1"),
    ("/v1/completions", b'{"prompt": "the", "max_tokens": -3}', "at least 1"),
    ("/v1/completions", b'{"prompt": "the", "max_tokens": true}', "at least 1"),
    ("/v1/completions", b'{"prompt": "the", "max_tokens": "2"}', "at least 1"),
    ("/v1/completions", b'{"prompt": "the", "max_tokens": 2.5}', "at least 1"),
    ("/v1/completions", b'{"prompt": "the", "max_tokens": 100000000}', "above the model's 1024 positions"),
    ("/v1/completions", b'{"prompt": "the", "temperature": NaN}', "temperature must be a finite number"),
    ("/v1/completions", b'{"prompt": "the", "temperature": -1}', "temperature must be"),
    ("/v1/completions", b'{"prompt": "the", "temperature": "hot"}', "temperature must be"),
    ("/v1/completions", b'{"prompt": "the", "top_p": 0}', "top_p must be a number in (0, 1]"),
    ("/v1/completions", b'{"prompt": "the", "generation_config": "{\\"max_new_tokens\\": 0}"}',
     "generation_config.max_new_tokens"),
    ("/v1/completions", b'{"prompt": "the", "generation_config": "[1]"}', "generation_config must be"),
    ("/v1/completions", b"[1, 2]", "a JSON object"),
    ("/v1/completions", b"[" * 100_000, "not JSON"),
    ("/v1/completions", b"\xff\xfe", "not JSON"),
    ("/v1/chat/completions", b'{"messages": [], "max_tokens": 2}', "messages must be a non-empty list"),
    ("/v1/chat/completions", b'{"max_tokens": 2}', "messages must be"),
    ("/v1/chat/completions", b'{"messages": ["hi"]}', "messages must be"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}',
     "max_completion_tokens must be"),
])
def test_completions_transformers_cannot_serve_are_400_before_the_worker(path, raw, why):
    client, _, reached = make_app(max_request_bytes=1 << 20)
    r = post_raw(client, path, raw)
    assert r.status_code == 400 and why in r.json()["detail"], r.text
    assert reached == []


def test_completions_it_can_serve_go_through_unchanged():
    client, _, reached = make_app()
    bodies = [("/v1/completions", {"prompt": "the of", "max_tokens": 2, "temperature": 0.0, "stream": True}),
              ("/v1/completions", {"prompt": "the", "top_p": 1, "generation_config": '{"max_new_tokens": 4}'}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}], "max_tokens": 1024})]
    for path, body in bodies:
        assert client.post(path, json=body).status_code == 200
    assert [b for _, b in reached] == [b for _, b in bodies]


# ---- a dead batching worker -------------------------------------------------------------------------


@pytest.mark.parametrize("state, why", [
    (fake_state(fatal=RuntimeError("cannot reshape tensor of 0 elements\ninto shape [1, 0, -1, 16]")),
     "the continuous-batching worker died (RuntimeError: cannot reshape tensor of 0 elements into shape "
     "[1, 0, -1, 16])"),
    (fake_state(thread_alive=False), "the continuous-batching worker's thread has exited"),
])
def test_a_dead_worker_is_named_by_health_status_and_completions(state, why):
    client, _, reached = make_app(state)
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["reason"] == "cb_worker_dead"
    assert health.json()["detail"].startswith(why + "; every completion fails until kvtrace serve is restarted")
    status = client.get("/kvtrace/status")
    assert status.status_code == 503, status.text
    doc = status.json()
    assert doc["batching_worker"] == {"state": "dead", "error": why} and doc["error"].startswith(why)
    r = client.post("/v1/completions", json={"prompt": "the", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["detail"].startswith(why) and reached == []


def test_a_live_or_unstarted_worker_is_healthy():
    for state, name in ((fake_state(thread_alive=True), "running"), (fake_state(started=False), "not started")):
        client, _, _ = make_app(state)
        assert client.get("/health").json() == {"status": "ok"}
        status = client.get("/kvtrace/status")
        assert status.status_code == 200 and status.json()["batching_worker"] == {"state": name}


# ---- the real server ------------------------------------------------------------------------------------


def _vm_hwm_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))


@pytest.mark.slow
def test_kvtrace_serve_refuses_what_would_kill_its_worker(tmp_path):
    """The tiny llama on CPU with continuous batching: an empty prompt, a whitespace one and
    max_tokens 0 are 400 and the worker stays alive (before: the empty prompt killed it, 503 for every
    later request); a 300 MiB phase body is 413 and the server's peak RSS does not grow by it; a lone
    surrogate phase name is 400 and not in the trace."""
    import httpx
    from serve_helpers import kvtrace_cmd, save_tiny_server_model, server_env, wait_healthy

    from kvtrace.format.reader import Trace
    from kvtrace.serving.tracefacts import phase_markers
    from tests.helpers.net import free_port

    model_dir = save_tiny_server_model(tmp_path / "tiny")
    trace = tmp_path / "guard.kvt.h5"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(kvtrace_cmd("serve", str(model_dir), "-o", str(trace), "--port", str(port), "-q",
                                        "--continuous-batching", "--device", "cpu", "--cb-num-blocks", "16"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=server_env())
    out = ""
    try:
        wait_healthy(url, proc)
        with httpx.Client(base_url=url, timeout=60, trust_env=False) as c:
            for body in ({"prompt": "", "max_tokens": 2, "stream": True}, {"prompt": "   ", "max_tokens": 2},
                         {"max_tokens": 2}, {"prompt": "the of", "max_tokens": 0}):
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 400, (body, r.text)
            r = c.post("/v1/chat/completions", json={"messages": [], "max_tokens": 2})
            assert r.status_code == 400, r.text
            r = c.post("/v1/completions", json={"prompt": "the of and", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["choices"], r.text  # the worker still serves
            assert c.get("/health").status_code == 200
            status = c.get("/kvtrace/status").json()
            assert status["batching_worker"] == {"state": "running"}, status
            r = c.post("/kvtrace/phase", content=b'{"name": "\\ud800"}', headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text
            assert c.post("/kvtrace/phase", json={"name": "single"}).status_code == 200
            before = _vm_hwm_kib(proc.pid)

            def pieces():
                block = b"x" * (1 << 20)
                yield b'{"name": "'
                for _ in range(300):
                    yield block

            r = c.post("/kvtrace/phase", content=pieces(), headers={"content-type": "application/json"})
            assert r.status_code == 413, r.text
            assert _vm_hwm_kib(proc.pid) - before < 64 * 1024  # not 300 MiB more
            assert c.get("/health").status_code == 200
    except BaseException:
        proc.kill()
        raise
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    with Trace(trace) as t:
        assert [name for name, _ in phase_markers(t)] == ["single"]


def test_the_guard_is_thread_safe_enough_for_concurrent_posts():
    """Several requests at once through the guard (each has its own replayed body)."""
    client, _, reached = make_app()
    errors: list[BaseException] = []

    def post(i: int) -> None:
        try:
            assert client.post("/v1/completions", json={"prompt": f"the {i}", "max_tokens": 2}).status_code == 200
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=post, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sorted(b["prompt"] for _, b in reached) == sorted(f"the {i}" for i in range(8))
