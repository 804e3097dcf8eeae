"""The recorder's view of a model spread over devices and processes (/meta parallel_json, §3.1)."""

from __future__ import annotations

import pytest
import torch

import kvtrace
from kvtrace.format.reader import Trace
from kvtrace.recorder import parallel
from tests.helpers.models import tiny_model, tiny_prompt


@pytest.mark.parametrize(("path", "rank", "want"), [
    ("out/run.kvt.h5", 1, "out/run.rank1.kvt.h5"),
    ("out/run.h5", 0, "out/run.rank0.h5"),
    ("out/run-{rank}.kvt.h5", 3, "out/run-3.kvt.h5"),
    ("out/run.rank2.kvt.h5", 2, "out/run.rank2.kvt.h5"),  # the caller templated it already
    ("out/trace", 1, "out/trace.rank1"),
])
def test_rank_path(path, rank, want):
    assert parallel.rank_path(path, rank) == want


def test_rank_path_outside_distributed_is_unchanged():
    assert parallel.distributed() is None
    assert parallel.rank_path("run.kvt.h5") == "run.kvt.h5"


def test_one_device_model_has_no_parallel_meta(tmp_path):
    m = tiny_model("llama")
    assert parallel.describe(m) is None
    with kvtrace.record(m, tmp_path / "one.kvt.h5"):
        m.generate(tiny_prompt(4), max_new_tokens=2, min_new_tokens=2, do_sample=False)
    with Trace(tmp_path / "one.kvt.h5") as t:
        assert "parallel" not in t.meta.extra


def test_device_map_cpu_and_disk_offload(tmp_path):
    """accelerate's dispatch_model with layer 1 offloaded to disk (weights on meta, run on the CPU):
    the map is in /meta and every layer's KV rows say where the cache lives (the CPU: -1)."""
    accelerate = pytest.importorskip("accelerate")
    m = tiny_model("llama")
    dmap = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
            "model.layers.1": "disk", "model.norm": "cpu", "lm_head": "cpu"}
    m = accelerate.dispatch_model(m, device_map=dmap, offload_dir=str(tmp_path / "offload"), main_device="cpu")
    assert m.model.layers[1].self_attn.k_proj.weight.device.type == "meta"  # really offloaded
    path = tmp_path / "dm.kvt.h5"
    with kvtrace.record(m, path):
        m.generate(tiny_prompt(6), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    with Trace(path) as t:
        par = t.meta.extra["parallel"]
        kv = t.kv[:]
    assert par["mode"] == "device_map"
    assert par["device_map"]["model.layers.1"] == "disk" and par["device_map"]["model.layers.0"] == "cpu"
    assert sorted(set(kv["layer"].tolist())) == [0, 1]
    assert set(kv["device"].tolist()) == {-1}


def test_device_map_values_are_named_devices():
    assert parallel._placements({"a": 0, "b": 1, "c": "cpu", "d": "disk", "e": torch.device("cuda", 2)}) == {
        "a": "cuda:0", "b": "cuda:1", "c": "cpu", "d": "disk", "e": "cuda:2"}
