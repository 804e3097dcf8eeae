"""Owner classification of an allocator snapshot and of a CPU tensor census (kvtrace.recorder.owners),
on synthetic snapshots in torch's documented format (torch.cuda.memory._snapshot(): segments with
address, total_size, blocks of address, size, requested_size, state, frames). The GPU tests
(tests/gpu/test_owners_gpu.py) run the same code on real snapshots."""

from __future__ import annotations

import json

import pytest

from kvtrace.format.schema import Owner, OwnerMoment
from kvtrace.recorder import owners as ow

MiB = 1 << 20
KiB = 1 << 10


def _seg(address: int, blocks: list[tuple[int, str, int | None, list | None]], device: int = 0) -> dict:
    """A segment of consecutive blocks: (size, state, requested_size, frames)."""
    out, addr = [], address
    for size, state, req, frames in blocks:
        b = {"address": addr, "size": size, "requested_size": req if req is not None else size, "state": state}
        if frames is not None:
            b["frames"] = frames
        out.append(b)
        addr += size
    total = addr - address
    return {"device": device, "address": address, "total_size": total, "stream": 0, "segment_type": "large",
            "allocated_size": sum(b["size"] for b in out if b["state"] == "active_allocated"),
            "active_size": sum(b["size"] for b in out if b["state"] != "inactive"), "blocks": out}


A = "active_allocated"
def _torch_file(rel: str) -> str:
    try:
        import torch
    except ImportError:
        return "/usr/lib/python3/site-packages/torch/" + rel
    import os

    return os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), rel)


USER_FRAMES = [
    {"filename": _torch_file("nn/functional.py"), "line": 10, "name": "linear"},
    {"filename": "/home/me/serve/leaky.py", "line": 42, "name": "keep_copy"},
    {"filename": "/home/me/serve/main.py", "line": 7, "name": "<module>"},
]


def _known() -> ow.KnownMemory:
    k = ow.KnownMemory()
    base = 0x7F0000000000
    d = k.on(0)
    d.kv_request = {base: 4 * MiB, base + 4 * MiB + 512: 4 * MiB}  # the second is a view, 512 B in
    d.kv_earlier = {base + 16 * MiB: 3}
    d.weights = {base + 32 * MiB: 8 * MiB}
    d.outputs = {base + 40 * MiB: "sequences"}
    k.workspaces = ow.workspace_candidates(9, {})
    # per-token K/V bytes of one layer: batch 2 x 8 heads x 128 dims x 2 bytes = 4 KiB
    k.kv_units = {2 * 8 * 128 * 2}
    k.kv_max_multiple = 2048 * 4 * 2  # 2,048 tokens x 4 layers x (K, V)
    k.output_sizes = {2 * 32000 * 4: "scores/logits"}
    return k


def _snapshot() -> list[dict]:
    base = 0x7F0000000000
    seg1 = _seg(base, [
        (4 * MiB, A, None, None),  # kv_request (identity)
        (4 * MiB + 2 * MiB, A, 4 * MiB + 2 * MiB, None),  # a storage starts 512 B inside: kv_request (view)
        (6 * MiB, "inactive", None, None),
        (16 * MiB, A, None, None),  # kv_earlier
    ])
    seg2 = _seg(base + 32 * MiB, [
        (8 * MiB, A, None, None),  # weights
        (2 * MiB, A, 2 * 1000 * 8, None),  # generate output sequences (identity; rounded block)
        (32 * MiB, A, 32 * MiB, None),  # the cuBLAS workspace (once)
        (32 * MiB, A, 32 * MiB, None),  # the cuBLASLt workspace (unified size, once)
        (32 * MiB, A, 32 * MiB, USER_FRAMES),  # a third 32 MiB block: 32 MiB / 4 KiB = 8192 tokens = copy
        (2 * 32000 * 4, A, 2 * 32000 * 4, None),  # a score row the call asked for
        (300 * 4 * KiB, A, 300 * 4 * KiB, USER_FRAMES),  # a KV-sized copy of 300 tokens
        (1 * MiB + 512, A, 1 * MiB + 100, USER_FRAMES),  # odd-sized: unknown
        (3 * MiB, "inactive", None, None),
    ])
    return [seg1, seg2, _seg(base + 512 * MiB, [(2 * MiB, A, 2 * MiB - 1000, None)], device=1)]


def test_every_active_block_has_exactly_one_owner() -> None:
    segs = _snapshot()
    totals = ow.classify_segments([s for s in segs if s["device"] == 0], _known(), 0)
    active = sum(b["size"] for s in segs if s["device"] == 0 for b in s["blocks"] if b["state"] == A)
    reserved = sum(s["total_size"] for s in segs if s["device"] == 0)
    assert sum(t.bytes for o, t in totals.items() if o != Owner.INACTIVE) == active
    assert sum(t.bytes for t in totals.values()) == reserved
    assert totals[Owner.KV_REQUEST].blocks == 2  # the block a view's storage starts inside counts
    assert totals[Owner.KV_EARLIER].extra == {"requests": [3]}
    assert totals[Owner.WEIGHTS].bytes == 8 * MiB
    assert totals[Owner.WORKSPACE].blocks == 2 and totals[Owner.WORKSPACE].bytes == 64 * MiB
    assert sorted(totals[Owner.WORKSPACE].extra["names"]) == ["cuBLAS workspace", "cuBLASLt workspace"]
    out = totals[Owner.GENERATE_OUTPUT]
    assert out.blocks == 2 and sorted(out.extra["fields"]) == ["scores/logits", "sequences"]
    copies = totals[Owner.KV_COPIES]
    assert copies.blocks == 2 and copies.bytes == 32 * MiB + 300 * 4 * KiB
    assert copies.top[0]["at"] == "serve/leaky.py:42 (keep_copy)"  # the user's line, not torch's
    unknown = totals[Owner.UNKNOWN]
    assert unknown.blocks == 1 and unknown.top[0]["requested_bytes"] == 1 * MiB + 100
    assert totals[Owner.INACTIVE].bytes == 9 * MiB


def test_workspaces_are_counted_once_per_device_and_sizes_follow_the_environment() -> None:
    assert ow.cublas_workspace_bytes(9, None) == 32 * MiB
    assert ow.cublas_workspace_bytes(8, None) == 4096 * KiB * 2 + 16 * KiB * 8
    assert ow.cublas_workspace_bytes(9, ":4096:8") == 32 * MiB
    assert ow.cublas_workspace_bytes(9, ":16:8:4096:2") == 16 * KiB * 8 + 8 * MiB
    assert ow.cublas_workspace_bytes(8, "garbage") == 4096 * KiB * 2 + 16 * KiB * 8
    ws = dict(ow.workspace_candidates(9, {"CUBLASLT_WORKSPACE_SIZE": "2048"}))
    assert ws["cuBLASLt workspace"] == (2 * MiB,)
    k = ow.KnownMemory(workspaces=ow.workspace_candidates(8, {}))
    size = 4096 * KiB * 2 + 16 * KiB * 8
    totals = ow.classify_segments([_seg(0x1000, [(size, A, size, None)] * 3)], k, 0)
    assert totals[Owner.WORKSPACE].blocks == 2 and totals[Owner.UNKNOWN].blocks == 1  # cuBLAS + cuBLASLt


def test_small_blocks_are_never_copies_of_kv_and_multiples_are_bounded() -> None:
    k = ow.KnownMemory(kv_units={512}, kv_max_multiple=10)
    totals = ow.classify_segments([_seg(0x1000, [(512 * 8, A, None, None), (512 * 200, A, None, None)])], k, 0)
    # 4 KiB is below the 64 KiB floor; 200 tokens is past tokens x layers x 2 = 10
    assert Owner.KV_COPIES not in totals and totals[Owner.UNKNOWN].blocks == 2
    assert ow.kv_copy_unit(512 * 10, k) == 512 and ow.kv_copy_unit(512 * 10 + 1, k) == 0


def test_other_devices_and_odd_snapshots_do_not_break_the_reading() -> None:
    segs = _snapshot()
    totals = ow.classify_segments([s for s in segs if s["device"] == 1], _known(), 1)
    assert set(totals) == {Owner.UNKNOWN} and totals[Owner.UNKNOWN].bytes == 2 * MiB
    # blocks without address/requested_size (older torch): addresses follow the segment's
    legacy = {"device": 0, "address": 0x2000, "total_size": 4 * MiB,
              "blocks": [{"size": 2 * MiB, "state": A}, {"size": 2 * MiB, "state": "inactive"}]}
    k = ow.KnownMemory()
    k.on(0).weights = {0x2000: 2 * MiB}
    totals = ow.classify_segments([legacy], k, 0)
    assert totals[Owner.WEIGHTS].bytes == 2 * MiB and totals[Owner.INACTIVE].bytes == 2 * MiB
    assert ow.classify_segments([], k, 0) == {}


def test_allocation_site_skips_the_machinery() -> None:
    assert ow.allocation_site(None) == ""
    assert ow.allocation_site(USER_FRAMES) == "serve/leaky.py:42 (keep_copy)"
    only_torch = USER_FRAMES[:1]
    assert ow.allocation_site(only_torch) == "nn/functional.py:10 (linear)"
    assert ow.allocation_site([{"filename": "??", "line": 0, "name": "cudaMalloc"}]) == "??:0 (cudaMalloc)"


def test_rows_carry_the_detail_as_json() -> None:
    totals = ow.classify_segments([s for s in _snapshot() if s["device"] == 0], _known(), 0)
    texts: list[str] = []

    def add_text(s: str) -> tuple[int, int]:
        texts.append(s)
        return len(texts), len(s)

    rows = ow.owner_rows(totals, request=5, step=-1, moment=OwnerMoment.REQUEST_END, device=0, t_ns=7,
                         add_text=add_text)
    assert [r.owner for r in rows] == sorted(int(o) for o in totals)
    by = {Owner(r.owner): r for r in rows}
    assert by[Owner.KV_EARLIER].detail_off and json.loads(texts[by[Owner.KV_EARLIER].detail_off - 1]) == {
        "requests": [3]}
    assert all(r.largest_bytes <= r.bytes and r.blocks >= 1 for r in rows)
    assert by[Owner.WEIGHTS].detail_len == 0


def test_output_sizes_follow_what_the_call_asked_for() -> None:
    eff = {"return_dict_in_generate": True, "output_scores": True, "output_logits": True}
    sizes = ow.output_sizes(eff, batch=2, vocab=131072, hidden=0, heads=0, item=2, prompt=8, tokens=16)
    assert sizes == {2 * 131072 * 4: "scores/logits"}
    assert ow.output_sizes({**eff, "return_dict_in_generate": False}, 2, 131072, 0, 0, 2, 8, 16) == {}
    att = ow.output_sizes({"return_dict_in_generate": True, "output_attentions": True}, 1, 0, 0, 4, 2, 8, 3)
    assert set(att) == {8, 16, 24, 4 * 64 * 2}


def test_cpu_census_names_views_copies_and_outputs() -> None:
    torch = pytest.importorskip("torch")
    k_cache = torch.zeros(1, 2, 10, 16)
    weight = torch.nn.Parameter(torch.zeros(8, 8))
    view = k_cache[:, :, :1]  # a view: the same storage
    copy = k_cache.clone()  # a copy: its own storage, the cache's shape
    stacked = torch.stack([k_cache, k_cache])  # [2, 1, 2, 10, 16]: still KV-shaped
    scores = torch.zeros(1, 50)
    other = torch.zeros(3, 5)
    k = ow.KnownMemory(kv_shapes={(2, 16)}, output_sizes={200: "scores/logits"})
    k.on(-1).kv_request[k_cache.untyped_storage().data_ptr()] = k_cache.untyped_storage().nbytes()
    k.on(-1).weights[weight.untyped_storage().data_ptr()] = 256
    totals = ow.classify_tensors([view, weight, copy, stacked, scores, other, k_cache], k)
    assert totals[Owner.KV_REQUEST].blocks == 1  # the view and the tensor: one storage
    assert totals[Owner.WEIGHTS].bytes == 256
    assert totals[Owner.KV_COPIES].blocks == 2 and totals[Owner.KV_COPIES].extra == {"unit_bytes": ["2x16"]}
    assert totals[Owner.GENERATE_OUTPUT].bytes == 200
    assert totals[Owner.UNKNOWN].bytes == 60


def test_gc_census_finds_a_tensor_held_only_by_a_list() -> None:
    torch = pytest.importorskip("torch")
    held = [torch.full((1, 2, 7, 16), 3.0)]
    found = ow.gc_tensors()
    ptr = held[0].untyped_storage().data_ptr()
    assert any(t.untyped_storage().data_ptr() == ptr for t in found)
    found.clear()


def test_cuda_graph_private_pools_are_named_not_unknown() -> None:
    """transformers' compiled static path captures CUDA graphs: their private pool's blocks (a segment
    whose segment_pool_id is not (0, 0)) are a reservation for replay, not an unknown owner."""
    graph = _seg(0x9000_0000, [(20 * MiB, A, 20 * MiB - 3, None), (2 * MiB, "inactive", None, None)])
    graph["segment_pool_id"] = (1, 0)
    plain = _seg(0xA000_0000, [(5 * MiB + 512, A, 5 * MiB + 100, None)])
    plain["segment_pool_id"] = (0, 0)
    totals = ow.classify_segments([graph, plain], ow.KnownMemory(), 0)
    ws = totals[Owner.WORKSPACE]
    assert ws.bytes == 20 * MiB and ws.extra == {"names": ["CUDA graph pool"], "graph_pool_bytes": 20 * MiB}
    assert totals[Owner.UNKNOWN].bytes == 5 * MiB + 512 and totals[Owner.INACTIVE].bytes == 2 * MiB
