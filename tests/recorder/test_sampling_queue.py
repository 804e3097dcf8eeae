"""A full queue drops and counts samples; generation never waits for the writer."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtrace.format import EventKind, PayloadKind, TraceWriter, open_trace  # noqa: E402
from kvtrace.recorder.sampling import PayloadSampler, SamplingSettings  # noqa: E402
from tests.helpers.hfcache import output_cache  # noqa: E402
from tests.helpers.models import tiny_model, tiny_prompt  # noqa: E402

NEW_TOKENS = 8


def test_blocked_writer_drops_and_counts_while_generation_runs(tmp_path) -> None:
    path = tmp_path / "q.kvt.h5"
    model = tiny_model("llama")
    release = threading.Event()
    entered = threading.Event()
    with TraceWriter(path) as writer:
        real_write = writer.write_payload

        written = threading.Event()

        def stuck_write(payload):  # a writer slower than any generation: blocked until released
            entered.set()
            release.wait(timeout=30)
            real_write(payload)
            written.set()

        writer.write_payload = stuck_write
        sampler = PayloadSampler(writer, SamplingSettings(every_n_steps=1, queue_size=1))
        results: list[bool] = []

        def sample_cache(module, args, kwargs, output):  # every forward: K and V of every layer
            cache = output_cache(output)
            for layer_idx, layer in enumerate(cache.layers):
                results.append(sampler.submit(0, len(results), layer_idx, PayloadKind.KEY, layer.keys))
                results.append(sampler.submit(0, len(results), layer_idx, PayloadKind.VALUE, layer.values))

        hook = model.register_forward_hook(sample_cache, with_kwargs=True)
        with torch.no_grad():
            out = model.generate(tiny_prompt(5), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False)
        # Had submit() waited for a queue slot, the slot could only have freed once the stuck
        # write returned: generate finishing while it is still stuck proves no wait (no clock).
        never_waited = not written.is_set()
        hook.remove()
        assert entered.wait(timeout=10)  # the one accepted sample is stuck in the writer
        blocked_during_generation = not release.is_set()
        release.set()
        stats = sampler.close()
        del writer.write_payload
    assert blocked_during_generation
    assert never_waited
    assert out.shape[1] == 5 + NEW_TOKENS
    forwards = NEW_TOKENS  # prefill + NEW_TOKENS - 1 decode forwards
    assert len(results) == forwards * model.config.num_hidden_layers * 2
    assert results[0] is True and not any(results[1:])  # one slot: everything after the first dropped
    assert stats["written"] == 1
    assert stats["dropped"] == len(results) - 1
    with open_trace(path) as trace:
        assert trace.nrows("payloads/index") == 1
        (event,) = trace.events.where(kind=EventKind.DROPPED_SAMPLES)
        assert event["value"] == stats["dropped"]


def test_slots_free_up_after_writing(tmp_path) -> None:
    with TraceWriter(tmp_path / "s.kvt.h5") as writer:
        sampler = PayloadSampler(writer, SamplingSettings(every_n_steps=1, queue_size=2))
        t = torch.randn(1, 2, 4, 8)
        accepted = 0
        for step in range(6):
            accepted += sampler.submit(0, step, 0, PayloadKind.KEY, t)
            assert sampler.drain(timeout=10)  # once drained, the next submit finds a free slot
        stats = sampler.close()
        assert sampler.close() == stats  # idempotent
        assert not sampler.submit(0, 9, 0, PayloadKind.KEY, t)  # closed: refused, not queued
    assert accepted == 6 and stats["written"] == 6 and stats["dropped"] == 0
    with open_trace(tmp_path / "s.kvt.h5") as trace:
        assert sorted(trace.payload_index[:]["step"].tolist()) == list(range(6))
        assert len(trace.events.where(kind=EventKind.DROPPED_SAMPLES)) == 0
