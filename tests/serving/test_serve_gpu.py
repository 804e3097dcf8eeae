"""The four-phase diagnosis on a GPU, at the protocol's own sizes: kvtrace serve of the llama-3.1-8b
preset (random weights, real geometry, bf16) with continuous batching, kvtrace loadtest with
10 x 2,048 tokens and one 16,384-token request, then SIGTERM. On a GPU every threshold has its
number: device memory from NVML, fragmentation from the allocator, pool use and concurrency from
/sched. Asserts what is measured and where from, not the levels (they are the host's)."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("fastapi", reason="the serving packages (kvtrace[serve]) are not installed")
pytest.importorskip("httpx", reason="the serving packages (kvtrace[serve]) are not installed")

from serve_helpers import kvtrace_cmd, server_env, wait_healthy  # noqa: E402

from kvtrace.format.reader import Trace  # noqa: E402
from tests.helpers.net import free_port  # noqa: E402


def test_four_phases_on_a_gpu(tmp_path):
    port = free_port()
    trace = tmp_path / "gpu-serve.kvt.h5"
    proc = subprocess.Popen(kvtrace_cmd("serve", "preset:llama-3.1-8b", "-o", str(trace), "--port", str(port),
                                        "--continuous-batching", "--device", "cuda", "--dtype", "bfloat16"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=server_env())
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, timeout_s=300)
        run = subprocess.run(kvtrace_cmd("loadtest", f"http://127.0.0.1:{port}", "--baseline-s", "3",
                                         "--max-tokens", "32", "--trace", str(trace), "--json-out",
                                         str(tmp_path / "run.json")),
                             capture_output=True, text=True, env=server_env(), timeout=420)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    print(run.stdout)
    assert run.returncode == 0, run.stderr + run.stdout
    assert proc.returncode == 0, out[-3000:]
    doc = json.loads((tmp_path / "run.json").read_text())
    by_phase = {p["phase"]["name"]: {c["name"]: c for c in p["checks"]} for p in doc["phases"]}
    assert list(by_phase) == ["baseline", "single", "concurrent", "long"]
    for name, checks in by_phase.items():
        assert checks["device_memory_use"]["level"] != "not measured", checks["device_memory_use"]
        assert checks["device_memory_use"]["source"].startswith("trace /telemetry/nvml")
        assert checks["fragmentation"]["level"] != "not measured", checks["fragmentation"]
        if name != "baseline":
            assert checks["kv_pool_use"]["source"].startswith("trace /sched"), checks["kv_pool_use"]
            assert checks["concurrency"]["level"] != "not measured", checks["concurrency"]
            assert checks["requests"]["level"] == "ok", checks["requests"]
    v = subprocess.run(kvtrace_cmd("validate", str(trace)), capture_output=True, text=True, env=server_env())
    assert v.returncode == 0, v.stdout + v.stderr
    with Trace(trace) as t:
        assert t.complete and len(t.requests[:]) == 1 + 1 + 10 + 1  # warm-up, single, concurrent, long
