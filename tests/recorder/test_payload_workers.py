"""How many payload workers a sampler starts (the b16 prefill sample is ~3 GiB, and
each worker shuffles and compresses with the GIL released, so they run in parallel)."""

from __future__ import annotations

import pytest

from kvtrace.recorder import sampling


@pytest.mark.parametrize(("cpus", "workers"), [(1, 2), (2, 2), (4, 2), (6, 3), (16, 8), (128, 8)])
def test_default_workers_is_half_the_cpus_within_2_to_8(monkeypatch, cpus, workers):
    monkeypatch.setattr(sampling.os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    assert sampling.default_workers() == workers


def test_sampler_starts_the_default_or_the_asked_number(tmp_path, monkeypatch):
    from kvtrace.format import TraceWriter

    monkeypatch.setattr(sampling, "default_workers", lambda: 5)
    with TraceWriter(tmp_path / "w.kvt.h5", flush_interval_s=60) as w:
        for asked, started in ((None, 5), (3, 3)):
            s = sampling.PayloadSampler(w, sampling.SamplingSettings(every_n_steps=1), workers=asked)
            assert len(s._workers) == started and all(t.is_alive() for t in s._workers)
            s.close()
            assert not any(t.is_alive() for t in s._workers)
