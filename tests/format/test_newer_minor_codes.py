"""Enumeration codes a reader does not know, decided by the file's minor (spec §2).

- A newer minor's file (1.6, written by a newer kvtrace): rows holding such codes are skipped by the
  reader; every command answers (exit 0) and each one that read a skipping table says so in one
  stderr line per trace; validate warns and exits 0.
- The same file claiming 1.5 (this kvtrace's minor): the codes are damage, refused with exit 1.

The skipped rows are left out coherently: a table's row count, its slices and the payload numbers
are those of the remaining rows (the analyser addresses /kv and payloads by position).
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import serving_parallel_traces as H
from fmt_helpers import request_row
from test_hostile_serving_parallel import NOT_READING_SERVING, check_case, run_every_consumer

from kvtrace import exitcodes
from kvtrace.format import CacheDType, PayloadKind, Trace, TraceWriter, encode_payload, schema
from kvtrace.format.errors import InvalidTrace
from kvtrace.format.skipped import collect_skipped, skipped_notes
from kvtrace.format.validate import validate
from tests.helpers.cli_run import run_main

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

EVENTS = "2 events of kinds added after format 1.5 (kind 23)"
REQUEST = "1 request of outcomes added after format 1.5 (outcome 9)"


def new_codes(f: h5py.File) -> None:
    """What a 1.5 writer might add: two events of a new kind 23 and a request of a new outcome 9."""
    H.event(23, 0)(f)
    H.event(23, 7, 1)(f)
    H.set_rows("requests", "outcome", 9, [0])(f)


@pytest.fixture(scope="module")
def serving(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return H.serving_trace(tmp_path_factory.mktemp("codes") / "serving.kvt.h5")


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTRACE_DEBUG", raising=False)
    monkeypatch.setenv("COLUMNS", "200")


def test_every_consumer_reads_a_newer_minor_and_notes_the_skipped_rows(serving, tmp_path, capsys):
    trace = H.damaged(serving, tmp_path / "v15.kvt.h5", lambda f: (H.version("1.6")(f), new_codes(f)))
    results = run_every_consumer(trace, serving, tmp_path / "out", capsys)
    note = f"kvtrace: {trace}: note: {REQUEST} and {EVENTS} were skipped (written by format 1.6); a newer kvtrace reads them"
    for name, (rc, out, err) in results.items():
        assert rc == 0, (name, err)
        assert "Traceback" not in out + err
        lines = err.splitlines()
        if name in ("validate", "fleet summary"):
            continue
        if name in NOT_READING_SERVING:  # they read no /events: a note names what they did read, or none
            assert len(lines) <= 1 and all(ln.startswith(f"kvtrace: {trace}: note: ") for ln in lines), (name, err)
            continue
        assert lines == [note], (name, err)  # one line, whatever the command read first; diff: the 1.5 side only
    # what the consumers saw: the request and the events of the new codes are not there
    with Trace(serving) as t:
        events = t.nrows("events")
    info = json.loads(results["info --json"][1])
    assert info["rows"]["requests"] == 2 and info["rows"]["events"] == events, info["rows"]
    rc, out, err = results["validate"]
    assert "valid kvtrace trace (format 1.6)" in out
    assert "/events kind has codes added after format 1.5 [23] in 2 row(s) (written by format 1.6)" in err
    assert "/requests outcome has codes added after format 1.5 [9] in 1 row(s)" in err


def test_the_same_file_claiming_this_minor_is_refused(serving, tmp_path, capsys):
    results = check_case({"serving": serving}, tmp_path, capsys, "serving", new_codes,
                         "/events kind has unknown codes [23]", may_succeed=NOT_READING_SERVING)
    assert "/requests outcome has unknown codes [9]" in results["validate"][2]
    assert "unknown codes" in results["analyze"][2]


def test_validate_json_of_a_newer_minor_lists_warnings_not_problems(serving, tmp_path, capsys):
    trace = H.damaged(serving, tmp_path / "v15.kvt.h5", lambda f: (H.version("1.6")(f), new_codes(f)))
    rc, out, _ = run_main(["validate", "--json", str(trace)], capsys)
    doc = json.loads(out)
    assert rc == 0 and doc["valid"] and doc["problems"] == [], doc
    assert sum("codes added after format 1.5" in w for w in doc["warnings"]) == 2, doc["warnings"]


def test_other_damage_in_a_newer_minor_is_still_refused(serving, tmp_path, capsys):
    """Only codes are forgiven: a 1.5 trace whose serving events break a rule is refused as before."""
    trace = H.damaged(serving, tmp_path / "v15.kvt.h5", lambda f: (H.version("1.6")(f), new_codes(f), H.event(20, -1)(f)))
    rc, out, err = run_main(["validate", str(trace)], capsys)
    assert rc == exitcodes.INVALID and "/events block_evicted holds value -1" in err
    rc, out, err = run_main(["analyze", str(trace)], capsys)
    assert rc == exitcodes.INVALID and err.count("kvtrace: ") == 1 and "block_evicted holds value -1" in err, err


# ---- the reader: row counts, slices and payload numbers of the rows that remain --------------------


def test_kv_rows_of_a_new_dtype_are_left_out_of_counts_and_slices(serving, tmp_path):
    with Trace(serving) as t:
        before = t.kv[:]
    trace = H.damaged(serving, tmp_path / "kv.kvt.h5",
                      lambda f: (H.version("1.6")(f), H.set_rows("kv", "k_dtype", 40, [3, 4, 10])(f)))
    keep = np.setdiff1d(np.arange(before.size), [3, 4, 10])
    with Trace(trace) as t:
        assert t.nrows("kv") == keep.size and t.nrows("kv", check_codes=False) == before.size
        assert np.array_equal(t.kv[:], before[keep])
        for a, b in ((0, 3), (2, 6), (3, 4), (5, 21), (20, 40), (7, 7)):
            assert np.array_equal(t.table("kv", slice(a, b)), before[keep][a:b]), (a, b)
        assert t.skipped["kv"].rows == 3 and t.skipped["kv"].codes == {"k_dtype": [40]}
        assert "3 /kv rows of key dtypes added after format 1.5 (k_dtype 40)" in t.skipped_note()


def test_a_trace_of_this_minor_with_the_same_rows_is_refused_where_read(serving, tmp_path):
    trace = H.damaged(serving, tmp_path / "kv14.kvt.h5", H.set_rows("kv", "k_dtype", 40, [3]))
    with Trace(trace) as t:
        assert t.nrows("kv") == t.nrows("kv", check_codes=False)
        with pytest.raises(InvalidTrace, match=r"/kv k_dtype has unknown codes \[40\]"):
            t.kv[:]
        assert not t.skipped


def payload_trace(path: Path) -> list[np.ndarray]:
    """Three key payloads of distinct contents; returns their raw bits."""
    rng = np.random.default_rng(3)
    raws = [rng.integers(0, 1 << 16, (1, 2, 8 + 8 * i, 16), dtype=np.uint16) for i in range(3)]
    with TraceWriter(path, {"model_id": "m", "contains_tensor_payloads": True}) as w:
        w.begin_request(request_row(0, schema.Outcome.OK))
        for i, raw in enumerate(raws):
            w.write_payload(encode_payload(0, i, 0, PayloadKind.KEY, CacheDType.BFLOAT16, raw))
    return raws


def set_payload_kind(path: Path, row: int, kind: int, version: str | None) -> None:
    with h5py.File(path, "a") as f:
        index = f["payloads/index"][:]
        index["kind"][row] = kind
        f["payloads/index"][:] = index
        if version is not None:
            H.version(version)(f)


def test_payloads_of_a_new_kind_are_skipped_and_the_rest_numbered_in_order(tmp_path):
    p = tmp_path / "pay.kvt.h5"
    raws = payload_trace(p)
    set_payload_kind(p, 1, 9, "1.6")
    with Trace(p) as t:
        index = t.payload_index[:]
        assert index.size == 2 and list(index["step"]) == [0, 2]
        assert np.array_equal(t.payload(1).data.reshape(raws[2].shape), raws[2])  # payload 1 is the third row
        assert np.array_equal(t.payload(-1).data.reshape(raws[2].shape), raws[2])
        with pytest.raises(IndexError):
            t.payload(2)
        assert "1 payload of kinds added after format 1.5 (kind 9) was skipped" in t.skipped_note()
        assert "3 sampled tensors" in t.stored_contents()["tensor_payloads"]  # the file holds three
    report = validate(p)
    assert report.valid, report.problems
    assert any("/payloads/index has 1 row(s) of kinds or dtypes added after format 1.5" in w for w in report.warnings)


def test_a_payload_of_an_unknown_kind_in_this_minor_is_refused_at_open(tmp_path):
    p = tmp_path / "pay14.kvt.h5"
    payload_trace(p)
    set_payload_kind(p, 1, 9, None)
    with pytest.raises(InvalidTrace, match="payload index kind has unknown code 9"):
        Trace(p)
    assert not validate(p).valid


def test_skipped_notes_name_each_file_once(serving, tmp_path):
    trace = H.damaged(serving, tmp_path / "v15.kvt.h5", lambda f: (H.version("1.6")(f), new_codes(f)))
    with collect_skipped() as seen:
        for _ in range(2):  # a command that opens the trace twice (report does)
            with Trace(trace) as t:
                t.events[:]
        with Trace(serving) as t:
            t.events[:]  # nothing skipped: not collected
    assert len(seen) == 2
    assert skipped_notes(seen) == [f"{trace}: note: {EVENTS} were skipped (written by format 1.6); a newer kvtrace reads them"]
    with Trace(trace) as t:  # outside a collector: counted on the trace alone
        t.events[:]
        assert t.skipped["events"].rows == 2
    assert schema.FORMAT_VERSION == "1.5"  # the messages above name this reader's version
