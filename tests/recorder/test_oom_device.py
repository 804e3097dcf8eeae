"""The recorder stamps an out-of-memory event on the device the error names: a model spread over
GPUs (device_map) runs out on any of them, and torch's caching allocator says which ("... GPU 1 has
a total capacity of ..."; "(GPU 1; ... total capacity; ...)" before torch 2.1). Without a named
device it falls back to the model's first device and a NOTE event says so; a host allocation
failure is stamped -1 (the CPU). The event's value is the size the allocation asked for, -1 when
the message gives none (spec §4.5).

On a CPU-only machine the planted errors are raised inside a recorded generate (a forward hook),
with the recorder told the model lives on cuda:0 and cuda:1 (its readings then hold -1 values: the
allocator cannot be read here; only the stamping is under test).
"""

from __future__ import annotations

import pytest
import torch
from rec_helpers import generate, model, text
from test_session import _Raise  # a forward hook raising at a given call

import kvtrace
from kvtrace.analyzer import analyze
from kvtrace.format.reader import Trace
from kvtrace.format.schema import EventKind, Outcome
from kvtrace.memory_errors import named_gpu, requested_bytes
from kvtrace.recorder.requests import oom_device

GiB = 1 << 30
NEW = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 23.99 GiB of which "
       "10.00 MiB is free. Including non-PyTorch memory, this process has 23.97 GiB memory in use. Of the "
       "allocated memory 21.50 GiB is allocated by PyTorch, and 1.20 GiB is reserved by PyTorch but unallocated.")
OLD = ("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 1; 23.99 GiB total capacity; 21.50 GiB already "
       "allocated; 10.00 MiB free; 22.70 GiB reserved in total by PyTorch)")
UNNAMED = "CUDA out of memory."
HOST = ("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: not enough memory: you tried to allocate "
        "1099511627776 bytes.")


@pytest.mark.parametrize(("text_", "device", "size"), [
    (NEW, 1, 2 * GiB), (OLD, 1, 20 << 20), (NEW.replace("GPU 1", "GPU 12"), 12, 2 * GiB), (UNNAMED, None, None),
    (HOST, None, 1 << 40),  # the CPU allocator's "you tried to allocate N bytes"
    ("GPU 1 is fine; CUDA out of memory", None, None),  # a GPU mentioned, not as the one that failed
])
def test_message_reading(text_, device, size):
    assert named_gpu(text_) == device
    assert requested_bytes(text_) == size


@pytest.mark.parametrize(("exc", "devices", "want"), [
    (torch.OutOfMemoryError(NEW), [0, 1], (1, False)),
    (torch.OutOfMemoryError(OLD), [0, 1], (1, False)),
    (torch.OutOfMemoryError(NEW.replace("GPU 1", "GPU 0")), [0, 1], (0, False)),
    (torch.OutOfMemoryError(UNNAMED), [0, 1], (0, True)),
    (torch.OutOfMemoryError(UNNAMED), [2, 3], (2, True)),
    (torch.OutOfMemoryError(UNNAMED), [], (-1, False)),
    (RuntimeError(HOST), [0, 1], (-1, False)),
    (MemoryError(), [0, 1], (-1, False)),
])
def test_oom_device(exc, devices, want):
    device, note = oom_device(exc, devices)
    assert (device, bool(note)) == want
    if note:
        assert "names no device" in note and f"device {devices[0]}" in note


def _record_failure(tmp_path, exc: BaseException, devices: list[int]):
    m = model("llama")
    h = m.model.layers[1].self_attn.register_forward_hook(_Raise(exc, at=3))
    path = tmp_path / "oom.kvt.h5"
    try:
        with pytest.raises(type(exc)):
            with kvtrace.record(m, path, structure_every=1) as rec:
                rec._readings.devices = list(devices)  # as if the model spanned these GPUs
                rec._readings.reset_peak = lambda: None  # the CUDA allocator's peak cannot be reset here
                generate(m, new=8)
        assert rec.recorder_errors == 0, dict(rec._ctx.errors)
    finally:
        h.remove()
    return path


@pytest.mark.parametrize(("message", "devices", "device", "value", "noted"), [
    (NEW, [0, 1], 1, 2 * GiB, False),  # was stamped on cuda:0
    (OLD, [0, 1], 1, 20 << 20, False),
    (UNNAMED, [0, 1], 0, -1, True),
    (NEW, [], 1, 2 * GiB, False),  # a GPU named while the recorder saw none: the message is the truth
])
def test_recorded_oom_is_stamped_on_the_named_device(tmp_path, message, devices, device, value, noted):
    exc = torch.OutOfMemoryError(message)
    path = _record_failure(tmp_path, exc, devices)
    with Trace(path) as t:
        assert t.requests[:][0]["outcome"] == int(Outcome.OOM)
        (e,) = t.events.where(kind=EventKind.OOM)
        assert (int(e["device"]), int(e["value"]), int(e["step"])) == (device, value, 3)
        assert message[:100] in text(t, e["text_off"], e["text_len"])
        notes = [text(t, n["text_off"], n["text_len"]) for n in t.events.where(kind=EventKind.NOTE)]
        said = [n for n in notes if n.startswith("oom: the error names no device")]
        assert len(said) == (1 if noted else 0), notes


def test_host_oom_is_stamped_on_the_cpu(tmp_path):
    path = _record_failure(tmp_path, RuntimeError(HOST), [0, 1])
    with Trace(path) as t:
        (e,) = t.events.where(kind=EventKind.OOM)
        assert int(e["device"]) == -1 and int(e["value"]) == 1099511627776


def test_analyzer_names_the_recorded_device(tmp_path):
    """End to end on the recorded trace: the oom finding names the GPU the error named."""
    path = _record_failure(tmp_path, torch.OutOfMemoryError(NEW), [0, 1])
    (f,) = [f for f in analyze(path).findings if f.detector == "oom"]
    assert f.evidence["requested_bytes"].value == 2 * GiB
    with Trace(path) as t:
        assert int(t.events.where(kind=EventKind.OOM)[0]["device"]) == 1
