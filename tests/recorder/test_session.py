"""Session lifecycle: model restored exactly, requests/events/readings, failures, retention."""

from __future__ import annotations

import gc
import hashlib
import json
import weakref

import pytest
import torch
from rec_helpers import NEW, PROMPT, generate, model, record_run, text

import kvtrace
from kvtrace.format.reader import Trace
from kvtrace.format.schema import EventKind, Outcome, ReadingLabel
from kvtrace.format.validate import validate
from kvtrace.recorder import CannotWriteTrace, layouts
from tests.helpers.hfcache import output_cache  # noqa: E402
from tests.helpers.models import tiny_model, tiny_prompt


def _state(m: torch.nn.Module) -> dict:
    """Everything a recorder could leave behind on a model."""
    mods = list(m.named_modules())
    return {
        "tree": [(n, type(x).__name__, id(x)) for n, x in mods],
        "hooks": [(n, dict(x._forward_hooks), dict(x._forward_pre_hooks), dict(x._forward_hooks_with_kwargs),
                   dict(getattr(x, "_forward_pre_hooks_with_kwargs", {})), dict(x._backward_hooks))
                  for n, x in mods],
        "dict_keys": sorted(m.__dict__),
        "attn": m.config._attn_implementation,
        "generate": type(m).generate,
        "global": (dict(torch.nn.modules.module._global_forward_hooks),
                   dict(torch.nn.modules.module._global_forward_pre_hooks)),
        "params": [(n, p.data_ptr()) for n, p in m.named_parameters()],
    }


@pytest.mark.parametrize("name", ["gpt_neox", "gemma4_text_shared", "t5"])
def test_model_restored_exactly(tmp_path, name):
    m = tiny_model(name)
    before = _state(m)
    ref = generate(m, new=4)
    with kvtrace.record(m, tmp_path / "r.kvt.h5") as rec:
        assert "generate" in m.__dict__
        out = generate(m, new=4)
    assert _state(m) == before
    assert "generate" not in m.__dict__
    assert torch.equal(out, ref)  # the recorder changed nothing in what the model computed
    assert rec.recorder_errors == 0


def test_requests_events_and_readings(tmp_path):
    path, rec = record_run(tmp_path, "gemma3_text", calls=3)
    assert rec.requests == 3
    assert validate(path).valid
    with Trace(path) as t:
        req = t.requests[:]
        assert req["request"].tolist() == [0, 1, 2]
        assert set(req["outcome"].tolist()) == {int(Outcome.OK)}
        assert req["prompt_tokens"].tolist() == [PROMPT] * 3 and req["new_tokens"].tolist() == [NEW] * 3
        assert req["batch_size"].tolist() == [1] * 3
        assert (req["end_ns"] > req["start_ns"]).all()
        # the same prompt hashes the same within a session; no prompt text unless asked
        assert len(set(req["prompt_sha256"].tolist())) == 1 and len(req["prompt_sha256"][0]) == 64
        assert req["prompt_text_len"].tolist() == [0, 0, 0]
        assert not t.meta.contains_prompt_text and not t.meta.contains_tensor_payloads
        gen_args = json.loads(text(t, req[0]["gen_args_off"], req[0]["gen_args_len"]))
        assert gen_args["max_new_tokens"] == NEW and "input_ids" not in gen_args
        ev = t.events[:]
        for rid in range(3):
            kinds = [int(k) for k in ev[ev["request"] == rid]["kind"]]
            order = [EventKind.REQUEST_START, EventKind.PREFILL_START, EventKind.PREFILL_END]
            assert kinds[:3] == [int(k) for k in order]
            assert kinds.count(int(EventKind.DECODE_STEP)) == NEW - 1
            tail = [EventKind.GENERATE_RETURN, EventKind.REQUEST_END]
            assert [k for k in kinds if k in {int(x) for x in tail}] == [int(x) for x in tail]
            # no KV storage outlived its request: no collection, nothing to empty (each costs time)
            assert int(EventKind.GC) not in kinds and int(EventKind.EMPTY_CACHE) not in kinds
            labels = t.readings.where(request=rid)["label"].tolist()
            assert labels == [ReadingLabel.BASELINE, ReadingLabel.AFTER_RETURN]
            r = t.readings.where(request=rid)
            assert (r["allocated_bytes"] == -1).all() and (r["rss_bytes"] > 0).all()  # no invented values
        steps = t.steps[:]
        assert (steps["allocated_bytes"] == -1).all() and (steps["rss_bytes"] > 0).all()
        meta = t.meta
        assert meta.sources["cache_structure"]["available"]
        assert not meta.source_available("nvml") and not meta.source_available("allocator")
        assert meta.model_type == "gemma3_text" and meta.model_config["num_hidden_layers"] == 3
        assert meta.recorder_settings["empty_cache"] is False
        salt_hash = meta.extra.get("prompt_hash_salt_sha256")
        assert salt_hash and len(salt_hash) == 64


def test_prompt_hash_is_salted_per_session(tmp_path):
    p1, _ = record_run(tmp_path, "llama", new=2)
    p2 = tmp_path / "second.kvt.h5"
    m = model("llama")
    with kvtrace.record(m, p2):
        generate(m, new=2)
    with Trace(p1) as a, Trace(p2) as b:
        assert a.requests[:]["prompt_sha256"][0] != b.requests[:]["prompt_sha256"][0]
    raw = tiny_prompt(PROMPT).numpy().astype("<i8").tobytes()
    with Trace(p1) as a:
        assert a.requests[:]["prompt_sha256"][0] != hashlib.sha256(raw).hexdigest().encode()


def test_store_prompts_opt_in(tmp_path):
    path, _ = record_run(tmp_path, "llama", new=2, record_kwargs={"store_prompts": True})
    with Trace(path) as t:
        r = t.requests[:][0]
        stored = text(t, r["prompt_text_off"], r["prompt_text_len"])
        assert t.meta.contains_prompt_text
    assert stored == "token ids: " + " ".join(map(str, tiny_prompt(PROMPT)[0].tolist()))


def test_eos_step_recorded(tmp_path):
    m = model("llama")
    ids = tiny_prompt(PROMPT)
    ref = m.generate(ids, max_new_tokens=6, do_sample=False)
    eos = int(ref[0, PROMPT + 2])  # make the 3rd greedy token the EOS: generation stops at step 2
    path = tmp_path / "eos.kvt.h5"
    with kvtrace.record(m, path):
        out = m.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=eos)
    first = (out[0, PROMPT:] == eos).nonzero()[0, 0].item()
    with Trace(path) as t:
        r = t.requests[:][0]
        assert r["eos_step"] == first
        assert r["new_tokens"] == out.shape[1] - PROMPT
        ev = t.events.where(kind=EventKind.EOS)
        assert ev["step"].tolist() == [first]


def test_recorder_error_never_reaches_the_model(tmp_path, monkeypatch):
    m = model("mistral")
    ref = generate(m, new=5)

    def broken(*a, **k):
        raise ValueError("injected failure")

    monkeypatch.setattr("kvtrace.recorder.steps.read_cache", broken)
    path = tmp_path / "err.kvt.h5"
    with kvtrace.record(m, path, structure_every=1) as rec:  # a failure at every step
        out = generate(m, new=5)
        out2 = generate(m, new=5)
    assert torch.equal(out, ref) and torch.equal(out2, ref)
    assert rec.recorder_errors == 10  # 5 steps x 2 requests, every one counted
    assert validate(path).valid
    with Trace(path) as t:
        ev = t.events.where(kind=EventKind.RECORDER_ERROR)
        texts = [text(t, e["text_off"], e["text_len"]) for e in ev]
        assert all("injected failure" in s for s in texts)
        assert sorted(ev["value"].tolist()) == [1, 1, 5, 5]  # first occurrence + per-request count
        assert set(t.requests[:]["outcome"].tolist()) == {int(Outcome.OK)}


class _Raise:
    """A forward hook (the test's, standing in for the model) raising at a given step."""

    def __init__(self, exc: BaseException, at: int) -> None:
        self.exc, self.at, self.calls = exc, at, 0

    def __call__(self, *args):
        self.calls += 1
        if self.calls > self.at:
            raise self.exc


@pytest.mark.parametrize(("exc", "outcome", "kind"), [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), Outcome.OOM, EventKind.OOM),
    (KeyboardInterrupt(), Outcome.INTERRUPTED, EventKind.INTERRUPT),
    (RuntimeError("boom"), Outcome.ERROR, EventKind.EXCEPTION),
    # host allocator failures are OOMs too (they are not torch.OutOfMemoryError)
    (RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: not enough memory: you tried "
                  "to allocate 1099511627776 bytes."), Outcome.OOM, EventKind.OOM),
    (MemoryError(), Outcome.OOM, EventKind.OOM),
])
def test_failures_inside_generate(tmp_path, exc, outcome, kind):
    m = tiny_model("llama")
    layer = m.model.layers[1].self_attn
    h = layer.register_forward_hook(_Raise(exc, at=3))  # raises during the 4th forward
    path = tmp_path / "fail.kvt.h5"
    try:
        with pytest.raises(type(exc)) as info:
            with kvtrace.record(m, path, structure_every=1):  # every step up to the failure
                generate(m, new=8)
        assert info.value is exc  # re-raised unchanged
    finally:
        h.remove()
    assert "generate" not in m.__dict__
    report = validate(path)
    assert report.valid, report.problems
    with Trace(path) as t:
        assert t.complete
        r = t.requests[:][0]
        assert r["outcome"] == int(outcome)
        assert r["new_tokens"] == 3 and r["end_ns"] > 0
        assert sorted(set(t.steps[:]["step"].tolist())) == [0, 1, 2]
        ev = t.events.where(kind=kind)
        assert len(ev) == 1 and ev[0]["step"] == 3
        assert int(EventKind.REQUEST_END) in t.events[:]["kind"].tolist()
        labels = t.readings.where(request=0)["label"].tolist()
        if outcome == Outcome.OOM:
            assert labels[-1] == ReadingLabel.AT_OOM
        if outcome != Outcome.INTERRUPTED:
            assert str(exc) in text(t, r["error_off"], r["error_len"])


def test_unwritable_path_fails_before_the_model_runs(tmp_path):
    m = model("llama")
    calls = []
    h = m.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        for bad in (tmp_path / "missing" / "x.kvt.h5", tmp_path):
            with pytest.raises(CannotWriteTrace, match="cannot write trace"):
                with kvtrace.record(m, bad):
                    generate(m, new=2)
    finally:
        h.remove()
    assert calls == [] and "generate" not in m.__dict__


def test_unknown_option_is_rejected(tmp_path):
    with pytest.raises(TypeError, match="unexpected keyword argument .sample_evry."):
        kvtrace.record(model("llama"), tmp_path / "x.kvt.h5", sample_evry=3)


def test_recorder_holds_no_cache_tensor(tmp_path):
    """Weak references to every cache tensor of the last step all die after generate + gc."""
    m = model("gemma3_text")
    refs: list[weakref.ref] = []

    def grab(mod, args, kwargs, output):
        cache = output_cache(output)
        refs.clear()
        for layer in cache.layers:
            refs.extend([weakref.ref(layer.keys), weakref.ref(layer.values)])

    h = m.register_forward_hook(grab, with_kwargs=True)
    try:
        with kvtrace.record(m, tmp_path / "w.kvt.h5") as rec:
            generate(m, new=6)
            gc.collect()
            assert refs and all(r() is None for r in refs)
    finally:
        h.remove()
    assert rec.recorder_errors == 0


@pytest.mark.slow
def test_retention_reports_what_the_caller_keeps(tmp_path):
    m = model("llama")
    path = tmp_path / "ret.kvt.h5"
    with kvtrace.record(m, path):
        generate(m, new=4)  # output dropped: nothing retained
        kept = generate(m, new=4, return_dict_in_generate=True)  # keeps its cache alive
    cache = output_cache(kept)
    with Trace(path) as t:
        assert len(t.retention.where(request=0)) == 0
        ret = t.retention.where(request=1)
        ptrs = sorted(ret["storage"].tolist())
        expect = sorted(layouts.storage_of(x)[0][1] for layer in cache.layers
                        for x in (layer.keys, layer.values))
        assert ptrs == expect
        assert sorted(set(ret["layer"].tolist())) == [0, 1]
        assert ret["nbytes"].sum() == sum(x.numel() * 4 for layer in cache.layers for x in (layer.keys, layer.values))
        names = {text(t, r["referrers_off"], r["referrers_len"]) for r in ret}
        # the holders by type, from the tensor up to the output the caller kept; never the recorder;
        # then the path from the cache to what roots it
        types_only = {",".join(x for x in n.split(",") if " < " not in x) for n in names}
        assert types_only == {"DynamicLayer,DynamicCache,GenerateDecoderOnlyOutput"}
        assert all("DynamicCache < GenerateDecoderOnlyOutput" in n for n in names)


def test_forward_outside_generate_is_not_recorded(tmp_path):
    m = model("llama")
    path = tmp_path / "fwd.kvt.h5"
    with kvtrace.record(m, path):
        with torch.no_grad():
            m(tiny_prompt(5), use_cache=True)
    with Trace(path) as t:
        assert t.nrows("kv") == 0 and t.nrows("requests") == 0
