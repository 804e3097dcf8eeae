"""Rank sets that disagree never pass silently (rank files are data someone else may have made).

Two different files that both claim rank 0 of a 2-rank run were read as one rank "analysed alone":
analyze reported no rank set, no missing rank 1, no duplicate, and exited 0 even with
``--fail-on critical``. Every command that reads rank sets now names the duplicate and the rank it
leaves missing and exits 1 (analyze, info and diff after their output; report and calc --trace
before writing anything). One file given twice on the command line is the user's slip: 64.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import serving_parallel_traces as H

from kvtrace import exitcodes
from tests.helpers.cli_run import run_main


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("ranks")
    other = {**H.rank_parallel(0), "run_id": "another-run"}
    return {
        "a0": H.rank_trace(d / "a.rank0.kvt.h5", 0), "b0": H.rank_trace(d / "b.rank0.kvt.h5", 0),
        "a1": H.rank_trace(d / "a.rank1.kvt.h5", 1),
        "c0": H.rank_trace(d / "c.rank0.kvt.h5", 0, other), "c1": H.rank_trace(d / "c.rank1.kvt.h5", 1,
                                                                              {**other, "rank": 1, "local_rank": 1}),
        "w3": H.rank_trace(d / "w3.rank1.kvt.h5", 1, {**H.rank_parallel(1), "world_size": 3}),
        "dir": d,
    }


def _names_both(err: str) -> None:
    line = err.strip().splitlines()[-1]
    assert "rank 0 is given twice" in line and "rank(s) 1 of world size 2 not given" in line, err
    assert "Traceback" not in err


def test_analyze_names_the_duplicate_and_the_missing_rank(ranks, capsys):
    a0, b0 = str(ranks["a0"]), str(ranks["b0"])
    for extra in ([], ["--fail-on", "critical"], ["--quiet"]):
        code, out, err = run_main(["analyze", a0, b0, *extra], capsys)
        assert code == exitcodes.INVALID, (extra, err)
        _names_both(err)
        assert "problem: rank 0 is given twice" in out and "missing 1" in out  # the set's own view
    code, out, err = run_main(["analyze", "--json", a0, b0], capsys)
    assert code == exitcodes.INVALID
    _names_both(err)
    (rs,) = json.loads(out)["rank_sets"]  # the document is still written, with the problem in it
    assert rs["missing_ranks"] == [1] and any("given twice" in p for p in rs["problems"])
    kinds = {f["kind"] for f in rs["findings"]}
    assert {"missing_ranks", "inconsistent_ranks"} <= kinds


def test_info_names_them_after_the_summaries(ranks, capsys):
    code, out, err = run_main(["info", str(ranks["a0"]), str(ranks["b0"])], capsys)
    assert code == exitcodes.INVALID and "MISSING rank(s) 1" in out and "problem: rank 0 is given twice" in out
    _names_both(err)
    code, out, err = run_main(["info", "--json", str(ranks["a0"]), str(ranks["b0"])], capsys)
    assert code == exitcodes.INVALID and json.loads(out)["rank_sets"][0]["missing_ranks"] == [1]


def test_diff_of_a_run_whose_ranks_contradict(ranks, capsys):
    code, _, err = run_main(["diff", str(ranks["a0"]), str(ranks["b0"]), str(ranks["c0"]), str(ranks["c1"])], capsys)
    assert code == exitcodes.INVALID
    _names_both(err)


def test_report_and_calc_refuse_before_writing(ranks, capsys):
    out = ranks["dir"] / "run.html"
    code, _, err = run_main(["report", str(ranks["a0"]), str(ranks["b0"]), "-o", str(out)], capsys)
    assert code == exitcodes.INVALID and not out.exists()
    _names_both(err)
    code, _, err = run_main(["calc", "--trace", str(ranks["a0"]), "--trace", str(ranks["b0"]), "--context", "4k",
                             "--gpu-memory", "80GiB"], capsys)
    assert code == exitcodes.INVALID
    _names_both(err)


def test_world_sizes_that_disagree_exit_1_in_analyze(ranks, capsys):
    code, _, err = run_main(["analyze", str(ranks["a0"]), str(ranks["w3"])], capsys)
    assert code == exitcodes.INVALID and "disagree on the world size" in err and "Traceback" not in err


def test_one_file_given_twice_is_a_usage_error(ranks, capsys):
    a0 = str(ranks["a0"])
    for argv in (["analyze", a0, a0], ["info", a0, a0]):
        code, _, err = run_main(argv, capsys)
        assert code == exitcodes.USAGE and "is given twice: give each rank trace once" in err, (argv, err)


def test_a_whole_set_still_passes(ranks, capsys):
    for argv in (["analyze", str(ranks["a0"]), str(ranks["a1"])], ["info", str(ranks["a0"]), str(ranks["a1"])],
                 ["diff", str(ranks["a0"]), str(ranks["a1"]), str(ranks["c0"]), str(ranks["c1"])]):
        code, _, err = run_main(argv, capsys)
        assert code == 0, (argv, err)
