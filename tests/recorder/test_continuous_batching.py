"""Continuous batching: generate_batch and the manager API inside kvtrace.record give one
/requests row per CB request, lifecycle events (SCHEDULED, FIRST_TOKEN, PREEMPTED, ...), and per
scheduler step a /sched row with /sched_groups rows (format 1.4) whose occupancy equals the cache's
own counters (tests/recorder/test_serving_accounting.py checks it against the live cache, step by
step). Tiny llama on CPU, a 16-block pool of 16-token pages, warmup off: each run takes well under a
second."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("transformers.generation.continuous_batching")

from transformers import GenerationConfig  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402
from transformers.generation.continuous_batching import continuous_api, scheduler  # noqa: E402

import kvtrace  # noqa: E402
from kvtrace.format.reader import open_trace  # noqa: E402
from kvtrace.format.schema import EventKind, Outcome  # noqa: E402
from tests.helpers.hfcache import cb_config  # noqa: E402
from tests.helpers.models import tiny_model  # noqa: E402

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
NEW = 5


def _configs(new: int = NEW) -> tuple[GenerationConfig, ContinuousBatchingConfig]:
    # eos -1: no EOS, every request runs exactly `new` tokens
    gc = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    return gc, cb_config(page_size=16, num_blocks=16, max_batch_tokens=64)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


ATTENTION_TYPES = {"llama": {"full_attention"}, "gemma3_text": {"full_attention", "sliding_attention"}}


def _occupancy(trace) -> list[dict]:
    """Per /sched row: its fields, and its /sched_groups rows (a release may cut one attention type
    into several groups: 5.17 does for gemma3's full layers)."""
    groups = trace.sched_groups[:]
    names = {1: "full_attention", 2: "sliding_attention"}
    out = []
    for row in trace.sched[:]:
        mine = groups[(groups["manager"] == row["manager"]) & (groups["step"] == row["step"])]
        out.append({"row": row, **{k: int(row[k]) for k in row.dtype.names},
                    "groups": [{"type": names[int(g["layer_type"])], **{k: int(g[k]) for k in g.dtype.names}}
                               for g in mine]})
    return out


@pytest.mark.parametrize("name", list(ATTENTION_TYPES))  # GQA llama; gemma3: sliding + full allocators
def test_generate_batch_is_recorded_request_by_request(name, llama, tmp_path):
    llama = llama if name == "llama" else tiny_model(name)
    path = tmp_path / "cb.kvt.h5"
    gc, cb = _configs()
    originals = (continuous_api.ContinuousBatchingManager.add_request, scheduler.Scheduler.finish_request)
    with kvtrace.record(llama, path) as rec:
        out = llama.generate_batch(inputs=PROMPTS, generation_config=gc, continuous_batching_config=cb,
                                   warmup=False)
    assert rec.recorder_errors == 0
    # the class methods are the originals again once the recording closed
    assert (continuous_api.ContinuousBatchingManager.add_request, scheduler.Scheduler.finish_request) == originals
    assert all(len(o.generated_tokens) == NEW for o in out.values())

    t = open_trace(path)
    # one NOTE per manager: no per-layer rows for its requests, and how its forwards ran (CPU: no graphs)
    assert t_notes(path) == ["continuous-batching manager 0: no per-layer rows (/steps, /kv, /layers) for its "
                             "requests; their paged KV cache is in /sched, /sched_groups and /blocks, read from the "
                             "scheduler and cache every step. CUDA graphs (varlen, decode): (False, False); async "
                             "batching off"]
    assert t.kv[:].size == 0 and t.steps[:].size == 0
    reqs = t.requests[:]
    assert len(reqs) == len(PROMPTS)
    by_cb = {}
    for r in reqs:
        args = json.loads(t.text(r["gen_args_off"], r["gen_args_len"]))
        by_cb[args["cb_request_id"]] = r
        assert r["outcome"] == Outcome.OK and r["new_tokens"] == NEW and r["end_ns"] > r["start_ns"]
    # the manager's ids req_0.. follow the inputs: each row has its own prompt's length
    assert {k: int(r["prompt_tokens"]) for k, r in by_cb.items()} == {f"req_{i}": len(p) for i, p in enumerate(PROMPTS)}
    assert sorted(t.events.where(kind=EventKind.REQUEST_START)["request"].tolist()) == [0, 1, 2]
    assert sorted(t.events.where(kind=EventKind.REQUEST_END)["request"].tolist()) == [0, 1, 2]
    scheduled = t.events.where(kind=EventKind.SCHEDULED)
    assert sorted(scheduled["request"].tolist()) == [0, 1, 2] and set(scheduled["value"].tolist()) == {1}

    steps = _occupancy(t)
    # one forward for the three prefills together, then one per further token
    assert [s["step"] for s in steps] == list(range(NEW))
    # first token: once per request, produced by step 0's forward (after step 0's NOTE, before step 1's)
    firsts = t.events.where(kind=EventKind.FIRST_TOKEN)
    assert sorted(firsts["request"].tolist()) == [0, 1, 2] and set(firsts["step"].tolist()) == {0}
    for e in firsts:
        r = reqs[reqs["request"] == e["request"]][0]
        assert r["start_ns"] < e["t_ns"] <= r["end_ns"]
        assert steps[0]["row"]["t_ns"] < e["t_ns"] < steps[1]["row"]["t_ns"]
    total_prompt = sum(map(len, PROMPTS))
    for s in steps:
        allocs = s["groups"]
        assert {a["type"] for a in allocs} == ATTENTION_TYPES[name]
        assert s["running"] == 3 and s["waiting"] == 0
        assert s["blocks_in_use"] == sum(a["blocks_in_use"] for a in allocs)
        # exact: with nothing freed yet, every byte the pool lacks is in a block of a running request
        assert s["pool_bytes"] - s["free_bytes"] == sum(a["blocks_in_use"] * a["bytes_per_block"] for a in allocs)
        # tokens held after the step's forward: the prompts, then one more per request and step
        assert s["tokens_cached"] == total_prompt + 3 * s["step"]
        for a in allocs:  # each request's <= 10 tokens fit in one block of each group
            assert a["blocks_in_use"] == 3 and a["tokens_per_block"] >= 10 and a["blocks_total"] > 3
        assert len(t.blocks[:][t.blocks[:]["step"] == s["step"]]) == 3 * len(allocs)  # per request and group

        # the batch: the three prompts together, then one decode token per request
        expect = (total_prompt, 0) if s["step"] == 0 else (0, 3)
        assert (s["batch_requests"], s["prefill_tokens"], s["decode_tokens"]) == (3, *expect)
    _analyze_clean(path, tmp_path)


def _analyze(path, tmp_path, fail_on: str | None = "low") -> list[dict]:
    """The analyser reads the trace without crashing (nor a finding at ``fail_on``); its findings."""
    report = tmp_path / "a.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    gate = ["--fail-on", fail_on] if fail_on else []
    p = subprocess.run([sys.executable, "-m", "kvtrace.cli", "analyze", str(path), "--json-out", str(report),
                        *gate, "-q"], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    return json.loads(report.read_text())["reports"][0]["findings"]


def _analyze_clean(path, tmp_path) -> None:
    """No finding of severity >= low (serving detectors may add info-level notes, e.g. block tails)."""
    assert {f["severity"] for f in _analyze(path, tmp_path)} <= {"info"}


def test_cancelled_request_and_unrecorded_model(llama, tmp_path):
    path = tmp_path / "cancel.kvt.h5"
    gc, cb = _configs(new=400)
    other = tiny_model("llama", seed=1)
    with kvtrace.record(llama, path) as rec:
        # control: continuous batching of a model that is not recorded leaves no row
        other.generate_batch(inputs=PROMPTS[:1], generation_config=_configs()[0],
                             continuous_batching_config=cb, warmup=False)
        manager = llama.init_continuous_batching(generation_config=gc, continuous_batching_config=cb)
        manager.start()
        try:
            rid = manager.add_request([1, 2, 3], max_new_tokens=400)
            manager.cancel_request(rid)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and open_requests(rec) and manager.is_running():
                time.sleep(0.02)
        finally:
            manager.stop(block=True)
    t = open_trace(path)
    reqs = t.requests[:]
    assert len(reqs) == 1  # the other model's request is not in this trace
    r = reqs[0]
    assert r["prompt_tokens"] == 3 and r["outcome"] == Outcome.INTERRUPTED
    assert t.text(r["error_off"], r["error_len"]) == "cancelled"
    assert r["new_tokens"] < 400


def test_generate_paged_is_recorded_as_cb_requests(llama, tmp_path):
    """generate(cache_implementation="paged") hands over to generate_batch: one row per sequence, no
    generate row whose step hooks would find no Cache (before: 5 recorder errors on this call)."""
    import torch

    path = tmp_path / "paged.kvt.h5"
    gc, cb = _configs()
    with kvtrace.record(llama, path) as rec:
        out = llama.generate(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), generation_config=gc,
                             cache_implementation="paged", continuous_batching_config=cb)
    assert rec.recorder_errors == 0
    t = open_trace(path)
    reqs = t.requests[:]
    assert out.shape[-1] == 4 + NEW
    assert len(reqs) == 2 and set(reqs["batch_size"].tolist()) == {1}
    assert set(reqs["prompt_tokens"].tolist()) == {4} and set(reqs["new_tokens"].tolist()) == {NEW}
    # one scheduler step per new token after the last request was admitted: the loop thread may take
    # the first request before generate has queued the second (a race inside transformers, seen on
    # 2 loaded cores), which the SCHEDULED events record
    admitted = int(t.events.where(kind=EventKind.SCHEDULED)["step"].max())
    assert len(_occupancy(t)) == NEW + admitted and len(t.events.where(kind=EventKind.GENERATE_RETURN)) == 0


def open_requests(rec) -> int:
    return len(rec._serving.flights)


def test_missing_hook_is_said_not_half_patched(llama, tmp_path, monkeypatch, capfd):
    """A transformers without one of the hooked methods: nothing is patched but the entry point, and
    only a recording whose model enters continuous batching says why (a NOTE; stderr once per
    process); the entry point is the original again after close."""
    from kvtrace.recorder import serving

    monkeypatch.setattr(serving, "_SAID_ON_STDERR", set())
    monkeypatch.delattr(continuous_api.ContinuousBatchingManager, "_create_batch_processor")
    before = continuous_api.ContinuousBatchingManager.__dict__["add_request"]
    entry = continuous_api.ContinuousMixin.__dict__["init_continuous_batching"]
    with kvtrace.record(llama, tmp_path / "plain.kvt.h5"):
        assert continuous_api.ContinuousBatchingManager.__dict__["add_request"] is before
    assert not t_notes(tmp_path / "plain.kvt.h5") and "unsupported" not in capfd.readouterr().err
    for i in range(2):
        with kvtrace.record(llama, tmp_path / f"old{i}.kvt.h5"):
            llama.init_continuous_batching(generation_config=_configs()[0], continuous_batching_config=_configs()[1])
        err = [line for line in capfd.readouterr().err.splitlines() if "unsupported transformers version" in line]
        assert len(err) == (1 if i == 0 else 0)
        notes = t_notes(tmp_path / f"old{i}.kvt.h5")
        assert len(notes) == 1 and notes[0].startswith("continuous batching is not recorded: unsupported "
                                                       "transformers version 5.")
        assert notes[0].endswith("(transformers lacks ContinuousBatchingManager._create_batch_processor)")
    assert continuous_api.ContinuousMixin.__dict__["init_continuous_batching"] is entry


def t_notes(path) -> list[str]:
    t = open_trace(path)
    return [t.text(e["text_off"], e["text_len"]) for e in t.events.where(kind=EventKind.NOTE)]


def test_preemption_is_an_event_not_an_end(llama, tmp_path):
    """A 4-block pool for 4 requests growing past one block each: transformers soft-resets some
    (finish_request + requeue inside offload_requests). Those are NOTE 'preempted' events; each
    request still ends once, OK, with all its tokens counted."""
    path = tmp_path / "preempt.kvt.h5"
    gc = GenerationConfig(max_new_tokens=60, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = cb_config(page_size=16, num_blocks=4, max_batch_tokens=64)
    prompts = [*PROMPTS, [13, 14, 15]]
    with kvtrace.record(llama, path) as rec:
        llama.generate_batch(inputs=prompts, generation_config=gc, continuous_batching_config=cb, warmup=False)
    assert rec.recorder_errors == 0
    t = open_trace(path)
    reqs = t.requests[:]
    assert len(reqs) == 4 and set(reqs["outcome"].tolist()) == {Outcome.OK} and set(reqs["new_tokens"].tolist()) == {60}
    assert sorted(t.events.where(kind=EventKind.REQUEST_END)["request"].tolist()) == [0, 1, 2, 3]
    preempted = t.events.where(kind=EventKind.PREEMPTED)
    scheduled = t.events.where(kind=EventKind.SCHEDULED)
    assert preempted.size and len(scheduled) == 4 + len(preempted)  # each preemption is followed by a re-admission
    assert sorted(t.events.where(kind=EventKind.FIRST_TOKEN)["request"].tolist()) == [0, 1, 2, 3]  # once, even if recomputed
    assert all(t.text(e["text_off"], e["text_len"]).startswith("soft reset") for e in preempted)  # no CPU pool here
    assert int(t.sched[:]["preempted"].sum()) == len(preempted)
    steps = _occupancy(t)
    assert max(s["waiting"] for s in steps) > 0  # requeued requests wait while the pool is full
    for s in steps:
        (a,) = s["groups"]
        assert s["blocks_in_use"] <= a["blocks_total"] == 4
        # cached blocks (complete, unreferenced, kept for prefix reuse) are not free either, where
        # the release keeps them (-1: it keeps none)
        held = s["blocks_in_use"] + max(a["blocks_cached"], 0)
        assert s["pool_bytes"] - s["free_bytes"] == held * a["bytes_per_block"]
    # a prefill (new or recomputed after a soft reset) after step 0 is the preemptions' cost, visible per step
    assert sum(s["prefill_tokens"] for s in steps[1:]) > 0
    # a pool too small for the load: the serving detectors say so from these tables
    findings = _analyze(path, tmp_path, fail_on=None)
    assert "preemption" in {f["detector"] for f in findings if f["severity"] != "info"}


def test_failed_batch_is_an_error_row(tmp_path):
    """The model raises on its third forward: transformers fails the batch's requests, and their rows
    say ERROR with the error's text (before any finish_request, and for no request twice)."""
    llama = tiny_model("llama")
    calls = []

    def boom(module, args, kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("planted failure")

    handle = llama.register_forward_pre_hook(boom, with_kwargs=True)
    path = tmp_path / "fail.kvt.h5"
    gc, cb = _configs()
    try:
        with kvtrace.record(llama, path) as rec:
            llama.generate_batch(inputs=PROMPTS, generation_config=gc, continuous_batching_config=cb, warmup=False)
    finally:
        handle.remove()
    assert rec.recorder_errors == 0
    t = open_trace(path)
    reqs = t.requests[:]
    assert len(reqs) == 3 and set(reqs["outcome"].tolist()) == {Outcome.ERROR}
    assert {t.text(r["error_off"], r["error_len"]) for r in reqs} == {"RuntimeError: planted failure"}
    assert sorted(t.events.where(kind=EventKind.REQUEST_END)["request"].tolist()) == [0, 1, 2]
    assert set(reqs["new_tokens"].tolist()) == {2}  # the two forwards before the failure


def test_two_sessions_closed_out_of_order(llama, tmp_path):
    """Two recordings of two models open at once, the first closed first: the second still records
    its model's CB requests, and once both are closed the transformers methods are the originals."""
    other = tiny_model("llama", seed=1)
    gc, cb = _configs()
    original = continuous_api.ContinuousBatchingManager.__dict__["add_request"]
    first = kvtrace.record(llama, tmp_path / "a.kvt.h5").start()
    second = kvtrace.record(other, tmp_path / "b.kvt.h5").start()
    first.close()
    assert continuous_api.ContinuousBatchingManager.__dict__["add_request"] is not original  # second's
    other.generate_batch(inputs=PROMPTS, generation_config=gc, continuous_batching_config=cb, warmup=False)
    llama.generate_batch(inputs=PROMPTS[:1], generation_config=gc, continuous_batching_config=cb, warmup=False)
    second.close()
    assert continuous_api.ContinuousBatchingManager.__dict__["add_request"] is original
    assert len(open_trace(tmp_path / "a.kvt.h5").requests) == 0
    b = open_trace(tmp_path / "b.kvt.h5").requests[:]
    assert len(b) == 3 and set(b["outcome"].tolist()) == {Outcome.OK}
