"""A writer SIGKILLed mid-write leaves a trace that opens, validates and holds every row
up to its last flush (explicit or from the background flusher)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from kvtrace.format import Trace
from kvtrace.format.validate import validate

WRITER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from kvtrace.format import TraceWriter, CacheDType, PayloadKind, encode_payload
    path, mode = sys.argv[1], sys.argv[2]
    w = TraceWriter(path, {"model_id": "killed", "contains_tensor_payloads": True}, flush_interval_s=0.25)
    row = [0] * 15
    row[2], row[5], row[8] = 1, -1, b"0" * 64
    w.begin_request(tuple(row))
    i = 0
    rng = np.random.default_rng(0)
    while True:
        w.append("telemetry/process", (i, i * 7))
        if i % 40 == 0:
            w.write_payload(encode_payload(0, i, 0, PayloadKind.KEY, CacheDType.FLOAT16,
                            rng.integers(0, 1 << 16, 3000, dtype=np.uint16)))
        i += 1
        if mode == "explicit" and i % 50 == 0:
            w.flush()
            print("flushed", i, flush=True)
        elif mode == "timed":
            print("appended", i, time.monotonic(), flush=True)
            time.sleep(0.002)
    """
)


def _spawn(path, mode):
    return subprocess.Popen([sys.executable, "-c", WRITER, str(path), mode],
                            stdout=subprocess.PIPE, text=True)


def _check_prefix(path, at_least: int) -> int:
    report = validate(path)
    assert report.valid, report.problems
    assert any("did not close" in w for w in report.warnings)
    with Trace(path) as t:
        assert not t.complete
        rows = t.process[:]
        n = rows.shape[0]
        assert n >= at_least
        assert np.array_equal(rows["t_ns"], np.arange(n))
        assert np.array_equal(rows["rss_bytes"], np.arange(n) * 7)
        for i in range(t.nrows("payloads/index")):
            t.payload(i)  # every indexed payload decodes
    return n


@pytest.mark.parametrize("attempt", range(3))
def test_sigkill_after_explicit_flush(tmp_path, attempt):
    path = tmp_path / "k.kvt.h5"
    proc = _spawn(path, "explicit")
    last = 0
    for line in proc.stdout:
        last = int(line.split()[1])
        if last >= 400 + 150 * attempt:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    _check_prefix(path, last)


def test_sigkill_loses_at_most_the_flush_interval(tmp_path):
    path = tmp_path / "t.kvt.h5"
    proc = _spawn(path, "timed")
    appended: list[tuple[int, float]] = []
    start = None  # from the first row appended: the child's start-up is not part of the window
    for line in proc.stdout:
        _, i, t = line.split()
        appended.append((int(i), float(t)))
        start = time.monotonic() if start is None else start
        if time.monotonic() - start > 2.0:
            break
    kill_time = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    # Interval 0.25 s; allow 0.5 s more for scheduling on a loaded 2-core machine.
    must_have = max(i for i, t in appended if t < kill_time - 0.75)
    _check_prefix(path, must_have)
