"""Format 1.4 continuous-batching tables (/sched, /sched_groups, /blocks) and serving event kinds:
optional (older traces read as empty), validated (free <= pool, shared <= blocks, /blocks requests
exist), summarised by `kvtrace info`, and read through the Trace (sched, blocks, phases, cb_requests)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fmt_helpers import request_row

from kvtrace.format import DeviceInfo, TraceWriter, schema
from kvtrace.format.joins import CB_REQUESTS
from kvtrace.format.reader import Trace
from kvtrace.format.summary import summarize
from kvtrace.format.validate import validate
from tests.helpers.cli_run import run_main

OLD = Path(__file__).resolve().parents[1] / "data" / "gpu_gemma3_tiny.kvt.h5"  # written before 1.4's tables
K = schema.EventKind
POOL, BLOCK = 64 * 4096, 4096


def _write(path: Path, *, free: int = POOL - 3 * BLOCK, shared: int = 0, orphan: bool = False,
           group_free: int = 1) -> Path:
    with TraceWriter(path, {"model_id": "test/cb", "model_type": "llama"}, [DeviceInfo(-1, "cpu", -1)]) as w:
        for rid, cb in ((0, "req_0"), (1, "req_1")):
            off, n = w.add_text(json.dumps({"cb_request_id": cb, "manager": 0, "max_new_tokens": 4}))
            w.begin_request(request_row(rid)._replace(start_ns=100 + rid, gen_args_off=off, gen_args_len=n))
            w.update_request(rid, outcome=int(schema.Outcome.OK), new_tokens=4, end_ns=900)

        def ev(t: int, kind: K, rid: int = -1, value: int = 0, text: str = "") -> None:
            off, n = w.add_text(text) if text else (0, 0)
            w.append("events", schema.EventRow(t, int(kind), rid, 0, -1, -1, value, off, n))

        ev(50, K.PHASE, value=0, text="baseline")
        ev(150, K.PHASE, value=1, text="concurrent")
        for rid in (0, 1):
            ev(200 + rid, K.SCHEDULED, rid, 1)
            ev(300 + rid, K.FIRST_TOKEN, rid)
        ev(400, K.PREEMPTED, 1, 7, "soft reset")
        ev(450, K.SCHEDULED, 1, 2)
        ev(210, K.PREFIX_HIT, 0, 16)
        for step in range(2):
            w.append("sched", schema.SchedRow(200 + step, 0, step, 2, 8 if step == 0 else 0, 0 if step == 0 else 2,
                                              2, 1, 0, 64, POOL, free, 2 * 5 * BLOCK // 16, 3, 0, 10 + 2 * step,
                                              16 if step == 0 else 0, 1 if step == 0 else 0, 0, step))
            w.append("sched_groups", schema.SchedGroupRow(0, step, 0, int(schema.LayerType.FULL), 2, -1, 16, BLOCK,
                                                          64, 3, 0, group_free, 10 + 2 * step))
            w.append("blocks", [schema.BlockRow(0, step, 0, 0, 2, shared, 5 + step),
                                schema.BlockRow(0, step, 7 if orphan else 1, 0, 1, 0, 5 + step)])
    return path


def test_older_traces_have_none_and_read_as_empty() -> None:
    with Trace(OLD) as t:
        assert not t.has("sched")
        for rows, dtype in ((t.sched[:], schema.SCHED), (t.sched_groups[:], schema.SCHED_GROUPS),
                            (t.blocks[:], schema.BLOCKS)):
            assert rows.shape == (0,) and rows.dtype == dtype
        assert len(t.sched) == t.blocks.where().size == t.phases.size == 0
        assert t.cb_requests.size == 0 and t.cb_requests.dtype == CB_REQUESTS
        s = summarize(t)
        assert "serving" not in s and "sched" not in s["rows"]  # info --json of old traces unchanged
    assert validate(OLD).valid


def test_tables_roundtrip_validate_and_read(tmp_path: Path) -> None:
    path = _write(tmp_path / "cb.kvt.h5")
    report = validate(path)
    assert report.valid, report.problems
    with Trace(path) as t:
        assert t.sched[:]["step"].tolist() == [0, 1] and t.sched[:]["prefix_hit_tokens"].tolist() == [16, 0]
        assert t.blocks.where(request=1).shape == (2,) and t.blocks.where(step=1, request=0)["tokens_valid"].tolist() == [6]
        assert t.phases["name"].tolist() == ["baseline", "concurrent"] and t.phases["index"].tolist() == [0, 1]
        cb = t.cb_requests
        assert cb["request"].tolist() == [0, 1]
        assert cb["arrival_ns"].tolist() == [100, 101] and cb["admitted_ns"].tolist() == [200, 201]
        assert cb["first_token_ns"].tolist() == [300, 301] and cb["end_ns"].tolist() == [900, 900]
        assert cb["preemptions"].tolist() == [0, 1] and cb["preempted_tokens"].tolist() == [0, 7]
        assert cb["prefix_hit_tokens"].tolist() == [16, 0]
        sv = summarize(t)["serving"]
    assert sv["steps"] == 2 and sv["pool_bytes"] == POOL and sv["peak_used_bytes"] == 3 * BLOCK
    assert sv["peak_block_usage"] == pytest.approx(3 / 64) and sv["preemptions"] == 1
    assert sv["phases"] == ["baseline", "concurrent"] and sv["prefix_hit_tokens"] == 16


@pytest.mark.parametrize(("kwargs", "problem"), [
    ({"free": POOL + 1}, "/sched has rows with more free than pool bytes"),
    ({"shared": 3}, "/blocks has rows sharing more blocks than they hold"),
    ({"orphan": True}, "/blocks names requests absent from /requests: [7]"),
    ({"group_free": 62}, "/sched_groups has rows counting more blocks in use, cached and free than the pool holds"),
])
def test_validate_rules(tmp_path: Path, kwargs: dict, problem: str) -> None:
    report = validate(_write(tmp_path / "bad.kvt.h5", **kwargs))
    assert report.problems == [problem]


def test_info_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path / "cb.kvt.h5")
    monkeypatch.setenv("COLUMNS", "400")  # one line each (info folds long lines at the terminal width)
    code, out, err = run_main(["info", str(path)], capsys)
    assert code == 0, err
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert lines["serving"].startswith("serving    2 scheduler steps (1 manager(s)), pool 256.0 KiB, peak use 4.7% of "
                                       "blocks (1.0% of tokens), peak 2 running / 1 waiting; 1 preemptions")
    assert lines["phases"] == "phases     baseline, concurrent"
    assert lines["rows"].endswith(", sched 2, sched_groups 2, blocks 4")
    code, out, _ = run_main(["info", str(path), "--json"], capsys)
    doc = json.loads(out)
    assert doc["rows"]["sched"] == 2 and doc["rows"]["blocks"] == 4 and doc["serving"]["evicted_blocks"] == 0


def test_serving_event_kinds_are_new_codes() -> None:
    """1.4 adds codes 16-22 after NOTE (15); codes are never reused (spec §2)."""
    assert [int(k) for k in (K.SCHEDULED, K.FIRST_TOKEN, K.PREEMPTED, K.PREFIX_HIT, K.BLOCK_EVICTED,
                             K.OFFLOADED, K.PHASE)] == list(range(16, 23))
    assert np.array_equal(schema.TABLES["sched"][0].names, schema.SCHED.names) and not schema.SCHED_TABLE.required
