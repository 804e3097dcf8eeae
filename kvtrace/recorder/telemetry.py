"""Memory telemetry: one background thread polling NVML, the caching allocator and process RSS.

Readings are taken at ``rate_hz`` for every CUDA device the model touches, plus two synchronous
entry points for the recorder core: ``step_reading`` (one allocator stats call per step) and
``reading`` (a full labelled reading, per request). Nothing here is ever called per layer.

Default rate 5 Hz (200 ms). Measured on an H100 with Pythia-1.4B at batch 1, where the model's
thread is the bottleneck (bench/bench_overhead.py amplified variants, docs/benchmarks.md): each
tick costs that thread ~0.8 ms for NVML (a memory read and the process list; NVML takes a
driver-wide lock) and ~0.3 ms for the allocator stats (a nested dict built with the GIL held), so
20 Hz cost ~2% of decode time and 5 Hz costs ~0.5%. What 5 Hz gives up is little: every request
still gets exact labelled readings (baseline, peak, after return) and the allocator is also read
at every structure step; 200 ms samples still show the allocator's trends (fragmentation) over
any request longer than a second. Pass a higher rate to see shorter transients. The first tick
comes one period after start, so the thread does not compete for the GIL while the recorder
opens. Sources that do not exist are reported as unavailable with a reason and produce no rows;
no value is ever invented.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from kvtrace.format.schema import EventKind
from kvtrace.format.writer import DeviceInfo, TraceWriter, monotonic_ns
from kvtrace.recorder import allocator
from kvtrace.recorder.limits import read_limits
from kvtrace.recorder.nvml import Nvml

MAX_RATE_HZ = 1000.0
DEFAULT_RATE_HZ = 5.0  # see the module docstring for what a tick costs
READING_KEYS = (
    "allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes",
    "nvml_used_bytes", "nvml_process_used_bytes", "rss_bytes",
)


# ---- process RSS ------------------------------------------------------------------------------

def _statm_rss() -> int:
    with open("/proc/self/statm", "rb") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _psutil_rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _probe_rss() -> tuple[Any, str]:
    """(reader or None, reason): /proc/self/statm is ~10x cheaper than psutil where it exists."""
    try:
        if _statm_rss() > 0:
            return _statm_rss, "/proc/self/statm resident pages"
    except (OSError, ValueError, IndexError):
        pass
    try:
        if _psutil_rss() > 0:
            return _psutil_rss, "psutil memory_info().rss"
    except Exception as exc:  # noqa: BLE001 - ImportError, AccessDenied, ...
        return None, f"no /proc/self/statm and psutil failed ({exc})"
    return None, "process RSS reads as 0"


def total_ram_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001
        return -1


_NVML: Nvml | None = None
_NVML_LOCK = threading.Lock()


def _open_nvml() -> Nvml:
    """The process's NVML session (tests substitute their own here). Opened by the first recorder
    and kept: nvmlInit + nvmlShutdown cost milliseconds per recording session, on the caller's
    thread, and NVML counts its users itself. A failed open is retried next time."""
    global _NVML
    with _NVML_LOCK:
        if _NVML is None or not _NVML.available:
            _NVML = Nvml()
        return _NVML


# listener(device, nvml memory or None, allocator reading or None), on the sampler thread
Listener = Callable[[int, Any, Any], None]


class Telemetry:
    """Probes memory sources at construction (before any writer exists) and, once attached to a
    writer, samples them from ONE background thread between ``start()`` and ``stop()``."""

    def __init__(
        self,
        devices: list[int],
        *,
        rate_hz: float = DEFAULT_RATE_HZ,
        use_nvml: bool = True,
        use_allocator: bool = True,
        listeners: list[Listener] | None = None,
    ) -> None:
        if not 0 < float(rate_hz) <= MAX_RATE_HZ:
            raise ValueError(f"telemetry rate must be in (0, {MAX_RATE_HZ:g}] Hz, got {rate_hz}")
        self.rate_hz = float(rate_hz)
        self.devices = sorted({int(d) for d in devices if int(d) >= 0})
        self._writer: TraceWriter | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.ticks = 0
        self.tick_ns = 0  # wall and CPU time of the ticks so far: the thread's own cost, read
        self.tick_cpu_ns = 0  # without A/B noise (bench_overhead.py); CPU here mostly holds the GIL
        self.tick_errors = 0
        self.last_tick_error = ""
        self.last_rss = -1  # the background thread's latest RSS sample (-1: none yet); see latest_rss
        self._reported = {"nvml": 0, "tick": 0}  # error counts already written as events
        # Called once per device per tick with what was just read (live exporters). A listener
        # that raises is counted as a tick error; the rows of that tick are already written.
        self.listeners: list[Listener] = list(listeners or ())

        self._rss, rss_reason = _probe_rss()
        self._sources: dict[str, dict[str, Any]] = {
            "process_rss": {"available": self._rss is not None, "reason": rss_reason, "rate_hz": self.rate_hz},
        }
        self._probe_allocator(use_allocator)
        self._nvml: Nvml | None = None
        self._handles: dict[int, Any] = {}
        self._uuids: dict[int, str] = {}
        self._probe_nvml(use_nvml)

    # ---- probing --------------------------------------------------------------------------------

    def _probe_allocator(self, use: bool) -> None:
        self._alloc_backend = ""
        if not use:
            ok, reason = False, "disabled by the user"
        else:
            ok, reason, self._alloc_backend = allocator.probe()
            if ok and not self.devices:
                ok, reason = False, "the model has no parameters on a CUDA device"
        self._alloc_ok = ok
        self._sources["allocator"] = {
            "available": ok, "reason": reason, "backend": self._alloc_backend, "rate_hz": self.rate_hz,
            "devices": list(self.devices) if ok else [],
        }

    def _probe_nvml(self, use: bool) -> None:
        entry: dict[str, Any] = {"available": False, "reason": "", "rate_hz": self.rate_hz, "devices": []}
        self._sources["nvml"] = entry
        if not use:
            entry["reason"] = "disabled by the user"
            return
        nvml = _open_nvml()
        self._nvml = nvml  # kept even when no device matches: it still knows the driver version
        self._reported["nvml"] = nvml.errors  # the session is shared: count only this one's errors
        if not nvml.available:
            entry["reason"] = nvml.reason
            return
        if not self.devices:
            entry["reason"] = "the model has no parameters on a CUDA device"
            return
        unmatched = []
        for device in self.devices:
            uuid = self._cuda_uuid(device)
            handle = nvml.handle_by_uuid(uuid) if uuid else None
            if handle is None:
                unmatched.append(device)
                continue
            self._handles[device] = handle
            self._uuids[device] = nvml.uuid(handle)
        entry["devices"] = sorted(self._handles)
        if not self._handles:
            entry["reason"] = f"no NVML device matches the UUID of CUDA device(s) {unmatched} (MIG?)"
            return
        entry["available"] = True
        # A container with its own pid namespace sees host pids in NVML: say so up front.
        listed = any(nvml.process_used(h) >= 0 for h in self._handles.values())
        entry["process_usage"] = listed
        entry["reason"] = nvml.reason + (
            "; process usage matched by pid" if listed
            else "; this pid is not in NVML's process list (pid namespace?): process usage stored as -1"
        )
        if unmatched:
            entry["reason"] += f"; CUDA device(s) {unmatched} not found in NVML"

    @staticmethod
    def _cuda_uuid(device: int) -> str:
        try:
            import torch

            return str(torch.cuda.get_device_properties(device).uuid)
        except Exception:  # noqa: BLE001 - no CUDA, bad ordinal, old torch without .uuid
            return ""

    # ---- static facts -------------------------------------------------------------------------

    def sources(self) -> dict[str, dict]:
        """{"nvml": {...}, "allocator": {...}, "process_rss": {...}, "limits": {...}}: available,
        reason, details. The limits (per-process memory fraction, rlimits) are read now."""
        out = {name: dict(entry) for name, entry in self._sources.items()}
        out["limits"] = read_limits(self.devices)
        return out

    def device_infos(self) -> list[DeviceInfo]:
        if not self.devices:
            return [DeviceInfo(-1, "cpu", total_ram_bytes())]
        import torch

        infos = []
        for device in self.devices:
            try:
                props = torch.cuda.get_device_properties(device)
                name, total, uuid = str(props.name), int(props.total_memory), str(props.uuid)
            except Exception:  # noqa: BLE001
                name, total, uuid = "unknown", -1, ""
            infos.append(DeviceInfo(device, name, total, self._uuids.get(device, uuid)))
        return infos

    def versions(self) -> dict[str, str]:
        try:
            import torch

            cuda = torch.version.cuda or "unavailable"
        except ImportError:
            cuda = "unavailable"
        driver = self._nvml.driver_version() if self._nvml is not None else "unavailable"
        return {"cuda_version": str(cuda), "driver_version": driver}

    @staticmethod
    def devices_of(model: Any) -> list[int]:
        """CUDA ordinals holding the model's parameters or buffers (every device of a
        device_map split), plus CUDA entries of ``hf_device_map`` (offloaded modules)."""
        found: set[int] = set()
        for tensors in (model.parameters(), model.buffers()):
            for tensor in tensors:
                if tensor.device.type == "cuda":
                    found.add(tensor.device.index or 0)
        for place in (getattr(model, "hf_device_map", None) or {}).values():
            if isinstance(place, int):
                found.add(place)
            elif isinstance(place, str) and place.startswith("cuda"):
                found.add(int(place.split(":", 1)[1]) if ":" in place else 0)
        return sorted(found)

    # ---- synchronous readings -----------------------------------------------------------------

    def rss_bytes(self) -> int:
        if self._rss is None:
            return -1
        try:
            return int(self._rss())
        except Exception:  # noqa: BLE001
            return -1

    def latest_rss(self) -> int:
        """The last RSS the background thread sampled (at most ~1/rate_hz old), -1 before the first
        tick or without a source: the per-step path must not pay a /proc read."""
        return self.last_rss

    def step_reading(self, device: int) -> tuple[int, int]:
        """(allocated, reserved) of ``device``: one allocator stats call; (-1, -1) without one."""
        if not self._alloc_ok or device < 0:
            return (-1, -1)
        return allocator.read_allocated_reserved(device)

    def reading(self, device: int) -> dict[str, int]:
        """Full labelled reading (~100-200 us): call per request, never per layer."""
        out = dict.fromkeys(READING_KEYS, -1)
        if self._alloc_ok and device >= 0:
            r = allocator.read(device, self._alloc_backend)
            out.update(
                allocated_bytes=r.allocated_bytes, reserved_bytes=r.reserved_bytes,
                active_bytes=r.active_bytes, inactive_split_bytes=r.inactive_split_bytes,
            )
        handle = self._handles.get(device)
        if handle is not None and self._nvml is not None:
            mem = self._nvml.memory(handle)
            if mem is not None:
                out["nvml_used_bytes"] = mem.used
            out["nvml_process_used_bytes"] = self._nvml.process_used(handle)
        out["rss_bytes"] = self.rss_bytes()
        return out

    # ---- the sampler thread -------------------------------------------------------------------

    def attach(self, writer: TraceWriter) -> None:
        self._writer = writer

    def start(self) -> None:
        if self._writer is None:
            raise RuntimeError("Telemetry.start() needs a writer: call attach(writer) first")
        if self._thread is not None:
            return
        self._stop.clear()
        self.last_rss = self.rss_bytes()  # ~10 us: steps before the first tick still get an RSS
        self._thread = threading.Thread(target=self._run, name="kvtrace-telemetry", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Join the thread, take a last reading and record any read errors. Idempotent."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join()
        if self._writer is not None and not self._writer.closed:
            try:
                self._tick()
                self._record_errors()
            except RuntimeError:  # the writer closed under us
                pass

    def close(self) -> None:
        """stop(). The NVML session stays open for the next recorder (see _open_nvml)."""
        self.stop()

    def _run(self) -> None:
        period = 1.0 / self.rate_hz
        due = time.monotonic() + period
        if self._stop.wait(period):  # the first tick one period in: not while the recorder opens
            return
        while not self._stop.is_set():
            try:
                self._tick()
            except RuntimeError as exc:
                if self._writer is not None and self._writer.closed:
                    return  # nothing left to write into
                self._note_error(exc)
            except Exception as exc:  # noqa: BLE001 - telemetry must never take the host down
                self._note_error(exc)
            due += period
            delay = due - time.monotonic()
            if delay < 0:  # fell behind (GIL, suspended VM): resume the grid, never burst
                due = time.monotonic()
                delay = 0.0
            if self._stop.wait(delay):
                return

    def _note_error(self, exc: BaseException) -> None:
        self.tick_errors += 1
        self.last_tick_error = f"{type(exc).__name__}: {exc}"

    def _tick(self) -> None:
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        try:
            self._read_and_write()
        finally:
            self.tick_ns += time.perf_counter_ns() - t0
            self.tick_cpu_ns += time.thread_time_ns() - c0

    def _read_and_write(self) -> None:
        writer = self._writer
        assert writer is not None
        t = monotonic_ns()
        nvml_rows, alloc_rows = [], []
        seen: list[tuple[int, Any, Any]] = []
        for device in self.devices:
            handle = self._handles.get(device)
            mem = r = None
            if handle is not None and self._nvml is not None:
                mem = self._nvml.memory(handle)
                if mem is not None:  # a failed read leaves a gap, never a fabricated row
                    proc = self._nvml.process_used(handle)
                    nvml_rows.append((t, device, mem.used, mem.free, mem.reserved, mem.total, proc))
            if self._alloc_ok:
                r = allocator.read(device, self._alloc_backend)
                if r is not allocator.UNAVAILABLE:
                    alloc_rows.append((t, device, *r.as_row()))
                else:
                    r = None
            if mem is not None or r is not None:
                seen.append((device, mem, r))
        if nvml_rows:
            writer.append("telemetry/nvml", nvml_rows)
        if alloc_rows:
            writer.append("telemetry/allocator", alloc_rows)
        rss = self.rss_bytes()
        self.last_rss = rss
        if rss >= 0:
            writer.append("telemetry/process", (t, rss))
        self.ticks += 1
        for listener in self.listeners:
            for device, mem, r in seen:
                try:
                    listener(device, mem, r)
                except Exception as exc:  # noqa: BLE001 - a listener must not stop the sampling
                    self._note_error(exc)

    def _record_errors(self) -> None:
        """Write read failures since the last stop() as RECORDER_ERROR events (count in value)."""
        writer = self._writer
        assert writer is not None
        counts = {
            "nvml": (self._nvml.errors if self._nvml is not None else 0,
                     self._nvml.last_error if self._nvml is not None else ""),
            "tick": (self.tick_errors, self.last_tick_error),
        }
        for source, (total, last) in counts.items():
            new = total - self._reported[source]
            if new <= 0:
                continue
            self._reported[source] = total
            what = "failed NVML call(s)" if source == "nvml" else "failed telemetry tick(s)"
            off, length = writer.add_text(f"telemetry: {new} {what}, last: {last}")
            writer.append("events", (monotonic_ns(), int(EventKind.RECORDER_ERROR), -1, -1, -1, -1,
                                     new, off, length))
