"""kvtrace serve + kvtrace loadtest with a real server on 127.0.0.1: a tiny llama saved
with a word-level tokenizer, served on CPU in a subprocess, load-tested with tiny phases, stopped
with SIGTERM; then the trace (requests, phase markers, validity) and the latency table are checked.
Also against plain `transformers serve` (no kvtrace routes: latency table only)."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys

import pytest

pytest.importorskip("fastapi", reason="the serving packages (kvtrace[serve]) are not installed")
pytest.importorskip("uvicorn", reason="the serving packages (kvtrace[serve]) are not installed")
pytest.importorskip("httpx", reason="the serving packages (kvtrace[serve]) are not installed")

from serve_helpers import (  # noqa: E402
    kvtrace_cmd,
    save_tiny_server_model,
    server_env,
    stop_server,
    wait_healthy,
)

from kvtrace.format.reader import Trace  # noqa: E402
from kvtrace.format.schema import EventKind, Outcome  # noqa: E402
from tests.helpers.net import free_port  # noqa: E402

PHASES = ["--concurrency", "3", "--tokens", "32", "--long-tokens", "128", "--max-tokens", "4", "--baseline-s", "0.3",
          "--timeout", "60"]
N_REQUESTS = 1 + 3 + 1  # single, concurrent, long


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_server_model(tmp_path_factory.mktemp("tiny-served"))


def _start(cmd: list[str], port: int) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=server_env())
    wait_healthy(f"http://127.0.0.1:{port}", proc)
    return proc


def _stop(proc: subprocess.Popen) -> tuple[int, str]:
    return stop_server(proc)


def _loadtest(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(kvtrace_cmd("loadtest", *args), capture_output=True, text=True, env=server_env(),
                          timeout=180)


def _phase_names(t: Trace) -> list[str]:
    from kvtrace.serving.tracefacts import phase_markers

    return [name for name, _ in phase_markers(t)]


@pytest.mark.slow
def test_kvtrace_serve_continuous_batching_loadtest_then_sigterm(model_dir, tmp_path):
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    port, metrics_port = free_port(), free_port()
    trace = tmp_path / "served.kvt.h5"
    proc = _start(kvtrace_cmd("serve", str(model_dir), "-o", str(trace), "--port", str(port), "--no-nvml",
                              "--prometheus", f"127.0.0.1:{metrics_port}", "--prometheus-linger", "0",
                              "--continuous-batching", "--device", "cpu", "--cb-num-blocks", "64",
                              "--cb-block-size", "16"), port)
    try:
        run = _loadtest(f"http://127.0.0.1:{port}", *PHASES, "--trace", str(trace),
                        "--json-out", str(tmp_path / "run.json"), "--fail-on", "warning")
        # the live serving metrics of kvtrace serve --prometheus, scraped while it still serves
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10, trust_env=False).text
        # /reset would swap the recorded model for an unrecorded copy: refused, and the server goes on
        reset = httpx.post(f"http://127.0.0.1:{port}/reset", timeout=10, trust_env=False)
        # so would /load_model of another model (transformers' route would load it, 200 and a stream)
        load_other = httpx.post(f"http://127.0.0.1:{port}/load_model", json={"model": "someone/other-model"},
                                timeout=10, trust_env=False)
        load_same = httpx.post(f"http://127.0.0.1:{port}/load_model", json={"model": str(model_dir)}, timeout=30,
                               trust_env=False)
        # a completion naming another model: refused by transformers' pin (the served model is force_model)
        other = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30, trust_env=False,
                           json={"model": "someone/other-model", "prompt": "the of", "max_tokens": 2})
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10, trust_env=False)
    finally:
        rc, out = _stop(proc)
    assert reset.status_code == 409 and "records the model it loaded at start" in reset.json()["detail"], reset.text
    detail = load_other.json()["detail"]
    assert load_other.status_code == 409 and "'someone/other-model' would serve a model that nothing records" in detail
    assert "\n" not in detail
    assert load_same.status_code == 200 and '"ready"' in load_same.text, load_same.text  # already loaded: no-op
    assert other.status_code == 400 and "pinned" in other.text, other.text
    assert health.status_code == 200
    live = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert live["kvtrace_serving_kv_pool_bytes"] > 0, sorted(live)
    assert live["kvtrace_serving_requests_running"] == 0  # every request had ended when scraped
    assert live["kvtrace_serving_scheduler_steps_total"] >= N_REQUESTS
    # a clean run: no phase reaches --fail-on warning (the long phase's spike is the planted probe, and
    # the pool holds it well under 80%)
    assert run.returncode == 0, run.stderr + run.stdout
    assert "phase long (1 request(s), 1 at once, 128 prompt words" in run.stdout and "WARNING" not in run.stdout
    assert rc == 0, out
    assert "stopped by SIGTERM" in out and f"{N_REQUESTS + 1} request(s)" in out

    # the trace: complete, valid, every request OK, one marker per phase plus "end"
    v = subprocess.run(kvtrace_cmd("validate", str(trace)), capture_output=True, text=True, env=server_env())
    assert v.returncode == 0, v.stdout + v.stderr
    with Trace(trace) as t:
        assert t.complete
        reqs = t.requests[:][1:]  # the first is the load test's warm-up request (8 words, 2 tokens)
        assert t.requests[:][0]["prompt_tokens"] == 8 and t.requests[:][0]["new_tokens"] == 2
        assert len(reqs) == N_REQUESTS
        assert set(reqs["outcome"].tolist()) == {int(Outcome.OK)}
        assert sorted(reqs["prompt_tokens"].tolist()) == [32, 32, 32, 32, 128]
        assert reqs["new_tokens"].tolist() == [4] * N_REQUESTS
        assert _phase_names(t) == ["baseline", "single", "concurrent", "long", "end"]
        assert len(t.events.where(kind=EventKind.REQUEST_END)) == N_REQUESTS + 1

    # kvtrace analyze on the same trace agrees with the verdict: the long phase's request is the load
    # test's own probe (132 tokens, 3.7x the typical 36), info while the pool holds it (was critical)
    import kvtrace
    from kvtrace.analyzer.base import INFO_MAX_SCORE

    (probe,) = kvtrace.analyze(trace).result("context_spike").findings
    assert probe.kind == "long_context_probe" and probe.score <= INFO_MAX_SCORE, probe.message
    assert "(phase 'long') is the load test's long-context probe: a 132-token context, 3.7x the typical 36" in probe.message
    assert probe.evidence["spike_share_of_pool"].value == pytest.approx(9 / 64, abs=1e-3)  # 9 blocks of 16 tokens
    assert "under the 80% warning" in probe.message

    # the latency table beside the trace: one row per request, streamed tokens timed
    rows = list(csv.DictReader(open(tmp_path / "served.latency.csv", encoding="utf-8")))
    assert rows[0]["phase"] == "warmup" and rows[0]["status"] == "ok"  # before the first marker, judged nowhere
    rows = rows[1:]
    assert [r["phase"] for r in rows] == ["single", "concurrent", "concurrent", "concurrent", "long"]
    assert {r["status"] for r in rows} == {"ok"}
    assert [int(r["prompt_tokens"]) for r in rows] == [32, 32, 32, 32, 128]  # the server's usage counts
    assert all(int(r["output_tokens"]) == 4 for r in rows)
    assert all(0 <= float(r["ttft_s"]) <= float(r["e2e_s"]) for r in rows)

    # verdicts: the paged pool's numbers come from the trace; device memory is not measured on CPU
    doc = json.loads((tmp_path / "run.json").read_text())
    assert [p["phase"]["name"] for p in doc["phases"]] == ["baseline", "single", "concurrent", "long"]
    assert doc["markers"] and doc["live_status"]
    checks = {p["phase"]["name"]: {c["name"]: c for c in p["checks"]} for p in doc["phases"]}
    for name in ("single", "concurrent", "long"):
        pool = checks[name]["kv_pool_use"]
        assert pool["level"] == "ok" and pool["source"].startswith("trace "), pool
        assert checks[name]["concurrency"]["level"] == "ok", checks[name]["concurrency"]
        assert checks[name]["device_memory_use"]["level"] == "not measured"
        assert checks[name]["requests"]["value"] == ("3/3 ok" if name == "concurrent" else "1/1 ok")
        # the live sample after the phase: the requests' blocks are back in the pool
        assert checks[name]["kv_released"]["level"] == "ok", checks[name]["kv_released"]
        assert checks[name]["kv_released"]["value"].startswith("0 blocks in use")
    assert all(p["live_samples"] >= 1 and p["live_unavailable"] is None for p in doc["phases"][1:])
    assert [p["verdict"] for p in doc["phases"]] == ["ok"] * 4
    # the long request (128 + 4 tokens) is 3.67x the typical context (36: a fifth of 5 requests reach it):
    # a spike, reported with its blocks, not a warning while the pool stays under 80%
    spike = checks["long"]["context_spike"]
    assert spike["level"] == "ok" and spike["value"].startswith("spike: max 132 tokens = 3.67x the typical 36"), spike
    assert "its blocks hold" in spike["value"] and "within the memory thresholds" in spike["value"]
    assert checks["concurrent"]["context_spike"]["value"].startswith("max 36 tokens = 1.00x")
    assert checks["single"]["context_spike"]["level"] == "not measured"  # 1 request: no typical context yet
    assert checks["baseline"]["context_spike"]["level"] == "not measured"


@pytest.mark.slow
def test_a_pool_too_small_for_the_concurrent_phase_warns(model_dir, tmp_path):
    """Planted: 8 blocks of 16 tokens hold two requests of 32 + 32 tokens (4 blocks each), the concurrent
    phase sends 3 at once (32 decode steps each, so they overlap): the concurrency check (at 100% or more
    of the 2 that fit) and the pool warn there, not in the single phase."""
    port = free_port()
    trace = tmp_path / "small.kvt.h5"
    proc = _start(kvtrace_cmd("serve", str(model_dir), "-o", str(trace), "--port", str(port), "--no-nvml",
                              "--continuous-batching", "--device", "cpu", "--cb-num-blocks", "8",
                              "--cb-block-size", "16"), port)
    try:
        run = _loadtest(f"http://127.0.0.1:{port}", "--phases", "baseline,single,concurrent", *PHASES,
                        "--max-tokens", "32", "--trace", str(trace), "--json", "--fail-on", "warning")
    finally:
        rc, out = _stop(proc)
    assert rc == 0, out
    assert run.returncode == 3, run.stderr + run.stdout  # a warning or worse reaches --fail-on
    doc = json.loads(run.stdout)
    verdicts = {p["phase"]["name"]: p for p in doc["phases"]}
    checks = {name: {c["name"]: c for c in p["checks"]} for name, p in verdicts.items()}
    assert verdicts["single"]["verdict"] == "ok", checks["single"]
    conc = checks["concurrent"]["concurrency"]
    # 2 or 3 in flight (running + waiting at a recorded step): at 100% of what fits or more
    assert conc["level"] == "warning" and " in flight of 2 that fit at 64 tokens" in conc["value"], conc
    assert checks["concurrent"]["kv_pool_use"]["level"] in ("warning", "critical"), checks["concurrent"]["kv_pool_use"]
    assert checks["concurrent"]["requests"]["value"] == "3/3 ok"  # the third waited for blocks, then ran


@pytest.mark.slow
def test_loadtest_against_plain_transformers_serve(model_dir, tmp_path):
    """No /kvtrace routes: the phase markers are refused (404), the latency table is still written, and
    every threshold that needs the server's numbers says "not measured"."""
    port = free_port()
    proc = _start([sys.executable, "-m", "transformers.cli.transformers", "serve", str(model_dir), "--port",
                   str(port), "--host", "127.0.0.1", "--device", "cpu"], port)
    table = tmp_path / "plain.csv"
    try:
        run = _loadtest(f"http://127.0.0.1:{port}/v1", "--phases", "single,concurrent", *PHASES, "-o", str(table),
                        "--api", "chat", "--json")
    finally:
        proc.kill()
        proc.communicate()
    assert run.returncode == 0, run.stderr + run.stdout
    doc = json.loads(run.stdout)
    assert not doc["markers"] and not doc["live_status"]
    assert doc["phases"][0]["marker"] == "unsupported (404)"
    rows = list(csv.DictReader(open(table, encoding="utf-8")))
    assert [r["phase"] for r in rows] == ["warmup", "single", "concurrent", "concurrent", "concurrent"]
    assert {r["status"] for r in rows} == {"ok"}
    assert all(int(r["output_tokens"]) >= 1 for r in rows)
    for phase in doc["phases"]:
        checks = {c["name"]: c for c in phase["checks"]}
        assert checks["kv_pool_use"]["level"] == "not measured"
        assert "not kvtrace serve" in checks["kv_pool_use"]["source"]
        assert checks["requests"]["level"] == "ok"
        assert checks["health"]["level"] == "ok"


@pytest.mark.slow
def test_kvtrace_serve_preset_without_continuous_batching_records_generate_and_stops_on_sigint(tmp_path):
    """A preset (random weights, real KV geometry, kvtrace's word tokenizer; nothing on disk) on
    sequential transformers serve (model.generate per request): the recorder's generate path writes
    the request with its per-step rows; Ctrl-C (SIGINT) ends it like SIGTERM."""
    port = free_port()
    trace = tmp_path / "plain.kvt.h5"
    proc = _start(kvtrace_cmd("serve", "preset:llama-3.1-8b", "--tiny", "-o", str(trace), "--port", str(port),
                              "--no-nvml", "--device", "cpu"), port)
    try:
        run = _loadtest(f"http://127.0.0.1:{port}", "--phases", "single", *PHASES, "--api", "chat", "--json",
                        "--warmup", "0")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert run.returncode == 0, run.stderr
    assert proc.returncode == 0 and "stopped by SIGINT" in out, out
    doc = json.loads(run.stdout)
    checks = {c["name"]: c for c in doc["phases"][0]["checks"]}
    assert "no continuous-batching cache" in checks["kv_pool_use"]["source"]  # said, not guessed
    with Trace(trace) as t:
        assert t.complete
        (req,) = t.requests[:]
        assert req["outcome"] == int(Outcome.OK) and req["new_tokens"] == 4
        assert t.meta.model_id == "preset:llama-3.1-8b"
        assert len(t.steps.where(request=0)) > 0  # generate's per-step rows
        assert _phase_names(t) == ["single", "end"]
