"""A small HTTP/1.1 server on 127.0.0.1 that misbehaves on purpose: each route is a
behaviour that writes raw bytes to the socket, so an answer can be anything a hostile or broken
server sends: a line that never ends, a stream that never ends, a body of hundreds of MiB, headers
one byte at a time, a reset mid-stream, bytes that are not UTF-8, kvtrace-shaped JSON of wrong
types. Plain sockets and threads, no dependency. One request per connection (``Connection: close``)."""

from __future__ import annotations

import json
import socket
import socketserver
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

MiB = 1 << 20


class Conn:
    """The accepted socket, and the server's stop flag (endless behaviours end when it is set)."""

    def __init__(self, sock: socket.socket, stop: threading.Event) -> None:
        self.sock = sock
        self.stop = stop

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)


Behaviour = Callable[[Conn, int], None]  # (connection, how many requests this route had before)


def head(code: int = 200, ctype: str = "application/json", length: int | None = None,
         extra: tuple[str, ...] = ()) -> bytes:
    lines = [f"HTTP/1.1 {code} Whatever", f"Content-Type: {ctype}", "Connection: close", *extra]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def answer(code: int = 200, ctype: str = "application/json", body: bytes | str = b"",
           extra: tuple[str, ...] = ()) -> Behaviour:
    data = body.encode() if isinstance(body, str) else body

    def fn(c: Conn, n: int) -> None:
        c.send(head(code, ctype, len(data), extra) + data)
    return fn


def json_answer(doc: Any, code: int = 200) -> Behaviour:
    return answer(code, "application/json", json.dumps(doc, allow_nan=True))


def sequence(*behaviours: Behaviour) -> Behaviour:
    """The n-th request of the route gets the n-th behaviour (the last one from then on)."""
    def fn(c: Conn, n: int) -> None:
        behaviours[min(n, len(behaviours) - 1)](c, n)
    return fn


def sse(*chunks: dict[str, Any], done: bool = True) -> bytes:
    return ("".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + ("data: [DONE]\n\n" if done else "")).encode()


TEXT = {"choices": [{"index": 0, "text": " the"}]}
USAGE = {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 2}}
GOOD_SSE = sse(TEXT, TEXT, USAGE)
GOOD = answer(200, "text/event-stream", GOOD_SSE)
HEALTHY = json_answer({"status": "ok"})
VALID_STATUS = {"recording": "x.kvt.h5", "phase": None, "phase_events": "PHASE", "requests_recorded": 0,
                "recorder_errors": 0,
                "paged_cache": {"pool_bytes": 8 * MiB, "free_bytes": 6 * MiB, "blocks_in_use": 16,
                                "allocators": {"full_0": {"blocks_in_use": 16, "blocks_total": 64, "blocks_cached": 0,
                                                          "tokens_per_block": 256, "bytes_per_block": 131072,
                                                          "window": -1}},
                                "tokens_cached": 0, "running": 0, "waiting": 0}}


def endless_line(c: Conn, n: int) -> None:
    """A 200 event stream whose first line never ends: 1 MiB blocks of 'a', up to 2 GiB."""
    c.send(head(200, "text/event-stream"))
    c.send(b"data: {\"choices\": [{\"text\": \"")
    block = b"a" * MiB
    for _ in range(2048):
        if c.stop.is_set():
            return
        c.send(block)


def endless_stream(every_s: float = 0.02) -> Behaviour:
    """A valid completion stream that never ends: one text chunk every ``every_s``."""
    line = sse(TEXT, done=False)

    def fn(c: Conn, n: int) -> None:
        c.send(head(200, "text/event-stream"))
        while not c.stop.is_set():
            c.send(line)
            time.sleep(every_s)
    return fn


def huge(size: int, ctype: str = "application/json", prefix: bytes = b"", fill: bytes = b" ",
         declared: bool = True, code: int = 200) -> Behaviour:
    """A body of ``size`` bytes: ``prefix`` then ``fill`` repeated; with or without Content-Length."""
    def fn(c: Conn, n: int) -> None:
        c.send(head(code, ctype, size if declared else None))
        c.send(prefix)
        block = fill * (MiB // len(fill))
        left = size - len(prefix)
        while left > 0 and not c.stop.is_set():
            c.send(block[:left])
            left -= len(block)
    return fn


def slow_headers(c: Conn, n: int) -> None:
    """Slow loris: a status line, then a header one byte every 0.1 s, never finished."""
    c.send(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    while not c.stop.is_set():
        c.send(b"a")
        time.sleep(0.1)


def reset_mid_stream(c: Conn, n: int) -> None:
    """Two good chunks, then a TCP reset (SO_LINGER 0)."""
    c.send(head(200, "text/event-stream") + sse(TEXT, TEXT, done=False))
    time.sleep(0.05)
    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    c.sock.close()


def _read_request(sock: socket.socket) -> tuple[str, str]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        piece = sock.recv(65536)
        if not piece or len(buf) > MiB:
            raise ValueError("no request")
        buf += piece
    header, _, body = buf.partition(b"\r\n\r\n")
    lines = header.decode("latin-1").split("\r\n")
    method, path = lines[0].split(" ")[:2]
    length = next((int(h.split(":", 1)[1]) for h in lines[1:] if h.lower().startswith("content-length:")), 0)
    while len(body) < length:
        piece = sock.recv(65536)
        if not piece:
            break
        body += piece
    return method, path


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class Hostile:
    """``routes``: {"GET /kvtrace/status": behaviour, ...}; GET /health answers 200 and POST
    /v1/completions a good stream unless given; anything else 404."""

    def __init__(self, routes: dict[str, Behaviour] | None = None) -> None:
        self.routes = {"GET /health": HEALTHY, "POST /v1/completions": GOOD, **(routes or {})}
        self.counts: Counter[str] = Counter()
        self.stop = threading.Event()
        lock = threading.Lock()
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sock = self.request
                sock.settimeout(60)
                try:
                    method, path = _read_request(sock)
                except (OSError, ValueError):
                    return
                key = f"{method} {path}"
                with lock:
                    n = outer.counts[key]
                    outer.counts[key] += 1
                fn = outer.routes.get(key, answer(404, "text/plain", "not found"))
                try:
                    fn(Conn(sock, outer.stop), n)
                except OSError:
                    pass  # the client went away: what a bounded client does

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()
