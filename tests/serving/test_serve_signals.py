"""SIGTERM sent early to kvtrace serve: after the recording started but before uvicorn installed its
own signal handlers. The signal must not be lost (the server would keep serving) nor lose the trace:
it is handed to uvicorn, which starts and shuts down at once; serve returns, the trace is complete.
A real SIGTERM, sent by the process to itself from the on_ready callback, which runs in exactly that
window (inside transformers' build_server, before uvicorn.Config/Server exist). In a subprocess, so
the test process's own handlers are untouched."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("fastapi", reason="the serving packages (kvtrace[serve]) are not installed")
pytest.importorskip("uvicorn", reason="the serving packages (kvtrace[serve]) are not installed")

from serve_helpers import save_tiny_server_model, server_env  # noqa: E402

from kvtrace.format.reader import Trace  # noqa: E402
from kvtrace.format.validate import validate  # noqa: E402
from tests.helpers.net import free_port  # noqa: E402

DRIVER = textwrap.dedent("""
    import os, signal, sys, time
    from kvtrace.serving.runner import serve

    seen = []

    def on_ready(url):
        seen.append(url)
        os.kill(os.getpid(), signal.SIGTERM)  # delivered at the next bytecode: uvicorn is not set up yet
        time.sleep(0.05)

    t0 = time.monotonic()
    outcome = serve(sys.argv[1], sys.argv[2], port=int(sys.argv[3]),
                    serve_args=["--continuous-batching", "--device", "cpu", "--cb-num-blocks", "16"],
                    record_options={"nvml": False}, on_ready=on_ready)
    print("ready", bool(seen), "stopped_by", outcome.stopped_by, "requests", outcome.requests,
          "seconds", round(time.monotonic() - t0, 1))
""")


@pytest.mark.slow
def test_sigterm_before_uvicorn_handlers_stops_with_a_complete_trace(tmp_path):
    model_dir = save_tiny_server_model(tmp_path / "tiny")
    trace = tmp_path / "early.kvt.h5"
    run = subprocess.run([sys.executable, "-c", DRIVER, str(model_dir), str(trace), str(free_port())],
                         capture_output=True, text=True, env=server_env(), timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    last = run.stdout.strip().splitlines()[-1]
    assert last.startswith("ready True stopped_by SIGTERM requests 0"), run.stdout + run.stderr
    # uvicorn took the signal as its own: it started and shut down gracefully
    assert "Finished server process" in run.stderr, run.stderr
    with Trace(trace) as t:
        assert t.complete and len(t.requests[:]) == 0
    assert validate(trace).valid
