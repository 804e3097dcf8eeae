"""Tensor parallel recorded on real GPUs: two H200s, NCCL, torchrun (bench/run_multigpu.sh,
transformers 5.17, torch 2.11; raw log bench/results/multigpu_h200x2.log). The two rank traces are
committed so the analyser is checked on real NCCL rank files, with real NVML and allocator telemetry
per GPU, on every CI run."""

from __future__ import annotations

import json
from pathlib import Path

from kvtrace.analyzer.ranks import parallel_of
from kvtrace.format.reader import Trace
from tests.helpers.cli_run import run_main

DATA = Path(__file__).resolve().parents[1] / "data" / "parallel_h200"
RANKS = [str(DATA / f"run.rank{r}.kvt.h5") for r in (0, 1)]


def test_each_rank_file_is_its_own_gpu_and_shard():
    for rank, path in enumerate(RANKS):
        with Trace(path) as t:
            par = parallel_of(t.meta)
            assert par["mode"] == "tensor_parallel" and par["backend"] == "nccl"
            assert (par["rank"], par["world_size"]) == (rank, 2)
            assert (par["kv_heads_local"], par["kv_heads_total"]) == (2, 4)
            assert set(t.kv[:]["device"].tolist()) == {rank}  # each rank's KV lives on its own GPU
            assert t.nvml[:].size and t.allocator[:].size  # real per-GPU telemetry
    with Trace(RANKS[0]) as a, Trace(RANKS[1]) as b:
        assert parallel_of(a.meta)["run_id"] == parallel_of(b.meta)["run_id"]


def test_analyze_reads_the_nccl_run_as_one_balanced_run(capsys):
    code, out, err = run_main(["analyze", *RANKS, "--json"], capsys)
    assert code == 0, err
    (rs,) = json.loads(out)["rank_sets"]
    assert rs["world_size"] == 2 and rs["ranks_present"] == [0, 1] and rs["missing_ranks"] == []
    assert rs["kv_heads_sum"] == rs["model_kv_heads_per_layer"] == 4
    assert rs["requests"] and all(r["adds_up"] is True for r in rs["requests"])
    kinds = {f["kind"] for f in rs["findings"]}
    assert kinds == {"balanced"}, kinds  # a clean run: no imbalance, retention or outcome finding


def test_calc_tp2_agrees_with_the_nccl_ranks_and_tp4_does_not(capsys):
    both = [a for p in RANKS for a in ("--trace", p)]
    code, out, err = run_main(["calc", *both, "--context", "4k", "--gpu-memory", "141GB", "--json"], capsys)
    assert code == 0, err
    rc = json.loads(out)["rank_check"]
    assert rc["tp"] == 2 and rc["agrees"] is True
    code, out, _ = run_main(["calc", *both, "--context", "4k", "--gpu-memory", "141GB", "--tp", "4"], capsys)
    assert code == 0 and "DIFFERS" in out
