"""kvtrace attach without vLLM: bad options, unreachable and hostile endpoints (one line, a documented
exit code, never a traceback), hostile event payloads, and sequence gaps filled from a replay endpoint or
recorded as lost. The publisher here is a PUB + ROUTER pair speaking vLLM's wire protocol
(kvtrace/engines/vllm_events.py); the real engine is in test_vllm_real.py."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("zmq", reason="kvtrace[engines] (pyzmq) is not installed")
pytest.importorskip("msgspec", reason="kvtrace[engines] (msgspec) is not installed")

import msgspec  # noqa: E402
import zmq  # noqa: E402

from kvtrace import exitcodes  # noqa: E402
from kvtrace.engines import prom  # noqa: E402
from kvtrace.engines.attach import AttachOptions, EngineRecorder  # noqa: E402
from kvtrace.engines.vllm_events import (  # noqa: E402
    BadBatch,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
)
from kvtrace.format import schema  # noqa: E402
from kvtrace.format.reader import Trace  # noqa: E402
from tests.helpers.cli_run import run_main  # noqa: E402
from tests.helpers.net import free_port  # noqa: E402

K = schema.EventKind
METRICS = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",engine="0",kv_cache_memory_bytes="1048576",kv_cache_size_tokens="1024",num_gpu_blocks="32",prefix_caching_hash_algo="sha256"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:num_preemptions_total{engine="0",model_name="m"} %(pre)d.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} %(hits)d.0
vllm:generation_tokens_total{engine="0",model_name="m"} 10.0
"""


class _Server:
    """An HTTP server on 127.0.0.1 answering GET with `answer(path) -> (status, body)`."""

    def __init__(self, answer) -> None:  # type: ignore[no-untyped-def]
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                status, body = outer.answer(self.path)
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: object) -> None:
                pass

        self.answer = answer
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.handle_error = lambda request, address: None  # a client that left early is no news
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def engine() -> Iterator[_Server]:
    state = {"pre": 0, "hits": 0}

    def answer(path: str) -> tuple[int, bytes]:
        if path == "/metrics":
            return 200, (METRICS % state).encode()
        if path == "/version":
            return 200, b'{"version": "0.32.0"}'
        return 404, b"{}"

    srv = _Server(answer)
    srv.state = state  # type: ignore[attr-defined]
    yield srv
    srv.close()


def _attach(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    return run_main(["attach", *args], capsys)


# ---- options and endpoints ------------------------------------------------------------------------


def test_unreachable_engine_is_69_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _attach([f"http://127.0.0.1:{free_port()}", "-o", str(tmp_path / "t.kvt.h5"), "--duration", "1"],
                           capsys)
    assert code == exitcodes.UNAVAILABLE
    assert err.count("\n") == 1 and "cannot reach the engine" in err and "Traceback" not in err
    assert not (tmp_path / "t.kvt.h5").exists()


@pytest.mark.parametrize("args, word", [
    (["ftp://127.0.0.1:1"], "not an http(s) URL"),
    (["http://127.0.0.1:1", "--events", "127.0.0.1:5"], "not a ZMQ"),
    (["http://127.0.0.1:1", "--replay", "tcp://127.0.0.1:5"], "needs --events"),
    (["http://127.0.0.1:1", "--duration", "1", "--until-signal"], "exclude each other"),
    (["http://127.0.0.1:1", "--interval", "0"], "--interval"),
])
def test_bad_options_are_64(args: list[str], word: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _attach([*args, "-o", str(tmp_path / "t.kvt.h5")], capsys)
    assert code == exitcodes.USAGE, err
    assert word in err and "Traceback" not in err


def test_never_overwrites_an_existing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           engine: _Server) -> None:
    out = tmp_path / "t.kvt.h5"
    out.write_bytes(b"keep me")
    code, _, err = _attach([engine.url, "-o", str(out), "--duration", "0.2"], capsys)
    assert code == exitcodes.USAGE and "already exists" in err
    assert out.read_bytes() == b"keep me"


@pytest.mark.parametrize("status, body, word", [
    (200, b"<html>hello</html>", "no vllm:cache_config_info"),
    (500, b"oops", "HTTP 500"),
    (200, b"x" * (17 << 20), "over 16777216"),
    (200, b'vllm:cache_config_info{block_size="32",num_gpu_blocks="-5" 1\n\xff\xfe', "no vllm:cache_config_info"),
])
def test_hostile_metrics_are_69(status: int, body: bytes, word: str, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    srv = _Server(lambda path: (status, body))
    try:
        code, _, err = _attach([srv.url, "-o", str(tmp_path / "t.kvt.h5"), "--duration", "0.2"], capsys)
    finally:
        srv.close()
    assert code == exitcodes.UNAVAILABLE, err
    assert word in err and err.count("\n") == 1


def test_events_endpoint_in_use_is_69(tmp_path: Path, capsys: pytest.CaptureFixture[str], engine: _Server) -> None:
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PULL)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        code, _, err = _attach([engine.url, "--events", f"tcp://127.0.0.1:{port}", "-o", str(tmp_path / "t.kvt.h5"),
                                "--duration", "0.2"], capsys)
    finally:
        ctx.destroy(linger=0)
    assert code == exitcodes.UNAVAILABLE and "cannot bind" in err, err
    assert not (tmp_path / "t.kvt.h5").exists()  # nothing was recorded: no file left behind


def test_prometheus_parser_bounds() -> None:
    page = prom.parse('a{x="1"} 2\na{x="2"} 3\nbad line here\nb{unterminated="1 4\nc 1e3 123\n# comment\n'
                      'd{x="q\\"uote"} 5\n')
    assert page.value("a") == 5 and page.value("a", x="2") == 3 and page.value("c") == 1000
    assert page.labels("d") == {"x": 'q"uote'}
    assert page.value("missing") is None and page.skipped_lines == 2


# ---- the event stream ---------------------------------------------------------------------------------


def _payload(*events: object, ts: float | None = None) -> bytes:
    return msgspec.msgpack.encode(KVEventBatch(ts=time.time() if ts is None else ts, events=list(events)))


@pytest.mark.parametrize("payload", [b"", b"\x00\x01garbage", msgspec.msgpack.encode({"ts": 1}),
                                     msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": "x"}]]),
                                     msgspec.msgpack.encode([1.0, [{"type": "Nope"}]]),
                                     msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved",
                                                                    "block_hashes": [b"x" * 65]}]])])
def test_hostile_payloads_are_bad_batches(payload: bytes) -> None:
    with pytest.raises(BadBatch):
        decode_batch(payload)


class _Publisher:
    """A PUB socket connecting to the attach's bound endpoint and a ROUTER replay endpoint that serves
    the batches it holds, as vLLM's ZmqEventPublisher does (END_SEQ = -1 closes a replay)."""

    def __init__(self, events: str, serve_replay: bool = True) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.connect(events)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: list[tuple[int, bytes]] = []
        self.serve_replay = serve_replay
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            client, _, start = self.router.recv_multipart()
            if not self.serve_replay:
                continue
            first = int.from_bytes(start, "big")
            for seq, buf in list(self.buffer):
                if seq >= first:
                    self.router.send_multipart([client, b"", b"kv", seq.to_bytes(8, "big"), buf])
            self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def send(self, seq: int, payload: bytes, live: bool = True) -> None:
        self.buffer.append((seq, payload))
        if live:
            self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])

    def close(self) -> None:
        self._stop.set()
        self.thread.join()
        self.ctx.destroy(linger=0)


def _record(engine: _Server, tmp_path: Path, serve_replay: bool) -> tuple[Path, dict]:
    events = f"tcp://127.0.0.1:{free_port()}"
    out = tmp_path / "e.kvt.h5"
    rec = None
    pub = _Publisher(events, serve_replay)
    try:
        rec = EngineRecorder(out, AttachOptions(engine.url, events=events,
                                                replay=f"tcp://127.0.0.1:{pub.replay_port}", topic="kv",
                                                interval_s=0.1))
        rec.start()
        time.sleep(0.5)  # the PUB socket connects to the bound endpoint
        a, b, c = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
        pub.send(0, _payload(BlockStored(block_hashes=[a, b], parent_block_hash=None, token_ids=[1] * 64,
                                         block_size=32)))
        pub.send(1, _payload(BlockStored(block_hashes=[a], parent_block_hash=None, block_size=32)), live=False)
        pub.send(2, _payload(BlockRemoved(block_hashes=[b])), live=False)
        pub.send(3, _payload(BlockStored(block_hashes=[c], parent_block_hash=a, block_size=32)))
        pub.pub.send_multipart([b"kv", b"\x00", b"short sequence frame"])  # hostile: dropped, noted
        engine.state["pre"] = 3  # type: ignore[attr-defined]
        engine.state["hits"] = 32  # type: ignore[attr-defined]
        time.sleep(0.6)
    finally:
        summary = rec.close() if rec is not None else {}
        pub.close()
    return out, summary


def _texts(path: Path) -> list[tuple[int, int, str]]:
    with Trace(path) as t:
        return [(int(r["kind"]), int(r["value"]), t.text(int(r["text_off"]), int(r["text_len"])))
                for r in t.table("events")]


def test_a_gap_is_replayed(engine: _Server, tmp_path: Path) -> None:
    out, summary = _record(engine, tmp_path, serve_replay=True)
    ev = summary["kv_events"]
    assert ev["replayed_batches"] == 2 and ev["lost_batches"] == 0 and ev["bad_batches"] == 1
    assert (ev["stored_blocks"], ev["reused_blocks"], ev["removed_blocks"]) == (3, 1, 1)
    texts = _texts(out)
    assert any(k == K.NOTE and "sequences 1-2 missed live, 2 replayed" in t for k, _, t in texts)
    assert any(k == K.PREFIX_HIT and v == 32 and "kv reused group 0" in t for k, v, t in texts)
    assert any(k == K.BLOCK_EVICTED and v == 1 and t.endswith("02" * 32) for k, v, t in texts)
    with Trace(out) as t:
        sched = t.table("sched")
    assert int(sched["preempted"].sum()) == 3 and int(sched["prefix_hit_tokens"].sum()) == 32
    assert int(sched["evicted_blocks"].sum()) == 1 and set(sched["pool_bytes"].tolist()) == {1 << 20}
    assert set(sched["blocks_in_use"].tolist()) == {16}  # 0.5 x 32 blocks


def test_a_gap_the_engine_cannot_replay_is_recorded_lost(engine: _Server, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    out, summary = _record(engine, tmp_path, serve_replay=False)
    assert summary["kv_events"]["lost_batches"] == 2 and summary["kv_events"]["replayed_batches"] == 0
    lost = [(v, t) for k, v, t in _texts(out) if k == K.DROPPED_SAMPLES and "lost" in t]
    assert lost and lost[0][0] == 2 and "between sequences 1 and 2" in lost[0][1]
    code, _, _ = run_main(["validate", str(out)], capsys)
    assert code == 0
    code, stdout, _ = run_main(["whatif", str(out), "--pool-sizes", "1,2", "--json"], capsys)
    assert code == 0
    doc = json.loads(stdout)
    assert doc["accesses"] == 3 and doc["distinct_blocks"] == 3  # stores a, b, c; the lost reuse is not there


def test_array_encoded_events_decode() -> None:
    """Events as arrays [tag, field, ...]: SGLang's schema (its kv_events.py: int hashes, lora_id, no medium
    or group) and vLLM releases before the map form."""

    class Ev(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
        pass

    class BlockStoredS(Ev, tag="BlockStored"):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None

    class BlockRemovedS(Ev, tag="BlockRemoved"):
        block_hashes: list[int]

    class Batch(msgspec.Struct, array_like=True, omit_defaults=True):
        ts: float
        events: list[BlockStoredS | BlockRemovedS]

    raw = msgspec.msgpack.encode(Batch(ts=5.0, events=[BlockStoredS([11, 12], None, [1, 2], 16, None),
                                                       BlockRemovedS([11])]))
    batch = decode_batch(raw)
    stored, removed = batch.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == [11, 12] and stored.block_size == 16
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [11]


def test_hostile_values_are_recorded_absent_not_crashing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """NaN, inf, negative and huge numbers in an engine's /metrics: the trace is still valid, their columns
    absent (-1) or zero increases, never invented and never an internal error."""
    page = (b'vllm:cache_config_info{block_size="32",num_gpu_blocks="99999999999999999999",'
            b'kv_cache_memory_bytes="-4"} 1\n'
            b'vllm:num_requests_running NaN\nvllm:num_requests_waiting -3\nvllm:kv_cache_usage_perc +Inf\n'
            b'vllm:num_preemptions_total -7\nvllm:prefix_cache_hits_total 1e300\nvllm:generation_tokens_total NaN\n')
    srv = _Server(lambda path: (200, page) if path == "/metrics" else (404, b""))
    out = tmp_path / "h.kvt.h5"
    try:
        code, _, err = _attach([srv.url, "-o", str(out), "--duration", "0.5", "--interval", "0.1"], capsys)
    finally:
        srv.close()
    assert code == 0, err
    with Trace(out) as t:
        sched = t.table("sched")
    assert sched.size >= 2
    assert set(sched["pool_bytes"].tolist()) == {-1} and set(sched["blocks_in_use"].tolist()) == {-1}
    assert int(sched["preempted"].sum()) == 0 and int(sched["prefix_hit_tokens"].sum()) == 0
    assert int(sched["waiting"].max()) == 0
    code, _, err = run_main(["validate", str(out)], capsys)
    assert code == 0, err


@pytest.mark.parametrize("route", ["slow_headers", "endless"])
def test_a_server_that_never_finishes_is_69_within_the_timeout(route: str, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "serving"))  # the hostile server of the serving tests
    from hostile_http import Hostile, endless_stream, slow_headers

    srv = Hostile({"GET /metrics": slow_headers if route == "slow_headers" else endless_stream(0.05)})
    t0 = time.monotonic()
    try:
        code, _, err = _attach([srv.url, "-o", str(tmp_path / "t.kvt.h5"), "--http-timeout", "1"], capsys)
    finally:
        srv.close()
    assert code == exitcodes.UNAVAILABLE and "within 1 s" in err, err
    assert time.monotonic() - t0 < 10


def test_history_makes_blocks_cached_before_the_attach_known(engine: _Server, tmp_path: Path) -> None:
    events = f"tcp://127.0.0.1:{free_port()}"
    out = tmp_path / "h.kvt.h5"
    pub = _Publisher(events)
    a, b = b"\x0a" * 32, b"\x0b" * 32
    pub.send(0, _payload(BlockStored(block_hashes=[a, b], parent_block_hash=None, block_size=32)), live=False)
    pub.send(1, _payload(BlockRemoved(block_hashes=[b])), live=False)  # both before the attach
    rec = None
    try:
        rec = EngineRecorder(out, AttachOptions(engine.url, events=events,
                                                replay=f"tcp://127.0.0.1:{pub.replay_port}", topic="kv",
                                                interval_s=0.1, history=True))
        rec.start()
        time.sleep(0.5)
        pub.send(2, _payload(BlockStored(block_hashes=[a], parent_block_hash=None, block_size=32)))  # a reuse
        time.sleep(0.5)
    finally:
        summary = rec.close() if rec is not None else {}
        pub.close()
    ev = summary["kv_events"]
    assert (ev["stored_blocks"], ev["removed_blocks"], ev["reused_blocks"]) == (2, 1, 1)
    assert ev["lost_batches"] == 0 and ev["first_seq"] == 0 and ev["resident_blocks"] == 1
    assert any(k == K.NOTE and "history: sequences 0-1 (2 batches from before the attach)" in t
               for k, _, t in _texts(out))


def test_history_needs_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str], engine: _Server) -> None:
    code, _, err = _attach([engine.url, "--events", f"tcp://127.0.0.1:{free_port()}", "--history", "-o",
                            str(tmp_path / "t.kvt.h5")], capsys)
    assert code == exitcodes.USAGE and "--replay" in err


def test_a_storage_failure_ends_the_recording_with_74(engine: _Server, tmp_path: Path) -> None:
    from kvtrace.errors import TraceIncomplete
    from kvtrace.format.storage import StorageFault

    rec = EngineRecorder(tmp_path / "f.kvt.h5", AttachOptions(engine.url, interval_s=0.05))
    rec.w._enter_failed(StorageFault(28, "No space left on device", "write", 4096))  # as a full disk does
    t0 = time.monotonic()
    rec.run(lambda: time.monotonic() - t0 > 30)  # returns at once: the writer failed
    assert time.monotonic() - t0 < 5
    with pytest.raises(TraceIncomplete, match="ENOSPC") as info:
        rec.close()
    assert info.value.exit_code == exitcodes.IO_ERROR
