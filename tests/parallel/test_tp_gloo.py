"""Tensor parallel on the CPU (transformers tp_plan="auto", gloo, 2 ranks): each rank records its own
trace and `kvtrace analyze run.rank*.kvt.h5` reads them as one recording."""

from __future__ import annotations

import json
import shutil

import h5py
import pytest

from kvtrace.format.reader import Trace
from tests.helpers.cli_run import run_main

pytestmark = pytest.mark.slow  # two ranks record under gloo once for the module: ~13 s before any test


def _ranks(tp_run):
    return [str(tp_run / f"run.rank{r}.kvt.h5") for r in (0, 1)]


def test_each_rank_records_its_shard(tp_run):
    metas = []
    for r, path in enumerate(_ranks(tp_run)):
        with Trace(path) as t:
            par = t.meta.extra["parallel"]
            kv = t.kv[:]
        metas.append(par)
        assert par["mode"] == "tensor_parallel" and par["rank"] == r and par["world_size"] == 2
        assert par["backend"] == "gloo" and par["run_id"] == "tp-cpu-test"
        assert par["kv_heads_total"] == 4 and par["kv_heads_local"] == 2
        assert "model.layers.*.self_attn.k_proj" in par["tp_plan"]
        assert set(kv["k_shape"][:, 1].tolist()) == {2}  # the cache holds 2 of the 4 heads
    assert not (tp_run / "run.kvt.h5").exists()  # no rank wrote the untemplated path


def test_analyze_reads_the_ranks_as_one(tp_run, capsys):
    code, out, err = run_main(["analyze", *_ranks(tp_run), "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    (rs,) = doc["rank_sets"]
    assert rs["world_size"] == 2 and rs["missing_ranks"] == [] and rs["ranks_present"] == [0, 1]
    assert rs["model_kv_heads_per_layer"] == 4 and rs["kv_heads_sum"] == 4
    for req in rs["requests"]:  # per-rank bytes add up to the model's at the same tokens
        by_rank = list(req["final_kv_bytes_by_rank"].values())
        assert len(by_rank) == 2 and by_rank[0] == by_rank[1]
        assert req["final_kv_bytes_sum"] == req["model_kv_bytes"] and req["adds_up"] is True
    kinds = {f["kind"]: f for f in rs["findings"]}
    assert kinds["rank_retention"]["ranks"] == [1] and kinds["rank_retention"]["severity"] == "critical"
    assert "kv_imbalance" not in kinds and "kv_heads_mismatch" not in kinds and "kv_bytes_mismatch" not in kinds
    # each rank's own report: measured against its shard (no density mismatch), retention only on rank 1
    reports = {r["trace"]["parallel"]["rank"]: r for r in doc["reports"]}
    for rank, rep in reports.items():
        found = {(f["detector"], f["kind"]) for f in rep["findings"]}
        assert ("cache_density", "density_mismatch") not in found
        assert (("post_eos", "retained_after_request") in found) == (rank == 1)


def test_fail_on_sees_rank_set_findings(tp_run, capsys):
    code, _, _ = run_main(["analyze", *_ranks(tp_run), "--fail-on", "critical", "-q"], capsys)
    assert code == 3


def test_one_rank_alone_is_one_trace_with_a_note(tp_run, capsys):
    code, out, err = run_main(["analyze", _ranks(tp_run)[0], "--json"], capsys)
    assert code == 0
    assert "rank_sets" not in json.loads(out)
    assert "rank 0 of 2" in err and "run.rank*.kvt.h5" in err


def _set_parallel(path, **changes):
    with h5py.File(path, "r+") as f:
        par = json.loads(f["meta"].attrs["parallel_json"])
        par.update(changes)
        f["meta"].attrs["parallel_json"] = json.dumps(par, sort_keys=True)


def test_missing_rank_is_named(tp_run, tmp_path, capsys):
    """Ranks 0 and 2 of a world of 3: rank 1's file is not given."""
    a, b = tmp_path / "run.rank0.kvt.h5", tmp_path / "run.rank2.kvt.h5"
    shutil.copy(_ranks(tp_run)[0], a)
    shutil.copy(_ranks(tp_run)[1], b)
    _set_parallel(a, world_size=3)
    _set_parallel(b, world_size=3, rank=2)
    code, out, err = run_main(["analyze", str(a), str(b), "--json"], capsys)
    assert code == 0
    (rs,) = json.loads(out)["rank_sets"]
    assert rs["missing_ranks"] == [1]
    missing = [f for f in rs["findings"] if f["kind"] == "missing_ranks"]
    assert missing and missing[0]["ranks"] == [1] and missing[0]["severity"] == "critical"
    assert "rank trace(s) 1 of world size 3 not given" in err


def test_calc_tp_agrees_with_each_rank(tp_run, capsys):
    for path in _ranks(tp_run):  # one rank: the trace check is against its shard
        code, out, err = run_main(["calc", "--trace", path, "--context", "64", "--gpu-memory", "1GiB", "--tp", "2",
                                   "--json"], capsys)
        assert code == 0, err
        doc = json.loads(out)
        assert doc["trace_check"]["equal"] is True
        assert doc["kv_heads_per_rank"] == {"full": 2}
    both = [a for p in _ranks(tp_run) for a in ("--trace", p)]
    code, out, err = run_main(["calc", *both, "--context", "64", "--gpu-memory", "1GiB", "--json"], capsys)
    assert code == 0, err
    rc = json.loads(out)["rank_check"]  # --tp defaults to the world size of the rank traces
    assert rc["tp"] == 2 and rc["agrees"] is True
    assert [(r["rank"], r["kv_heads_recorded"], r["measured_bytes"] == r["predicted_bytes"]) for r in rc["ranks"]] == [
        (0, 2, True), (1, 2, True)]
    code, out, err = run_main(["calc", *both, "--context", "64", "--gpu-memory", "1GiB", "--tp", "4"], capsys)
    assert code == 0 and "rank check: --tp 4" in out and "DIFFERS" in out


def test_calc_refuses_traces_of_other_kinds(tp_run, tmp_path, capsys):
    import kvtrace
    from tests.helpers.models import tiny_model, tiny_prompt

    m = tiny_model("llama")
    with kvtrace.record(m, tmp_path / "single.kvt.h5"):
        m.generate(tiny_prompt(4), max_new_tokens=2, min_new_tokens=2, do_sample=False)
    code, _, err = run_main(["calc", "--trace", _ranks(tp_run)[0], "--trace", str(tmp_path / "single.kvt.h5"),
                             "--context", "64", "--gpu-memory", "1GiB"], capsys)
    assert code == 64 and "not a tensor-parallel rank trace" in err


def _without_retention(src, dst, run_id):
    """A copy of a rank trace whose /retention table is emptied (nothing outlived its request) and
    whose run_id is changed: the 'before' run of a diff."""
    shutil.copy(src, dst)
    with h5py.File(dst, "r+") as f:
        f["retention"].resize((0,))
    _set_parallel(dst, run_id=run_id)


def test_diff_two_runs_rank_by_rank(tp_run, tmp_path, capsys):
    before = [tmp_path / f"before.rank{r}.kvt.h5" for r in (0, 1)]
    for src, dst in zip(_ranks(tp_run), before, strict=True):
        _without_retention(src, dst, "before")
    code, out, err = run_main(["diff", *map(str, before), *_ranks(tp_run), "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert [r["rank"] for r in doc["ranks"]] == [0, 1] and doc["unmatched_ranks"] == {"a": [], "b": []}
    appeared = {(f["kind"], tuple(f["ranks"])) for f in doc["rank_findings"]["appeared"]}
    assert ("rank_retention", (1,)) in appeared
    per_rank = {r["rank"]: {f["kind"] for f in r["diff"]["findings"]["appeared"]} for r in doc["ranks"]}
    assert "retained_after_request" in per_rank[1] and "retained_after_request" not in per_rank[0]
    code, out, _ = run_main(["diff", *map(str, before), *_ranks(tp_run)], capsys)
    assert code == 0 and "rank 1" in out and "rank_balance appeared" in out


def test_diff_refuses_a_mix(tp_run, tmp_path, capsys):
    code, _, err = run_main(["diff", *_ranks(tp_run), _ranks(tp_run)[0]], capsys)
    assert code == 64 and "two runs" in err


def test_info_summarises_the_run(tp_run, capsys):
    code, out, err = run_main(["info", *_ranks(tp_run), "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert [t["parallel"]["rank"] for t in doc["traces"]] == [0, 1]
    (rs,) = doc["rank_sets"]
    assert rs["kv_heads_sum"] == 4 and rs["missing_ranks"] == []
    code, out, _ = run_main(["info", _ranks(tp_run)[1]], capsys)
    assert code == 0 and "tensor parallel: rank 1 of 2 (gloo), run tp-cpu-test, 2 of 4 KV heads" in out


def test_report_writes_a_run_page_and_a_page_per_rank(tp_run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "run.html"
    code, stdout, err = run_main(["report", *_ranks(tp_run), "-o", str(out), "--json"], capsys)
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc["report"] == str(out) and set(doc["rank_pages"]) == {"0", "1"}
    page = out.read_text()
    assert "run.rank1.html" in page and "rank_retention" in page and "adds up" in page
    assert (tmp_path / "run.rank0.html").stat().st_size > 10_000  # a full single-trace report
    code, _, err = run_main(["report", *_ranks(tp_run), "-o", _ranks(tp_run)[0]], capsys)
    assert code != 0 and not (tp_run / "run.rank0.html").exists()  # never overwrites an input
