"""Telemetry wiring: the background Telemetry thread, the labelled /readings rows a request takes
(BASELINE, AFTER_RETURN, PEAK, AFTER_GC, ...), the allocator totals of a /steps row, and each
telemetry tick mirrored to the live observers.

Owns the devices the model lives on and the Telemetry object; writes through the session's writer.
A serving recorder reuses it as is: readings are per request id, not per generate call.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtrace.format.schema import Phase, ReadingLabel
from kvtrace.format.writer import monotonic_ns
from kvtrace.recorder.context import SessionContext
from kvtrace.recorder.rows import ReadingRow


class MemoryReadings:
    def __init__(self, model: torch.nn.Module, ctx: SessionContext) -> None:
        self.model = model
        self.ctx = ctx
        self.telemetry: Any = None  # kvtrace.recorder.telemetry.Telemetry once opened
        self.devices: list[int] = []
        # Called with (step, allocated, rss) of each recorded step: the owner readings' growth check.
        self.on_step_memory: Any = None

    def open(self) -> Any:
        """Find the model's devices and create (not start) the Telemetry thread."""
        from kvtrace.recorder.telemetry import Telemetry

        opts = self.ctx.options
        self.devices = Telemetry.devices_of(self.model)
        self.telemetry = Telemetry(self.devices, rate_hz=opts.telemetry_hz, use_nvml=opts.nvml,
                                   use_allocator=opts.allocator)
        return self.telemetry

    def start(self) -> None:
        """Start sampling into the session's writer, mirrored to the observers when there are any."""
        assert self.ctx.writer is not None
        if self.ctx.observers:
            self.telemetry.listeners.append(self.on_telemetry)
        self.telemetry.attach(self.ctx.writer)
        self.telemetry.start()

    def close(self) -> None:
        if self.telemetry is not None:
            try:
                self.telemetry.close()  # its last tick still reaches the observers
            except Exception as exc:  # noqa: BLE001
                self.ctx.error("telemetry-stop", exc)

    def on_telemetry(self, device: int, mem: Any, alloc: Any) -> None:
        """Telemetry-thread listener: the readings just written, mirrored to the observers."""
        self.ctx.observers.memory(
            device,
            used_bytes=mem.used if mem is not None else None,
            total_bytes=mem.total if mem is not None else None,
            reserved_bytes=alloc.reserved_bytes if alloc is not None else None,
            allocated_bytes=alloc.allocated_bytes if alloc is not None else None,
            inactive_split_bytes=alloc.inactive_split_bytes if alloc is not None else None,
            num_alloc_retries=alloc.num_alloc_retries if alloc is not None else None,
            num_ooms=alloc.num_ooms if alloc is not None else None,
        )

    # ---- labelled readings of a request ---------------------------------------------------------

    def write(self, request: int, label: ReadingLabel) -> None:
        """One reading per device (device -1 without CUDA), read now."""
        w = self.ctx.writer
        assert w is not None
        rows = []
        for d in self.devices or [-1]:
            r = self.telemetry.reading(d)
            rows.append(ReadingRow(monotonic_ns(), request, int(label), d, r["allocated_bytes"],
                                   r["reserved_bytes"], r["active_bytes"], r["inactive_split_bytes"],
                                   r["nvml_used_bytes"], r["nvml_process_used_bytes"], r["rss_bytes"]))
        w.append("readings", rows)

    def reset_peak(self) -> None:
        for d in self.devices:
            torch.cuda.reset_peak_memory_stats(d)

    def write_peak(self, request: int) -> None:
        """PEAK: the allocator's high-water marks since :meth:`reset_peak`."""
        w = self.ctx.writer
        assert w is not None
        t = monotonic_ns()
        w.append("readings", [
            ReadingRow(t, request, int(ReadingLabel.PEAK), d, int(torch.cuda.max_memory_allocated(d)),
                       int(torch.cuda.max_memory_reserved(d))) for d in self.devices])

    def write_recorder_own(self, request: int, own_device_bytes_on: Any) -> None:
        """RECORDER_OWN: device bytes the recorder itself holds (the sampler's staging), per device."""
        w = self.ctx.writer
        assert w is not None
        t = monotonic_ns()
        w.append("readings", [ReadingRow(t, request, int(ReadingLabel.RECORDER_OWN), d,
                                         int(own_device_bytes_on(d)) if d >= 0 else 0, -1)
                              for d in (self.devices or [-1])])

    # ---- per step -------------------------------------------------------------------------------

    def step_readings(self, step: int, memory: bool) -> tuple[int, int, int, int]:
        """(phase, allocated, reserved, RSS) of a /steps row. Allocator totals are read
        synchronously at the step (-1 when ``memory`` is off); RSS is the telemetry thread's latest
        sample (at most ~1/telemetry_hz old), never a /proc read on the model's thread."""
        alloc, reserved = self._step_memory() if memory else (-1, -1)
        rss = self.telemetry.latest_rss()
        if self.on_step_memory is not None and memory:
            self.on_step_memory(step, alloc, rss)
        return int(Phase.PREFILL if step == 0 else Phase.DECODE), alloc, reserved, rss

    def _step_memory(self) -> tuple[int, int]:
        if not self.devices:
            return (-1, -1)
        alloc = reserved = 0
        for d in self.devices:
            a, r = self.telemetry.step_reading(d)
            if a < 0 or r < 0:
                return (-1, -1)
            alloc += a
            reserved += r
        return alloc, reserved
