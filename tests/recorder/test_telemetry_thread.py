"""The single telemetry thread: rows at roughly the configured rate, one per device per tick,
gaps (not fabricated rows) when a read fails, and failures recorded as events."""

from __future__ import annotations

import threading
import time

import pytest

from kvtrace.format import EventKind, TraceWriter, open_trace
from kvtrace.recorder import telemetry as telemetry_mod
from kvtrace.recorder.nvml import NvmlMemory
from kvtrace.recorder.telemetry import Telemetry

pytest.importorskip("torch")


class StandInNvml:
    """An NVML session with two GPUs whose memory grows by 1 MiB per read, and an optional failure."""

    available = True
    reason = "stand-in"

    def __init__(self, fail_every: int = 0) -> None:
        self.errors = 0
        self.last_error = ""
        self.reads = 0
        self.fail_every = fail_every

    def handle_by_uuid(self, uuid: str):
        return {"GPU-0": "h0", "GPU-1": "h1"}.get(uuid)

    def uuid(self, handle) -> str:
        return {"h0": "GPU-0", "h1": "GPU-1"}[handle]

    def memory(self, handle):
        self.reads += 1
        if self.fail_every and self.reads % self.fail_every == 0:
            self.errors += 1
            self.last_error = "nvmlDeviceGetMemoryInfo: GPU is lost"
            return None
        return NvmlMemory(used=self.reads << 20, free=1 << 30, reserved=1 << 20, total=80 << 30)

    def process_used(self, handle, pid=None) -> int:
        return 3 << 20

    def driver_version(self) -> str:
        return "580.95.05"

    def shutdown(self) -> None:
        pass


@pytest.fixture
def two_gpus(monkeypatch):
    nvml = StandInNvml(fail_every=7)
    monkeypatch.setattr(telemetry_mod, "_open_nvml", lambda: nvml)
    monkeypatch.setattr(Telemetry, "_cuda_uuid", staticmethod(lambda device: f"GPU-{device}"))
    return nvml


def test_thread_writes_rows_per_device_at_the_rate(tmp_path, two_gpus) -> None:
    rate, duration = 40.0, 0.5
    tel = Telemetry([1, 0], rate_hz=rate)  # a device_map split over two GPUs
    src = tel.sources()
    assert src["nvml"]["available"] and src["nvml"]["devices"] == [0, 1]
    assert src["nvml"]["process_usage"] is True
    assert tel.versions()["driver_version"] == "580.95.05"
    path = tmp_path / "t.kvt.h5"
    with TraceWriter(path, devices=tel.device_infos()) as writer:
        tel.attach(writer)
        before = {t.name for t in threading.enumerate()}
        tel.start()
        tel.start()  # no second thread
        started = [t for t in threading.enumerate() if t.name not in before]
        time.sleep(duration)
        tel.stop()
        tel.stop()  # idempotent
    assert [t.name for t in started] == ["kvtrace-telemetry"]
    assert not started[0].is_alive()
    with open_trace(path) as trace:
        nvml, process = trace.nvml[:], trace.process[:]
        alloc = trace.allocator[:]
        errors = trace.events.where(kind=EventKind.RECORDER_ERROR)
    ticks = len(process)
    expected = rate * duration
    assert 0.5 * expected <= ticks <= 1.5 * expected + 2  # start tick + final tick at stop
    assert len(alloc) == 0  # no CUDA allocator here: no rows, not rows of zeros
    assert set(nvml["device"].tolist()) == {0, 1}
    assert len(nvml) == 2 * ticks - two_gpus.errors  # a failed read is a gap
    assert two_gpus.errors >= 1
    assert (nvml["used_bytes"] <= nvml["total_bytes"]).all()
    assert (nvml["process_used_bytes"] == 3 << 20).all()
    assert (process["rss_bytes"] > 0).all()
    gaps = (process["t_ns"][1:] - process["t_ns"][:-1]) / 1e9
    assert gaps.min() > 0
    (event,) = errors
    assert event["value"] == two_gpus.errors


def test_start_needs_a_writer_and_stops_when_writer_closes(tmp_path) -> None:
    tel = Telemetry([], rate_hz=200)
    with pytest.raises(RuntimeError):
        tel.start()
    writer = TraceWriter(tmp_path / "c.kvt.h5")
    tel.attach(writer)
    tel.start()
    time.sleep(0.05)
    writer.close()  # the session closed the writer first: the thread must end quietly
    time.sleep(0.05)
    tel.stop()
    assert tel.tick_errors == 0


def test_pid_missing_from_nvml_is_declared_not_zeroed(monkeypatch, tmp_path) -> None:
    nvml = StandInNvml()
    nvml.process_used = lambda handle, pid=None: -1  # NVML lists host pids only
    monkeypatch.setattr(telemetry_mod, "_open_nvml", lambda: nvml)
    monkeypatch.setattr(Telemetry, "_cuda_uuid", staticmethod(lambda device: f"GPU-{device}"))
    tel = Telemetry([0, 5])  # device 5 has no NVML match
    src = tel.sources()["nvml"]
    assert src["available"] and src["process_usage"] is False
    assert "pid namespace" in src["reason"] and "[5]" in src["reason"]
    assert tel.reading(0)["nvml_process_used_bytes"] == -1
    assert tel.reading(5)["nvml_used_bytes"] == -1  # unmatched device: no NVML value
    assert tel.reading(0)["nvml_used_bytes"] > 0
