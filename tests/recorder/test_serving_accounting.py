"""Exact accounting of the continuous-batching tables (format 1.4): at every recorded scheduler step
the /sched, /sched_groups and /blocks rows equal what the paged cache itself reports at that moment
(transformers 5.23: ``compute_free_capacity``, ``num_sectors × bytes_per_sector``, each allocator's
``block_table``, ``ledger.cached_blocks`` and ``pool.count_free_blocks``), read by a probe that
wraps ``prepare_next_batch`` beneath the recorder, so both see the same state. GQA llama with prefix
sharing and a cached-block eviction; gemma3 (sliding + full allocators) past its window; the
soft-reset preemption path. Plus phase markers and the unsupported-layout messages. CPU, tiny
models, a few seconds each."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

pytest.importorskip("transformers.generation.continuous_batching.cache_allocators")  # the 5.23 layout

from transformers import GenerationConfig  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402
from transformers.generation.continuous_batching import continuous_api  # noqa: E402

import kvtrace  # noqa: E402
from kvtrace.format.reader import open_trace  # noqa: E402
from kvtrace.format.schema import EventKind, LayerType, Outcome  # noqa: E402
from kvtrace.format.validate import validate  # noqa: E402
from kvtrace.recorder.serving import UNSUPPORTED  # noqa: E402
from tests.helpers.models import tiny_model  # noqa: E402

PAGE = 16


class Probe:
    """What the cache says after each prepare_next_batch that found work, in the cache's own terms."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps: list[dict] = []
        proc = continuous_api.ContinuousBatchProcessor
        original = proc.__dict__["prepare_next_batch"]
        probe = self

        def prepare(processor, *args, **kwargs):
            found = original(processor, *args, **kwargs)
            if found:
                probe.steps.append(probe.read(processor))
            return found

        monkeypatch.setattr(proc, "prepare_next_batch", prepare)  # before recording: the recorder wraps it

    @staticmethod
    def read(processor) -> dict:
        cache = processor.cache
        groups = {}
        for alloc in cache.cache_allocators.values():
            groups[alloc.index] = {
                "tables": {rid: len(blocks) for rid, blocks in alloc.block_table.items()},
                "distinct": len({b for blocks in alloc.block_table.values() for b in blocks}),
                "cached": len(alloc.ledger.cached_blocks), "free": cache.pool.count_free_blocks(alloc.index),
                "bytes_per_block": alloc.bytes_per_block, "tokens_per_page": alloc.tokens_per_page,
                "window": getattr(alloc, "sliding_window", -1)}
        return {"pool": cache.num_sectors * cache.bytes_per_sector,
                "free": cache.compute_free_capacity(relative=False),
                "positions": {rid: s.position_offset for rid, s in processor.scheduler.active_requests.items()},
                "waiting": len(processor.scheduler.waiting_requests), "groups": groups}


def _cb_ids(t) -> dict[int, str]:
    return {int(r["request"]): json.loads(t.text(r["gen_args_off"], r["gen_args_len"]))["cb_request_id"]
            for r in t.requests[:]}


def assert_equal_to_cache(path, probe: Probe) -> None:
    """Every /sched, /sched_groups and /blocks row against the probe's reading of the same step."""
    t = open_trace(path)
    sched, groups, blocks = t.sched[:], t.sched_groups[:], t.blocks[:]
    assert sched.size == len(probe.steps) and sched["step"].tolist() == list(range(len(probe.steps)))
    cb_of = _cb_ids(t)
    for row, live in zip(sched, probe.steps, strict=True):
        step = int(row["step"])
        assert (row["pool_bytes"], row["free_bytes"]) == (live["pool"], live["free"])
        assert row["running"] == len(live["positions"]) and row["waiting"] == live["waiting"]
        assert row["tokens_cached"] == sum(live["positions"].values())
        mine = groups[groups["step"] == step]
        assert sorted(mine["group"].tolist()) == sorted(live["groups"])
        used = 0
        for g in mine:
            lg = live["groups"][int(g["group"])]
            assert (g["blocks_in_use"], g["blocks_cached"], g["blocks_free"]) == (lg["distinct"], lg["cached"], lg["free"])
            assert (g["bytes_per_block"], g["tokens_per_block"]) == (lg["bytes_per_block"], lg["tokens_per_page"])
            used += (int(g["blocks_in_use"]) + int(g["blocks_cached"])) * int(g["bytes_per_block"])
            rows = blocks[(blocks["step"] == step) & (blocks["group"] == g["group"])]
            got = {cb_of[int(b["request"])]: int(b["blocks"]) for b in rows}
            assert got == {rid: n for rid, n in lg["tables"].items() if n}
            for b in rows:  # tokens held: all positions, or the window's worth for a sliding group
                pos = live["positions"][cb_of[int(b["request"])]]
                assert b["tokens_valid"] == (min(pos, lg["window"]) if lg["window"] > 0 else pos)
                assert b["blocks"] * lg["tokens_per_page"] >= b["tokens_valid"]
            assert g["tokens_valid"] == int(rows["tokens_valid"].sum())
        # the identity the spec states: what the pool lacks is in blocks in use or cached
        assert row["pool_bytes"] - row["free_bytes"] == used
        assert row["blocks_in_use"] == int(mine["blocks_in_use"].sum())
        assert row["valid_bytes"] == sum(int(g["tokens_valid"]) * int(g["bytes_per_block"]) // int(g["tokens_per_block"])
                                         for g in mine)
    assert validate(path).valid


def _gc(new: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)


def run_prefix_scenario(model, path, cb: ContinuousBatchingConfig, timeout: float = 60):
    """Through the manager API, one request after another: A (48-token prefix + 2) finishes and leaves
    3 complete 16-token blocks cached; B (the same prefix + 3) shares them; C (100 tokens) needs the
    8-block pool and evicts them. Returns the closed recorder."""
    with kvtrace.record(model, path) as rec:
        prefix_scenario(model, cb, timeout)
    return rec


def prefix_scenario(model, cb: ContinuousBatchingConfig, timeout: float = 60) -> None:
    """run_prefix_scenario's requests on a manager of their own, inside the caller's recording."""
    prefix = list(range(3, 51))
    manager = model.init_continuous_batching(generation_config=_gc(4), continuous_batching_config=cb)
    manager.start()
    try:
        for prompt in (prefix + [60, 61], prefix + [70, 71, 72], list(range(100, 200))):
            rid = manager.add_request(prompt, max_new_tokens=4)
            assert manager.get_result(rid, timeout=timeout) is not None
    finally:
        manager.stop(block=True)


def test_events_without_a_request_name_their_manager(tmp_path):
    """Two managers in one recording, each evicting 3 cached blocks at its own step numbers: each
    BLOCK_EVICTED event (request -1) says which manager, and that manager's /sched row of the event's
    step counts the same blocks."""
    llama = tiny_model("llama")
    path = tmp_path / "two.kvt.h5"
    with kvtrace.record(llama, path) as rec:
        for _ in range(2):
            prefix_scenario(llama, ContinuousBatchingConfig(page_size=PAGE, num_blocks=8, max_batch_tokens=128))
    assert rec.recorder_errors == 0
    t = open_trace(path)
    evicted = t.events.where(kind=EventKind.BLOCK_EVICTED)
    texts = [t.text(e["text_off"], e["text_len"]) for e in evicted]
    assert texts == [f"manager {i}: cached prefix blocks returned to the pool" for i in (0, 1)]
    assert evicted["request"].tolist() == [-1, -1]
    sched = t.sched[:]
    for i, e in enumerate(evicted):
        row = sched[(sched["manager"] == i) & (sched["step"] == e["step"])]
        assert row["evicted_blocks"].tolist() == [int(e["value"])] == [3]


def test_llama_prefix_hit_and_eviction_match_the_cache(monkeypatch, tmp_path):
    """A finishes and leaves 3 complete 16-token blocks cached; B shares them (prefix hit 48 tokens);
    C's 100-token prompt needs the pool, so the scheduler evicts B's cached blocks."""
    probe = Probe(monkeypatch)
    llama = tiny_model("llama")  # 4 query heads, 2 KV heads
    path = tmp_path / "prefix.kvt.h5"
    rec = run_prefix_scenario(llama, path, ContinuousBatchingConfig(page_size=PAGE, num_blocks=8, max_batch_tokens=128))
    assert rec.recorder_errors == 0
    assert_equal_to_cache(path, probe)
    t = open_trace(path)
    hits = t.events.where(kind=EventKind.PREFIX_HIT)
    assert hits["request"].tolist() == [1] and hits["value"].tolist() == [48]
    sched = t.sched[:]
    assert sched["prefix_hit_tokens"].sum() == 48 and sched["prefix_hit_blocks"].sum() == 48 // PAGE
    evicted = t.events.where(kind=EventKind.BLOCK_EVICTED)
    assert evicted["value"].tolist() == [3] and sched["evicted_blocks"].sum() == 3
    # the eviction is counted in the row of the step whose scheduling made it
    assert sched["evicted_blocks"][sched["step"] == evicted["step"][0]].tolist() == [3]
    cb_rows = t.cb_requests
    assert cb_rows["prefix_hit_tokens"].tolist() == [0, 48, 0] and set(cb_rows["outcome"].tolist()) == {Outcome.OK}
    assert np.all(cb_rows["arrival_ns"] < cb_rows["admitted_ns"]) and np.all(cb_rows["admitted_ns"] < cb_rows["first_token_ns"])
    assert np.all(cb_rows["first_token_ns"] <= cb_rows["end_ns"])


def test_gemma3_sliding_and_full_groups_match_the_cache(monkeypatch, tmp_path):
    """gemma3_text: a sliding (window 8) and a full allocator. Requests grow past the window and past
    a block: the sliding group holds at most the window, the full group every position."""
    probe = Probe(monkeypatch)
    gemma = tiny_model("gemma3_text")
    path = tmp_path / "gemma.kvt.h5"
    cb = ContinuousBatchingConfig(page_size=PAGE, num_blocks=32, max_batch_tokens=64)
    prompts = [list(range(3, 13)), list(range(20, 23)), list(range(30, 48))]
    with kvtrace.record(gemma, path) as rec:
        gemma.generate_batch(inputs=prompts, generation_config=_gc(12), continuous_batching_config=cb, warmup=False)
    assert rec.recorder_errors == 0
    assert_equal_to_cache(path, probe)
    t = open_trace(path)
    groups = t.sched_groups[:]
    sliding = groups[groups["layer_type"] == int(LayerType.SLIDING)]
    full = groups[groups["layer_type"] == int(LayerType.FULL)]
    assert set(sliding["window"].tolist()) == {gemma.config.sliding_window} and set(full["window"].tolist()) == {-1}
    blocks = t.blocks[:]
    window = gemma.config.sliding_window
    for b in blocks:
        kind = int(groups[(groups["step"] == b["step"]) & (groups["group"] == b["group"])]["layer_type"][0])
        if kind == LayerType.SLIDING:
            assert b["tokens_valid"] <= window and b["blocks"] == math.ceil(b["tokens_valid"] / PAGE)
    # last step (11): positions 21, 14, 29 -> full blocks 2, 1, 2 of 16 tokens; sliding: 8 tokens, 1 block each
    last = blocks[blocks["step"] == 11]
    assert int(blocks["step"].max()) == 11 and sorted(last["blocks"].tolist()) == [1, 1, 1, 1, 2, 2]
    assert sorted(last["tokens_valid"].tolist()) == [8, 8, 8, 14, 21, 29]


def test_preemption_accounting(monkeypatch, tmp_path):
    """Soft resets on a 4-block pool: every step still matches the cache, each PREEMPTED event is
    counted in its step's row, and each is followed by a new admission."""
    probe = Probe(monkeypatch)
    llama = tiny_model("llama")
    path = tmp_path / "preempt.kvt.h5"
    cb = ContinuousBatchingConfig(page_size=PAGE, num_blocks=4, max_batch_tokens=64)
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13, 14, 15]]
    with kvtrace.record(llama, path) as rec:
        llama.generate_batch(inputs=prompts, generation_config=_gc(40), continuous_batching_config=cb, warmup=False)
    assert rec.recorder_errors == 0
    assert_equal_to_cache(path, probe)
    t = open_trace(path)
    preempted = t.events.where(kind=EventKind.PREEMPTED)
    sched = t.sched[:]
    assert preempted.size and int(sched["preempted"].sum()) == preempted.size
    for step in set(preempted["step"].tolist()):
        assert sched["preempted"][sched["step"] == step].tolist() == [int(np.sum(preempted["step"] == step))]
    assert np.all(preempted["value"] > 0)  # the positions each held
    cb_rows = t.cb_requests
    assert int(cb_rows["preemptions"].sum()) == preempted.size
    assert sorted(t.events.where(kind=EventKind.SCHEDULED)["value"].tolist())[-1] >= 2  # a re-admission counts up


def test_mark_phase(tmp_path):
    llama = tiny_model("llama")
    path = tmp_path / "phases.kvt.h5"
    rec = kvtrace.record(llama, path).start()
    assert rec.mark_phase("baseline") == 0
    assert rec.mark_phase("single") == 1
    assert rec.mark_phase("long", index=7) == 7
    with pytest.raises(ValueError):
        rec.mark_phase("")
    rec.close()
    with pytest.raises(RuntimeError, match="not open"):
        rec.mark_phase("late")
    phases = open_trace(path).phases
    assert phases["name"].tolist() == ["baseline", "single", "long"] and phases["index"].tolist() == [0, 1, 7]


def test_unknown_cache_layout_is_said_not_recorded_as_zeros(monkeypatch, tmp_path, capfd):
    """A cache the adapter does not recognise: requests and scheduler steps are recorded, the cache's
    columns are -1 (not recorded, never zeros), and a NOTE plus one stderr line say 'unsupported
    transformers version'."""
    from kvtrace.recorder import serving_v523

    monkeypatch.setattr(serving_v523.V523, "matches", lambda self, cache: False)
    llama = tiny_model("llama")
    path = tmp_path / "unknown.kvt.h5"
    cb = ContinuousBatchingConfig(page_size=PAGE, num_blocks=16, max_batch_tokens=64)
    with kvtrace.record(llama, path):
        llama.generate_batch(inputs=[[1, 2, 3]], generation_config=_gc(3), continuous_batching_config=cb, warmup=False)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "unsupported transformers version" in line]
    assert len(lines) == 1 and lines[0].startswith("kvtrace: warning: continuous batching is recorded without its paged cache")
    t = open_trace(path)
    notes = [t.text(e["text_off"], e["text_len"]) for e in t.events.where(kind=EventKind.NOTE)]
    assert [n for n in notes if UNSUPPORTED in n] == [lines[0][len("kvtrace: warning: "):]]
    assert len(t.requests[:]) == 1 and t.requests[:]["outcome"][0] == Outcome.OK
    sched = t.sched[:]
    assert sched.size == 3 and sched["running"].tolist() == [1, 1, 1]  # the scheduler's side is version-free
    for column in ("pool_bytes", "free_bytes", "valid_bytes", "blocks_in_use", "blocks_cached"):
        assert set(sched[column].tolist()) == {-1}, column
    assert t.sched_groups[:].size == 0 and t.blocks[:].size == 0


def _notes(path) -> list[str]:
    t = open_trace(path)
    return [t.text(e["text_off"], e["text_len"]) for e in t.events.where(kind=EventKind.NOTE)]


def test_no_known_generation_is_said_when_used_once_per_process(monkeypatch, tmp_path, capfd):
    """No known cache layout: nothing is said to a recording that never enters continuous batching
    (plain generate() users); a recording that does gets the NOTE, and stderr gets the line once per
    process, not at every recording a server opens."""
    from kvtrace.recorder import serving

    monkeypatch.setattr(serving, "adapter_for", lambda: None)
    monkeypatch.setattr(serving, "_SAID_ON_STDERR", set())
    llama = tiny_model("llama")
    with kvtrace.record(llama, tmp_path / "plain.kvt.h5"):
        llama.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
    assert UNSUPPORTED not in capfd.readouterr().err
    assert not [n for n in _notes(tmp_path / "plain.kvt.h5") if UNSUPPORTED in n]
    cb = ContinuousBatchingConfig(page_size=PAGE, num_blocks=16, max_batch_tokens=64)
    for i in range(2):
        with kvtrace.record(llama, tmp_path / f"cb{i}.kvt.h5"):
            llama.generate_batch(inputs=[[1, 2, 3]], generation_config=_gc(2), continuous_batching_config=cb,
                                 warmup=False)
        err = [line for line in capfd.readouterr().err.splitlines() if UNSUPPORTED in line]
        assert len(err) == (1 if i == 0 else 0), err
        if i == 0:
            assert "neither 5.23's cache_allocators nor 5.17's BlockManager" in err[0]
        said = [n for n in _notes(tmp_path / f"cb{i}.kvt.h5") if UNSUPPORTED in n]
        assert len(said) == 1 and said[0].startswith("continuous batching is recorded without its paged cache")


def test_eos_step_and_the_managers_readings(tmp_path):
    """A request that stops at an EOS token: its row's eos_step and new_tokens and an EOS event say
    where; the manager's loop has a BASELINE reading before its first step and an AFTER_RETURN one
    after its last (request -1: they belong to the manager)."""
    from kvtrace.format.schema import ReadingLabel

    llama = tiny_model("llama")
    cb = ContinuousBatchingConfig(page_size=PAGE, num_blocks=16, max_batch_tokens=64)
    prompt = [5, 9, 17, 33]
    out = llama.generate_batch(inputs=[prompt], generation_config=_gc(6), continuous_batching_config=cb, warmup=False)
    tokens = next(iter(out.values())).generated_tokens
    eos_at = tokens.index(tokens[2])  # greedy and deterministic: this token comes back at this index
    gc = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=tokens[2], pad_token_id=0)
    path = tmp_path / "eos.kvt.h5"
    with kvtrace.record(llama, path) as rec:
        llama.generate_batch(inputs=[prompt], generation_config=gc, continuous_batching_config=cb, warmup=False)
    assert rec.recorder_errors == 0
    t = open_trace(path)
    r = t.requests[:][0]
    assert (int(r["eos_step"]), int(r["new_tokens"]), int(r["outcome"])) == (eos_at, eos_at + 1, Outcome.OK)
    eos = t.events.where(kind=EventKind.EOS)
    assert eos["value"].tolist() == [eos_at] and eos["step"].tolist() == [eos_at]
    readings = t.readings[:]
    assert readings["request"].tolist() == [-1, -1]
    assert readings["label"].tolist() == [ReadingLabel.BASELINE, ReadingLabel.AFTER_RETURN]  # no PEAK without CUDA
    sched = t.sched[:]
    assert readings["t_ns"][0] < sched["t_ns"].min() and readings["t_ns"][1] > sched["t_ns"].max()
    assert np.all(readings["rss_bytes"] > 0)

    # with warmup (transformers' default) the manager builds its cache in warmup(), before the loop:
    # the BASELINE is still taken once, before that
    path = tmp_path / "warm.kvt.h5"
    with kvtrace.record(llama, path):
        llama.generate_batch(inputs=[prompt], generation_config=gc, continuous_batching_config=cb, warmup=True)
    t = open_trace(path)
    assert t.readings[:]["label"].tolist() == [ReadingLabel.BASELINE, ReadingLabel.AFTER_RETURN]


def test_cpu_offload_accounting(monkeypatch, tmp_path):
    """With a CPU swap pool, transformers copies a starved request's blocks there instead of a soft
    reset: PREEMPTED ('offloaded to the CPU swap pool') and OFFLOADED with the bytes copied, which are
    the request's blocks at the step before x the block bytes. The pool must be pinned memory, which
    torch allows only with CUDA: here transformers' offloading module gets a torch whose empty()
    ignores pin_memory (the copies are the same on the CPU)."""
    import types

    import torch
    from transformers.generation.continuous_batching import offloading_manager

    unpinned = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    unpinned.empty = lambda *a, pin_memory=False, **k: torch.empty(*a, **k)
    monkeypatch.setattr(offloading_manager, "torch", unpinned)
    probe = Probe(monkeypatch)
    llama = tiny_model("llama")
    path = tmp_path / "offload.kvt.h5"
    cb = ContinuousBatchingConfig(page_size=PAGE, num_blocks=4, max_batch_tokens=64, cpu_offload_space=0.001)
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13, 14, 15]]
    with kvtrace.record(llama, path) as rec:
        llama.generate_batch(inputs=prompts, generation_config=_gc(40), continuous_batching_config=cb, warmup=False)
    assert rec.recorder_errors == 0
    assert_equal_to_cache(path, probe)
    t = open_trace(path)
    preempted, offloaded = t.events.where(kind=EventKind.PREEMPTED), t.events.where(kind=EventKind.OFFLOADED)
    assert offloaded.size and offloaded.size == preempted.size
    assert {t.text(e["text_off"], e["text_len"]) for e in preempted} == {"offloaded to the CPU swap pool, requeued"}
    blocks, groups = t.blocks[:], t.sched_groups[:]
    for e in offloaded:
        step, rid = int(e["step"]), int(e["request"])
        assert preempted[(preempted["request"] == rid) & (preempted["step"] == step)].size == 1
        held = blocks[(blocks["step"] == step - 1) & (blocks["request"] == rid)]
        per_block = int(groups[groups["step"] == step - 1]["bytes_per_block"][0])
        assert int(e["value"]) == int(held["blocks"].sum()) * per_block > 0
    reqs = t.requests[:]
    assert set(reqs["outcome"].tolist()) == {Outcome.OK} and set(reqs["new_tokens"].tolist()) == {40}


class _Listener:
    """A live observer with the optional serving methods (what the Prometheus exporter implements)."""

    name = "listener"

    def __init__(self) -> None:
        self.steps: list[tuple] = []
        self.events: list[tuple] = []

    def __getattr__(self, method: str):  # every other RecorderObserver method: a no-op
        if method.startswith("on_") or method in ("start", "close"):
            return lambda *a, **k: None
        raise AttributeError(method)

    def on_serving_step(self, sched, groups) -> None:
        self.steps.append((sched, list(groups)))

    def on_serving_event(self, kind, request, value, t_ns) -> None:
        self.events.append((int(kind), int(request), int(value), int(t_ns)))


def test_live_observers_see_the_rows_and_events_written(tmp_path):
    from kvtrace.recorder import record

    listener = _Listener()
    llama = tiny_model("llama")
    path = tmp_path / "live.kvt.h5"
    cb = ContinuousBatchingConfig(page_size=PAGE, num_blocks=16, max_batch_tokens=64)
    with record(llama, path, observers=[listener]) as rec:
        rec.mark_phase("single")
        llama.generate_batch(inputs=[[1, 2, 3], [4, 5]], generation_config=_gc(3), continuous_batching_config=cb,
                             warmup=False)
    assert rec.recorder_errors == 0
    t = open_trace(path)
    assert [tuple(s) for s, _ in listener.steps] == [tuple(r) for r in t.sched[:].tolist()]
    assert [len(g) for _, g in listener.steps] == [1, 1, 1]
    kinds = [EventKind.PHASE, EventKind.SCHEDULED, EventKind.FIRST_TOKEN, EventKind.REQUEST_END]  # END: e2e latency
    written = t.events[:]
    written = written[np.isin(written["kind"], [int(k) for k in kinds])]
    assert sorted(listener.events) == sorted((int(e["kind"]), int(e["request"]), int(e["value"]), int(e["t_ns"]))
                                             for e in written)


def test_forked_parallel_sequences_are_requests_sharing_blocks(monkeypatch, tmp_path):
    """num_return_sequences=3: transformers forks the request after its prompt's first 19 tokens; the
    children share its complete 16-token block and get blocks of their own for the rest. Each child is
    a request row (forked_from the parent), and /blocks counts the shared block for all three."""
    probe = Probe(monkeypatch)
    llama = tiny_model("llama")
    path = tmp_path / "fork.kvt.h5"
    gc = GenerationConfig(max_new_tokens=5, do_sample=True, num_return_sequences=3, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=PAGE, num_blocks=16, max_batch_tokens=64)
    with kvtrace.record(llama, path) as rec:
        out = llama.generate_batch(inputs=[list(range(3, 23))], generation_config=gc, continuous_batching_config=cb,
                                   warmup=False)
    assert rec.recorder_errors == 0 and len(out) == 3
    assert_equal_to_cache(path, probe)
    t = open_trace(path)
    reqs = t.requests[:]
    args = [json.loads(t.text(r["gen_args_off"], r["gen_args_len"])) for r in reqs]
    assert [a.get("forked_from") for a in args] == [None, 0, 0]
    assert set(reqs["outcome"].tolist()) == {Outcome.OK} and set(reqs["new_tokens"].tolist()) == {5}
    last = t.blocks[:][t.blocks[:]["step"] == t.sched[:]["step"].max()]
    assert sorted(last["request"].tolist()) == [0, 1, 2] and set(last["blocks_shared"].tolist()) == {1}
    assert sorted(t.events.where(kind=EventKind.FIRST_TOKEN)["request"].tolist()) == [0, 1, 2]


def test_managers_numbered_and_steps_unique_across_calls(tmp_path):
    """Three generate_batch calls in one recording: two with a persistent manager (the second call
    reuses it and its processor is built again) and one with a fresh manager. (manager, step) stays
    unique in /sched, each request row names its manager, and the persistent one keeps counting."""
    llama = tiny_model("llama")
    path = tmp_path / "calls.kvt.h5"
    cb = ContinuousBatchingConfig(page_size=PAGE, num_blocks=16, max_batch_tokens=64)
    with kvtrace.record(llama, path) as rec:
        for persistent in (True, True, False):
            if not persistent:  # a fresh manager for the last call
                llama.destroy_cached_continuous_batching_manager()
            llama.generate_batch(inputs=[[1, 2, 3], [4, 5]], generation_config=_gc(3), continuous_batching_config=cb,
                                 warmup=False, persistent_manager=persistent)
    assert rec.recorder_errors == 0
    t = open_trace(path)
    sched = t.sched[:]
    pairs = list(zip(sched["manager"].tolist(), sched["step"].tolist(), strict=True))
    assert len(set(pairs)) == len(pairs) == 9
    cb_rows = t.cb_requests
    assert len(cb_rows) == 6
    by_manager = {int(m): sorted(int(s) for mm, s in pairs if mm == m) for m in set(sched["manager"].tolist())}
    # every request's manager has steps; the reused manager's second run continues its step count
    assert set(cb_rows["manager"].tolist()) == set(by_manager)
    assert sorted(len(v) for v in by_manager.values()) == [3, 6]
    assert sorted(by_manager.values(), key=len)[1] == list(range(6))  # the reused one: steps 0..5
    assert validate(path).valid


def test_manager_started_before_the_recording_is_taken_on(monkeypatch, tmp_path):
    """A manager built and running before kvtrace.record started (a server's, a persistent one): its
    next request is recorded with every step, and the rows equal the cache's own counters."""
    llama = tiny_model("llama")
    cb = ContinuousBatchingConfig(page_size=PAGE, num_blocks=16, max_batch_tokens=64)
    manager = llama.init_continuous_batching(generation_config=_gc(3), continuous_batching_config=cb)
    manager.start()
    try:
        assert manager.get_result(manager.add_request([1, 2, 3], max_new_tokens=3), timeout=60) is not None
        probe = Probe(monkeypatch)
        path = tmp_path / "late.kvt.h5"
        with kvtrace.record(llama, path) as rec:
            rid = manager.add_request([4, 5, 6, 7], max_new_tokens=3)
            assert manager.get_result(rid, timeout=60) is not None
    finally:
        manager.stop(block=True)
    assert rec.recorder_errors == 0
    t = open_trace(path)
    reqs = t.requests[:]
    assert len(reqs) == 1 and reqs["outcome"][0] == Outcome.OK and reqs["new_tokens"][0] == 3
    assert t.sched[:].size == 3  # the prefill step and two decode steps
    assert_equal_to_cache(path, probe)
