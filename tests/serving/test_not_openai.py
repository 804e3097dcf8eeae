"""kvtrace loadtest against servers that are not what it expects: a web page, a 404 on
the completion route, answers that stop being OpenAI completions mid-run, and a catch-all 200 on
kvtrace serve's own routes. A scripted local HTTP server plays each; nothing here needs a model."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("httpx", reason="the serving packages (kvtrace[serve]) are not installed")

from kvtrace import exitcodes  # noqa: E402
from kvtrace.serving.openai_stream import (  # noqa: E402
    DONE,
    NotOpenAI,
    check_chunk,
    chunk_text,
    error_detail,
    sse_data,
    whole_completion,
)
from tests.helpers.cli_run import run_main  # noqa: E402

QUICK = ["--tokens", "8", "--max-tokens", "2", "--timeout", "10", "--baseline-s", "0", "--json"]
GOOD_SSE = "".join(f"data: {json.dumps(c)}\n\n" for c in (
    {"choices": [{"index": 0, "text": "a"}]}, {"choices": [{"index": 0, "text": " b"}]},
    {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 2}})) + "data: [DONE]\n\n"
Answer = tuple[int, str, str]  # status, content type, body


class Scripted:
    """/health 200; POST /v1/* answered by ``completion(n)`` (n: 0 for the first POST, ...); POST
    /kvtrace/phase and GET /kvtrace/status by ``phase`` / ``status`` when given, else 404."""

    def __init__(self, completion: Callable[[int], Answer], phase: Answer | None = None,
                 status: Answer | None = None) -> None:
        self.posts = 0
        self.paths: list[str] = []
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, answer: Answer) -> None:
                code, ctype, body = answer
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path == "/health":
                    self._send((200, "application/json", '{"status": "ok"}'))
                elif self.path == "/kvtrace/status" and status is not None:
                    self._send(status)
                else:
                    self._send((404, "text/plain", "not found"))

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.paths.append(self.path)
                if self.path.startswith("/v1/"):
                    with lock:
                        n, outer.posts = outer.posts, outer.posts + 1
                    self._send(completion(n))
                elif self.path == "/kvtrace/phase" and phase is not None:
                    self._send(phase)
                else:
                    self._send((404, "text/plain", "not found"))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def scripted() -> Iterator[Callable[..., Scripted]]:
    made: list[Scripted] = []

    def make(*args: object, **kwargs: object) -> Scripted:
        made.append(Scripted(*args, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for s in made:
        s.close()


HTML = (200, "text/html", "<html><body>a web page</body></html>")
OK = (200, "text/event-stream", GOOD_SSE)


def test_a_web_page_is_refused_at_the_warm_up_with_69(scripted, capsys):
    s = scripted(lambda n: HTML)
    code, out, err = run_main(["loadtest", s.url, "--phases", "single,concurrent", *QUICK], capsys)
    assert code == exitcodes.UNAVAILABLE and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"kvtrace: cannot load-test {s.url}: not an OpenAI-compatible server: POST /v1/completions "
                          "answered HTTP 200 text/html: a line that is not Server-Sent Events: "), err
    assert s.posts == 1 and "/kvtrace/phase" not in s.paths  # refused before any phase or marker


def test_a_404_on_the_route_names_the_other_api(scripted, capsys):
    s = scripted(lambda n: (404, "application/json", '{"detail": "Not Found"}'))
    code, _, err = run_main(["loadtest", s.url, "--phases", "single", *QUICK, "--api", "chat"], capsys)
    assert code == exitcodes.UNAVAILABLE, err
    assert ("not an OpenAI-compatible server: POST /v1/chat/completions answered HTTP 404: Not Found "
            "(--api completions posts to /v1/completions)") in err and err.count("\n") == 1


def test_with_no_warm_up_the_first_phase_with_requests_is_the_check(scripted, capsys):
    s = scripted(lambda n: HTML)
    code, _, err = run_main(["loadtest", s.url, "--phases", "baseline,single,concurrent", *QUICK, "--warmup", "0"],
                            capsys)
    assert code == exitcodes.UNAVAILABLE and "not an OpenAI-compatible server" in err, err
    assert s.posts == 1  # the single phase's request; the concurrent phase is never sent


def test_a_failed_warm_up_of_an_openai_server_says_what_failed(scripted, capsys):
    s = scripted(lambda n: (503, "application/json", '{"error": {"message": "overloaded, try later"}}'))
    code, _, err = run_main(["loadtest", s.url, "--phases", "single", *QUICK], capsys)
    assert code == exitcodes.UNAVAILABLE and err.count("\n") == 1, err
    assert "the warm-up request to POST /v1/completions failed (http 503: overloaded, try later)" in err


def test_answers_that_stop_parsing_mid_run_are_failed_requests_not_ok(scripted, capsys):
    """Proven OpenAI at the warm-up, then every other answer is a web page or a stream of JSON that
    is not a completion: those requests fail (status says why), none is 'ok' with 0 tokens."""
    bad_json = (200, "text/event-stream", 'data: {"hello": "world"}\n\n')
    s = scripted(lambda n: OK if n % 2 == 0 else (HTML if n % 4 == 1 else bad_json))
    code, out, err = run_main(["loadtest", s.url, "--phases", "single,concurrent", "--concurrency", "4", *QUICK],
                              capsys)
    assert code == 0, err
    doc = json.loads(out)
    rows = [r for p in doc["phases"] for r in p["requests"]]
    assert len(rows) == 5 and s.posts == 6
    ok = [r for r in rows if r["status"] == "ok"]
    failed = [r for r in rows if r["status"] != "ok"]
    assert ok and failed and all(r["output_tokens"] == 2 for r in ok)
    assert all(r["status"].startswith("error: not an OpenAI completion: HTTP 200 ") and r["output_tokens"] == 0
               and r["e2e_s"] == -1 for r in failed), failed
    assert {r["status"].split(": ")[3] for r in failed} <= {"a line that is not Server-Sent Events",
                                                             "a JSON object with neither choices nor usage"}
    checks = {c["name"]: c for p in doc["phases"] for c in p["checks"] if c["name"] == "requests"}
    assert checks["requests"]["level"] == "critical"


def test_a_catch_all_200_on_kvtrace_routes_is_not_taken_for_kvtrace_serve(scripted, capsys):
    """POST /kvtrace/phase and GET /kvtrace/status answer 200 with JSON that is not kvtrace serve's:
    no phase markers (one try, then none), no live status."""
    catch_all = (200, "application/json", '{"ok": true}')
    s = scripted(lambda n: OK, phase=catch_all, status=catch_all)
    code, out, err = run_main(["loadtest", s.url, "--phases", "single,concurrent", *QUICK], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["markers"] is False and doc["live_status"] is False
    assert doc["phases"][0]["marker"] == "unsupported (HTTP 200, not kvtrace serve's answer)"
    assert doc["phases"][1]["marker"] == "not sent" and s.paths.count("/kvtrace/phase") == 1


def test_kvtrace_serves_marker_answer_is_taken(scripted, capsys):
    """The control: kvtrace serve's own answer ({"phase", "t_ns", "event"}) counts as a marker."""
    s = scripted(lambda n: OK, phase=(200, "application/json", json.dumps({"phase": "single", "t_ns": 5,
                                                                             "event": "PHASE"})))
    code, out, err = run_main(["loadtest", s.url, "--phases", "single", *QUICK], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["markers"] is True and doc["phases"][0]["marker"] == "PHASE"


def test_a_server_ignoring_stream_with_one_json_completion_is_ok(scripted, capsys):
    one = {"object": "text_completion", "choices": [{"index": 0, "text": "a b"}],
           "usage": {"prompt_tokens": 8, "completion_tokens": 2}}
    s = scripted(lambda n: (200, "application/json", json.dumps(one)))
    code, out, err = run_main(["loadtest", s.url, "--phases", "single", *QUICK], capsys)
    assert code == 0, err
    (row,) = json.loads(out)["phases"][0]["requests"]
    assert row["status"] == "ok" and row["output_tokens"] == 2 and row["prompt_tokens"] == 8


def test_the_openai_stream_checks():
    assert sse_data("") is None and sse_data(": keep-alive") is None and sse_data("event: message") is None
    assert sse_data("data: [DONE]") == DONE
    chunk = sse_data('data: {"choices": [{"delta": {"content": "hi"}}]}')
    assert isinstance(chunk, dict) and chunk_text(chunk) == "hi"
    assert chunk_text(check_chunk({"choices": [{"text": "x"}]})) == "x"
    assert chunk_text(check_chunk({"choices": [{"message": {"content": "y"}}]})) == "y"
    assert chunk_text(check_chunk({"choices": [{"delta": {"role": "assistant"}}]})) == ""
    assert check_chunk({"error": "boom"}) == {"error": "boom"}
    for bad, why in (("<html>", "not Server-Sent Events"), ("data: <p>", "not JSON"), ("data: [1, 2]", "JSON list"),
                     ('data: {"a": 1}', "neither choices nor usage"), ('data: {"choices": "x"}', "not a list"),
                     ('data: {"choices": [1]}', "not a list of objects"),
                     ('data: {"choices": [], "usage": {"prompt_tokens": "8"}}', "integer counts"),
                     ('data: {"choices": [], "usage": {"completion_tokens": true}}', "integer counts")):
        with pytest.raises(NotOpenAI, match=why):
            sse_data(bad)
    with pytest.raises(NotOpenAI, match="does not parse"):
        whole_completion(b"<html>")
    assert error_detail(b'{"error": {"message": "bad\\nrequest"}}') == ": bad request"
    assert error_detail(b'{"detail": "Not Found"}') == ": Not Found"
    assert error_detail(b"<html>") == "" and error_detail(b"[1]") == ""
