"""A sampling step's samples travel to the workers as one item per worker and all get written."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvtrace.format import DeviceInfo, TraceWriter, schema  # noqa: E402
from kvtrace.format.reader import Trace  # noqa: E402
from kvtrace.recorder.sampling import PayloadSampler, SamplingSettings, _Job  # noqa: E402


def _job(layer: int, kind: schema.PayloadKind, tokens: int) -> _Job:
    host = torch.arange(2 * tokens * 4, dtype=torch.int16).reshape(1, 2, tokens, 4) + layer
    return _Job(0, 3, layer, kind, schema.CacheDType.BFLOAT16, tuple(host.shape), host, None, 0, 1, 0, 0, 0)


def test_a_step_is_split_into_one_item_per_worker_and_fully_written(tmp_path):
    path = tmp_path / "b.kvt.h5"
    with TraceWriter(path, {"model_id": "t", "model_type": "llama"}, [DeviceInfo(-1, "cpu", -1)]) as w:
        sampler = PayloadSampler(w, SamplingSettings(every_n_steps=1), workers=2)
        items = []
        queue = sampler._jobs  # workers already wait on it: wrap put() only

        class Counting:
            def put(self, item):
                items.append(None if item is None else len(item))
                queue.put(item)

            def get(self):
                return queue.get()

        sampler._jobs = Counting()
        jobs = [_job(layer, kind, 3 + 5 * layer) for layer in range(5) for kind in (schema.PayloadKind.KEY,
                                                                                  schema.PayloadKind.VALUE)]
        want = {(j.layer, int(j.kind)): j.host.numpy().view("u2").copy() for j in jobs}
        for _ in jobs:
            assert sampler._slots.acquire(blocking=False)
        sampler._enqueue(jobs)
        stats = sampler.close()
    assert items[:2] == [5, 5] and stats["written"] == 10 and stats["failed"] == 0
    with Trace(path) as t:
        got = {(p.layer, int(p.kind)): p for p in (t.payload(i) for i in range(10))}
    assert set(got) == set(want)
    for key, data in want.items():
        assert got[key].shape == data.shape and (got[key].data.reshape(data.shape) == data).all()
