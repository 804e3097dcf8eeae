"""Live Prometheus metrics from a recording session: what the recorder feeds the exporter (checked
against the trace it wrote at the same time), the CLI options and their exit codes, and that an
exporter failure never reaches the model."""

from __future__ import annotations

import re
import socket
import time
import urllib.request

import pytest
import torch
import transformers
from rec_helpers import generate, model

import kvtrace
from kvtrace import exitcodes
from kvtrace.cli import main
from kvtrace.export.prometheus import PrometheusExporter, exporter_from_trace
from kvtrace.format.reader import Trace
from kvtrace.format.schema import EventKind, LayerType
from kvtrace.recorder import sampling as sampling_mod
from kvtrace.recorder import telemetry as telemetry_mod
from kvtrace.recorder.allocator import AllocatorReading
from kvtrace.recorder.nvml import NvmlMemory
from kvtrace.recorder.telemetry import Telemetry

TINY = ["--model", "preset:llama-3.1-8b", "--layers", "2", "--width", "0.05", "--vocab", "512"]
LINE = re.compile(r'^([a-z_]+)(?:\{(.*)\})? (\S+)$')


def parse(text: str) -> dict[tuple[str, tuple], float]:
    """{(name, sorted label items): value} from exposition text (format 0.0.4)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = LINE.match(line)
        assert m, line
        labels = tuple(sorted(re.findall(r'(\w+)="((?:\\.|[^"\\])*)"', m.group(2) or "")))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def read_metrics(path) -> dict[tuple[str, tuple], float]:
    with open(path, encoding="utf-8") as fh:
        return parse(fh.read())


def run(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        main(argv)
        raise SystemExit(0)
    return int(info.value.code or 0), capsys.readouterr().err


def last_step_kv(t: Trace) -> dict[str, float]:
    kv = t.kv[:]
    kv = kv[kv["request"] == kv["request"].max()]
    kv = kv[kv["step"] == kv["step"].max()]
    return {str(int(r["layer"])): float(r["bytes_unique"]) for r in kv}


# ---- CLI ----------------------------------------------------------------------------------------


def test_cli_textfile_mirrors_the_trace(tmp_path, capsys):
    out, prom = tmp_path / "r.kvt.h5", tmp_path / "kvtrace.prom"
    code, err = run(["record", *TINY, "--prompt", "hi", "--prompt", "there", "--max-new-tokens", "3",
                     "--min-new-tokens", "3", "--prometheus-textfile", str(prom), "-o", str(out)], capsys)
    assert code == 0, err
    got = read_metrics(prom)
    with Trace(out) as t:
        kv, steps, nvml = last_step_kv(t), t.steps[:], t.meta.source_available("nvml")
        t_events = t.events[:]
        n_layers = t.nrows("layers")
        replay = parse(exporter_from_trace(t, tmp_path / "replay.prom").render())
    assert got[("kvtrace_requests_total", (("outcome", "ok"),))] == 2
    assert got[("kvtrace_requests_in_flight", ())] == 0
    assert got[("kvtrace_generated_tokens_total", ())] == 6
    assert got[("kvtrace_steps_total", (("phase", "prefill"),))] == 2
    decode_events = int((t_events["kind"] == int(EventKind.DECODE_STEP)).sum())
    assert got[("kvtrace_steps_total", (("phase", "decode"),))] == decode_events == 4  # 2 per request
    # no request in flight at exit: the request gauges are idle, with a series for every layer
    assert got[("kvtrace_kv_cache_tokens", ())] == 0 < int(steps["tokens_seen"][-1])
    live_kv = {dict(k[1])["layer"]: v for k, v in got.items() if k[0] == "kvtrace_kv_cache_bytes"}
    assert live_kv == dict.fromkeys(kv, 0) and len(kv) == n_layers and all(v > 0 for v in kv.values())
    assert {dict(k[1])["layer_type"] for k in got if k[0] == "kvtrace_kv_cache_bytes"} == {"full"}
    assert got[("kvtrace_recorder_errors_total", ())] == 0
    info = [dict(k[1]) for k in got if k[0] == "kvtrace_info"]
    assert info == [{"version": kvtrace.__version__, "model": "preset:llama-3.1-8b", "model_type": "llama"}]
    if not nvml:  # a CPU run: no GPU number is invented
        assert not any(k[0].startswith(("kvtrace_gpu_", "kvtrace_allocator_")) for k in got)
    # the live state at exit equals the replay of the finished trace, series for series
    stamp = "kvtrace_last_update_timestamp_seconds"
    assert {k: v for k, v in got.items() if k[0] != stamp} == {k: v for k, v in replay.items() if k[0] != stamp}


def test_cli_bad_prometheus_address_is_a_usage_error(tmp_path, capsys):
    code, err = run(["record", *TINY, "--prompt", "x", "--max-new-tokens", "2", "--prometheus", "host:port",
                     "-o", str(tmp_path / "x.kvt.h5")], capsys)
    assert code == exitcodes.USAGE and "HOST:PORT" in err and "Traceback" not in err


def test_cli_unwritable_textfile_exits_73_before_loading(tmp_path, capsys, monkeypatch):
    import kvtrace.commands.record as rec_cmd

    def never(*a, **k):
        raise AssertionError("model loaded despite an unwritable textfile")

    monkeypatch.setattr(rec_cmd, "load_model", never)
    code, err = run(["record", *TINY, "--prompt", "x", "--max-new-tokens", "2", "--prometheus-textfile",
                     str(tmp_path / "no" / "dir" / "k.prom"), "-o", str(tmp_path / "x.kvt.h5")], capsys)
    assert code == exitcodes.CANNOT_WRITE
    assert err.startswith("kvtrace: cannot write Prometheus textfile") and err.count("\n") == 1


def test_cli_port_in_use_exits_69_without_a_trace(tmp_path, capsys):
    out = tmp_path / "x.kvt.h5"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        code, err = run(["record", *TINY, "--prompt", "x", "--max-new-tokens", "2",
                         "--prometheus", f"127.0.0.1:{port}", "-o", str(out)], capsys)
    assert code == exitcodes.UNAVAILABLE, err
    assert f"127.0.0.1:{port}" in err and err.count("\n") == 1
    assert not out.exists()


# ---- API ----------------------------------------------------------------------------------------


def test_endpoint_on_any_free_port_and_closed_at_exit(tmp_path):
    m = model("llama")
    with kvtrace.record(m, tmp_path / "h.kvt.h5", prometheus="127.0.0.1:0", prometheus_linger_s=0) as rec:
        url = rec.exporter.url
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", url) and not url.endswith(":0/metrics")
        generate(m, new=3)
        with urllib.request.urlopen(url, timeout=5) as resp:
            got = parse(resp.read().decode())
    assert got[("kvtrace_requests_total", (("outcome", "ok"),))] == 1
    assert got[("kvtrace_generated_tokens_total", ())] == 3
    assert rec.exporter is None
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=2)


def test_malformed_address_is_refused_before_the_model_is_touched(tmp_path):
    m = model("llama")
    with pytest.raises(ValueError, match="HOST:PORT"):
        kvtrace.record(m, tmp_path / "x.kvt.h5", prometheus="localhost:http")
    assert "generate" not in m.__dict__


def test_busy_port_fails_at_start_without_a_trace(tmp_path):
    from kvtrace.recorder import CannotServeMetrics

    m = model("llama")
    path = tmp_path / "x.kvt.h5"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        rec = kvtrace.record(m, path, prometheus=f"127.0.0.1:{port}")
        with pytest.raises(CannotServeMetrics, match="Address already in use"):
            rec.start()
    assert not path.exists() and "generate" not in m.__dict__
    rec.close()  # harmless after a failed start


def test_exporter_failure_never_reaches_the_model(tmp_path, monkeypatch):
    m = model("llama")
    ref = generate(m, new=4)

    def broken(self, *a, **k):
        raise RuntimeError("exporter bug")

    monkeypatch.setattr(PrometheusExporter, "on_kv", broken)
    prom = tmp_path / "k.prom"
    path = tmp_path / "b.kvt.h5"
    with kvtrace.record(m, path, prometheus_textfile=str(prom), structure_every=1) as rec:
        out = generate(m, new=4)
    assert torch.equal(out, ref)
    assert rec.recorder_errors == 4  # once per step (structure read at every step)
    got = read_metrics(prom)
    assert got[("kvtrace_recorder_errors_total", ())] == 4
    assert got[("kvtrace_requests_total", (("outcome", "ok"),))] == 1
    with Trace(path) as t:
        ev = t.events.where(kind=EventKind.RECORDER_ERROR)
        assert "prometheus: RuntimeError: exporter bug" in t.text(int(ev[0]["text_off"]), int(ev[0]["text_len"]))


def test_failed_request_is_counted_by_outcome(tmp_path):
    class Boom(transformers.StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            raise ValueError("user code failed")

    m = model("llama")
    prom = tmp_path / "k.prom"
    with kvtrace.record(m, tmp_path / "f.kvt.h5", prometheus_textfile=str(prom)):
        with pytest.raises(ValueError):
            generate(m, new=4, stopping_criteria=transformers.StoppingCriteriaList([Boom()]))
        generate(m, new=2)
    got = read_metrics(prom)
    assert got[("kvtrace_requests_total", (("outcome", "error"),))] == 1
    assert got[("kvtrace_requests_total", (("outcome", "ok"),))] == 1
    assert got[("kvtrace_requests_in_flight", ())] == 0


def test_dropped_samples_are_counted_live(tmp_path, monkeypatch):
    """A slow payload writer and a queue of one: the counter equals what the trace records."""
    original = sampling_mod.encode_samples

    def slow(*a, **k):
        time.sleep(0.02)
        return original(*a, **k)

    monkeypatch.setattr(sampling_mod, "encode_samples", slow)
    m = model("llama")
    prom, path = tmp_path / "k.prom", tmp_path / "d.kvt.h5"
    with kvtrace.record(m, path, prometheus_textfile=str(prom),
                        sampling={"every_n_steps": 1, "queue_size": 1}):
        generate(m, new=4)
    with Trace(path) as t:
        recorded = int(t.events.where(kind=EventKind.DROPPED_SAMPLES)["value"].sum())
    assert recorded > 0
    assert read_metrics(prom)[("kvtrace_dropped_samples_total", ())] == recorded


def test_layer_types_are_labelled(tmp_path):
    m = model("gemma3_text")  # sliding, sliding, full
    prom, path = tmp_path / "k.prom", tmp_path / "g.kvt.h5"
    with kvtrace.record(m, path, prometheus_textfile=str(prom)):
        generate(m, new=3)
    got = read_metrics(prom)
    with Trace(path) as t:
        types = {str(int(r["layer"])): LayerType(int(r["layer_type"])).name.lower() for r in t.layers[:]}
    assert {dict(k[1])["layer"]: dict(k[1])["layer_type"] for k in got if k[0] == "kvtrace_kv_cache_bytes"} == types
    assert set(types.values()) == {"sliding", "full"}


# ---- telemetry -> exporter ----------------------------------------------------------------------


class StandInNvml:
    """One GPU whose used memory grows by 1 MiB per read."""

    available = True
    reason = "stand-in"

    def __init__(self) -> None:
        self.errors, self.last_error, self.reads = 0, "", 0

    def handle_by_uuid(self, uuid):
        return "h0" if uuid == "GPU-0" else None

    def uuid(self, handle):
        return "GPU-0"

    def memory(self, handle):
        self.reads += 1
        return NvmlMemory(used=self.reads << 20, free=1 << 30, reserved=1 << 20, total=80 << 30)

    def process_used(self, handle, pid=None):
        return -1

    def driver_version(self):
        return "580.95.05"

    def shutdown(self):
        pass


@pytest.fixture
def one_gpu(monkeypatch):
    nvml = StandInNvml()
    monkeypatch.setattr(telemetry_mod, "_open_nvml", lambda: nvml)
    monkeypatch.setattr(Telemetry, "_cuda_uuid", staticmethod(lambda device: f"GPU-{device}"))
    return nvml


def test_telemetry_listeners_see_each_reading_and_cannot_stop_it(tmp_path, one_gpu):
    from kvtrace.format import TraceWriter

    seen: list[tuple] = []

    def broken(device, mem, alloc):
        raise RuntimeError("listener bug")

    tel = Telemetry([0], rate_hz=200.0, listeners=[lambda d, mem, alloc: seen.append((d, mem, alloc)), broken])
    with TraceWriter(tmp_path / "t.kvt.h5", devices=tel.device_infos()) as writer:
        tel.attach(writer)
        tel.start()
        time.sleep(0.2)
        tel.stop()
    with Trace(tmp_path / "t.kvt.h5") as t:
        rows = t.nvml[:]
    assert len(rows) == len(seen) > 5  # every row written also reached the listener, and vice versa
    assert [m.used for _, m, _ in seen] == rows["used_bytes"].tolist()
    assert {(d, a) for d, _, a in seen} == {(0, None)}  # no CUDA allocator here: None, not zeros
    assert tel.tick_errors == len(seen) and "listener bug" in tel.last_tick_error


def test_gpu_memory_reaches_the_endpoint(tmp_path, one_gpu, monkeypatch):
    """A stand-in NVML device 0: the exporter's GPU gauges are the trace's last NVML row."""
    monkeypatch.setattr(Telemetry, "devices_of", staticmethod(lambda m: [0]))
    m = model("llama")
    prom, path = tmp_path / "k.prom", tmp_path / "n.kvt.h5"
    with kvtrace.record(m, path, prometheus_textfile=str(prom), reset_peak=False, empty_cache=False,
                        telemetry_hz=200.0):
        generate(m, new=3)
    got = read_metrics(prom)
    with Trace(path) as t:
        last = t.nvml[:][-1]
    assert got[("kvtrace_gpu_memory_used_bytes", (("device", "0"),))] == int(last["used_bytes"])
    assert got[("kvtrace_gpu_memory_total_bytes", (("device", "0"),))] == 80 << 30
    assert not any(k[0].startswith("kvtrace_allocator_") for k in got)  # no allocator: absent


def test_session_maps_allocator_readings(tmp_path):
    m = model("llama")
    with kvtrace.record(m, tmp_path / "a.kvt.h5", prometheus="127.0.0.1:0") as rec:
        rec._readings.on_telemetry(3, NvmlMemory(used=5 << 30, free=1, reserved=2, total=80 << 30),
                                   AllocatorReading(allocated_bytes=1 << 30, reserved_bytes=2 << 30, active_bytes=7,
                                                    inactive_split_bytes=1 << 20, num_alloc_retries=4, num_ooms=-1))
        exp = rec.exporter
        assert exp.value("kvtrace_gpu_memory_used_bytes", device=3) == 5 << 30
        assert exp.value("kvtrace_gpu_memory_total_bytes", device=3) == 80 << 30
        assert exp.value("kvtrace_allocator_allocated_bytes", device=3) == 1 << 30
        assert exp.value("kvtrace_allocator_reserved_bytes", device=3) == 2 << 30
        assert exp.value("kvtrace_allocator_inactive_split_bytes", device=3) == 1 << 20
        assert exp.value("kvtrace_alloc_retries_total", device=3) == 4
        assert exp.value("kvtrace_allocator_ooms_total", device=3) is None  # -1: not measured
