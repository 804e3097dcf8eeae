"""The recorder's cheap per-step paths: the fast reader for plain dynamic caches must write exactly
what the general reader writes, and ``structure_every`` must read the structure at exactly the
steps it promises (prefill, multiples of N, the last step) with bytes still matching the geometry."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from rec_helpers import NEW, PROMPT, model
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

import kvtrace
from kvtrace import geometry
from kvtrace.cli import main
from kvtrace.format.reader import Trace
from kvtrace.format.schema import KV, STEPS, EventKind
from kvtrace.format.validate import validate
from kvtrace.recorder.layouts import (
    FastStepTotals,
    context_from_config,
    fast_plan,
    read_cache,
    read_step_fast,
)
from kvtrace.recorder.steps import StepRecorder
from kvtrace.recorder.steps import rows_of as _rows_of
from tests.helpers.hfcache import cache_kwargs  # noqa: E402
from tests.helpers.models import tiny_prompt

FAST_MODELS = ["gpt_neox", "mistral", "gemma3_text"]  # full; sliding; sliding + full mixed


def _caches(m: torch.nn.Module, decode_steps: int):
    """The model's DynamicCache after the prefill forward and after each greedy decode forward."""
    cache = DynamicCache(config=m.config)
    with torch.no_grad():
        out = m(tiny_prompt(PROMPT), use_cache=True, **cache_kwargs(m, cache))
        yield cache
        for _ in range(decode_steps):
            out = m(out.logits[:, -1:].argmax(-1), use_cache=True, **cache_kwargs(m, cache))
            yield cache


@pytest.mark.parametrize("name", FAST_MODELS)
def test_fast_rows_equal_general_rows_every_step(name):
    m = model(name)
    ctx = context_from_config(m.config)
    plan = None
    fast_steps = 0
    for step, cache in enumerate(_caches(m, NEW)):  # NEW > window: sliding layers saturate
        readings = read_cache(cache, ctx)
        rows, naive, unique, valid, seen = _rows_of(3, step, 1000 + step, readings)
        if plan is None:
            plan = fast_plan(cache, ctx, readings)
            assert plan is not None, "a plain dynamic cache must qualify for the fast path"
            continue
        live: dict = {}
        fast = read_step_fast(cache, plan, 3, step, 1000 + step, live)
        assert fast is not None, f"fast path fell back at step {step}"
        # the rows the flusher writes are the general reader's rows, field for field
        assert fast.rows_array(KV).tobytes() == np.array(rows, dtype=KV).tobytes(), step
        totals = FastStepTotals(fast, 1, -1, -1, 7).rows_array(STEPS)[0]
        assert (totals["kv_bytes_naive"], totals["kv_bytes_unique"], totals["kv_bytes_valid"],
                totals["tokens_seen"], fast.seen) == (naive, unique, valid, seen, seen), step
        # retention sees every storage of the step, attributed to its layer, by weak reference only
        assert {k: v[0] for k, v in live.items()} == {key: r.layer for r in readings for key, _ in r.storages}
        assert all(v[1]() is not None for v in live.values())
        fast_steps += 1
    assert fast_steps == NEW


def test_fast_path_refuses_storages_shared_across_layers():
    m = model("gpt_neox")
    ctx = context_from_config(m.config)
    caches = _caches(m, 1)
    cache = next(caches)
    plan = fast_plan(cache, ctx, read_cache(cache, ctx))
    cache = next(caches)
    assert read_step_fast(cache, plan, 0, 1, 0) is not None
    cache.layers[1].keys = cache.layers[0].keys  # layer 1's K now aliases layer 0's K
    assert read_step_fast(cache, plan, 0, 1, 0) is None
    readings = read_cache(cache, ctx)
    assert fast_plan(cache, ctx, readings) is None
    _, naive, unique, _, _ = _rows_of(0, 1, 0, readings)
    assert unique < naive  # the general accounting counted the shared storage once


def test_structure_every_must_be_a_positive_int(tmp_path):
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="structure_every"):
            kvtrace.record(model("gpt_neox"), tmp_path / "x.kvt.h5", structure_every=bad)


def _assert_geometry(kv, m, steps: list[int]) -> None:
    """Each recorded step's per-layer bytes equal kvtrace.geometry's (dynamic cache, batch 1)."""
    geo = geometry.model_geometry(m.config.to_dict())
    for step in steps:
        rows = kv[kv["step"] == step]
        assert len(rows) == len(geo.layers), step
        seen = PROMPT + step
        for i, g in enumerate(geo.layers):
            r = rows[rows["layer"] == i][0]
            alloc, valid = geometry.layer_kv_bytes(g, seen, 4, 1, "dynamic", None,
                                                   last_step_tokens=PROMPT if step == 0 else 1)
            assert (int(r["bytes_allocated"]), int(r["bytes_valid"]), int(r["tokens_seen"])) == (alloc, valid, seen)


@pytest.mark.parametrize("name", ["gpt_neox", "gemma3_text"])
def test_structure_every_4_reads_prefill_multiples_and_last_step(tmp_path, name):
    m = model(name)
    path = tmp_path / "every4.kvt.h5"
    with kvtrace.record(m, path, structure_every=4) as rec:
        m.generate(tiny_prompt(PROMPT), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    assert rec.recorder_errors == 0, dict(rec.errors)
    assert validate(path).valid
    want = sorted({0, NEW - 1} | set(range(0, NEW, 4)))  # 0, 4, 8, 11
    with Trace(path) as t:
        kv, steps = t.kv[:], t.steps[:]
        decode = t.events.where(kind=EventKind.DECODE_STEP)["step"].tolist()
        settings = t.meta.recorder_settings
    assert sorted(set(kv["step"].tolist())) == want
    assert steps["step"].tolist() == want
    assert decode == list(range(1, NEW))  # every step still has its event
    assert settings["structure_every"] == 4
    _assert_geometry(kv, m, want)
    report = kvtrace.analyze(path)
    assert all(r.status != "error" for r in report.results), [(r.name, r.status, r.reason) for r in report.results]
    assert not [(f.detector, f.score, f.message) for f in report.findings if f.score > 0.1]


class _StopAfter(StoppingCriteria):
    """Stops generation after ``n`` new tokens: an early stop the recorder cannot foresee."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= PROMPT + self.n, dtype=torch.bool)


@pytest.mark.parametrize("keep_cache", [False, True])
def test_early_stop_still_records_the_last_step(tmp_path, keep_cache):
    """generate stops after 7 of 20 tokens: steps 0 and 4 are read by the hook, step 6 at request
    end, from the Cache as it is freed (plain output) or from the live Cache (returned in the output)."""
    m = model("gpt_neox")
    path = tmp_path / "early.kvt.h5"
    with kvtrace.record(m, path, structure_every=4) as rec:
        out = m.generate(tiny_prompt(PROMPT), max_new_tokens=20, do_sample=False,
                         stopping_criteria=StoppingCriteriaList([_StopAfter(7)]),
                         return_dict_in_generate=keep_cache)
        del out
    assert rec.recorder_errors == 0, dict(rec.errors)
    with Trace(path) as t:
        kv, steps = t.kv[:], t.steps[:]
        notes = len(t.events.where(kind=EventKind.NOTE))
        requests = t.requests[:]
    assert int(requests[0]["new_tokens"]) == 7
    assert steps["step"].tolist() == [0, 4, 6]
    assert sorted(set(kv["step"].tolist())) == [0, 4, 6]
    _assert_geometry(kv, m, [0, 4, 6])
    assert notes == 1  # only the retention check note: the last step was readable
    assert validate(path).valid


def test_without_the_death_read_the_missing_last_step_is_said_not_invented(tmp_path, monkeypatch):
    monkeypatch.setattr(StepRecorder, "cache_died", lambda self, req, ref: None)
    m = model("gpt_neox")
    path = tmp_path / "nolast.kvt.h5"
    with kvtrace.record(m, path, structure_every=4):
        m.generate(tiny_prompt(PROMPT), max_new_tokens=20, do_sample=False,
                   stopping_criteria=StoppingCriteriaList([_StopAfter(7)]))
    with Trace(path) as t:
        assert t.steps[:]["step"].tolist() == [0, 4]
        notes = [t.text(int(e["text_off"]), int(e["text_len"])) for e in t.events.where(kind=EventKind.NOTE)]
    assert any("last step (6) not recorded" in n for n in notes), notes


def test_cli_structure_every(tmp_path, capsys):
    out = tmp_path / "cli.kvt.h5"
    argv = ["record", "--model", "preset:llama-3.1-8b", "--layers", "2", "--width", "0.05", "--vocab", "512",
            "--prompt", "hello", "--max-new-tokens", "6", "--min-new-tokens", "6", "--structure-every", "3",
            "-q", "-o", str(out)]
    with pytest.raises(SystemExit) as info:
        main(argv)
        raise SystemExit(0)
    assert int(info.value.code or 0) == 0, capsys.readouterr().err
    with Trace(out) as t:
        assert t.steps[:]["step"].tolist() == [0, 3, 5]
        assert json.loads(json.dumps(t.meta.recorder_settings))["structure_every"] == 3
