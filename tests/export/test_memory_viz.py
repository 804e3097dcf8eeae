"""`kvtrace export memory-viz`: an /owners reading as a PyTorch memory snapshot, loaded back with torch's
own memory_viz tooling (torch.cuda._memory_viz: segsum checks that every segment's blocks add up,
segments/memory build the flame graphs pytorch.org/memory_viz draws)."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtrace.analyzer import owners as own  # noqa: E402
from kvtrace.export.memory_viz import NoOwnerReading, pick_reading, snapshot  # noqa: E402
from kvtrace.format.schema import Owner, OwnerMoment  # noqa: E402

KEPT: list = []


@pytest.fixture(scope="module")
def kept_exception_trace(tmp_path_factory):
    """A request whose exception (raised by a stopping criterion) the caller keeps: the request-end
    reading holds its KV, earlier requests' KV at the next verdict, weights and unknown tensors."""
    from transformers import StoppingCriteria

    import kvtrace
    from tests.helpers.models import tiny_model, tiny_prompt

    class Boom(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            if input_ids.shape[-1] >= 9:
                raise ValueError("boom")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    path = tmp_path_factory.mktemp("mviz") / "kept.kvt.h5"
    model = tiny_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with kvtrace.record(model, path):
            try:
                model.generate(tiny_prompt(6), max_new_tokens=6, do_sample=False, stopping_criteria=[Boom()])
            except ValueError as exc:
                KEPT.append(exc)
            model.generate(tiny_prompt(5), max_new_tokens=3, do_sample=False)
    yield path
    KEPT.clear()


def test_snapshot_loads_in_torch_memory_viz(kept_exception_trace, tmp_path):
    from torch.cuda import _memory_viz

    out = tmp_path / "snap.pickle"
    r = subprocess.run([sys.executable, "-m", "kvtrace.cli", "export", "memory-viz", str(kept_exception_trace),
                        "-o", str(out), "--request", "0", "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["request"] == 0 and info["moment"] == "request_end" and info["device"] == -1
    data = pickle.loads(out.read_bytes())
    summary = _memory_viz.segsum(data)  # raises when a segment's blocks do not add up
    assert f"segments: {len(data['segments'])}" in summary
    flame = _memory_viz.memory(data, format_flamegraph=lambda lines: lines)
    assert "owner: KV of request 0" in flame and "owner: weights" in flame
    assert sum(s["total_size"] for s in data["segments"]) == info["allocated_bytes"]


def test_largest_blocks_keep_their_allocation_site():
    rd = own.Reading(3, 12, OwnerMoment.OOM, 0, 1)
    rd.classes[Owner.UNKNOWN] = own.OwnerClass(10 << 20, 3, 6 << 20, {"largest": [
        {"bytes": 6 << 20, "requested_bytes": (6 << 20) - 7, "at": "serve/leaky.py:42 (keep)"},
        {"bytes": 3 << 20, "requested_bytes": 3 << 20}]})
    rd.classes[Owner.INACTIVE] = own.OwnerClass(2 << 20, 1, 2 << 20)
    data = snapshot(rd)
    from torch.cuda import _memory_viz

    _memory_viz.segsum(data)
    (unknown, free) = data["segments"]
    assert [b["size"] for b in unknown["blocks"]] == [6 << 20, 3 << 20, 1 << 20]
    assert unknown["blocks"][0]["frames"][0] == {"filename": "serve/leaky.py", "line": 42, "name": "keep"}
    assert free["blocks"][0]["state"] == "inactive"
    assert pick_reading([rd]) is rd
    with pytest.raises(NoOwnerReading):
        pick_reading([rd], moment="tick")


def test_trace_without_readings_is_a_usage_error(tmp_path):
    from tests.helpers.tracebuild import LLAMA_LIKE, Req, build

    path = build(tmp_path / "old.kvt.h5", LLAMA_LIKE, [Req(6, 4)])
    r = subprocess.run([sys.executable, "-m", "kvtrace.cli", "export", "memory-viz", str(path), "-o",
                        str(tmp_path / "x.pickle")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 64 and "holds none" in r.stderr
    assert not (tmp_path / "x.pickle").exists()
