"""Telemetry sources on this machine (whatever exists is read for real, the rest says why it is
absent) and the NVML / allocator parsing logic against stand-ins with known answers."""

from __future__ import annotations

import os
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest

from kvtrace.recorder import allocator
from kvtrace.recorder.nvml import Nvml, normalize_uuid
from kvtrace.recorder.telemetry import READING_KEYS, Telemetry

torch = pytest.importorskip("torch")
HAS_CUDA = torch.cuda.is_available()
MiB = 1 << 20


def _rss_from_proc_status() -> int:
    """An independent RSS source (VmRSS, kB) to check ours against."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU behaviour")
def test_without_gpu_sources_say_why_and_nothing_is_invented() -> None:
    tel = Telemetry([])
    src = tel.sources()
    assert set(src) >= {"nvml", "allocator", "process_rss"}
    assert src["process_rss"]["available"] is True
    for name in ("nvml", "allocator"):
        assert src[name]["available"] is False
        assert src[name]["reason"]  # a reason, never an empty string
    assert tel.step_reading(0) == (-1, -1)
    reading = tel.reading(-1)
    assert set(reading) == set(READING_KEYS)
    assert all(reading[k] == -1 for k in READING_KEYS if k != "rss_bytes")
    assert reading["rss_bytes"] > 0
    (cpu,) = tel.device_infos()
    assert (cpu.index, cpu.name) == (-1, "cpu")
    assert cpu.total_memory_bytes == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    versions = tel.versions()
    if not Nvml().available:  # no NVML library/driver here: the version is not made up
        assert versions["driver_version"] == "unavailable"
    assert versions["cuda_version"] == (torch.version.cuda or "unavailable")


def test_user_can_disable_sources() -> None:
    tel = Telemetry([0, 1], use_nvml=False, use_allocator=False)
    src = tel.sources()
    assert src["nvml"] == {**src["nvml"], "available": False, "reason": "disabled by the user"}
    assert src["allocator"]["available"] is False and src["allocator"]["reason"] == "disabled by the user"
    assert tel.step_reading(0) == (-1, -1)
    assert tel.versions()["driver_version"] == "unavailable"


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_rss_is_real_and_follows_allocations() -> None:
    tel = Telemetry([])
    ours, theirs = tel.rss_bytes(), _rss_from_proc_status()
    assert abs(ours - theirs) < 64 * MiB
    before = tel.rss_bytes()
    block = np.ones(256 * MiB, dtype=np.uint8)  # touched: resident
    grown = tel.rss_bytes() - before
    del block
    assert grown >= 200 * MiB


def test_rate_is_validated() -> None:
    for bad in (0, -1, 1e9):
        with pytest.raises(ValueError):
            Telemetry([], rate_hz=bad)


def test_devices_of_reads_parameters_and_device_map() -> None:
    model = torch.nn.Linear(2, 2)
    assert Telemetry.devices_of(model) == []
    model.hf_device_map = {"a": 0, "b": "cuda:3", "c": "cpu", "d": "disk"}
    assert Telemetry.devices_of(model) == [0, 3]


# ---- NVML wrapper against a stand-in pynvml --------------------------------------------------

class NVMLError(Exception):
    pass


def _fake_pynvml(*, v2: bool = True, fail: set[str] | None = None, pid: int | None = None) -> types.ModuleType:
    fail = fail or set()
    calls: list[tuple[str, dict]] = []
    mod = types.ModuleType("pynvml")
    mod.NVMLError = NVMLError
    mod.calls = calls
    if v2:
        mod.nvmlMemory_v2 = 0x2000028
    devices = [SimpleNamespace(uuid=b"GPU-aaaa-0001"), SimpleNamespace(uuid="GPU-BBBB-0002")]

    def fn(name, result):
        def call(*args, **kwargs):
            calls.append((name, kwargs))
            if name in fail:
                raise NVMLError(f"{name} failed")
            return result(*args, **kwargs)
        setattr(mod, name, call)

    fn("nvmlInit", lambda: None)
    fn("nvmlShutdown", lambda: None)
    fn("nvmlSystemGetDriverVersion", lambda: b"580.95.05")
    fn("nvmlDeviceGetCount", lambda: len(devices))
    fn("nvmlDeviceGetHandleByIndex", lambda i: devices[i])
    fn("nvmlDeviceGetUUID", lambda h: h.uuid)
    fn("nvmlDeviceGetName", lambda h: "NVIDIA H200")

    def memory(handle, version=None):
        if version is None:  # v1: used includes the reserved part
            return SimpleNamespace(used=700, free=300, total=1000)
        assert version == mod.nvmlMemory_v2
        return SimpleNamespace(used=600, free=300, reserved=100, total=1000)

    fn("nvmlDeviceGetMemoryInfo", memory)
    me = os.getpid() if pid is None else pid
    fn("nvmlDeviceGetComputeRunningProcesses", lambda h: [
        SimpleNamespace(pid=me + 1, usedGpuMemory=5 * MiB),
        SimpleNamespace(pid=me, usedGpuMemory=256 * MiB),
        SimpleNamespace(pid=me, usedGpuMemory=2 ** 64 - 1),  # "not available": ignored
    ])
    return mod


def test_nvml_uses_v2_struct_and_matches_this_pid(monkeypatch) -> None:
    fake = _fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    nvml = Nvml()
    assert nvml.available and "v2" in nvml.reason
    handle = nvml.handle_by_uuid("bbbb-0002")
    assert handle is not None and nvml.uuid(handle) == "GPU-BBBB-0002"
    mem = nvml.memory(handle)
    assert (mem.used, mem.free, mem.reserved, mem.total) == (600, 300, 100, 1000)
    assert ("nvmlDeviceGetMemoryInfo", {"version": fake.nvmlMemory_v2}) in fake.calls
    assert nvml.process_used(handle) == 256 * MiB
    assert nvml.process_used(handle, pid=1) == -1  # not listed: unknown, not zero
    assert nvml.driver_version() == "580.95.05"
    assert nvml.errors == 0


def test_nvml_failures_become_unavailable_values(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(v2=False, fail={"nvmlDeviceGetComputeRunningProcesses"}))
    nvml = Nvml()
    handle = nvml.handle_by_uuid("GPU-AAAA-0001")
    mem = nvml.memory(handle)
    assert (mem.used, mem.reserved) == (700, -1)  # v1 only: reserved unknown
    assert nvml.process_used(handle) == -1
    assert nvml.errors == 1 and "ComputeRunningProcesses" in nvml.last_error

    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(fail={"nvmlInit"}))
    dead = Nvml()
    assert not dead.available and "nvmlInit failed" in dead.reason
    assert dead.memory(handle) is None and dead.process_used(handle) == -1
    assert dead.driver_version() == "unavailable"

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    missing = Nvml()
    assert not missing.available and "not installed" in missing.reason


def test_uuid_normalisation() -> None:
    assert normalize_uuid("GPU-AbC-1") == normalize_uuid(b"abc-1") == "abc-1"
    assert normalize_uuid("") == ""


# ---- allocator parsing ------------------------------------------------------------------------

def test_allocator_fields_come_from_the_allocators_own_names() -> None:
    stats = {
        "allocated_bytes": {"all": {"current": 11, "peak": 99}, "large_pool": {"current": 5}},
        "reserved_bytes": {"all": {"current": 22}},
        "active_bytes": {"all": {"current": 33}},
        "inactive_split_bytes": {"all": {"current": 44}},
        "num_alloc_retries": 5,
        "num_ooms": 6,
    }
    r = allocator.parse_nested_stats(stats)
    assert r.as_row() == (11, 22, 33, 44, 5, 6)
    # cudaMallocAsync reports these as constant zero: stored as unknown, not as 0.
    r = allocator.parse_nested_stats(stats, backend="cudaMallocAsync")
    assert r.as_row() == (11, 22, -1, -1, -1, 6)
    partial = allocator.parse_nested_stats({"allocated_bytes": {"all": {"current": 7}}})
    assert partial.as_row() == (7, -1, -1, -1, -1, -1)
    assert allocator.parse_nested_stats({}) is allocator.UNAVAILABLE
