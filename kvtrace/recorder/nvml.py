"""Thin, guarded NVML wrapper (nvidia-ml-py, imported as ``pynvml``).

Every call is guarded: a missing library, no driver, no device or a failing call gives
"unavailable" (``None`` / ``-1``) plus a reason string, never an exception and never an invented
number. Memory comes from the v2 struct (``nvmlMemory_v2``): the v1 ``used`` field includes the
driver-reserved memory, v2 reports ``reserved`` separately.

Devices are matched to CUDA ordinals by UUID, not by index: NVML enumerates every GPU in PCI order
while CUDA ordinals follow CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

# NVML reports "not available" as all-ones in unsigned fields.
_NOT_AVAILABLE = {2**64 - 1, 2**32 - 1}


@dataclass(frozen=True)
class NvmlMemory:
    """One memory reading of one device, in bytes; ``reserved`` is -1 when only v1 worked."""

    used: int
    free: int
    reserved: int
    total: int


def _text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def normalize_uuid(uuid: str) -> str:
    """'GPU-1a2b...' and '1A2B...' name the same device; compare without prefix and case."""
    text = _text(uuid).strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    return text


class Nvml:
    """An initialised NVML session, or an unavailable one that says why (``reason``)."""

    def __init__(self) -> None:
        self.available = False
        self.reason = ""
        self.errors = 0
        self.last_error = ""
        self._lock = threading.Lock()  # guards the error counters only; NVML is thread-safe
        self._nvml: Any = None
        self._v2 = True
        try:
            import pynvml  # nvidia-ml-py
        except ImportError as exc:
            self.reason = f"nvidia-ml-py is not installed ({exc})"
            return
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - NVMLError subclasses, OSError from ctypes
            self.reason = f"nvmlInit failed: {_text(exc) or type(exc).__name__}"
            return
        self._nvml = pynvml
        self._v2 = hasattr(pynvml, "nvmlMemory_v2")
        self.available = True
        self.reason = "nvidia-ml-py " + ("v2 memory struct" if self._v2 else "v1 memory struct only")

    # ---- guarded calls --------------------------------------------------------------------

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if not self.available:
            return None
        try:
            return getattr(self._nvml, name)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a telemetry read must never raise into the host
            with self._lock:
                self.errors += 1
                self.last_error = f"{name}: {_text(exc) or type(exc).__name__}"
            return None

    def driver_version(self) -> str:
        value = self._call("nvmlSystemGetDriverVersion")
        return _text(value) if value is not None else "unavailable"

    def device_count(self) -> int:
        value = self._call("nvmlDeviceGetCount")
        return int(value) if value is not None else 0

    def handle_by_uuid(self, uuid: str) -> Any:
        """The NVML handle whose UUID matches (any prefix/case), or None."""
        want = normalize_uuid(uuid)
        if not want:
            return None
        for index in range(self.device_count()):
            handle = self._call("nvmlDeviceGetHandleByIndex", index)
            if handle is not None and normalize_uuid(self.uuid(handle)) == want:
                return handle
        return None

    def handle_by_index(self, index: int) -> Any:
        return self._call("nvmlDeviceGetHandleByIndex", index)

    def name(self, handle: Any) -> str:
        value = self._call("nvmlDeviceGetName", handle)
        return _text(value) if value is not None else "unknown"

    def uuid(self, handle: Any) -> str:
        value = self._call("nvmlDeviceGetUUID", handle)
        return _text(value) if value is not None else ""

    def memory(self, handle: Any) -> NvmlMemory | None:
        """used/free/reserved/total from the v2 struct; falls back to v1 (reserved = -1)."""
        if not self.available:
            return None
        if self._v2:
            info = self._call("nvmlDeviceGetMemoryInfo", handle, version=self._nvml.nvmlMemory_v2)
            if info is not None:
                return NvmlMemory(int(info.used), int(info.free), int(info.reserved), int(info.total))
        info = self._call("nvmlDeviceGetMemoryInfo", handle)
        if info is None:
            return None
        return NvmlMemory(int(info.used), int(info.free), -1, int(info.total))

    def process_used(self, handle: Any, pid: int | None = None) -> int:
        """Device memory NVML attributes to ``pid`` (this process by default); -1 when NVML does
        not list the pid (e.g. a container with its own pid namespace) or does not know the size."""
        procs = self._call("nvmlDeviceGetComputeRunningProcesses", handle)
        if procs is None:
            return -1
        pid = os.getpid() if pid is None else pid
        total = -1
        for proc in procs:
            if int(getattr(proc, "pid", -1)) != pid:
                continue
            used = getattr(proc, "usedGpuMemory", None)
            if used is None or int(used) in _NOT_AVAILABLE:
                continue
            total = max(total, 0) + int(used)
        return total

    def shutdown(self) -> None:
        if self.available:
            self._call("nvmlShutdown")
            self.available = False
            self.reason = "NVML shut down"
