"""Deferred retention verdict: a request's KV storages count as retained only if they are still
alive when the caller had its chance to drop generate's output (the next generate call on the
same recorder, or close), while the post-return readings are still taken at return."""

from __future__ import annotations

import gc

import pytest
import torch
from rec_helpers import generate, model, text

import kvtrace
from kvtrace.format.reader import Trace
from kvtrace.format.schema import EventKind, ReadingLabel
from kvtrace.format.validate import validate
from kvtrace.recorder import layouts

NEW = 4


def notes(t: Trace) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for e in t.events.where(kind=EventKind.NOTE):
        out.setdefault(int(e["request"]), []).append(text(t, e["text_off"], e["text_len"]))
    return out


def holders(t: Trace, request: int) -> set[str]:
    """The holder types of each retained storage (the path to a root, an entry holding " < ", apart)."""
    return {",".join(x for x in text(t, r["referrers_off"], r["referrers_len"]).split(",") if " < " not in x)
            for r in t.retention.where(request=request)}


def cache_storages(cache) -> list[int]:
    return sorted(layouts.storage_of(x)[0][1] for layer in cache.layers for x in (layer.keys, layer.values))


class CountCollect:
    """Counts gc.collect() calls (the recorder's per-request cost) and still collects."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        self._collect = gc.collect
        monkeypatch.setattr(gc, "collect", self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._collect(*args, **kwargs)


def gc_events(t: Trace) -> list[int]:
    return [int(e["request"]) for e in t.events.where(kind=EventKind.GC)]


def test_plain_generate_retains_nothing(tmp_path, monkeypatch):
    m = model("llama")
    path = tmp_path / "plain.kvt.h5"
    collects = CountCollect(monkeypatch)
    with kvtrace.record(m, path) as rec:
        generate(m, new=NEW)  # token ids only: the cache dies inside generate
        generate(m, new=NEW)
    # the weak references showed no KV storage alive: no collection was needed to prove it
    assert collects.calls == 0
    assert rec.recorder_errors == 0
    assert validate(path).valid
    with Trace(path) as t:
        assert t.nrows("retention") == 0
        assert gc_events(t) == []
        assert notes(t) == {0: ["retention checked at next request"], 1: ["retention checked at close"]}
        for rid in (0, 1):  # the immediate readings are still taken as generate returns
            labels = set(t.readings.where(request=rid)["label"].tolist())
            assert {int(ReadingLabel.BASELINE), int(ReadingLabel.AFTER_RETURN)} <= labels
            assert int(ReadingLabel.AFTER_GC) not in labels


def test_full_measurement_when_asked(tmp_path, monkeypatch):
    """empty_cache=True: gc.collect() and the AFTER_GC reading after every request, at return."""
    m = model("llama")
    path = tmp_path / "full.kvt.h5"
    collects = CountCollect(monkeypatch)
    with kvtrace.record(m, path, empty_cache=True) as rec:
        generate(m, new=NEW)
        generate(m, new=NEW)
    assert collects.calls == 2
    assert rec.recorder_errors == 0
    with Trace(path) as t:
        assert gc_events(t) == [0, 1]
        for rid in (0, 1):
            assert int(ReadingLabel.AFTER_GC) in set(t.readings.where(request=rid)["label"].tolist())


def test_cycle_freed_by_the_collection_is_not_retained(tmp_path, monkeypatch):
    """A cache kept alive only by a reference cycle survives the weak-reference check, so the
    recorder collects; the collection frees it, and nothing is reported retained."""
    m = model("llama")
    path = tmp_path / "cycle.kvt.h5"
    collects = CountCollect(monkeypatch)
    with kvtrace.record(m, path) as rec:
        gc.disable()  # keep the automatic collector from freeing the cycle first
        try:
            out = generate(m, new=NEW, return_dict_in_generate=True)
            out.past_key_values.cycle = out.past_key_values  # the cache refers to itself
            del out
            generate(m, new=NEW)
        finally:
            gc.enable()
    assert rec.recorder_errors == 0
    assert collects.calls == 1  # request 0's check; request 1 left nothing alive
    with Trace(path) as t:
        assert t.nrows("retention") == 0
        assert gc_events(t) == [0]
        assert int(ReadingLabel.AFTER_GC) in set(t.readings.where(request=0)["label"].tolist())


@pytest.mark.slow
def test_output_kept_past_the_next_request_is_retained(tmp_path):
    m = model("llama")
    path = tmp_path / "kept.kvt.h5"
    with kvtrace.record(m, path) as rec:
        out = generate(m, new=NEW, return_dict_in_generate=True)
        generate(m, new=NEW)  # `out` is still alive when this request starts
        expect = cache_storages(out.past_key_values)
        nbytes = sum(x.numel() * x.element_size() for layer in out.past_key_values.layers
                     for x in (layer.keys, layer.values))
    assert rec.recorder_errors == 0
    with Trace(path) as t:
        ret = t.retention.where(request=0)
        assert sorted(ret["storage"].tolist()) == expect
        assert int(ret["nbytes"].sum()) == nbytes
        assert holders(t, 0) == {"DynamicLayer,DynamicCache,GenerateDecoderOnlyOutput"}
        # the request whose storage survived paid a collection, and the next one, once, to prove
        # whether that retention persists (accumulating retention is critical)
        assert gc_events(t) == [0, 1]
        assert int(ReadingLabel.AFTER_GC) in set(t.readings.where(request=0)["label"].tolist())
        assert len(t.retention.where(request=1)) == 0  # the second output was dropped before close
        assert notes(t)[0] == ["retention checked at next request"]
        (note,) = [e for e in t.events.where(kind=EventKind.NOTE) if int(e["request"]) == 0]
        assert int(note["value"]) == len(expect)
    del out


def test_output_kept_until_close_is_retained(tmp_path):
    m = model("llama")
    path = tmp_path / "close.kvt.h5"
    with kvtrace.record(m, path):
        out = generate(m, new=NEW, return_dict_in_generate=True)
    with Trace(path) as t:
        assert sorted(t.retention.where(request=0)["storage"].tolist()) == cache_storages(out.past_key_values)
        assert holders(t, 0) == {"DynamicLayer,DynamicCache,GenerateDecoderOnlyOutput"}
        assert notes(t) == {0: ["retention checked at close"]}


def test_output_deleted_before_the_next_request_is_not_retained(tmp_path):
    m = model("llama")
    path = tmp_path / "del.kvt.h5"
    with kvtrace.record(m, path):
        out = generate(m, new=NEW, return_dict_in_generate=True)
        assert out.past_key_values.get_seq_length() > 0
        del out  # before the next request: the verdict must not blame request 0
        generate(m, new=NEW, return_dict_in_generate=True)  # output discarded at once
    with Trace(path) as t:
        assert t.nrows("retention") == 0
        assert notes(t) == {0: ["retention checked at next request"], 1: ["retention checked at close"]}


def test_cache_kept_without_the_output(tmp_path):
    """The caller keeps only `out.past_key_values`: the holders end at the Cache."""
    m = model("llama")
    path = tmp_path / "cache.kvt.h5"
    with kvtrace.record(m, path):
        cache = generate(m, new=NEW, return_dict_in_generate=True).past_key_values
    with Trace(path) as t:
        assert sorted(t.retention.where(request=0)["storage"].tolist()) == cache_storages(cache)
        assert holders(t, 0) == {"DynamicLayer,DynamicCache"}


def test_one_tensor_kept(tmp_path):
    """Only the storage the caller still refers to is retained, and no cache type is blamed."""
    m = model("llama")
    path = tmp_path / "one.kvt.h5"
    with kvtrace.record(m, path):
        keys = generate(m, new=NEW, return_dict_in_generate=True).past_key_values.layers[1].keys
        gc.collect()
    with Trace(path) as t:
        ret = t.retention.where(request=0)
        assert ret["storage"].tolist() == [layouts.storage_of(keys)[0][1]]
        assert ret["layer"].tolist() == [1]
        assert int(ret["nbytes"][0]) == keys.untyped_storage().nbytes()
        assert not any("Cache" in h for h in holders(t, 0))


def test_retention_off_writes_no_verdict(tmp_path):
    m = model("llama")
    path = tmp_path / "off.kvt.h5"
    with kvtrace.record(m, path, retention=False):
        out = generate(m, new=NEW, return_dict_in_generate=True)
    with Trace(path) as t:
        assert t.nrows("retention") == 0 and len(t.events.where(kind=EventKind.NOTE)) == 0
    assert isinstance(out.sequences, torch.Tensor)
