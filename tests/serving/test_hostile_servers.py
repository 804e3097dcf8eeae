"""kvtrace loadtest against hostile servers: a small server on 127.0.0.1
(tests/serving/hostile_http.py) misbehaves in each way a broken or malicious endpoint can, and the
client must stay bounded in time and memory, report what the server did in the phase verdict (the
request failed, with the reason naming the bound), exit 69 with one line when the warm-up cannot
complete, and never exit 70 or print a traceback. Peak memory is measured in a subprocess (its own
ru_maxrss) for the cases that grew without bound before: one SSE line that never ends (~300 MB/s,
killed at 3 GB) and a 200 MiB /kvtrace/status answer (1.5 GB peak)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

pytest.importorskip("httpx", reason="the serving packages (kvtrace[serve]) are not installed")

from hostile_http import (  # noqa: E402
    GOOD,
    HEALTHY,
    TEXT,
    VALID_STATUS,
    Hostile,
    MiB,
    answer,
    endless_line,
    endless_stream,
    huge,
    json_answer,
    reset_mid_stream,
    sequence,
    slow_headers,
    sse,
)

from kvtrace import exitcodes  # noqa: E402
from kvtrace.serving.openai_stream import NotOpenAI, check_chunk, one_line, sse_data  # noqa: E402
from kvtrace.serving.tracefacts import occupancy_problem  # noqa: E402
from tests.helpers.cli_run import run_main  # noqa: E402

QUICK = ["--phases", "single", "--tokens", "8", "--max-tokens", "2", "--timeout", "10", "--baseline-s", "0",
         "--poll", "0.05", "--json"]
# Peak RSS allowed for the loadtest process: its imports (click, numpy, httpx, kvtrace) take ~100 MiB;
# the bounds hold ~1 MiB per answer in flight, so 500 MiB is generous headroom on any platform, and
# still far below what the unbounded client reached (3 GB for the endless line, 1.5 GB for the status).
RSS_BOUND_MIB = 500


@pytest.fixture
def hostile() -> Iterator[Callable[..., Hostile]]:
    made: list[Hostile] = []

    def make(routes: dict | None = None) -> Hostile:
        made.append(Hostile(routes))
        return made[-1]

    yield make
    for s in made:
        s.close()


def _run(capsys, url: str, *extra: str) -> tuple[int, str, str]:
    code, out, err = run_main(["loadtest", url, *QUICK, *extra], capsys)
    assert "Traceback" not in err and code != exitcodes.INTERNAL, err
    return code, out, err


def _rows(out: str) -> list[dict]:
    return [r for p in json.loads(out)["phases"] for r in p["requests"]]


def _check(out: str, name: str) -> dict:
    return next(c for p in json.loads(out)["phases"] for c in p["checks"] if c["name"] == name)


# The child's own peak: VmHWM of its address space, which exec starts afresh. (ru_maxrss is not: Linux
# carries it across exec, so a child forked from a 3 GB pytest process reports 3 GB.)
DRIVER = """
import resource, sys
from kvtrace.cli import main
code = 0
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code or 0
try:
    with open("/proc/self/status") as fh:
        peak = next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))
except (OSError, StopIteration):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print("maxrss_kib", peak, file=sys.stderr)
sys.exit(code)
"""


def _run_measured(url: str, *extra: str) -> tuple[int, dict | None, str, float, float]:
    """The loadtest in a subprocess: (exit code, JSON document or None, stderr, peak RSS MiB, seconds)."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", DRIVER, "loadtest", url, *QUICK, *extra], capture_output=True,
                          text=True, timeout=120)
    seconds = time.monotonic() - t0
    lines = proc.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("maxrss_kib "), proc.stderr
    rss = int(lines[-1].split()[1]) / 1024
    err = "\n".join(lines[:-1])
    assert "Traceback" not in err and proc.returncode != exitcodes.INTERNAL, err
    return proc.returncode, json.loads(proc.stdout) if proc.stdout.strip() else None, err, rss, seconds


# ---- time and memory -------------------------------------------------------------------------------


def test_an_sse_line_that_never_ends_is_cut_at_max_line_bytes_and_rss_stays_bounded(hostile):
    s = hostile({"POST /v1/completions": endless_line})
    code, doc, err, rss, seconds = _run_measured(s.url, "--warmup", "0", "--request-timeout", "60")
    assert code == 0, err
    (row,) = [r for p in doc["phases"] for r in p["requests"]]
    assert row["status"] == f"error: an SSE line over {MiB} bytes (--max-line-bytes)", row
    assert rss < RSS_BOUND_MIB, f"peak RSS {rss:.0f} MiB"
    assert seconds < 50  # cut by the line bound, not by --request-timeout
    assert doc["bounds"] == {"request_s": 60.0, "gap_s": 10.0, "line_bytes": MiB, "answer_bytes": 8 * MiB,
                             "in_flight": 256}


def test_a_200_mib_status_answer_is_not_read_past_the_bound(hostile):
    """Without Content-Length (read until the bound) at the first probe; the run goes on without live
    numbers, saying why."""
    s = hostile({"GET /kvtrace/status": huge(200 * MiB, prefix=b'{"requests_recorded": 1, "paged_cache": {"x": [',
                                             fill=b"0,", declared=False)})
    code, doc, err, rss, _ = _run_measured(s.url)
    assert code == 0, err
    assert rss < RSS_BOUND_MIB, f"peak RSS {rss:.0f} MiB"
    assert doc["live_status"] is False
    assert doc["live_unavailable"] == (f"GET /kvtrace/status: an answer over {MiB} bytes (--max-line-bytes)")
    assert doc["phases"][0]["live_unavailable"] == doc["live_unavailable"]


def test_a_huge_status_answer_mid_run_leaves_the_live_numbers_not_measured(hostile, capsys):
    """Valid at the first probe, 200 MiB (declared) afterwards: refused from its Content-Length."""
    s = hostile({"GET /kvtrace/status": sequence(json_answer(VALID_STATUS), huge(200 * MiB))})
    code, out, err = _run(capsys, s.url)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["live_status"] is True
    assert doc["phases"][0]["live_unavailable"] == (f"GET /kvtrace/status: an answer of {200 * MiB} bytes, over "
                                                    f"{MiB} (--max-line-bytes)")
    assert _check(out, "kv_released")["level"] == "not measured"


def test_a_valid_stream_that_never_ends_is_cut_at_the_request_timeout(hostile, capsys):
    s = hostile({"POST /v1/completions": endless_stream(0.02)})
    t0 = time.monotonic()
    code, out, err = _run(capsys, s.url, "--warmup", "0", "--request-timeout", "1.5")
    assert code == 0 and time.monotonic() - t0 < 20, err
    (row,) = _rows(out)
    assert row["status"] == "timeout: the answer did not end within 1.5 s (--request-timeout)", row
    assert row["ttft_s"] >= 0 and row["e2e_s"] == -1  # what arrived is measured; the request failed
    requests = _check(out, "requests")
    assert requests["level"] == "critical" and "--request-timeout" in requests["source"]


def test_a_warm_up_that_never_ends_exits_69_with_one_line(hostile, capsys):
    s = hostile({"POST /v1/completions": endless_stream(0.02)})
    code, out, err = _run(capsys, s.url, "--request-timeout", "1")
    assert code == exitcodes.UNAVAILABLE and out == "" and err.count("\n") == 1, err
    assert err == (f"kvtrace: cannot load-test {s.url}: the warm-up request to POST /v1/completions failed "
                   "(timeout: the answer did not end within 1 s (--request-timeout)); a server that fails it "
                   "cannot be load-tested\n")


def test_a_warm_up_with_an_endless_line_exits_69(hostile, capsys):
    s = hostile({"POST /v1/completions": endless_line})
    code, _, err = _run(capsys, s.url, "--max-line-bytes", "4096")
    assert code == exitcodes.UNAVAILABLE and err.count("\n") == 1, err
    assert "(error: an SSE line over 4096 bytes (--max-line-bytes))" in err


def test_a_stream_over_max_answer_bytes_fails(hostile, capsys):
    many = sse(*[TEXT] * 2000)  # ~90 KB of valid lines
    s = hostile({"POST /v1/completions": sequence(GOOD, answer(200, "text/event-stream", many))})
    code, out, err = _run(capsys, s.url, "--max-answer-bytes", "65536")
    assert code == 0, err
    (row,) = _rows(out)
    assert row["status"] == "error: a streamed answer over 65536 bytes (--max-answer-bytes)"


def test_slow_loris_headers_on_the_completion_route_are_cut(hostile, capsys):
    s = hostile({"POST /v1/completions": sequence(GOOD, slow_headers)})
    t0 = time.monotonic()
    code, out, err = _run(capsys, s.url, "--request-timeout", "1")
    assert code == 0 and time.monotonic() - t0 < 20, err
    (row,) = _rows(out)
    assert row["status"].startswith("timeout: the answer did not end within 1 s (--request-timeout), no text")


def test_slow_loris_health_exits_69_and_slow_status_is_not_sampled(hostile, capsys):
    s = hostile({"GET /health": slow_headers})
    code, _, err = _run(capsys, s.url, "--timeout", "1")
    assert code == exitcodes.UNAVAILABLE and err.count("\n") == 1, err
    assert "GET /health: " in err and "no complete answer within 1 s (--timeout)" in err
    s = hostile({"GET /kvtrace/status": sequence(json_answer(VALID_STATUS), slow_headers)})
    code, out, err = _run(capsys, s.url, "--timeout", "1")
    assert code == 0, err
    assert "no complete answer within 1 s (--timeout)" in json.loads(out)["phases"][0]["live_unavailable"]


def test_the_in_flight_bound(hostile, capsys):
    s = hostile()
    code, _, err = run_main(["loadtest", s.url, *QUICK, "--phases", "concurrent", "--concurrency", "8",
                             "--max-in-flight", "4"], capsys)
    assert code == exitcodes.USAGE and "above --max-in-flight 4" in err, err
    code, out, err = _run(capsys, s.url, "--phases", "concurrent", "--concurrency", "4", "--max-in-flight", "4")
    assert code == 0 and len(_rows(out)) == 4 and json.loads(out)["bounds"]["in_flight"] == 4, err


# ---- broken answers ------------------------------------------------------------------------------------


def test_a_connection_reset_mid_stream_is_a_failed_request(hostile, capsys):
    s = hostile({"POST /v1/completions": sequence(GOOD, reset_mid_stream)})
    code, out, err = _run(capsys, s.url)
    assert code == 0, err
    (row,) = _rows(out)
    assert row["status"].startswith("error: ") and row["e2e_s"] == -1, row
    assert _check(out, "requests")["level"] == "critical"
    s = hostile({"POST /v1/completions": reset_mid_stream})
    code, _, err = _run(capsys, s.url)
    assert code == exitcodes.UNAVAILABLE and "the warm-up request" in err and err.count("\n") == 1, err


def test_invalid_utf8_is_decoded_with_replacement_and_never_crashes(hostile, capsys):
    bad = b'data: {"choices": [{"text": "\xff\xfe"}]}\n\ndata: \xc3\x28\n\n'
    s = hostile({"POST /v1/completions": sequence(GOOD, answer(200, "text/event-stream", b'data: {"choices": [{"text"'
                                                                b': "\xff\xfe"}]}\n\n'),
                                                  answer(200, "text/event-stream", bad)),
                 "GET /kvtrace/status": answer(200, "application/json", b'{"requests_recorded": 1, "\xff": 2}'),
                 "POST /kvtrace/phase": answer(500, "application/json", b'{"detail": "\xff\x1b[31m"}')})
    code, out, err = _run(capsys, s.url, "--phases", "single,concurrent", "--concurrency", "1")
    assert code == 0, err
    rows = _rows(out)
    assert rows[0]["status"] == "ok" and rows[0]["output_tokens"] == 1
    assert rows[1]["status"].startswith("error: not an OpenAI completion: HTTP 200 text/event-stream: a data "
                                        "line that is not JSON"), rows[1]
    assert json.loads(out)["live_status"] is False
    assert json.loads(out)["phases"][0]["marker"] == "failed: HTTP 500"


def test_http_500s_everywhere(hostile, capsys):
    err500 = json_answer({"error": {"message": "boom\n\x1b[2J\u202eevil"}}, code=500)
    routes = {"POST /v1/completions": sequence(GOOD, err500),
              "GET /kvtrace/status": sequence(json_answer(VALID_STATUS), err500),
              "GET /health": sequence(HEALTHY, json_answer({"status": "unhealthy", "reason": "cb_worker_dead"},
                                                           code=503))}
    code, out, err = _run(capsys, hostile(routes).url)
    assert code == 0, err
    (row,) = _rows(out)
    assert row["status"] == "http 500: boom \\x1b[2J\\u202eevil", row  # one printable line
    phase = json.loads(out)["phases"][0]
    assert phase["live_unavailable"] == "/kvtrace/status answered 500: {'message': 'boom\\n\\x1b[2J\\u202eevil'}"
    health = _check(out, "health")
    assert health["level"] == "critical" and health["value"] == "HTTP 503: cb_worker_dead"
    code, text, err = run_main(["loadtest", hostile(routes).url, *QUICK[:-1]], capsys)  # the text report
    assert code == 0 and "\x1b" not in text + err and "\u202e" not in text + err, text + err
    assert "http 500: boom \\x1b[2J\\u202eevil" in text
    s = hostile({"POST /v1/completions": huge(200 * MiB, fill=b"[", code=500, declared=False)})
    code, _, err = _run(capsys, s.url)
    assert code == exitcodes.UNAVAILABLE and err.count("\n") == 1, err
    assert f"(http 500 (an answer over {MiB} bytes (--max-line-bytes)))" in err
    s = hostile({"GET /health": json_answer({"detail": "x" * 5000}, code=500)})
    code, _, err = _run(capsys, s.url)
    assert code == exitcodes.UNAVAILABLE and err.count("\n") == 1 and len(err) < 400, err


def test_a_compressed_answer_is_not_decoded(hostile, capsys):
    import gzip

    bomb = gzip.compress(b" " * (64 * MiB))  # 64 KB that decode to 64 MiB
    s = hostile({"POST /v1/completions": sequence(GOOD, answer(200, "text/event-stream", bomb,
                                                               extra=("Content-Encoding: gzip",)))})
    code, out, err = _run(capsys, s.url)
    assert code == 0, err
    (row,) = _rows(out)
    assert row["status"].startswith("error: an answer with Content-Encoding gzip though identity was asked")


WRONG_STATUS = {
    "paged_cache a list": {"requests_recorded": 1, "paged_cache": [1, 2]},
    "pool_bytes NaN": {"requests_recorded": 1, "paged_cache": {"pool_bytes": float("nan"), "free_bytes": 1}},
    "free_bytes Infinity": {"requests_recorded": 1, "paged_cache": {"pool_bytes": 1, "free_bytes": float("inf")}},
    "pool_bytes a string": {"requests_recorded": 1, "paged_cache": {"pool_bytes": "8 GiB", "free_bytes": 1}},
    "pool_bytes 10**400": {"requests_recorded": 1, "paged_cache": {"pool_bytes": 10**400, "free_bytes": 1}},
    "running true": {"requests_recorded": 1, "paged_cache": {"pool_bytes": 1, "free_bytes": 1, "running": True}},
    "waiting negative": {"requests_recorded": 1, "paged_cache": {"pool_bytes": 1, "free_bytes": 1, "waiting": -7}},
    "allocators a list": {"requests_recorded": 1, "paged_cache": {"pool_bytes": 1, "free_bytes": 1, "allocators": []}},
    "allocator a string": {"requests_recorded": 1, "paged_cache": {"pool_bytes": 1, "free_bytes": 1,
                                                                   "allocators": {"full": "x"}}},
    "bytes_per_block a float": {"requests_recorded": 1, "paged_cache": {
        "pool_bytes": 1, "free_bytes": 1, "allocators": {"full": {"bytes_per_block": 1.5, "blocks_cached": 2}}}},
    "unavailable an object": {"requests_recorded": 1, "paged_cache": {"unavailable": {"why": [1]}}},
    "2,000 allocators": {"requests_recorded": 1, "paged_cache": {
        "pool_bytes": 1, "free_bytes": 1, "allocators": {f"g{i}": {} for i in range(2_000)}}},
    "100,000 allocators (1.4 MB)": {"requests_recorded": 1, "paged_cache": {
        "pool_bytes": 1, "free_bytes": 1, "allocators": {f"g{i}": {} for i in range(100_000)}}},
    "nested 500 deep": {"requests_recorded": 1, "paged_cache": {
        "pool_bytes": 1, "free_bytes": 1, "allocators": {"full": json.loads("[" * 500 + "]" * 500)}}},
}
RAW_STATUS = {
    "nested 100,000 deep": b'{"requests_recorded": 1, "paged_cache": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "a JSON string": b'"requests_recorded"',
    "not JSON": b"<html>",
}


@pytest.mark.parametrize("name", [*WRONG_STATUS, *RAW_STATUS])
def test_status_answers_of_wrong_types_never_crash(hostile, capsys, name):
    """kvtrace-shaped JSON of wrong types, at the first probe and mid-run (after a valid first answer):
    exit 0, the live numbers "not measured" with the reason; a list or NaN once gave exit 70."""
    bad = json_answer(WRONG_STATUS[name]) if name in WRONG_STATUS else answer(200, "application/json",
                                                                              RAW_STATUS[name])
    for status in (bad, sequence(json_answer(VALID_STATUS), bad)):
        s = hostile({"GET /kvtrace/status": status})
        code, out, err = _run(capsys, s.url, "--phases", "single,concurrent", "--concurrency", "2")
        assert code == 0, err
        doc = json.loads(out)
        for phase in doc["phases"]:
            assert phase["live_unavailable"], phase
            assert _check(out, "kv_released")["level"] == "not measured"
        if name in WRONG_STATUS:  # the first probe, else the phase's samples, say what is wrong with it
            why = doc["live_unavailable"] or doc["phases"][0]["live_unavailable"]
            assert why.startswith(("/kvtrace/status answered JSON that is not kvtrace serve's: paged_cache",
                                   "GET /kvtrace/status: an answer of ")), why


def test_occupancy_problem_names_what_is_wrong():
    assert occupancy_problem(VALID_STATUS["paged_cache"]) is None
    assert occupancy_problem({"unavailable": "not started"}) is None
    assert occupancy_problem([1]) == "paged_cache is a JSON array, not an object"
    assert occupancy_problem({"pool_bytes": float("nan")}) == "paged_cache.pool_bytes is nan, not an integer"
    assert occupancy_problem({"running": "3"}) == "paged_cache.running is a JSON string, not an integer"
    assert occupancy_problem({"free_bytes": 2**63}) == "paged_cache.free_bytes is above 2**62, not a reading"
    assert occupancy_problem({"allocators": {"g\x1b": {"window": -2}}}) == (
        "paged_cache.allocators['g\\x1b'].window is negative, not a reading")


def test_usage_counts_out_of_range_are_not_openai():
    for usage in ({"prompt_tokens": 10**400}, {"completion_tokens": -1}, {"completion_tokens": 2**41}):
        with pytest.raises(NotOpenAI, match="integer counts"):
            check_chunk({"choices": [], "usage": usage})
    with pytest.raises(NotOpenAI, match="not JSON"):
        sse_data("data: " + "[" * 100_000)
    assert one_line("a\nb\x1b[31m\u202ec\udc80") == "a b\\x1b[31m\\u202ec\\udc80"
