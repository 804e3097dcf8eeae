"""The /state table (format 1.5, spec §4.18, §7) read from committed hybrid recordings
(tests/data/hybrid_cpu, made by its make_hybrid_fixtures.py): valid as recorded, its rows consistent
with their shapes, and every §7 rule refused when broken, by validate and by the commands reading it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from serving_parallel_traces import damaged, set_rows

from kvtrace.format import schema
from kvtrace.format.errors import InvalidTrace
from kvtrace.format.reader import Trace
from kvtrace.format.state_rules import checked_state, state_block_problems
from kvtrace.format.validate import validate
from tests.helpers.cli_run import run_main

DATA = Path(__file__).resolve().parents[1] / "data" / "hybrid_cpu"
FIXTURES = sorted(DATA.glob("*.kvt.h5"))


def test_fixtures_exist():
    assert {p.name.split(".")[0] for p in FIXTURES} >= {"qwen3_next", "falcon_h1", "jamba", "lfm2", "minimax"}


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.name)
def test_recorded_state_is_valid_and_consistent(path):
    report = validate(path)
    assert report.valid, report.problems
    with Trace(path) as t:
        assert t.version == "1.5"
        rows = checked_state(t)
        steps = t.steps[:]
    assert rows.size and not state_block_problems(rows)
    # a row at every structure step, the same bytes at each (the state does not grow)
    keys = {(int(r), int(s)) for r, s in zip(steps["request"], steps["step"], strict=True)}
    assert {(int(r), int(s)) for r, s in zip(rows["request"], rows["step"], strict=True)} == keys
    for rid in np.unique(rows["request"]):
        mine = rows[rows["request"] == rid]
        totals = {int(s): int(mine[mine["step"] == s]["bytes_unique"].sum()) for s in np.unique(mine["step"])}
        assert len(set(totals.values())) == 1, totals
    assert set(rows["kind"].tolist()) <= {int(k) for k in schema.StateKind}


@pytest.mark.parametrize(("column", "value", "message"), [
    ("bytes_valid", 1 << 40, "more valid than allocated"),
    ("bytes_unique", 1 << 40, "more unique bytes than their storage"),
    ("ndim", 7, "ndim above 6"),
    ("dtype", int(schema.CacheDType.FLOAT16), "not their shape's elements x item size"),
])
def test_broken_rows_are_refused(tmp_path, capsys, column, value, message):
    bad = damaged(DATA / "qwen3_next.kvt.h5", tmp_path / "bad.kvt.h5", set_rows("state", column, value, [0]))
    report = validate(bad)
    assert any(message in p for p in report.problems), report.problems
    with Trace(bad) as t, pytest.raises(InvalidTrace, match=message):
        checked_state(t)
    rc, _, err = run_main(["info", str(bad)], capsys)
    assert rc == 1 and message in err


def test_state_requests_must_exist(tmp_path):
    bad = damaged(DATA / "lfm2.kvt.h5", tmp_path / "orphan.kvt.h5", set_rows("state", "request", 7, [0]))
    assert any("/state names requests absent from /requests: [7]" in p for p in validate(bad).problems)


def test_a_byte_count_past_the_ceiling_is_refused(tmp_path):
    bad = damaged(DATA / "lfm2.kvt.h5", tmp_path / "huge.kvt.h5", set_rows("state", "bytes_allocated", 1 << 63, [0]))
    assert any("/state bytes_allocated holds" in p for p in validate(bad).problems)


def test_info_prints_the_state(capsys):
    rc, out, _ = run_main(["info", str(DATA / "qwen3_next.kvt.h5")], capsys)
    assert rc == 0
    line = out.split("\nstate      ", 1)[1].split("\npayloads", 1)[0]
    assert "3 layers hold 21.0 KiB of state (conv 9.0 KiB, recurrent 12.0 KiB)" in " ".join(line.split())
    assert "10.5 KiB per sequence (batch 2)" in " ".join(line.split())
