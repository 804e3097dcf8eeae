"""Models spread over devices on real GPUs (device_map and tensor parallel).

One GPU:   python -m pytest tests/gpu/test_parallel_gpu.py -m gpu -q
           (device_map across cuda:0 and the CPU, two ways: layers executed on the CPU, and
           layers offloaded to the CPU but executed on cuda:0)
Two GPUs:  the same command on a machine with 2+ GPUs also runs device_map over cuda:0 and cuda:1
           and tensor parallel with nccl under torchrun (tests/parallel/tp_record.py --backend nccl).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("zstandard", reason="the trace writer needs zstandard (carry it to the GPU host)")

import kvtrace  # noqa: E402
from kvtrace.analyzer import analyze  # noqa: E402
from kvtrace.format.reader import Trace  # noqa: E402
from tests.helpers.cli_run import run_main  # noqa: E402
from tests.helpers.models import tiny_prompt  # noqa: E402

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
TP_SCRIPT = Path(__file__).resolve().parents[1] / "parallel" / "tp_record.py"


def _llama4():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, intermediate_size=128,
                               max_position_embeddings=256, vocab_size=256, bos_token_id=1, eos_token_id=2,
                               pad_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _record(model, path, device):
    with kvtrace.record(model, path):
        model.generate(tiny_prompt(12).to(device), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    with Trace(path) as t:
        kv = t.kv[:]
        return t.meta.extra.get("parallel"), {int(r["layer"]): int(r["device"]) for r in kv}


def _map(places):
    rest = {"model.embed_tokens": places[0], "model.rotary_emb": places[0], "model.norm": places[-1],
            "lm_head": places[-1]}
    return {**rest, **{f"model.layers.{i}": p for i, p in enumerate(places)}}


def _accelerate():
    return pytest.importorskip("accelerate", reason="device_map dispatch needs accelerate (carry it to the GPU host)")


def test_device_map_cuda0_and_cpu_executed_there(tmp_path):
    """Layers 0-1 on cuda:0, 2-3 executed on the CPU (main_device cpu): each layer's KV rows carry
    the device it ran on, and capacity judges cuda:0 with only its own layers' KV."""
    accelerate = _accelerate()
    m = accelerate.dispatch_model(_llama4(), device_map=_map([0, 0, "cpu", "cpu"]), main_device="cpu")
    par, where = _record(m, tmp_path / "dm.kvt.h5", "cpu")
    assert par["mode"] == "device_map"
    assert par["device_map"]["model.layers.0"] == "cuda:0" and par["device_map"]["model.layers.3"] == "cpu"
    assert where == {0: 0, 1: 0, 2: -1, 3: -1}
    rep = analyze(tmp_path / "dm.kvt.h5")
    cap = [f for f in rep.findings if f.detector == "capacity"]
    assert cap and cap[0].device == 0 and cap[0].layers == [0, 1]
    assert cap[0].evidence["kv_on_cpu_bytes"].value > 0


def test_device_map_cpu_offload_executes_on_cuda0(tmp_path):
    """accelerate's CPU offload (main_device cuda:0): weights of layers 2-3 live on the CPU but run
    on cuda:0, so all KV is on cuda:0; the map still says where the weights are."""
    accelerate = _accelerate()
    m = accelerate.dispatch_model(_llama4(), device_map=_map([0, 0, "cpu", "cpu"]), main_device=0)
    par, where = _record(m, tmp_path / "off.kvt.h5", "cuda:0")
    assert par["device_map"]["model.layers.2"] == "cpu"
    assert set(where.values()) == {0}


@two_gpus
def test_device_map_over_two_gpus(tmp_path):
    accelerate = _accelerate()
    m = accelerate.dispatch_model(_llama4(), device_map=_map([0, 0, 1, 1]))
    par, where = _record(m, tmp_path / "two.kvt.h5", "cuda:0")
    assert where == {0: 0, 1: 0, 2: 1, 3: 1}
    assert par["device_map"]["model.layers.2"] == "cuda:1"
    with Trace(tmp_path / "two.kvt.h5") as t:
        assert sorted({int(r["device"]) for r in t.readings[:]} - {-1}) == [0, 1]  # readings per GPU
    rep = analyze(tmp_path / "two.kvt.h5")
    cap = [f for f in rep.findings if f.detector == "capacity"]
    assert cap and cap[0].evidence["devices_judged"].value == 2
    assert {f.device for f in rep.findings if f.detector == "fragmentation"} >= {0, 1}


@two_gpus
def test_tensor_parallel_nccl_two_ranks(tmp_path, capsys):
    env = {**os.environ, "KVTRACE_RUN_ID": "tp-nccl-test", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(TP_SCRIPT),
           "--out", str(tmp_path), "--backend", "nccl", "--keep-output-rank", "1"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = [str(tmp_path / f"run.rank{r}.kvt.h5") for r in (0, 1)]
    code, out, err = run_main(["analyze", *ranks, "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    (rs,) = doc["rank_sets"]
    assert rs["kv_heads_sum"] == 4 and all(r["adds_up"] for r in rs["requests"])
    assert [r["devices"] for r in rs["ranks"]] == [[0], [1]]  # each rank on its own GPU
    assert all(r["max_allocated_bytes"] is not None for r in rs["ranks"])  # allocator telemetry per rank
    kinds = {f["kind"]: f for f in rs["findings"]}
    assert kinds["rank_retention"]["ranks"] == [1]
    code, out, _ = run_main(["calc", *[a for p in ranks for a in ("--trace", p)], "--context", "64",
                             "--gpu-memory", "80GiB", "--json"], capsys)
    assert code == 0 and json.loads(out)["rank_check"]["agrees"] is True
