"""`kvtrace export parquet`: row counts equal the traces', incremental skips, failures, outputs."""

from __future__ import annotations

import json
import os
import shutil

import pyarrow.parquet as pq

import kvtrace
from kvtrace import exitcodes
from tests.fleet.conftest import make_trace
from tests.helpers.cli_run import run_main

TRACE_TABLES = {"requests": "requests", "steps": "steps", "kv": "kv", "events": "events",
                "layers": "layers", "readings": "readings"}


def _export(capsys, *args: str) -> dict:
    code, out, err = run_main(["export", "parquet", *args, "--json"], capsys)
    doc = json.loads(out)
    doc["code"], doc["err"] = code, err
    return doc


def test_rows_match_the_trace_and_carry_its_id(tmp_path, versions, capsys):
    src = versions["5.17.0"][0]
    doc = _export(capsys, str(src), "-o", str(tmp_path / "f"))
    assert doc["code"] == 0 and len(doc["exported"]) == 1
    tid = doc["exported"][0]["trace_id"]
    with kvtrace.open(str(src)) as t:
        for name, table in TRACE_TABLES.items():
            got = pq.read_table(tmp_path / "f" / name / f"{tid}.parquet")
            assert got.num_rows == t.nrows(table) > 0, name
            assert set(got.column("trace_id").to_pylist()) == {tid}
        telemetry = pq.read_table(tmp_path / "f" / "telemetry" / f"{tid}.parquet")
        assert telemetry.num_rows == t.nrows("telemetry/nvml") + t.nrows("telemetry/allocator") + t.nrows(
            "telemetry/process")
        assert kvtrace.analyze(t).to_dict()["summary"]["findings"] == pq.read_table(
            tmp_path / "f" / "findings" / f"{tid}.parquet").num_rows
    meta = pq.read_table(tmp_path / "f" / "traces.parquet").to_pylist()[0]
    assert meta["trace_id"] == tid
    assert meta["transformers_version"] == "5.17.0" and meta["device"] == "Synthetic GPU"
    assert meta["format_version"] == kvtrace.FORMAT_VERSION
    assert pq.read_table(tmp_path / "f" / "kv" / f"{tid}.parquet").column("layer_type").to_pylist()[0] in (
        "sliding", "full")  # enum names, not codes


def test_incremental_skips_unchanged_and_replaces_changed(tmp_path, capsys):
    a, b = make_trace(tmp_path / "a.kvt.h5"), make_trace(tmp_path / "b.kvt.h5", new_tokens=7)
    out = tmp_path / "fleet"
    first = _export(capsys, str(a), str(b), "-o", str(out))
    assert len(first["exported"]) == 2 and first["skipped"] == []
    again = _export(capsys, str(a), str(b), "-o", str(out))
    assert again["exported"] == [] and {s["reason"] for s in again["skipped"]} == {"unchanged since the last export"}
    os.utime(a)  # touched, same content: hashed again, still skipped
    touched = _export(capsys, str(a), "-o", str(out))
    assert touched["exported"] == [] and len(touched["skipped"]) == 1
    old_id = first["exported"][0]["trace_id"] if first["exported"][0]["path"] == str(a) else \
        first["exported"][1]["trace_id"]
    make_trace(a, residual_bytes=4096)  # rewritten: new id, the old rows go
    changed = _export(capsys, str(a), "-o", str(out))
    assert len(changed["exported"]) == 1 and changed["exported"][0]["trace_id"] != old_id
    assert not (out / "requests" / f"{old_id}.parquet").exists()
    ids = pq.read_table(out / "traces.parquet").column("trace_id").to_pylist()
    assert len(ids) == 2 and old_id not in ids and changed["exported"][0]["trace_id"] in ids
    shutil.copy(b, tmp_path / "copy.kvt.h5")  # the same recording twice is one trace
    dup = _export(capsys, str(b), str(tmp_path / "copy.kvt.h5"), "-o", str(out), "--force")
    assert len(dup["exported"]) == 1 and dup["skipped"][0]["reason"].startswith("same content as")


def test_unreadable_inputs_fail_alone(tmp_path, capsys):
    good = make_trace(tmp_path / "good.kvt.h5")
    junk = tmp_path / "junk.kvt.h5"
    junk.write_bytes(b"not hdf5 at all")
    doc = _export(capsys, str(good), str(junk), str(tmp_path), "-o", str(tmp_path / "f"))
    assert doc["code"] == exitcodes.UNREADABLE and len(doc["exported"]) == 1 and len(doc["failed"]) == 2
    assert "not an HDF5 file" in doc["err"] and "Traceback" not in doc["err"]


def test_outputs_never_clobber_inputs(tmp_path, capsys):
    t = make_trace(tmp_path / "t.kvt.h5")
    code, _, err = run_main(["export", "parquet", str(t), "-o", str(t)], capsys)
    assert code == exitcodes.USAGE and "is a file" in err and t.read_bytes()[:4] == b"\x89HDF"
    code, _, err = run_main(["export", "parquet", str(t), "-o", str(tmp_path / "f"), "--json-out", str(t)], capsys)
    assert code == exitcodes.USAGE and t.read_bytes()[:4] == b"\x89HDF"


def test_process_pool_gives_the_same_rows(tmp_path, versions, capsys):
    paths = [str(p) for p in versions["5.17.0"] + versions["5.23.0"]]
    serial = _export(capsys, *paths, "-o", str(tmp_path / "s"))
    pooled = _export(capsys, *paths, "-o", str(tmp_path / "p"), "-j", "2")
    assert pooled["engine"].startswith("process pool")
    key = lambda d: sorted((e["trace_id"], json.dumps(e["rows"], sort_keys=True)) for e in d["exported"])  # noqa: E731
    assert key(serial) == key(pooled) and len(key(serial)) == 6


def test_missing_extra_is_exit_69(tmp_path, monkeypatch, capsys):
    t = make_trace(tmp_path / "t.kvt.h5")
    for mod in [m for m in list(__import__("sys").modules) if m.startswith("kvtrace.fleet")]:
        monkeypatch.delitem(__import__("sys").modules, mod)
    monkeypatch.setitem(__import__("sys").modules, "pyarrow", None)
    code, _, err = run_main(["export", "parquet", str(t), "-o", str(tmp_path / "f")], capsys)
    assert code == exitcodes.UNAVAILABLE and "kvtrace[fleet]" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_main(["fleet", str(tmp_path)], capsys)
    assert code == exitcodes.UNAVAILABLE




def test_interrupted_run_keeps_its_checkpoints(tmp_path, monkeypatch):
    """traces.parquet and the manifest are rewritten every CHECKPOINT_TRACES exports: a run stopped
    after 3 of 5 keeps the first 2 (one checkpoint), and the next run exports only the other 3."""
    from kvtrace.fleet import export as fx

    paths = [str(make_trace(tmp_path / f"t{i}.kvt.h5", new_tokens=5 + i)) for i in range(5)]
    monkeypatch.setattr(fx, "CHECKPOINT_TRACES", 2)
    monkeypatch.setattr(fx, "CHECKPOINT_SECONDS", 0.0)
    real, calls = fx.export_one, []

    def stop_at_the_fourth(*args):
        calls.append(args[0])
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(fx, "export_one", stop_at_the_fourth)
    out = tmp_path / "f"
    try:
        fx.export_parquet(paths, out)
    except KeyboardInterrupt:
        pass
    assert pq.read_table(out / "traces.parquet").num_rows == 2
    assert len(json.loads((out / fx.MANIFEST).read_text())["traces"]) == 2
    monkeypatch.setattr(fx, "export_one", real)
    again = fx.export_parquet(paths, out)
    assert len(again.exported) == 3 and len(again.skipped) == 2
    ids = pq.read_table(out / "traces.parquet").column("trace_id").to_pylist()
    assert sorted(ids) == sorted({e["trace_id"] for e in again.exported} | {s["trace_id"] for s in again.skipped})


def test_disk_full_midway_keeps_whole_traces_and_leaves_no_part(tmp_path, monkeypatch, capsys):
    """The disk fills while the second trace's tables are written: exit 73 in one line; the first trace
    is kept whole (its rows and its traces row, checkpointed), the second leaves none of its table
    files (a trace goes whole or not at all) and no .part temporary is left (pyarrow's OSError was an
    internal error, exit 70, with the .part behind)."""
    import errno

    from kvtrace.fleet import export as fx

    paths = [str(make_trace(tmp_path / f"t{i}.kvt.h5", new_tokens=5 + i)) for i in range(2)]
    real, writes = pq.write_table, []

    def fills_up(table, where, **kw):
        if "file_bytes" in table.column_names:  # traces.parquet: there is room for it
            return real(table, where, **kw)
        writes.append(table.column("trace_id")[0].as_py())  # every per-trace table carries it
        ids = list(dict.fromkeys(writes))
        if len(ids) == 2 and writes.count(ids[1]) == 2:  # the second trace fails at its second table
            where.write(b"PAR1 half")  # a partial temporary, as a real full disk leaves
            raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")
        return real(table, where, **kw)

    monkeypatch.setattr(fx.pq, "write_table", fills_up)
    out = tmp_path / "f"
    code, _, err = run_main(["export", "parquet", *paths, "-o", str(out)], capsys)
    assert code == exitcodes.CANNOT_WRITE and err.count("\n") == 1, err
    assert err.startswith("kvtrace: cannot write ") and err.rstrip().endswith(": No space left on device"), err
    monkeypatch.setattr(fx.pq, "write_table", real)
    kept = pq.read_table(out / "traces.parquet").column("trace_id").to_pylist()
    assert len(kept) == 1 and len(json.loads((out / fx.MANIFEST).read_text())["traces"]) == 1
    files = [p for p in out.rglob("*") if p.is_file()]
    assert not [p for p in files if p.name.endswith(".part")], files
    assert {p.stem for p in files if p.suffix == ".parquet" and p.name != "traces.parquet"} == set(kept)
    again = fx.export_parquet(paths, out)  # room again: the second trace is exported, the first skipped
    assert len(again.exported) == 1 and len(again.skipped) == 1
