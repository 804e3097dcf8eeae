"""Run the kvtrace CLI in a subprocess whose long steps wait for the test: each named function
(``module:attr``) blocks, when called, until the test opens its gate. A test reads the command's
output line by line and opens gate k once it has read the line announcing step k, so a line that
was not flushed before its step began is never read (the step waits for it): the test fails on
the read timeout instead of passing by timing luck. Nothing here measures how long anything takes."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

DRIVER = """
import importlib, os, sys, time
gates, where = sys.argv[1].split(","), sys.argv[2]
for i, spec in enumerate(g for g in gates if g):
    mod, attr = spec.split(":")
    m = importlib.import_module(mod)
    def gated(*a, _orig=getattr(m, attr), _i=i, **k):
        while not os.path.exists(os.path.join(where, f"gate{_i}")):
            time.sleep(0.02)
        return _orig(*a, **k)
    setattr(m, attr, gated)
from kvtrace.cli import main
main(sys.argv[3:])
"""


class Gated:
    """``Gated(["kvtrace.loading:load_model"], ["demo", ...], tmp)``; ``expect(prefix)`` reads lines
    of ``stream`` until one starts with ``prefix`` (and returns it); ``open(k)`` lets step k run."""

    def __init__(self, gates: list[str], argv: list[str], where: Path, *, stream: str = "stdout",
                 env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        self.where = where
        # as a user's shell runs it: a pipe is block-buffered unless the command flushes (a CI image
        # often exports PYTHONUNBUFFERED=1, which would hide a missing flush)
        environ = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
        self.proc = subprocess.Popen([sys.executable, "-c", DRIVER, ",".join(gates), str(where), *argv],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**environ, **(env or {})}, cwd=cwd or where)
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self.other: list[str] = []
        watched = self.proc.stdout if stream == "stdout" else self.proc.stderr
        rest = self.proc.stderr if stream == "stdout" else self.proc.stdout
        threading.Thread(target=self._pump, args=(watched, self._queue.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(rest, self.other.append), daemon=True).start()

    @staticmethod
    def _pump(stream, put) -> None:
        for line in stream:
            put(line.rstrip("\n"))
        put(None)

    def expect(self, prefix: str, timeout_s: float = 240.0) -> str:
        while True:
            try:
                line = self._queue.get(timeout=timeout_s)
            except queue.Empty:
                self.kill()
                raise AssertionError(f"no line starting {prefix!r} within {timeout_s:.0f} s; read so far: "
                                     f"{self.lines}; other stream: {self.other[-20:]}") from None
            if line is None:
                raise AssertionError(f"the command ended before a line starting {prefix!r}; read: {self.lines}; "
                                     f"other stream: {self.other[-20:]}")
            self.lines.append(line)
            if line.startswith(prefix):
                return line

    def open(self, k: int) -> None:
        (self.where / f"gate{k}").touch()

    def finish(self, timeout_s: float = 240.0) -> int:
        code = self.proc.wait(timeout=timeout_s)
        while True:
            line = self._queue.get(timeout=10)
            if line is None:
                return code
            self.lines.append(line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
