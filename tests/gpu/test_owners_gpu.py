"""GPU checks of the owner readings (/owners, format 1.5) on real caching-allocator snapshots:
every active block has exactly one owner and they add up to the allocator's allocated bytes, a view
into a KV storage is that storage, the cuBLAS workspace is found once, copies of KV and odd-sized
temporaries are told apart, memory history names the allocating line, an OOM reading names who
filled the device, and the snapshot's cost at realistic block counts is printed (-s).

Run on the device:  python -m pytest tests/gpu/test_owners_gpu.py -m gpu -q -s
(bench/owners_gpu_check.py runs this file and the GPU accuracy cases in one command.)
"""

from __future__ import annotations

import gc
import time
import warnings

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("transformers")

import kvtrace  # noqa: E402
from kvtrace.analyzer.base import Severity  # noqa: E402
from kvtrace.format import open_trace  # noqa: E402
from kvtrace.format.schema import Owner, OwnerMoment  # noqa: E402
from kvtrace.recorder import owners as ow  # noqa: E402
from kvtrace.recorder.hooks import cache_of_output  # noqa: E402
from tests.helpers.models import tiny_model, tiny_prompt  # noqa: E402

MiB = 1 << 20
KV16x64 = dict(num_key_value_heads=16, num_attention_heads=16, head_dim=64)
HELD: list = []


def _model(**extra):
    m = tiny_model("llama", dtype=torch.float16, **{**KV16x64, **extra}).to("cuda")
    with torch.no_grad():  # warm: the first matmul's workspaces exist before recording
        m.generate(tiny_prompt(8).to("cuda"), max_new_tokens=2, do_sample=False)
    torch.cuda.synchronize()
    return m


def _gen(m, prompt=32, new=64, **kw):
    kw.setdefault("do_sample", False)
    return m.generate(tiny_prompt(prompt).to("cuda"), max_new_tokens=new, min_new_tokens=new, **kw)


def _owner_rows(path):
    with open_trace(path) as tr:
        return tr["owners"][:]


def _active(segments) -> int:
    return sum(b["size"] for s in segments for b in s["blocks"] if b["state"] == "active_allocated")


def test_real_snapshot_every_block_one_owner_and_views_count() -> None:
    torch.cuda.synchronize()
    gc.collect()
    kv = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
    view = kv[4096:8192]  # a view: its data pointer is inside kv's block
    weight = torch.empty(3 * MiB + 17, dtype=torch.uint8, device="cuda")
    odd = torch.empty(1_000_003, dtype=torch.uint8, device="cuda")
    copy = torch.empty(300 * 4096, dtype=torch.uint8, device="cuda")  # 300 tokens x 4 KiB/token
    known = ow.KnownMemory(kv_units={4096}, kv_max_multiple=4096)
    known.on(0).kv_request[view.data_ptr()] = view.nbytes  # only the view is known
    known.on(0).weights[weight.data_ptr()] = weight.nbytes
    torch.cuda.synchronize()
    segs = [s for s in torch.cuda.memory_snapshot() if s["device"] == 0]
    totals = ow.classify_segments(segs, known, 0)
    allocated = torch.cuda.memory_allocated(0)
    assert sum(t.bytes for o, t in totals.items() if o != Owner.INACTIVE) == _active(segs) == allocated
    assert totals[Owner.KV_REQUEST].bytes >= kv.nbytes  # the view names the block of its whole storage
    assert totals[Owner.WEIGHTS].blocks == 1
    assert totals[Owner.KV_COPIES].largest >= copy.nbytes
    assert any(x["requested_bytes"] == odd.nbytes for x in totals[Owner.UNKNOWN].top)
    del kv, view, weight, odd, copy


def test_cublas_workspace_is_found_once_after_the_first_matmul() -> None:
    a = torch.randn(256, 256, device="cuda", dtype=torch.float16)
    (a @ a).sum().item()
    torch.cuda.synchronize()
    cc = torch.cuda.get_device_capability(0)[0]
    known = ow.KnownMemory(workspaces=ow.workspace_candidates(cc))
    totals = ow.classify_segments([s for s in torch.cuda.memory_snapshot() if s["device"] == 0], known, 0)
    ws = totals.get(Owner.WORKSPACE)
    sizes = sorted({b["requested_size"] for s in torch.cuda.memory_snapshot() for b in s["blocks"]
                    if b["state"] == "active_allocated"}, reverse=True)[:8]
    print(f"\ncompute capability {cc}; workspace candidates {ow.workspace_candidates(cc)}; "
          f"found {ws.extra if ws else None}; largest active requested sizes {sizes}")
    assert ws is not None and ws.blocks >= 1 and ws.bytes <= 2 * ow.cublas_workspace_bytes(cc, None)


@pytest.mark.parametrize("blocks", [1_000, 10_000, 50_000])
def test_snapshot_cost_at_realistic_block_counts(blocks: int) -> None:
    """Printed, not asserted: the cost of one owner reading (snapshot + classification)."""
    held = [torch.empty(4096 + 512 * (i % 97), dtype=torch.uint8, device="cuda") for i in range(blocks)]
    torch.cuda.synchronize()
    known = ow.KnownMemory(kv_units={4096}, kv_max_multiple=1 << 16)
    for t in held[::50]:
        known.on(0).kv_request[t.data_ptr()] = t.nbytes
    t0 = time.perf_counter()
    segs = torch.cuda.memory_snapshot()
    t1 = time.perf_counter()
    totals = ow.classify_segments([s for s in segs if s["device"] == 0], known, 0)
    t2 = time.perf_counter()
    n = sum(len(s["blocks"]) for s in segs)
    print(f"\n{n:,} blocks in {len(segs):,} segments: memory_snapshot {1e3 * (t1 - t0):.1f} ms, "
          f"classify {1e3 * (t2 - t1):.1f} ms")
    assert sum(t.blocks for o, t in totals.items() if o != Owner.INACTIVE) >= blocks
    held.clear()


def test_copies_and_temporaries_told_apart_with_allocation_sites(tmp_path) -> None:
    m = _model()
    kept: list = []

    def clones(module, args, kwargs, output):
        cache = cache_of_output(output)
        if cache is not None and len(kept) < 400:
            kept.extend(t.clone() for layer in cache.layers for t in (layer.keys, layer.values))

    h = m.register_forward_hook(clones, with_kwargs=True)
    path = tmp_path / "copies.kvt.h5"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with kvtrace.record(m, path, memory_history=True, telemetry_hz=50):
            _gen(m)
    h.remove()
    r = kvtrace.analyze(path)
    dup = [f for f in r.result("growth_curve").findings if f.kind == "duplication"]
    assert dup and dup[0].score >= 0.5 and "sized like the cache's own K/V" in dup[0].message, \
        [(f.kind, f.score, f.message) for f in r.findings]
    assert "test_owners_gpu.py" in dup[0].message  # the clone's line, from memory history
    kept.clear()

    temps: list = []

    def odd(module, args, output):
        temps.append(torch.empty(1_000_003 * 3, dtype=torch.uint8, device="cuda"))

    h = m.register_forward_hook(odd)
    path2 = tmp_path / "odd.kvt.h5"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with kvtrace.record(m, path2, memory_history=True, telemetry_hz=50):
            _gen(m)
    h.remove()
    r2 = kvtrace.analyze(path2)
    gc_f = r2.result("growth_curve").findings
    assert not [f for f in gc_f if f.kind == "duplication" and f.score > 0.1], [(f.kind, f.message) for f in gc_f]
    named = [f for f in gc_f if f.kind == "unexplained_memory_growth"]
    assert named and named[0].score >= 0.5 and "test_owners_gpu.py" in named[0].message, named
    temps.clear()


def test_kept_exception_and_clean_error_on_gpu(tmp_path) -> None:
    from transformers import StoppingCriteria

    class Boom(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            if input_ids.shape[-1] >= 40:
                raise ValueError("boom")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    m = _model()
    path = tmp_path / "exc.kvt.h5"
    with kvtrace.record(m, path):
        try:
            _gen(m, stopping_criteria=[Boom()])
        except ValueError as exc:
            HELD.append(exc)
        try:
            _gen(m, stopping_criteria=[Boom()])
        except ValueError as exc:
            str(exc)  # dropped: the second request's cache is freed
        _gen(m, new=4)
    HELD.clear()
    r = kvtrace.analyze(path)
    by = {f.requests[0]: f for f in r.result("post_eos").findings}
    assert by[0].kind == "retained_after_request" and by[0].score >= 0.5 and "traceback" in by[0].message
    assert 1 not in by or by[1].severity < Severity.LOW, by.get(1)
    rows = _owner_rows(path)
    end0 = rows[(rows["request"] == 0) & (rows["moment"] == int(OwnerMoment.REQUEST_END))]
    assert int(end0[end0["owner"] == int(Owner.KV_REQUEST)]["bytes"].sum()) > 0


def test_scores_on_a_large_vocabulary_are_by_design(tmp_path) -> None:
    m = _model(vocab_size=131072)
    path = tmp_path / "scores.kvt.h5"
    with kvtrace.record(m, path):
        out = _gen(m, new=128, return_dict_in_generate=True, output_scores=True, output_logits=True)
        scores = out.scores
        del out
        _gen(m, new=4)
    del scores
    r = kvtrace.analyze(path)
    assert not [f for f in r.findings if f.severity >= Severity.LOW], [(f.detector, f.kind, f.score, f.message)
                                                                       for f in r.findings if f.score > 0.1]
    req = [f for f in r.result("growth_curve").findings if f.kind == "requested_outputs"]
    assert req and "output_scores" in req[0].message


def test_oom_post_mortem_names_the_owners(tmp_path) -> None:
    m = _model(max_position_embeddings=8192)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((base + 1536 * MiB) / total)
    kept: list = []
    path = tmp_path / "oom.kvt.h5"
    try:
        with kvtrace.record(m, path):
            for _ in range(64):
                try:
                    kept.append(_gen(m, prompt=4000, new=4, return_dict_in_generate=True))
                except torch.OutOfMemoryError:
                    break
    finally:
        kept.clear()
        torch.cuda.set_per_process_memory_fraction(1.0)
        gc.collect()
        torch.cuda.empty_cache()
    r = kvtrace.analyze(path)
    (f,) = r.result("oom").findings
    assert "who held it" in f.message and "KV of earlier requests" in f.message, f.message
    print("\n" + f.message)


def test_memory_viz_export_of_a_gpu_trace_loads_in_torch(tmp_path) -> None:
    from torch.cuda import _memory_viz

    from kvtrace.export.memory_viz import write_memory_viz

    m = _model()
    path = tmp_path / "kept.kvt.h5"
    with kvtrace.record(m, path):
        HELD.append(_gen(m, return_dict_in_generate=True))
        _gen(m, new=4)
    HELD.clear()
    out, info = write_memory_viz(path, tmp_path / "s.pickle", request=0, moment="request_end")
    import pickle

    data = pickle.loads(out.read_bytes())
    _memory_viz.segsum(data)
    assert "owner: KV of request" in _memory_viz.memory(data, format_flamegraph=lambda x: x)
    assert info["device"] == 0
