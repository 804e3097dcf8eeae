"""`kvtrace loadtest` and `kvtrace serve` say what they do as they do it (no silent minutes): each
line is flushed when written, so a pipe (CI log, `| tee`) sees it while the command still works.

Each test holds the command at a known point (the hostile test server keeps the concurrent phase's
answers until the test has read the lines of the phase before; serve's model load and server start
wait for the test: tests/gated_run.py) and reads its output line by line: a line left in a buffer
until exit is never read and the test fails. No wall-clock thresholds."""

from __future__ import annotations

import signal
import threading

import pytest

pytest.importorskip("httpx", reason="the serving packages (kvtrace[serve]) are not installed")

from hostile_http import GOOD, Conn, Hostile, sequence  # noqa: E402
from serve_helpers import wait_healthy  # noqa: E402

from tests.helpers.gated_run import Gated  # noqa: E402
from tests.helpers.net import free_port  # noqa: E402


def test_loadtest_prints_each_phase_and_its_verdict_as_it_ends(tmp_path):
    release = threading.Event()

    def held(c: Conn, n: int) -> None:  # the concurrent phase's answers wait for the test
        release.wait(120)
        GOOD(c, n)

    server = Hostile({"POST /v1/completions": sequence(GOOD, GOOD, held)})  # warm-up, single, then held
    run = Gated([], ["loadtest", server.url, "--phases", "single,concurrent", "--concurrency", "2", "--tokens", "8",
                     "--max-tokens", "2", "--timeout", "60", "--poll", "0.05"], tmp_path)
    try:
        run.expect(f"loadtest {server.url}: single, concurrent; checking /health, then 1 warm-up request(s)")
        run.expect("warm-up request 0: ok")
        run.expect("phase single: 1 request(s), 1 at once, 8 prompt words ...")
        done = run.expect("phase single done in ")
        assert "1/1 ok" in done and "verdict " in done
        run.expect("phase concurrent: 2 request(s), 2 at once")
        assert run.proc.poll() is None  # the server still holds the concurrent answers
        release.set()
        assert "2/2 ok" in run.expect("phase concurrent done in ")
        run.expect("overall verdict: ")
        assert run.finish() == 0, run.other
    finally:
        release.set()
        run.kill()
        server.close()


@pytest.mark.slow
def test_serve_says_what_it_loads_before_loading_it_and_logs_no_status_polls(tmp_path):
    pytest.importorskip("transformers")
    port = free_port()
    run = Gated(["kvtrace.commands.serve:load_preset", "kvtrace.serving.runner:serve"],
                ["serve", "preset:llama-3.1-8b", "--tiny", "-o", str(tmp_path / "s.kvt.h5"), "--port", str(port),
                 "--no-nvml", "--device", "cpu"], tmp_path, stream="stderr",
                env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    try:
        run.expect("importing torch and transformers ...")
        run.expect("loading preset:llama-3.1-8b (random weights")
        run.open(0)
        run.expect("starting transformers serve: importing its server")
        run.open(1)
        run.expect(f"serving preset:llama-3.1-8b at http://127.0.0.1:{port}")
        # loadtest's status polling stays out of the access log; other requests are logged
        import httpx

        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, run.proc)
        for _ in range(3):
            assert httpx.get(f"{url}/kvtrace/status", timeout=10, trust_env=False).status_code == 200
        assert httpx.get(f"{url}/v1/models", timeout=10, trust_env=False).status_code in (200, 404)
        run.proc.send_signal(signal.SIGTERM)
        run.expect("stopped by SIGTERM")
        assert run.finish() == 0
    finally:
        run.kill()
    log = "\n".join(run.lines + [x for x in run.other if x])
    assert '"GET /health HTTP/1.1" 200' in log and '"GET /v1/models HTTP/1.1"' in log, log[-3000:]
    assert "/kvtrace/status" not in log
