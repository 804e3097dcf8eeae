"""`kvtrace record --tp-plan auto` under torchrun (2 ranks, gloo, CPU): each rank loads its shard
with transformers' tp_plan and writes its own trace, the rank in the name, and the rank traces read
back as one run (analyze's rank set, calc's rank check). Outside torchrun the option is a usage
error before any model loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tp_record import TINY

from kvtrace import exitcodes
from kvtrace.format.reader import Trace
from tests.helpers.cli_run import run_main

ARGS = ["--tp-plan", "auto", "--device", "cpu", "--prompt", "hello there", "--prompt", "a second request",
        "--max-new-tokens", "5", "--min-new-tokens", "5"]


def _torchrun(out: Path, model: str, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KVTRACE_RUN_ID": f"tp-cli-{out.name}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "kvtrace.cli",
           "record", "--model", model, *ARGS, *extra, "-o", str(out / "run.kvt.h5")]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _check_ranks(out: Path, heads_total: int, capsys: pytest.CaptureFixture[str]) -> None:
    ranks = [out / f"run.rank{r}.kvt.h5" for r in (0, 1)]
    assert all(p.is_file() for p in ranks) and not (out / "run.kvt.h5").exists()
    for r, path in enumerate(ranks):
        with Trace(path) as t:
            par = t.meta.extra["parallel"]
            kv = t.kv[:]
            assert len(t.requests[:]) == 2 and t.meta.recorder_settings["cli"]["tp_plan"] == "auto"
        assert (par["mode"], par["rank"], par["world_size"], par["backend"]) == ("tensor_parallel", r, 2, "gloo")
        assert par["run_id"] == f"tp-cli-{out.name}"
        assert (par["kv_heads_total"], par["kv_heads_local"]) == (heads_total, heads_total // 2)
        assert set(kv["k_shape"][:, 1].tolist()) == {heads_total // 2}  # each rank caches half the heads
    code, text, err = run_main(["analyze", *map(str, ranks), "--json"], capsys)
    assert code == 0, err
    (rs,) = json.loads(text)["rank_sets"]
    assert rs["ranks_present"] == [0, 1] and rs["missing_ranks"] == [] and rs["kv_heads_sum"] == heads_total
    assert all(req["adds_up"] for req in rs["requests"]) and len(rs["requests"]) == 2
    code, text, err = run_main(["calc", "--trace", str(ranks[0]), "--trace", str(ranks[1]), "--context", "4k",
                                "--gpu-memory", "80GiB", "--json"], capsys)
    assert code == 0 and json.loads(text)["rank_check"]["agrees"] is True, err


@pytest.mark.slow
def test_preset_recorded_tensor_parallel(tmp_path, capsys):
    proc = _torchrun(tmp_path, "preset:llama-3.1-8b", "--tiny")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stderr.count("request 0: ") == 1  # rank 0 speaks for the run
    for r in (0, 1):  # every rank names its own trace
        assert f"trace   {tmp_path / f'run.rank{r}.kvt.h5'}: 2 request(s)" in proc.stderr
    assert "Traceback" not in proc.stderr
    _check_ranks(tmp_path, 8, capsys)  # llama-3.1-8b: 8 KV heads, 4 per rank


@pytest.mark.slow
def test_local_checkpoint_recorded_tensor_parallel(tmp_path, capsys):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model_dir = tmp_path / "model"
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY)).save_pretrained(model_dir)
    out = tmp_path / "out"
    out.mkdir()
    proc = _torchrun(out, str(model_dir))
    assert proc.returncode == 0, proc.stderr[-4000:]
    _check_ranks(out, TINY["num_key_value_heads"], capsys)


def _never(*args, **kwargs):
    raise AssertionError("the model was loaded despite a refused command line")


BASE = ["record", "--model", "preset:llama-3.1-8b", "--tiny", "--tp-plan", "auto", "--prompt", "x",
        "--max-new-tokens", "2"]


def test_tp_plan_outside_torchrun_is_64(tmp_path, capsys, monkeypatch):
    import kvtrace.commands.record as rec_cmd

    monkeypatch.setattr(rec_cmd, "load_model", _never)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    code, _, err = run_main([*BASE, "-o", str(tmp_path / "run.kvt.h5")], capsys)
    assert code == exitcodes.USAGE and "--tp-plan" in err and "torchrun" in err and err.count("\n") == 1, err
    code, _, err = run_main([*BASE, "--tp-plan", "none", "-o", str(tmp_path / "run.kvt.h5")], capsys)
    assert code == exitcodes.USAGE and "--tp-plan" in err, err


def test_tp_plan_checks_this_ranks_file_and_refuses_metrics(tmp_path, capsys, monkeypatch):
    """Under torchrun, rank 1 checks run.rank1.kvt.h5 (the file it would write), not run.kvt.h5."""
    import kvtrace.commands.record as rec_cmd

    monkeypatch.setattr(rec_cmd, "load_model", _never)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    mine = tmp_path / "run.rank1.kvt.h5"
    mine.write_bytes(b"an earlier recording")
    code, _, err = run_main([*BASE, "-o", str(tmp_path / "run.kvt.h5")], capsys)
    assert code == exitcodes.USAGE and "run.rank1.kvt.h5 already exists" in err, err
    assert mine.read_bytes() == b"an earlier recording"
    code, _, err = run_main([*BASE, "-o", str(tmp_path / "other.kvt.h5"), "--prometheus-textfile",
                             str(tmp_path / "m.prom")], capsys)
    assert code == exitcodes.USAGE and "--tp-plan" in err, err


def test_world_size_not_dividing_the_heads_is_64(tmp_path, capsys, monkeypatch):
    """3 ranks over llama-3.1-8b's 8 KV / 32 attention heads: refused before the load (it loaded,
    then generate failed in a reshape on every rank: exit 70 three times)."""
    import kvtrace.commands.record as rec_cmd

    monkeypatch.setattr(rec_cmd, "load_model", _never)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    code, _, err = run_main([*BASE, "-o", str(tmp_path / "run.kvt.h5")], capsys)
    assert code == exitcodes.USAGE and "3 ranks do not split the model's heads evenly (8, 32" in err, err
    monkeypatch.setenv("WORLD_SIZE", "4")  # the control: 4 divides both (the load is reached)
    _, _, err = run_main([*BASE, "-o", str(tmp_path / "run.kvt.h5")], capsys)
    assert "the model was loaded" in err  # _never's own failure, past every check


def test_torchrun_without_tp_plan_is_64(tmp_path, capsys, monkeypatch):
    """Two processes recording one model each wrote the same -o file at once."""
    import kvtrace.commands.record as rec_cmd

    monkeypatch.setattr(rec_cmd, "load_model", _never)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = [a for a in BASE if a not in ("--tp-plan", "auto")]
    code, _, err = run_main([*argv, "-o", str(tmp_path / "run.kvt.h5")], capsys)
    assert code == exitcodes.USAGE and "rank 1 of 2 (torchrun) without --tp-plan" in err, err
