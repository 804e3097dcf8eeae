"""What the recorder no longer does on the caller's thread (the model's time): one NVML session per
process, no telemetry tick while a recorder opens, no trace flush when a request ends."""

from __future__ import annotations

import threading

from rec_helpers import generate, model

import kvtrace
from kvtrace.format import TraceWriter, open_trace
from kvtrace.format import writer as writer_mod
from kvtrace.recorder import telemetry as telemetry_mod
from kvtrace.recorder.telemetry import Telemetry


class CountingNvml:
    made = 0

    def __init__(self, available: bool = True) -> None:
        type(self).made += 1
        self.available = available
        self.reason = "counting stand-in"
        self.errors = 7  # errors of earlier sessions: not this telemetry's to report

    def driver_version(self) -> str:
        return "0"


def test_one_nvml_session_per_process(monkeypatch):
    monkeypatch.setattr(telemetry_mod, "_NVML", None)
    monkeypatch.setattr(telemetry_mod, "Nvml", CountingNvml)
    CountingNvml.made = 0
    first = telemetry_mod._open_nvml()
    assert telemetry_mod._open_nvml() is first and CountingNvml.made == 1
    tel = Telemetry([], use_allocator=False)  # no CUDA device: NVML opened, no handle matched
    assert tel._nvml is first and tel._reported["nvml"] == 7
    tel.close()
    assert first.available and telemetry_mod._open_nvml() is first  # close does not shut it down


def test_unavailable_nvml_is_retried(monkeypatch):
    monkeypatch.setattr(telemetry_mod, "_NVML", None)
    monkeypatch.setattr(telemetry_mod, "Nvml", lambda: CountingNvml(available=False))
    CountingNvml.made = 0
    telemetry_mod._open_nvml()
    telemetry_mod._open_nvml()
    assert CountingNvml.made == 2


def test_first_tick_waits_one_period(tmp_path):
    """Started and stopped within a period: only stop()'s own final tick is written."""
    tel = Telemetry([], rate_hz=0.5, use_nvml=False, use_allocator=False)
    path = tmp_path / "t.kvt.h5"
    with TraceWriter(path) as writer:
        tel.attach(writer)
        tel.start()
        assert tel.latest_rss() > 0  # read at start: early steps still get an RSS
        tel.stop()
    with open_trace(path) as trace:
        assert len(trace.process[:]) == 1


def test_default_rate_is_five_hz():
    assert telemetry_mod.DEFAULT_RATE_HZ == 5.0
    assert kvtrace.recorder.RecordOptions().telemetry_hz == telemetry_mod.DEFAULT_RATE_HZ


def test_request_end_flushes_off_the_callers_thread(tmp_path, monkeypatch):
    flushes: list[str] = []
    original = writer_mod.TraceWriter.flush

    def flush(self):
        flushes.append(threading.current_thread().name)
        return original(self)

    monkeypatch.setattr(writer_mod.TraceWriter, "flush", flush)
    m = model("llama")
    with kvtrace.record(m, tmp_path / "f.kvt.h5", flush_interval_s=60):
        generate(m, new=3)
        generate(m, new=3)
        during = list(flushes)
    caller = threading.current_thread().name
    assert caller not in during  # the request ends woke the flusher instead
    assert "kvtrace-flush" in during
    with open_trace(tmp_path / "f.kvt.h5") as trace:
        assert len(trace.requests[:]) == 2

