"""Recorder behaviour that only a GPU can show. Run on the device machine:

    pytest tests/recorder/test_gpu_recorder.py -m gpu -q
"""

from __future__ import annotations

import gc

import pytest
import torch
from rec_helpers import NEW, PROMPT, sampled_cache_at

import kvtrace
from kvtrace import geometry
from kvtrace.format.reader import Trace
from kvtrace.format.schema import EventKind, Outcome, ReadingLabel
from kvtrace.format.validate import validate
from tests.helpers.hfcache import output_cache  # noqa: E402
from tests.helpers.models import tiny_model, tiny_prompt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _model(name: str, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    return tiny_model(name, dtype=dtype).to("cuda")


def _gen(m, new: int = NEW, **kw):
    ids = tiny_prompt(PROMPT).to("cuda")
    return m.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kw)


def _settle() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def test_allocated_memory_identical_with_and_without_recorder(tmp_path):
    m = _model("gemma3_text")
    _gen(m)  # warm-up: cuBLAS workspaces, kernels
    without = []
    with_rec = []
    for i in range(2):
        _gen(m)
        without.append(_settle())
        with kvtrace.record(m, tmp_path / f"r{i}.kvt.h5", empty_cache=False) as rec:
            _gen(m)
            with_rec.append(_settle())  # inside the session: the recorder is still attached
        assert rec.recorder_errors == 0
    assert with_rec == without, (with_rec, without)
    with Trace(tmp_path / "r0.kvt.h5") as t:
        assert len(t.retention[:]) == 0


def test_real_cuda_oom_closes_the_trace_and_reraises(tmp_path):
    m = _model("llama")
    free, total = torch.cuda.mem_get_info()
    calls = {"n": 0}

    def hog(mod, args, output):
        calls["n"] += 1
        if calls["n"] == 4:  # 4th forward of layer 1: ask the allocator for more than the device has
            torch.empty(int(total) * 2, dtype=torch.uint8, device="cuda")

    h = m.model.layers[1].register_forward_hook(hog)
    path = tmp_path / "oom.kvt.h5"
    try:
        with pytest.raises(torch.OutOfMemoryError) as info:
            with kvtrace.record(m, path):
                _gen(m)
    finally:
        h.remove()
    assert "out of memory" in str(info.value).lower()
    assert validate(path).valid
    with Trace(path) as t:
        assert t.complete
        r = t.requests[:][0]
        assert r["outcome"] == int(Outcome.OOM)
        ev = t.events.where(kind=EventKind.OOM)
        assert len(ev) == 1 and ev[0]["step"] == 3 and ev[0]["device"] == 0
        at = t.readings.where(request=0)
        at = at[at["label"] == int(ReadingLabel.AT_OOM)]
        assert len(at) == 1 and at[0]["allocated_bytes"] > 0 and at[0]["reserved_bytes"] >= at[0]["allocated_bytes"]


@pytest.mark.parametrize("empty_cache", [False, True])
def test_telemetry_and_labelled_readings_on_gpu(tmp_path, empty_cache):
    """Defaults: no empty_cache after a request whose output was dropped (a gc only if a weak
    reference showed KV storage alive then); empty_cache=True: gc and empty_cache at return."""
    m = _model("gpt_oss")
    path = tmp_path / "tel.kvt.h5"
    with kvtrace.record(m, path, telemetry_hz=50, empty_cache=empty_cache):
        _gen(m, new=24)
    with Trace(path) as t:
        meta = t.meta
        assert meta.source_available("allocator")
        assert meta.cuda_version != "unavailable"
        steps = t.steps[:]
        assert (steps["allocated_bytes"] > 0).all() and (steps["reserved_bytes"] >= steps["allocated_bytes"]).all()
        labels = set(t.readings.where(request=0)["label"].tolist())
        assert {int(x) for x in (ReadingLabel.BASELINE, ReadingLabel.PEAK, ReadingLabel.AFTER_RETURN)} <= labels
        gcs, empties = len(t.events.where(kind=EventKind.GC)), len(t.events.where(kind=EventKind.EMPTY_CACHE))
        if empty_cache:
            assert {int(ReadingLabel.AFTER_GC), int(ReadingLabel.AFTER_EMPTY_CACHE)} <= labels
            assert gcs == empties == 1
        else:  # the output was dropped: nothing survived a collection, so no empty_cache
            assert int(ReadingLabel.AFTER_EMPTY_CACHE) not in labels and empties == 0
            assert (int(ReadingLabel.AFTER_GC) in labels) == (gcs == 1) and gcs <= 1
            assert len(t.retention.where(request=0)) == 0
        assert t.nrows("telemetry/allocator") > 0
        assert set(t.kv[:]["device"].tolist()) == {0}
        if meta.source_available("nvml"):
            assert t.nrows("telemetry/nvml") > 0


@pytest.mark.parametrize("impl", ["offloaded", "offloaded_static"])
def test_offloaded_caches_exact_and_cpu_resident(tmp_path, impl):
    m = _model("llama", torch.float32)
    path = tmp_path / f"{impl}.kvt.h5"
    with kvtrace.record(m, path) as rec:
        _gen(m, cache_implementation=impl, disable_compile=True)
    assert rec.recorder_errors == 0
    geo = geometry.model_geometry(m.config.to_dict())
    kind = "static" if impl == "offloaded_static" else "dynamic"
    max_len = geometry.generate_static_max_cache_len(PROMPT, NEW)
    with Trace(path) as t:
        kv = t.kv[:]
    assert -1 in set(kv["device"].tolist())  # some layers live on the CPU between uses
    for row in kv:
        g = geo.layers[int(row["layer"])]
        seen = PROMPT + int(row["step"])
        alloc, valid = geometry.layer_kv_bytes(g, seen, 4, 1, kind, max_len,
                                               last_step_tokens=PROMPT if row["step"] == 0 else 1)
        assert (row["bytes_allocated"], row["bytes_valid"]) == (alloc, valid), row


def test_offloaded_samples_match_cache_contents(tmp_path):
    from kvtrace.format.schema import PayloadKind
    from kvtrace.recorder.sampling import SamplingSettings

    m = _model("llama", torch.float32)
    path = tmp_path / "offs.kvt.h5"
    with kvtrace.record(m, path, sampling=SamplingSettings(every_n_steps=4)):
        out = _gen(m, cache_implementation="offloaded", return_dict_in_generate=True)
    cache = output_cache(out)
    with Trace(path) as t:
        last = int(t.payload_index[:]["step"].max())
    assert last == NEW - 1
    for layer_idx, layer in enumerate(cache.layers):  # incremental samples, joined: the cache, bit for bit
        for kind, src in ((PayloadKind.KEY, layer.keys), (PayloadKind.VALUE, layer.values)):
            got = sampled_cache_at(path, last, layer_idx, int(kind), src.shape[2])
            torch.testing.assert_close(torch.from_numpy(got.to_float32()), src.float().cpu(), rtol=0, atol=0)


def test_static_cache_with_auto_compile(tmp_path):
    """generate auto-compiles static caches on GPUs; the recorder must neither break nor change it."""
    m = _model("llama")
    ref = _gen(m, new=6, cache_implementation="static")
    with kvtrace.record(m, tmp_path / "c.kvt.h5", structure_every=1) as rec:  # every step
        out = _gen(m, new=6, cache_implementation="static")
    assert torch.equal(out, ref)
    with Trace(tmp_path / "c.kvt.h5") as t:
        assert t.requests[:][0]["outcome"] == int(Outcome.OK)
        n_steps = len(set(t.steps[:]["step"].tolist()))
    assert n_steps == 6, f"{n_steps} steps recorded ({rec.recorder_errors} recorder errors: {dict(rec.errors)})"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_device_map_split_records_every_device(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    m = tiny_model("llama", dtype=torch.bfloat16)
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0,
                  "model.layers.1": 1, "model.norm": 1, "lm_head": 1}
    m = accelerate.dispatch_model(m, device_map=device_map)  # what device_map="auto" sets up
    path = tmp_path / "split.kvt.h5"
    with kvtrace.record(m, path, telemetry_hz=50):
        _gen(m, new=4)
    with Trace(path) as t:
        assert set(t.devices[:]["device"].tolist()) == {0, 1}
        assert set(t.kv[:]["device"].tolist()) == {0, 1}
        assert set(t.readings.where(request=0)["device"].tolist()) == {0, 1}
        assert set(t.allocator[:]["device"].tolist()) == {0, 1}
        assert set(t.nvml[:]["device"].tolist()) == {0, 1}
