"""``kvtrace attach``: record a running vLLM engine into a kvtrace trace (spec §10, "Engine traces").

Two sources, each recorded as it is and marked absent when it is:

* **KV events** (ZMQ): a SUB socket that *binds* the engine's ``endpoint`` (vLLM's PUB socket connects
  to a non-wildcard endpoint). Every batch's sequence number is checked; a gap is asked again from
  the engine's ROUTER replay endpoint and what the engine no longer holds is recorded as lost
  (``dropped_samples`` events), never papered over.
* **/metrics** (HTTP), scraped every ``interval_s``: one ``/sched`` row per scrape ("tick"), its
  counters the deltas of vLLM's counters since the previous tick.

The engine's cache configuration (``vllm:cache_config_info``: block size, blocks, tokens, bytes, KV
dtype) is read once before the trace is created and written into ``/meta recorder_settings_json``.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtrace.engines import prom
from kvtrace.engines.vllm_events import (
    END_SEQ,
    AllBlocksCleared,
    BadBatch,
    BlockRemoved,
    BlockStored,
    decode_batch,
    decode_seq,
    hash_text,
)
from kvtrace.errors import BadOption, Unavailable
from kvtrace.format import schema
from kvtrace.format.writer import TraceWriter, monotonic_ns

K = schema.EventKind
MANAGER = 0  # an engine trace has one scheduler: manager 0
STORED = "kv blocks stored"  # the text a block-store NOTE event starts with (spec §10)
MAX_ZMQ_MESSAGE = 64 << 20  # a hostile publisher's giant frame is refused by ZMQ itself
MAX_HTTP_BYTES = 16 << 20
REPLAY_WAIT_S = 2.0
RCVHWM = 100_000  # batches queued for the subscriber before ZMQ drops (vLLM's publisher holds as many)
# vLLM counters a tick turns into /sched deltas, and the other counters the closing summary reports.
COUNTERS = {
    "preemptions": "vllm:num_preemptions_total",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "prompt_tokens_cached": "vllm:prompt_tokens_cached_total",
    "generation_tokens": "vllm:generation_tokens_total",
}
LOCAL_COMPUTE = ("vllm:prompt_tokens_by_source_total", {"source": "local_compute"})


class EngineUnreachable(Unavailable):
    """The engine's /metrics cannot be read, or is not a vLLM engine's (exit 69)."""


@dataclass
class AttachOptions:
    url: str  # the engine's HTTP base, e.g. http://127.0.0.1:8000
    events: str | None = None  # ZMQ endpoint to bind for the PUB stream, e.g. tcp://127.0.0.1:5557
    replay: str | None = None  # the engine's ROUTER replay endpoint, e.g. tcp://127.0.0.1:5558
    topic: str = ""
    interval_s: float = 1.0
    http_timeout_s: float = 5.0
    history: bool = False  # at the first batch, replay what the engine still holds from before the attach

    def check(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise BadOption(f"{self.url!r} is not an http(s) URL", "URL")
        for name, ep in (("--events", self.events), ("--replay", self.replay)):
            if ep is not None and not ep.startswith(("tcp://", "ipc://")):
                raise BadOption(f"{ep!r} is not a ZMQ tcp:// or ipc:// endpoint", name)
        if self.replay is not None and self.events is None:
            raise BadOption("a replay endpoint needs --events", "--replay")
        if self.history and self.replay is None:
            raise BadOption("the engine's history is read from its replay endpoint: give --replay", "--history")
        if not 0.05 <= self.interval_s <= 3600:
            raise BadOption(f"{self.interval_s} s: the scrape interval must be 0.05-3600 s", "--interval")


# ---- HTTP ------------------------------------------------------------------------------------------


def http_get(url: str, timeout_s: float) -> tuple[int, bytes]:
    """(status, body) of a GET, whole within `timeout_s` and MAX_HTTP_BYTES (a slow drip, headers one
    byte at a time or an endless body end there); EngineUnreachable when nothing answers in time."""
    import asyncio

    import httpx

    from kvtrace.serving.client import BoundBroken, read_bounded

    async def get() -> tuple[int, bytes]:
        async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client, \
                client.stream("GET", url, headers={"Accept-Encoding": "identity"}) as resp:
            return resp.status_code, await read_bounded(resp, MAX_HTTP_BYTES, "at most 16 MiB")

    try:
        return asyncio.run(asyncio.wait_for(get(), timeout=timeout_s))
    except (asyncio.TimeoutError, httpx.TimeoutException):
        raise EngineUnreachable(f"{url} did not answer in full within {timeout_s:g} s (--http-timeout)") from None
    except BoundBroken as exc:
        raise EngineUnreachable(f"{url}: {exc}") from None
    except httpx.HTTPError as exc:
        why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise EngineUnreachable(f"cannot reach the engine at {url}: {why}") from None


def scrape(base: str, timeout_s: float) -> prom.Page:
    status, body = http_get(base + "/metrics", timeout_s)
    if status != 200:
        raise EngineUnreachable(f"{base}/metrics answered HTTP {status}")
    return prom.parse(body.decode("utf-8", "replace"))


def _json_or_none(base: str, path: str, timeout_s: float) -> Any:
    try:
        status, body = http_get(base + path, timeout_s)
        return json.loads(body) if status == 200 else None
    except (EngineUnreachable, ValueError, RecursionError):
        return None


# ---- engine configuration --------------------------------------------------------------------------


MAX_CONFIG_VALUE = 1 << 50  # a block count, token count or byte size past this is not a real pool


def _int(labels: dict[str, str], key: str) -> int:
    try:
        v = int(labels.get(key, ""))
    except ValueError:
        return -1
    return v if 0 <= v <= MAX_CONFIG_VALUE else -1


def engine_config(page: prom.Page, url: str) -> dict[str, Any]:
    """What vllm:cache_config_info says about the pool, EngineUnreachable when the page has none (not
    a vLLM engine, or one without metrics)."""
    labels = page.labels("vllm:cache_config_info")
    if labels is None:
        raise EngineUnreachable(f"{url}/metrics has no vllm:cache_config_info: not a vLLM engine's metrics")
    labels = {k: v[:200] for k, v in list(labels.items())[:prom.MAX_LABELS]}
    block = _int(labels, "block_size")
    blocks = _int(labels, "num_gpu_blocks")
    tokens = _int(labels, "kv_cache_size_tokens")
    if tokens < 0 and block > 0 and blocks >= 0:
        tokens = block * blocks
    budget = _int(labels, "kv_cache_memory_bytes")
    per_block = budget // blocks if budget > 0 and blocks > 0 else -1
    return {
        "engine": "vllm",
        "block_size": block,
        "pool_blocks": blocks,
        "pool_tokens": tokens,
        "kv_cache_memory_bytes": budget,
        "bytes_per_block": per_block,
        "pool_bytes": per_block * blocks if per_block > 0 else -1,
        "kv_cache_dtype": labels.get("cache_dtype", "unknown"),
        "enable_prefix_caching": labels.get("enable_prefix_caching") == "True",
        "prefix_caching_hash_algo": labels.get("prefix_caching_hash_algo", "unknown"),
        "sliding_window": labels.get("sliding_window", "None"),
        "cache_config_info": labels,
    }


def counters(page: prom.Page) -> dict[str, float | None]:
    out: dict[str, float | None] = {k: page.value(name) for k, name in COUNTERS.items()}
    out["prompt_tokens_local_compute"] = page.value(LOCAL_COMPUTE[0], **LOCAL_COMPUTE[1])
    return out


def _model_meta(base: str, timeout_s: float) -> tuple[str, dict[str, Any]]:
    """(model id, its config.json when the engine serves a local directory this host can read)."""
    models = _json_or_none(base, "/v1/models", timeout_s)
    data = models.get("data") if isinstance(models, dict) else None
    first = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
    model_id = str(first.get("id", "unknown"))[:200]
    root = first.get("root")
    config: dict[str, Any] = {}
    if isinstance(root, str) and root.startswith("/"):
        path = Path(root) / "config.json"
        try:
            if path.is_file() and path.stat().st_size < (1 << 20):
                loaded = json.loads(path.read_text(encoding="utf-8"))
                config = loaded if isinstance(loaded, dict) else {}
        except (OSError, ValueError, RecursionError):
            config = {}
    return model_id, config


def replay(ctx: Any, endpoint: str, first: int, last: int,
           wait_s: float = REPLAY_WAIT_S) -> tuple[dict[int, bytes], str]:
    """Ask a vLLM ROUTER replay endpoint for batches first..last: ({seq: payload} received, why the
    others were not). The endpoint streams every buffered batch from `first` on, then END_SEQ."""
    import zmq

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_ZMQ_MESSAGE)
    got: dict[int, bytes] = {}
    why = "the replay endpoint no longer holds them"
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", first.to_bytes(8, "big")])
        deadline = time.monotonic() + wait_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000)):
                why = f"the replay endpoint did not finish within {wait_s:g} s"
                break
            frames = sock.recv_multipart()
            # vLLM answers [b"", topic, seq, payload]; SGLang [b"", seq, payload]
            if len(frames) not in (3, 4) or frames[0] != b"":
                why = "the replay endpoint answered a malformed frame"
                break
            seq = decode_seq(frames[-2])
            if seq is None or seq == END_SEQ:
                break
            if first <= seq <= last:
                got[seq] = frames[-1]
    except zmq.ZMQError as exc:
        why = f"replay failed: {exc}"
    finally:
        sock.close(linger=0)
    return got, why


# ---- the event subscriber --------------------------------------------------------------------------


@dataclass
class EventStats:
    batches: int = 0
    events: int = 0
    stored_blocks: int = 0
    reused_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    replayed_batches: int = 0
    lost_batches: int = 0
    bad_batches: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    restarts: int = 0


@dataclass
class _Shared:
    lock: threading.Lock = field(default_factory=threading.Lock)
    removed_since_tick: int = 0


class EventSubscriber:
    """Receives vLLM's KV events on its own thread and writes them as /events rows (spec §10)."""

    def __init__(self, writer: TraceWriter, opts: AttachOptions, anchors: tuple[int, int]) -> None:
        import zmq

        self.w = writer
        self.opts = opts
        self.stats = EventStats()
        self.shared = _Shared()
        self.resident: dict[tuple[int, str], None] = {}  # (group, hash) -> resident in the prefix cache
        self._wall0, self._mono0 = anchors
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.MAXMSGSIZE, MAX_ZMQ_MESSAGE)
        self._sub.setsockopt(zmq.RCVHWM, RCVHWM)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, opts.topic.encode())
        try:
            self._sub.bind(opts.events)
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            raise Unavailable(f"--events {opts.events}: cannot bind it ({exc}); vLLM's publisher connects "
                              "to a non-wildcard endpoint, so kvtrace binds it") from None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtrace-kv-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, drain_s: float = 0.5) -> None:
        """Take what is still queued (up to `drain_s`), then close the sockets."""
        time.sleep(drain_s)
        self._stop.set()
        self._thread.join(timeout=10)
        self._ctx.destroy(linger=0)

    # -- receiving --

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not dict(poller.poll(100)):
                    continue
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            try:
                self._frames(frames, live=True)
            except Exception as exc:  # noqa: BLE001 - a message must not end the recording; it is noted
                self._bad(f"{type(exc).__name__}: {str(exc)[:120]}")

    def _frames(self, frames: list[bytes], *, live: bool) -> None:
        if len(frames) != 3:
            self._bad(f"a message of {len(frames)} frames (expected topic, sequence, payload)")
            return
        seq = decode_seq(frames[1])
        if seq is None or seq < 0:
            self._bad("a sequence frame that is not 8 bytes")
            return
        last = self.stats.last_seq
        if live and last is None and seq > 0 and self.opts.history and self.opts.replay is not None:
            self._history(seq)
            last = self.stats.last_seq
        if live and last is not None:
            if seq <= last:  # the engine restarted (its sequence starts again at 0)
                self.stats.restarts += 1
                self._note(monotonic_ns(), K.NOTE, 0, f"kv events: sequence restarted at {seq} after {last} "
                           "(engine restarted?); its prefix cache is assumed empty")
                self.resident.clear()
            elif seq > last + 1:
                self._gap(last + 1, seq - 1)
        self._batch(seq, frames[2], replayed=not live)

    def _history(self, seq: int) -> None:
        """Before the first live batch (sequence `seq`): the batches the engine still buffers from before
        the attach, replayed and written with their own timestamps, so that blocks cached before it are
        known. What the engine no longer holds is older than the recording: not a loss."""
        assert self.opts.replay is not None
        got, _ = replay(self._ctx, self.opts.replay, 0, seq - 1)
        for s in sorted(got):
            self.stats.replayed_batches += 1
            self._batch(s, got[s], replayed=True)
        text = (f"kv events: history: sequences {min(got)}-{max(got)} ({len(got)} batches from before the attach) "
                f"replayed from {self.opts.replay}" if got else
                f"kv events: history: the replay endpoint held nothing before sequence {seq}")
        self._note(monotonic_ns(), K.NOTE, len(got), text)

    def _gap(self, first: int, last: int) -> None:
        """Batches first..last were missed live: ask the replay endpoint, record what stays lost."""
        got: dict[int, bytes] = {}
        why = "no --replay endpoint"
        if self.opts.replay is not None:
            got, why = self._replay(first, last)
        now = monotonic_ns()
        for s in range(first, last + 1):
            if s in got:
                self.stats.replayed_batches += 1
                self._batch(s, got[s], replayed=True)
        lost = [s for s in range(first, last + 1) if s not in got]
        if got:
            self._note(now, K.NOTE, len(got), f"kv events: sequences {first}-{last} missed live, "
                       f"{len(got)} replayed from {self.opts.replay}")
        if lost:
            self.stats.lost_batches += len(lost)
            self._note(now, K.DROPPED_SAMPLES, len(lost), f"kv events: {len(lost)} batch(es) lost between "
                       f"sequences {lost[0]} and {lost[-1]} ({why}); the prefix-cache residency after them is "
                       "incomplete")

    def _replay(self, first: int, last: int) -> tuple[dict[int, bytes], str]:
        assert self.opts.replay is not None
        return replay(self._ctx, self.opts.replay, first, last)

    # -- writing --

    def _t(self, ts: float) -> int:
        """An engine batch timestamp (Unix seconds) on this trace's monotonic clock."""
        if not math.isfinite(ts):
            return monotonic_ns()
        return max(int(ts * 1e9) - self._wall0 + self._mono0, 0)

    def _note(self, t: int, kind: K, value: int, text: str) -> None:
        off, n = self.w.add_text(f"manager {MANAGER}: {text}")
        self.w.append("events", schema.EventRow(t, int(kind), -1, -1, -1, -1, value, off, n))

    def _bad(self, why: str) -> None:
        self.stats.bad_batches += 1
        if self.stats.bad_batches <= 10:
            self._note(monotonic_ns(), K.DROPPED_SAMPLES, 1, f"kv events: a message was not a KV event batch "
                       f"({why}); dropped")

    def _batch(self, seq: int, payload: bytes, *, replayed: bool) -> None:
        try:
            batch = decode_batch(payload)
        except BadBatch as exc:
            self._bad(str(exc))
            return
        st = self.stats
        st.batches += 1
        st.first_seq = seq if st.first_seq is None else st.first_seq
        st.last_seq = seq if st.last_seq is None else max(st.last_seq, seq)
        t = self._t(batch.ts)
        for ev in batch.events:
            st.events += 1
            if isinstance(ev, BlockStored):
                self._stored(t, ev)
            elif isinstance(ev, BlockRemoved):
                g = ev.group_idx or 0
                hashes = [hash_text(h) for h in ev.block_hashes]
                for h in hashes:
                    self.resident.pop((g, h), None)
                st.removed_blocks += len(hashes)
                with self.shared.lock:
                    self.shared.removed_since_tick += len(hashes)
                self._note(t, K.BLOCK_EVICTED, len(hashes), f"kv removed group {g} medium {ev.medium}: "
                           + " ".join(hashes))
            elif isinstance(ev, AllBlocksCleared):
                st.cleared += 1
                n = len(self.resident)
                self.resident.clear()
                with self.shared.lock:
                    self.shared.removed_since_tick += n
                self._note(t, K.BLOCK_EVICTED, n, "kv cleared all")

    def _stored(self, t: int, ev: BlockStored) -> None:
        """A store of new blocks (a miss: their KV was computed), or, for hashes already resident, a
        reuse report (vLLM's kv_cache_report_mode="full": a prefix-cache hit)."""
        g = ev.group_idx or 0
        hashes = [hash_text(h) for h in ev.block_hashes]
        new = [h for h in hashes if (g, h) not in self.resident]
        old = [h for h in hashes if (g, h) in self.resident]
        for h in new:
            self.resident[(g, h)] = None
        for h in old:  # a hit refreshes recency in the engine's LRU: keep our order the same
            self.resident.pop((g, h))
            self.resident[(g, h)] = None
        parent = hash_text(ev.parent_block_hash) if ev.parent_block_hash is not None else "-"
        if new:
            self.stats.stored_blocks += len(new)
            text = (f"{STORED} group {g} block_size {ev.block_size} medium {ev.medium} parent {parent}: "
                    + " ".join(new))
            off, n = self.w.add_text(text)  # a data note (analyzer/notes.DATA_NOTES): not listed as a note
            self.w.append("events", schema.EventRow(t, int(K.NOTE), -1, -1, -1, -1, len(new), off, n))
        if old:
            self.stats.reused_blocks += len(old)
            self._note(t, K.PREFIX_HIT, len(old) * max(ev.block_size, 0), f"kv reused group {g} block_size "
                       f"{ev.block_size}: " + " ".join(old))


# ---- the recorder ----------------------------------------------------------------------------------


def _finite(v: float | None) -> float | None:
    """A sample's value when it is a finite number within the columns' range (a hostile page's NaN, inf
    or 1e300 reads as absent)."""
    return v if v is not None and math.isfinite(v) and abs(v) < 2**62 else None


def _delta(now: float | None, before: float | None) -> int:
    """A counter's increase (a counter that went down restarted: its new value is the increase); 0 when
    the counter is absent or not a finite count."""
    now, before = _finite(now), _finite(before)
    if now is None or now < 0:
        return 0
    if before is None or now < before:
        return int(round(now))
    return int(round(now - before))


class EngineRecorder:
    """Attach to one engine: open the trace, scrape and subscribe until stopped, close it."""

    def __init__(self, out: str | Path, opts: AttachOptions, log: Callable[[str], None] = lambda s: None) -> None:
        opts.check()
        self.opts = opts
        self.base = opts.url.rstrip("/")
        self.log = log
        first = scrape(self.base, opts.http_timeout_s)
        self.config = engine_config(first, self.base)
        self.version = _json_or_none(self.base, "/version", opts.http_timeout_s)
        model_id, model_config = _model_meta(self.base, opts.http_timeout_s)
        from kvtrace.engines.vllm_calc import element_bytes

        self.config["kv_element_bytes"] = element_bytes(model_config, self.config["block_size"],
                                                        self.config["bytes_per_block"])
        wall0, mono0 = time.time_ns(), monotonic_ns()
        settings = {
            "recorder": "attach", "engine": "vllm", "url": self.base, "events_endpoint": opts.events,
            "replay_endpoint": opts.replay, "topic": opts.topic, "interval_s": opts.interval_s,
            "engine_version": (self.version or {}).get("version", "unknown") if isinstance(self.version, dict)
            else "unknown", "engine_config": self.config,
        }
        absent = {"available": False, "reason": "not read by kvtrace attach (the engine runs in another process)"}
        sources = {
            "metrics": {"available": True, "reason": f"{self.base}/metrics every {opts.interval_s:g} s"},
            "kv_events": ({"available": True, "reason": f"ZMQ {opts.events} (topic {opts.topic!r})"} if opts.events
                          else {"available": False, "reason": "no --events endpoint given"}),
            "cache_structure": {"available": False, "reason": "an engine trace: vLLM publishes no per-request "
                                                              "block tables (/kv, /blocks are empty)"},
            "nvml": absent, "allocator": absent, "process_rss": absent,
        }
        meta = {
            "model_id": model_id, "model_type": str(model_config.get("model_type", "unknown"))[:100],
            "model_config_json": model_config, "recorder_settings_json": settings, "sources_json": sources,
            "clock_anchor_wall_ns": wall0, "clock_anchor_mono_ns": mono0,
        }
        try:
            self.w = TraceWriter(out, meta)
        except OSError as exc:
            from kvtrace.errors import CannotWrite

            raise CannotWrite(f"cannot write trace {out}: {exc.strerror or exc}") from None
        self.sub: EventSubscriber | None = None
        try:
            if opts.events:
                self.sub = EventSubscriber(self.w, opts, (wall0, mono0))
        except BaseException:
            self.w.close()
            Path(out).unlink(missing_ok=True)  # ours, new (the command refuses an existing file), and empty
            raise
        self.step = 0
        self._phases = 0
        self.start_counters = counters(first)
        self.last = self.start_counters
        self.scrape_failures = 0
        note = (f"an engine trace of vLLM {settings['engine_version']} at {self.base}: /sched rows are /metrics "
                f"ticks every {opts.interval_s:g} s; block size {self.config['block_size']}, pool "
                f"{self.config['pool_blocks']} blocks / {self.config['pool_tokens']} tokens")
        off, n = self.w.add_text(f"manager {MANAGER}: {note}")
        self.w.append("events", schema.EventRow(monotonic_ns(), int(K.NOTE), -1, -1, -1, -1, 0, off, n))
        self._tick(first, monotonic_ns())

    def start(self) -> None:
        if self.sub is not None:
            self.sub.start()

    def mark_phase(self, name: str) -> int:
        """A load-test phase marker now (a PHASE event: value = its index, text = its name), as kvtrace
        serve's recorder writes them: the phases of kvtrace loadtest --attach."""
        index = self._phases
        self._phases += 1
        off, n = self.w.add_text(name[:200])
        self.w.append("events", schema.EventRow(monotonic_ns(), int(K.PHASE), -1, -1, -1, -1, index, off, n))
        return index

    def run_in_thread(self) -> Callable[[], dict[str, Any]]:
        """Scrape and subscribe on a thread until the returned function is called; it stops, closes the
        trace and returns the summary (kvtrace loadtest --attach)."""
        stop = threading.Event()
        thread = threading.Thread(target=self.run, args=(stop.is_set,), name="kvtrace-attach", daemon=True)
        thread.start()

        def finish() -> dict[str, Any]:
            stop.set()
            thread.join(timeout=60)
            return self.close()

        return finish

    def _tick(self, page: prom.Page, t: int) -> None:
        c = counters(page)
        cfg = self.config
        usage = _finite(page.value("vllm:kv_cache_usage_perc"))
        blocks = cfg["pool_blocks"]
        in_use = int(round(usage * blocks)) if usage is not None and blocks > 0 and 0 <= usage <= 1 else -1
        per_block = cfg["bytes_per_block"]
        pool = cfg["pool_bytes"]
        free = (blocks - in_use) * per_block if in_use >= 0 and per_block > 0 else -1
        running = _finite(page.value("vllm:num_requests_running"))
        waiting = _finite(page.value("vllm:num_requests_waiting"))
        with (self.sub.shared.lock if self.sub else threading.Lock()):
            removed = self.sub.shared.removed_since_tick if self.sub else 0
            if self.sub:
                self.sub.shared.removed_since_tick = 0
        last = self.last
        hits = _delta(c["prefix_cache_hits"], last["prefix_cache_hits"])
        bs = cfg["block_size"]
        computed = (_delta(c["prompt_tokens_local_compute"], last["prompt_tokens_local_compute"])
                    if c["prompt_tokens_local_compute"] is not None
                    else _delta(c["prompt_tokens"], last["prompt_tokens"]))
        run = max(int(running or 0), 0)
        self.w.append("sched", schema.SchedRow(
            t, MANAGER, self.step, min(run, 2**32 - 1), min(computed, 2**32 - 1),
            min(_delta(c["generation_tokens"], last["generation_tokens"]), 2**32 - 1),
            min(run, 2**32 - 1), min(max(int(waiting or 0), 0), 2**32 - 1), -1, -1, pool, free, -1, in_use, -1, -1,
            hits, hits // bs if bs > 0 else 0, removed,
            min(_delta(c["preemptions"], last["preemptions"]), 2**32 - 1)))
        self.last = c
        self.step += 1

    def tick(self) -> None:
        """One scrape; a failed scrape is noted (once per run of failures) and skipped, never invented."""
        try:
            page = scrape(self.base, self.opts.http_timeout_s)
        except Unavailable as exc:
            self.scrape_failures += 1
            if self.scrape_failures == 1 or self.scrape_failures % 60 == 0:
                off, n = self.w.add_text(f"manager {MANAGER}: metrics scrape failed ({exc}); no /sched row")
                self.w.append("events", schema.EventRow(monotonic_ns(), int(K.DROPPED_SAMPLES), -1, -1, -1, -1, 1,
                                                        off, n))
            return
        self._tick(page, monotonic_ns())

    def run(self, until: Callable[[], bool]) -> None:
        """Tick every interval until `until()` holds (checked every 50 ms)."""
        self.start()
        next_t = time.monotonic() + self.opts.interval_s
        while not until() and not self.w.failed:  # a storage failure ends the recording (close says so)
            if time.monotonic() >= next_t:
                self.tick()
                next_t += self.opts.interval_s
                if next_t < time.monotonic():
                    next_t = time.monotonic() + self.opts.interval_s
            time.sleep(0.05)

    def close(self) -> dict[str, Any]:
        """Drain the events, one last tick, the closing summary; returns the summary."""
        if self.sub is not None:
            self.sub.stop()
        self.tick()
        summary: dict[str, Any] = {
            "ticks": self.step, "scrape_failures": self.scrape_failures,
            "counters": {k: _delta(self.last[k], self.start_counters[k]) for k in self.last
                         if self.last[k] is not None},
        }
        if self.sub is not None:
            summary["kv_events"] = {k: v for k, v in vars(self.sub.stats).items()}
            summary["kv_events"]["resident_blocks"] = len(self.sub.resident)
        off, n = self.w.add_text(f"manager {MANAGER}: attach summary " + json.dumps(summary, sort_keys=True))
        self.w.append("events", schema.EventRow(monotonic_ns(), int(K.NOTE), -1, -1, -1, -1, self.step, off, n))
        self.w.close()
        if self.w.failure is not None:
            from kvtrace.errors import TraceIncomplete

            raise TraceIncomplete(f"{self.w.path}: trace incomplete, writing stopped early "
                                  f"({self.w.failure.describe()})")
        return summary
