"""The background work counts its own cost (what bench_overhead reports as the flusher's
and the telemetry thread's CPU, read without A/B noise)."""

from __future__ import annotations

import time

from kvtrace.format import TraceWriter
from kvtrace.recorder.telemetry import Telemetry


def test_ticks_and_flushes_count_their_time(tmp_path):
    with TraceWriter(tmp_path / "c.kvt.h5", flush_interval_s=60) as w:
        tel = Telemetry([], rate_hz=200.0, use_nvml=False, use_allocator=False)
        tel.attach(w)
        tel.start()
        deadline = time.monotonic() + 5
        while tel.ticks < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        tel.stop()  # takes one more tick on this thread
        assert tel.ticks >= 4
        assert 0 < tel.tick_cpu_ns and 0 < tel.tick_ns
        assert (w.flush_count, w.flush_ns, w.flush_cpu_ns) == (0, 0, 0)
        w.flush()
        w.flush()
        assert w.flush_count == 2 and w.flush_ns > 0 and w.flush_cpu_ns > 0
