"""`export parquet --workers 2`: the per-trace work on a dask.distributed LocalCluster of two
worker processes gives the same rows as in-process export."""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli_run import run_main

pytest.importorskip("distributed", reason="dask[distributed] is not installed (the fleet extra)")


def test_local_cluster_of_two_workers(tmp_path, versions, capsys):
    paths = [str(p) for p in versions["5.17.0"] + versions["5.99.0"]]
    code, out, _ = run_main(["export", "parquet", *paths, "-o", str(tmp_path / "d"), "--workers", "2", "--json"],
                            capsys)
    dask_doc = json.loads(out)
    code2, out2, _ = run_main(["export", "parquet", *paths, "-o", str(tmp_path / "s"), "--json"], capsys)
    serial = json.loads(out2)
    assert code == code2 == 0 and dask_doc["engine"] == "dask LocalCluster(2)"
    rows = lambda d: sorted((e["trace_id"], json.dumps(e["rows"], sort_keys=True)) for e in d["exported"])  # noqa: E731
    assert rows(dask_doc) == rows(serial) and len(rows(serial)) == 6
    code, _, err = run_main(["export", "parquet", paths[0], "-o", str(tmp_path / "x"), "--workers", "2",
                             "--dask", "tcp://127.0.0.1:1"], capsys)
    assert code == 64 and "pick one" in err


def test_unreachable_scheduler_is_one_line(tmp_path, versions, capsys, monkeypatch):
    from kvtrace.fleet import export

    monkeypatch.setattr(export, "DASK_CONNECT_TIMEOUT_S", 1)  # the default 5 s only slows the suite
    code, _, err = run_main(["export", "parquet", str(versions["5.17.0"][0]), "-o", str(tmp_path / "x"),
                             "--dask", "tcp://127.0.0.1:9"], capsys)
    assert code == 69 and "cannot reach the dask scheduler" in err and len(err.strip().splitlines()) == 1
