"""Continuous batching on CUDA, with transformers' CUDA graphs on (and off, as the control): the
serving recorder still records every request and every scheduler step, and its /sched,
/sched_groups and /blocks rows equal the paged cache's own counters at every step (the CPU tests'
probe and checks, tests/recorder/test_serving_accounting.py, reused as they are).

Under CUDA graphs a forward is a replay: no forward hook runs. The serving recorder uses none (it
wraps the scheduler, processor and cache methods, which run in Python every step), and it writes
no per-layer rows for continuous batching in either mode; each manager's NOTE says so and names the
graph and async-batching settings it ran with. Replays are counted here, so "on" is proven on.

transformers 5.23 (the cache_allocators layout) only; tiny GQA llama and tiny gemma3 (sliding +
full allocators), bf16 on cuda:0. Run on the device:
    python -m pytest tests/gpu/test_serving_cuda.py -m gpu -q
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
pytest.importorskip("transformers.generation.continuous_batching.cache_allocators")  # the 5.23 layout

from transformers import GenerationConfig  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

import kvtrace  # noqa: E402
from kvtrace.format.reader import open_trace  # noqa: E402
from kvtrace.format.schema import EventKind, LayerType, Outcome  # noqa: E402
from tests.helpers.models import tiny_model  # noqa: E402
from tests.recorder.test_serving_accounting import PAGE, Probe, assert_equal_to_cache, run_prefix_scenario  # noqa: E402

NEW = 24
PROMPTS = [list(range(3, 13)), list(range(20, 23)), list(range(30, 48)), list(range(50, 90)), [7, 8, 9, 10, 11]]


class Replays:
    """Counts CUDA graph replays and captures (torch.cuda.CUDAGraph) while the test runs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.replays = 0
        self.captures = 0
        graph = torch.cuda.CUDAGraph
        replay, capture_begin = graph.replay, graph.capture_begin
        counter = self

        def counted_replay(g, *a, **k):
            counter.replays += 1
            return replay(g, *a, **k)

        def counted_capture(g, *a, **k):
            counter.captures += 1
            return capture_begin(g, *a, **k)

        monkeypatch.setattr(graph, "replay", counted_replay)
        monkeypatch.setattr(graph, "capture_begin", counted_capture)


def _gc(new: int = NEW) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)


def _model(name: str):
    return tiny_model(name, dtype=torch.bfloat16).to("cuda")


def _manager_notes(t) -> list[str]:
    notes = t.events.where(kind=EventKind.NOTE)
    return [t.text(int(n["text_off"]), int(n["text_len"])) for n in notes
            if "per-layer" in t.text(int(n["text_off"]), int(n["text_len"]))]


def _check_requests(t, prompts: list[list[int]], new: int, lag: bool) -> None:
    """Every request a row that ended OK with its own prompt length and `new` tokens, admitted,
    with one first token; every step a /sched row numbered 0, 1, 2, ... ``lag``: async batching,
    where step N+1 is scheduled before step N's tokens are read, so requests that all end at step N
    also run in step N+1 (seen on an H200: one wasted decode token per request; the probe agrees)."""
    reqs = t.requests[:]
    assert len(reqs) == len(prompts)
    by_cb = {json.loads(t.text(r["gen_args_off"], r["gen_args_len"]))["cb_request_id"]: r for r in reqs}
    assert {k: int(r["prompt_tokens"]) for k, r in by_cb.items()} == {f"req_{i}": len(p) for i, p in enumerate(prompts)}
    assert all(r["outcome"] == Outcome.OK and r["new_tokens"] == new for r in reqs)
    ids = sorted(int(r["request"]) for r in reqs)
    for kind in (EventKind.REQUEST_START, EventKind.SCHEDULED, EventKind.FIRST_TOKEN, EventKind.REQUEST_END):
        assert sorted(t.events.where(kind=kind)["request"].tolist()) == ids, kind
    sched = t.sched[:]
    assert sched["step"].tolist() == list(range(sched.size))
    # every output token of every request came out of a recorded step: decode tokens + one per prefill
    # (with async batching, plus the one scheduled step whose tokens were thrown away)
    wasted = len(prompts) if lag else 0
    assert int(sched["decode_tokens"].sum()) + len(prompts) == len(prompts) * new + wasted
    assert int(sched["prefill_tokens"].sum()) == sum(map(len, prompts))


@pytest.mark.parametrize("graphs,async_batching", [(True, False), (True, True), (False, False)],
                         ids=["graphs", "graphs+async", "no-graphs"])
@pytest.mark.parametrize("name", ["llama", "gemma3_text"])  # GQA; sliding (window 8) + full allocators
def test_generate_batch_on_cuda_matches_the_cache(name, graphs, async_batching, monkeypatch, tmp_path):
    replays = Replays(monkeypatch)
    probe = Probe(monkeypatch)
    model = _model(name)
    path = tmp_path / f"{name}.kvt.h5"
    cb = ContinuousBatchingConfig(page_size=PAGE, num_blocks=64, max_batch_tokens=128, use_cuda_graph=graphs,
                                  use_async_batching=async_batching)
    with kvtrace.record(model, path) as rec:
        out = model.generate_batch(inputs=PROMPTS, generation_config=_gc(), continuous_batching_config=cb)
    assert all(len(o.generated_tokens) == NEW for o in out.values())
    assert rec.recorder_errors == 0
    if graphs:
        assert replays.captures > 0 and replays.replays > 0, "CUDA graphs were asked for and not used"
    else:
        assert replays.captures == replays.replays == 0
    assert_equal_to_cache(path, probe)  # every row against the cache's own counters, step by step
    t = open_trace(path)
    _check_requests(t, PROMPTS, NEW, lag=async_batching)
    # no per-layer rows for continuous batching, graphs or not, and the trace says so with the settings
    assert t.kv[:].size == 0 and t.steps[:].size == 0
    notes = _manager_notes(t)
    assert len(notes) == 1 and f"CUDA graphs (varlen, decode): {(graphs, graphs)}" in notes[0], notes
    assert ("async batching on" if async_batching else "async batching off") in notes[0]
    if name == "gemma3_text":
        groups = t.sched_groups[:]
        sliding = groups[groups["layer_type"] == int(LayerType.SLIDING)]
        assert sliding.size and set(sliding["window"].tolist()) == {model.config.sliding_window}
        blocks = t.blocks[:]
        by_group = {int(g["group"]): int(g["layer_type"]) for g in groups}
        kinds = np.array([by_group[int(g)] for g in blocks["group"]])
        assert int(blocks["tokens_valid"][kinds == int(LayerType.SLIDING)].max()) == model.config.sliding_window
        # the longest request's positions after its last step (async batching: one more, the wasted step)
        last = max(map(len, PROMPTS)) + NEW - 1 + int(async_batching)
        assert int(blocks["tokens_valid"][kinds == int(LayerType.FULL)].max()) == last


def test_prefix_hit_and_eviction_under_cuda_graphs(monkeypatch, tmp_path):
    """The CPU test's prefix scenario through the manager API with graphs on: A leaves 3 cached
    16-token blocks, B shares them (48 tokens), C's 100-token prompt evicts them."""
    replays = Replays(monkeypatch)
    probe = Probe(monkeypatch)
    llama = _model("llama")
    path = tmp_path / "prefix.kvt.h5"
    cb = ContinuousBatchingConfig(page_size=PAGE, num_blocks=8, max_batch_tokens=128, use_cuda_graph=True)
    rec = run_prefix_scenario(llama, path, cb, timeout=120)
    assert rec.recorder_errors == 0 and replays.replays > 0
    assert_equal_to_cache(path, probe)
    t = open_trace(path)
    hits = t.events.where(kind=EventKind.PREFIX_HIT)
    assert hits["request"].tolist() == [1] and hits["value"].tolist() == [48]
    assert t.events.where(kind=EventKind.BLOCK_EVICTED)["value"].tolist() == [3]
    assert set(t.cb_requests["outcome"].tolist()) == {Outcome.OK}
