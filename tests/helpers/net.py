"""Ports for the real servers tests start (Prometheus, transformers serve, vLLM)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound, read, released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
