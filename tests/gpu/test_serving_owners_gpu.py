"""Owners under continuous batching on CUDA: an out-of-memory error planted in a batch's generation
step (the processor's ``_generation_step``, Python at every step, so it fires under CUDA graphs too)
gives the manager's owner reading from the caching allocator's snapshot, in which the paged KV pool
is KV of the running requests with exactly the bytes of the allocator blocks holding it (measured
here from a snapshot taken as the error is raised); the `oom` finding names the manager, the step,
the running requests and the pool. The clean control (same load, nothing planted) raises nothing at
low or above. A slice of the pool kept past generate_batch keeps the pool's storage alive: found.

Tiny GQA llama, fp16 on cuda:0, transformers 5.17 or 5.23+, CUDA graphs off and on. Run on the device:
    python -m pytest tests/gpu/test_serving_owners_gpu.py -m gpu -q -s
Run on an H200 (torch 2.11.0+cu130; transformers 5.17.0 and 5.24.0): 5 passed each, 2026-11-28.
"""

from __future__ import annotations

import bisect
import gc

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
pytest.importorskip("transformers.generation.continuous_batching")

from transformers import GenerationConfig  # noqa: E402
from transformers.generation.continuous_batching import continuous_api  # noqa: E402

import kvtrace  # noqa: E402
from kvtrace.analyzer.base import Severity  # noqa: E402
from kvtrace.format import Trace, schema  # noqa: E402
from kvtrace.format.validate import validate  # noqa: E402
from kvtrace.units import format_bytes  # noqa: E402
from tests.helpers.hfcache import cb_config, spy_paged_caches  # noqa: E402
from tests.helpers.models import tiny_model  # noqa: E402

PROMPTS = [list(range(3, 13)), list(range(20, 23)), list(range(30, 48))]
OW = schema.Owner
KEPT: list = []


@pytest.fixture
def caches(monkeypatch):
    return spy_paged_caches(monkeypatch)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", dtype=torch.float16).to("cuda")


def _pool(cache) -> list:
    return [cache.cache_tensor] if hasattr(cache, "cache_tensor") else [*cache.key_cache, *cache.value_cache]


def _pool_block_bytes(cache) -> int:
    """Bytes of the allocator blocks that hold the pool's storages, from a snapshot taken now."""
    ptrs = {t.untyped_storage().data_ptr() for t in _pool(cache)}
    blocks = []
    for seg in torch.cuda.memory_snapshot():
        a = int(seg["address"])
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                blocks.append((a, int(b["size"])))
            a += int(b["size"])
    blocks.sort()
    starts = [b[0] for b in blocks]
    found = {}
    for p in ptrs:
        i = bisect.bisect_right(starts, p) - 1
        assert i >= 0 and p < blocks[i][0] + blocks[i][1]
        found[blocks[i][0]] = blocks[i][1]
    return sum(found.values())


def _run(model, path, monkeypatch, caches, graphs: bool, fail_at: int | None = None, keep: bool = False):
    seen = {"n": 0, "pool": 0}
    step = continuous_api.ContinuousBatchProcessor._generation_step

    def planted(self, *a, **k):
        seen["n"] += 1
        c = caches[-1]()
        if keep and not KEPT:
            KEPT.append(_pool(c)[0][:16])
        if fail_at is not None and seen["n"] == fail_at + 1:
            torch.cuda.synchronize()
            seen["pool"] = _pool_block_bytes(c)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total "
                                         "capacity of 139.80 GiB of which 1.00 GiB is free.")
        return step(self, *a, **k)

    monkeypatch.setattr(continuous_api.ContinuousBatchProcessor, "_generation_step", planted)
    gen = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1, pad_token_id=0)
    with kvtrace.record(model, path) as rec:
        model.generate_batch(inputs=PROMPTS, generation_config=gen, warmup=False,
                             continuous_batching_config=cb_config(page_size=16, num_blocks=64, max_batch_tokens=128,
                                                                  use_cuda_graph=graphs))
    assert rec.recorder_errors == 0
    return seen["pool"]


@pytest.mark.parametrize("graphs", [False, True])
def test_an_oom_in_a_batch_names_the_pool_from_the_allocator(llama, tmp_path, monkeypatch, caches, graphs):
    path = tmp_path / "oom.kvt.h5"
    pool = _run(llama, path, monkeypatch, caches, graphs, fail_at=3)
    assert pool > 0
    with Trace(path) as t:
        rids = sorted(int(r) for r in t.requests[:]["request"])
        ev = t.events[:]
        oom = ev[ev["kind"] == int(schema.EventKind.OOM)]
        assert len(oom) == 1 and int(oom["request"][0]) == -1 and int(oom["device"][0]) == 0
        step = int(oom["step"][0])
        rows = t["owners"][:]
        at = rows[(rows["moment"] == int(schema.OwnerMoment.OOM)) & (rows["device"] == 0)]
        assert set(at["request"].tolist()) == {-1} and set(at["step"].tolist()) == {step}
        kv = at[at["owner"] == int(OW.KV_REQUEST)]
        assert len(kv) == 1 and int(kv["bytes"][0]) == pool  # the pool's allocator blocks, exactly
        total = int(at[at["owner"] != int(OW.INACTIVE)]["bytes"].sum())
        outcomes = {int(r["request"]): int(r["outcome"]) for r in t.requests[:]}
    assert not validate(path).problems
    found = [f for f in kvtrace.analyze(path).findings if f.detector == "oom"]
    assert len(found) == 1, [f.message for f in found]
    f = found[0]
    running = f.requests
    assert running and set(running) <= set(rids)
    assert all(outcomes[r] == int(schema.Outcome.OOM) for r in running)
    assert f.message.startswith(f"Out of memory in continuous-batching manager 0, step {step} (running request"), \
        f.message
    assert "asking for 20.0 GiB (" in f.message and " allocated, " in f.message, f.message
    n, share = len(running), pool / total
    pct = f"{share:.0%}" if share >= 0.01 else "<1%"  # a tiny model's pool beside a 32 MiB cuBLAS workspace
    assert f"paged KV pool ({n} running request{'s' if n > 1 else ''}) {pct} ({format_bytes(pool)})" in f.message, \
        f.message
    print(f"\ngraphs={graphs}: {f.kind}: {f.message}")


@pytest.mark.parametrize("graphs", [False, True])
def test_the_clean_control_raises_nothing(llama, tmp_path, monkeypatch, caches, graphs):
    path = tmp_path / "clean.kvt.h5"
    _run(llama, path, monkeypatch, caches, graphs)
    with Trace(path) as t:
        assert set(t.requests[:]["outcome"].tolist()) == {int(schema.Outcome.OK)}
    low = [f for f in kvtrace.analyze(path).findings if f.severity >= Severity.LOW]
    assert not low, [(f.detector, f.message) for f in low]


def test_a_slice_of_the_pool_kept_past_generate_batch_is_found(llama, tmp_path, monkeypatch, caches):
    path = tmp_path / "kept.kvt.h5"
    try:
        _run(llama, path, monkeypatch, caches, False, keep=True)
        size = KEPT[0].untyped_storage().nbytes()
    finally:
        KEPT.clear()
        gc.collect()
    found = [f for f in kvtrace.analyze(path).findings if f.kind == "paged_pool_retained"]
    assert len(found) == 1 and found[0].severity == Severity.CRITICAL, found
    assert "global KEPT" in found[0].message, found[0].message
    with Trace(path) as t:
        rows = t["owners"][:]
        earlier = rows[(rows["request"] == -1) & (rows["owner"] == int(OW.KV_EARLIER))]
        assert len(earlier) == 1 and int(earlier["bytes"][0]) >= size  # the block holding the pool storage
    print(f"\n{found[0].message}")
