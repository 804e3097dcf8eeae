"""kvtrace attach throughput: how many KV-event blocks per second the subscriber decodes and writes, and
what one block costs on disk.

Run:  python bench/bench_attach.py [--batches 3000] [--blocks 16]

A PUB socket speaking vLLM's wire protocol sends `--batches` batches, each a BlockStored and a
BlockRemoved of `--blocks` random sha256 hashes (the worst case for the text heap: random hashes do not
compress), to a real EngineRecorder bound on 127.0.0.1; a small HTTP server answers /metrics with a
vLLM cache_config_info. The clock runs from the first send to the last batch written. A busy vLLM host
publishes thousands of block events a second; the table says how far that is from the limit here.
"""

from __future__ import annotations

import argparse
import http.server
import os
import socket
import tempfile
import threading
import time

import msgspec
import zmq
from rich.console import Console
from rich.table import Table

from kvtrace.engines.attach import AttachOptions, EngineRecorder
from kvtrace.engines.vllm_events import BlockRemoved, BlockStored, KVEventBatch

METRICS = (b'vllm:cache_config_info{block_size="16",num_gpu_blocks="4096",kv_cache_memory_bytes="268435456",'
           b'kv_cache_size_tokens="65536"} 1.0\nvllm:kv_cache_usage_perc 0.5\n')


def _metrics_server() -> http.server.ThreadingHTTPServer:
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(len(METRICS)))
            self.end_headers()
            self.wfile.write(METRICS)

        def log_message(self, *a: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def run(batches: int, blocks: int) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = _metrics_server()
    out = os.path.join(tempfile.mkdtemp(), "bench.kvt.h5")
    rec = EngineRecorder(out, AttachOptions(f"http://127.0.0.1:{srv.server_address[1]}",
                                            events=f"tcp://127.0.0.1:{port}", topic="kv", interval_s=1))
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.set_hwm(100_000)  # as vLLM's publisher (KVEventsConfig.hwm)
    pub.connect(f"tcp://127.0.0.1:{port}")
    rec.start()
    time.sleep(0.5)
    payloads = []
    for _ in range(batches):
        hashes = [os.urandom(32) for _ in range(blocks)]
        payloads.append(msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=[
            BlockStored(block_hashes=hashes, parent_block_hash=None, block_size=16), BlockRemoved(block_hashes=hashes)])))
    t0 = time.perf_counter()
    for seq, p in enumerate(payloads):
        pub.send_multipart([b"kv", seq.to_bytes(8, "big"), p])
    assert rec.sub is not None
    st = rec.sub.stats
    seen, idle_since = -1, time.perf_counter()
    while (st.last_seq or 0) < batches - 1 and time.perf_counter() - idle_since < 10:  # 10 s without progress
        if st.batches != seen:
            seen, idle_since = st.batches, time.perf_counter()
        time.sleep(0.01)
    dt = time.perf_counter() - t0
    summary = rec.close()
    ctx.destroy(linger=0)
    srv.shutdown()
    n = 2 * batches * blocks
    return {"block_events": n, "seconds": dt, "per_s": n / dt, "bytes_per_block": os.path.getsize(out) / n,
            "lost": summary["kv_events"]["lost_batches"], "received": summary["kv_events"]["batches"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=3000)
    ap.add_argument("--blocks", type=int, default=16)
    args = ap.parse_args()
    r = run(args.batches, args.blocks)
    t = Table(title=f"kvtrace attach: {args.batches:,} batches of {args.blocks} stored + {args.blocks} removed blocks")
    for col in ("block events", "batches received", "seconds", "block events/s", "bytes/block on disk", "lost"):
        t.add_column(col, justify="right")
    t.add_row(f"{r['block_events']:,}", f"{r['received']:,}", f"{r['seconds']:.2f}", f"{r['per_s']:,.0f}",
              f"{r['bytes_per_block']:.1f}", f"{r['lost']}")
    Console().print(t)


if __name__ == "__main__":
    main()
