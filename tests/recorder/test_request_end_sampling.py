"""Request end waits for the sampled copies only; encoding and writing finish in the background
and close() joins them, so the trace is complete when record() exits."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvtrace  # noqa: E402
from kvtrace.format import Outcome, PayloadKind, TraceWriter  # noqa: E402
from kvtrace.format.schema import CacheDType  # noqa: E402
from kvtrace.format.writer import monotonic_ns  # noqa: E402
from kvtrace.recorder.sampling import PayloadSampler, SamplingSettings, _Job  # noqa: E402
from tests.helpers.models import tiny_model, tiny_prompt  # noqa: E402


def test_generate_returns_while_a_sample_write_is_stuck_and_close_completes_it(tmp_path):
    model = tiny_model("llama")
    path = tmp_path / "bg.kvt.h5"
    release, entered = threading.Event(), threading.Event()
    with kvtrace.record(model, str(path), sampling={"every_n_steps": 2}) as rec, torch.no_grad():
        real_write = rec.writer.write_payload

        def stuck_write(payload):  # slower than any generation until released
            entered.set()
            release.wait(timeout=30)
            return real_write(payload)

        rec.writer.write_payload = stuck_write
        model.generate(tiny_prompt(6), max_new_tokens=6, min_new_tokens=6, do_sample=False)
        # generate returned while a write is still stuck: request end did not wait for it (no clock)
        assert entered.wait(timeout=10)
        stuck_at_return = rec.sampler.stats()["written"] == 0 and rec.sampler._pending > 0
        release.set()
    stats = rec.sampler.stats()
    assert stuck_at_return
    assert stats["written"] > 0 and stats["failed"] == stats["dropped"] == 0
    with kvtrace.open(str(path)) as trace:
        assert trace.complete
        assert len(trace.payload_index[:]) == stats["written"]  # close() joined every write
        assert int(trace.requests[:][0]["outcome"]) == int(Outcome.OK)


class _GatedEvent:
    """Stands in for a CUDA staging event: synchronize() returns once the copy "fires"."""

    def __init__(self) -> None:
        self.fired = threading.Event()
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1
        assert self.fired.wait(timeout=30)


def test_wait_copies_waits_for_the_copy_event_not_for_the_write(tmp_path):
    release, entered = threading.Event(), threading.Event()
    event = _GatedEvent()
    with TraceWriter(tmp_path / "w.kvt.h5") as writer:
        real_write = writer.write_payload

        def stuck_write(payload):
            entered.set()
            release.wait(timeout=30)
            return real_write(payload)

        writer.write_payload = stuck_write
        sampler = PayloadSampler(writer, SamplingSettings(every_n_steps=1), workers=1)
        host = torch.arange(64, dtype=torch.int16).reshape(1, 1, 8, 8)
        sampler._slots.acquire()
        sampler._enqueue([_Job(0, 0, 0, PayloadKind.KEY, CacheDType.BFLOAT16, (1, 1, 8, 8), host, event,
                               0, 1, 0, monotonic_ns(), 0)])
        waiter = threading.Thread(target=sampler.wait_copies)
        waiter.start()
        waiter.join(timeout=0.2)
        blocked_before_copy = waiter.is_alive()  # the copy has not "fired": wait_copies waits
        event.fired.set()
        waiter.join(timeout=10)
        returned_after_copy = not waiter.is_alive()
        assert entered.wait(timeout=10)
        write_stuck_when_returned = sampler.stats()["written"] == 0
        release.set()
        stats = sampler.close()
        del writer.write_payload
    assert blocked_before_copy and returned_after_copy and write_stuck_when_returned
    assert stats["written"] == 1 and not sampler._copies  # the worker's wait removed the event
