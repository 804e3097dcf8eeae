"""`kvtrace fleet`: summary over DuckDB views, --sql, and `fleet diff` verdicts with controls."""

from __future__ import annotations

import json

from kvtrace import exitcodes
from tests.helpers.cli_run import run_main


def _json(capsys, *argv: str) -> tuple[int, dict]:
    code, out, err = run_main(list(argv), capsys)
    assert "Traceback" not in err
    return code, (json.loads(out) if out.strip().startswith(("{", "[")) else {"err": err})


def test_summary_by_version_separates_retention(fleet_dir, capsys):
    code, doc = _json(capsys, "fleet", str(fleet_dir), "--group-by", "transformers_version", "--json")
    assert code == 0
    groups = {g["transformers_version"]: g for g in doc["groups"]}
    assert set(groups) == {"5.17.0", "5.23.0", "5.99.0"}
    for version, g in groups.items():
        assert g["traces"] == 3 and g["requests"] == 6
        planted = version == "5.99.0"  # 1 MiB left allocated after each request
        assert g["retained_bytes"] == (6 << 20 if planted else 0), version
        # the residual is not KV (post_eos sees the KV freed and says info): not a retention finding
        assert g["retention_rate"] == 0.0 and g["fragmentation_rate"] == 0.0
        assert g["kv_bytes_per_token_layer"] == 128.0  # 2 heads x 16 dims x K+V x bf16
    assert {r["layer_type"] for r in doc["kv_bytes_per_token"]} == {"sliding", "full"}


def test_rates_on_real_recordings(tmp_path, capsys):
    """Real H100 fixtures (tests/data/gpu/README.md): a kept cache, user-made fragmentation, a clean run."""
    from pathlib import Path

    from kvtrace.fleet.export import export_parquet

    data = Path(__file__).resolve().parent.parent / "data" / "gpu"
    names = ("gpu_kept_cache", "gpu_fragmentation", "gpu_clean")
    export_parquet([str(data / f"{n}.kvt.h5") for n in names], tmp_path / "f")
    code, doc = _json(capsys, "fleet", str(tmp_path / "f"), "--group-by", "path", "--json")
    assert code == 0
    rates = {Path(g["path"]).name.split(".")[0]: (g["retention_rate"], g["fragmentation_rate"]) for g in doc["groups"]}
    # the fragmentation fixture's logits processor keeps a 55% block until after the request: post_eos
    # names that memory (non-KV, held past the request) at low, so it counts as retention too
    assert rates == {"gpu_kept_cache": (1.0, 0.0), "gpu_fragmentation": (1.0, 1.0), "gpu_clean": (0.0, 0.0)}


def test_sql_and_bad_input(fleet_dir, tmp_path, capsys):
    code, doc = _json(capsys, "fleet", str(fleet_dir), "--sql",
                      "SELECT count(*) AS n, sum(new_tokens) AS t FROM requests", "--json")
    assert code == 0 and doc["result"] == [{"n": 18, "t": 2 * 3 * (10 + 11 + 12)}]
    code, _ = _json(capsys, "fleet", str(fleet_dir), "--sql", "SELEC 1")
    assert code == exitcodes.USAGE
    code, _ = _json(capsys, "fleet", str(fleet_dir), "--group-by", "no_such_key")
    assert code == exitcodes.USAGE
    code, _ = _json(capsys, "fleet", str(tmp_path))  # a directory with no export in it
    assert code == exitcodes.UNREADABLE
    # views exist even for tables no trace had rows in (no payloads in these traces)
    code, doc = _json(capsys, "fleet", str(fleet_dir), "--sql", "SELECT count(*) AS n FROM payloads", "--json")
    assert code == 0 and doc["result"] == [{"n": 0}]


def _verdicts(doc: dict) -> dict[str, str]:
    return {m["metric"]: m["verdict"] for m in doc["metrics"]}


def test_diff_flags_the_planted_regression_only(fleet_dir, capsys):
    base = "transformers_version=5.17.0"
    code, control = _json(capsys, "fleet", "diff", str(fleet_dir), "--baseline", base,
                          "--candidate", "transformers_version=5.23.0", "--fail-on", "regressed", "--json")
    assert code == 0 and control["regressed"] == []  # same recordings under another version: unchanged
    assert set(_verdicts(control).values()) <= {"unchanged", "insufficient", "absent"}
    # these synthetic traces hold no recorder_own readings: said absent, not zero
    assert _verdicts(control)["recorder_own device bytes per request"] == "absent"
    code, planted = _json(capsys, "fleet", "diff", str(fleet_dir), "--baseline", base,
                          "--candidate", "transformers_version=5.99.0", "--json")
    assert code == 0  # no --fail-on: report only
    v = _verdicts(planted)
    assert v["retained_allocated_bytes per request"] == "regressed"
    exact = [m for m in planted["metrics"] if m["kind"] == "exact"]
    assert {m["metric"] for m in exact} == {"kv bytes per token (qwen3, full layers)",
                                            "kv bytes per token (qwen3, sliding layers)"}
    assert {m["verdict"] for m in exact} == {"unchanged"}  # exact geometry did not move
    m = next(m for m in planted["metrics"] if m["metric"] == "retained_allocated_bytes per request")
    assert m["ci"][0] > 0 and m["p_value"] < 0.05 and m["cliffs_delta"] == 1.0
    code, _ = _json(capsys, "fleet", "diff", str(fleet_dir), "--baseline", base,
                    "--candidate", "transformers_version=5.99.0", "--fail-on", "regressed")
    assert code == exitcodes.FINDINGS
    code, _ = _json(capsys, "fleet", "diff", str(fleet_dir), "--baseline", base, "--candidate", "nokey")
    assert code == exitcodes.USAGE
    code, _ = _json(capsys, "fleet", "diff", str(fleet_dir), "--baseline", base,
                    "--candidate", "transformers_version=9.9")
    assert code == exitcodes.USAGE


def _copies(src, out_dir, n: int, version: str, own_bytes: int | None = None) -> list[str]:
    """n distinct copies of a real recording under another transformers_version; with own_bytes,
    one recorder_own reading per request holding that many device bytes."""
    import shutil

    import h5py
    import numpy as np

    paths = []
    for i in range(n):
        dst = out_dir / f"{version}-{i}-{src.name}"
        shutil.copy(src, dst)
        with h5py.File(dst, "r+") as f:
            f["meta"].attrs["transformers_version"] = version
            f["meta"].attrs["copy"] = i  # distinct content: distinct trace ids
            if own_bytes is not None:
                r = f["readings"]
                row = np.zeros(1, r.dtype)
                row["label"], row["device"], row["allocated_bytes"], row["reserved_bytes"] = 7, 0, own_bytes + i, -1
                r.resize((r.shape[0] + 1,))
                r[-1] = row[0]
        paths.append(str(dst))
    return paths


def test_diff_findings_rates_and_recorder_overhead(tmp_path, capsys):
    """Real H100 recordings: six clean runs against six that keep their cache. The post_eos rate
    goes 0/6 -> 6/6 (regressed, Fisher p = 0.002); the recorder's own bytes grow 1 MiB -> 8 MiB."""
    from pathlib import Path

    from kvtrace.fleet.export import export_parquet

    data = Path(__file__).resolve().parent.parent / "data" / "gpu"
    (tmp_path / "in").mkdir()
    paths = (_copies(data / "gpu_clean.kvt.h5", tmp_path / "in", 6, "A", own_bytes=1 << 20)
             + _copies(data / "gpu_kept_cache.kvt.h5", tmp_path / "in", 6, "B", own_bytes=8 << 20))
    r = export_parquet(paths, tmp_path / "f")
    assert len(r.exported) == 12 and not r.failed
    code, doc = _json(capsys, "fleet", "diff", str(tmp_path / "f"), "--baseline", "transformers_version=A",
                      "--candidate", "transformers_version=B", "--json")
    assert code == 0
    by = {m["metric"]: m for m in doc["metrics"]}
    rate = by["post_eos findings rate (traces with one >= low)"]
    assert (rate["baseline"]["flagged"], rate["candidate"]["flagged"]) == (0, 6)
    assert rate["verdict"] == "regressed" and rate["p_value"] < 0.01 and rate["ci"][0] > 0
    own = by["recorder_own device bytes per request"]
    assert own["verdict"] == "regressed" and own["baseline"]["n"] == 6 and own["candidate"]["n"] == 6
    assert by["recorder errors per trace"]["verdict"] == "unchanged"
    # the reverse direction is an improvement, and the same group against itself is unchanged
    code, rev = _json(capsys, "fleet", "diff", str(tmp_path / "f"), "--baseline", "transformers_version=B",
                      "--candidate", "transformers_version=A", "--json")
    assert _verdicts(rev)["post_eos findings rate (traces with one >= low)"] == "improved"
    code, same = _json(capsys, "fleet", "diff", str(tmp_path / "f"), "--baseline", "transformers_version=B",
                       "--candidate", "transformers_version=B", "--fail-on", "regressed", "--json")
    assert code == 0 and same["regressed"] == []


def test_rate_verdicts_with_controls():
    import numpy as np

    from kvtrace.fleet.compare import compare_rate
    kw = {"alpha": 0.05, "min_effect": 0.05, "level": 0.95}
    none, half, some = np.zeros(40), np.r_[np.ones(20), np.zeros(20)], np.r_[np.ones(2), np.zeros(38)]
    assert compare_rate("r", none, half, **kw)["verdict"] == "regressed"
    assert compare_rate("r", half, none, **kw)["verdict"] == "improved"
    assert compare_rate("r", half, half.copy(), **kw)["verdict"] == "unchanged"
    assert compare_rate("r", none, some, **kw)["verdict"] == "unchanged"  # 0/40 -> 2/40: p = 0.49
    assert compare_rate("r", none[:1], half, **kw)["verdict"] == "insufficient"


def test_noisy_verdicts_with_controls():
    # the statistical path on its own: identical samples are unchanged, a shifted one regressed
    import numpy as np

    from kvtrace.fleet.compare import compare_noisy
    a = np.arange(20.0)
    assert compare_noisy("m", "bytes", a, a.copy(), alpha=0.05, min_effect=0.05, level=0.95)["verdict"] == "unchanged"
    assert compare_noisy("m", "bytes", a, a + 100, alpha=0.05, min_effect=0.05, level=0.95)["verdict"] == "regressed"
    assert compare_noisy("m", "bytes", a + 100, a, alpha=0.05, min_effect=0.05, level=0.95)["verdict"] == "improved"
    # a significant shift smaller than min_effect of the median is not called a change
    big = np.linspace(1e9, 1.001e9, 50)
    assert compare_noisy("m", "bytes", big, big + 1e5, alpha=0.05, min_effect=0.05, level=0.95)["verdict"] == "unchanged"


def test_summary_aggregates_equal_the_tables_they_summarise(fleet_dir, tmp_path, capsys):
    """The summary reads only traces; its per-trace aggregates equal SQL over the full tables."""
    import shutil

    from kvtrace.fleet.query import connect, run_sql

    con = connect(fleet_dir)
    one = lambda sql: run_sql(con, sql).rows[0][0]  # noqa: E731
    assert one("SELECT sum(tokens) FROM traces") == one(
        "SELECT sum(batch_size::BIGINT * (prompt_tokens + new_tokens)) FROM requests")
    assert one("SELECT sum(findings_low) FROM traces") == one("SELECT count(*) FROM findings WHERE severity_rank >= 1")
    assert one("SELECT sum(retained_allocated_bytes) FROM traces") == one(
        "SELECT sum(retained_allocated_bytes) FROM requests") == 6 << 20
    assert one("SELECT sum(f.findings) FROM traces, unnest(findings_by) AS u(f)") == one("SELECT count(*) FROM findings")
    assert one("SELECT sum(kv_bytes_valid) / sum(kv_tokens) FROM traces") == one(
        "SELECT sum(bytes_valid) / sum(tokens_kept * k_shape[1]) FROM kv")
    # only traces/ is needed: the same summary from a copy holding nothing else
    only = tmp_path / "only-traces"
    only.mkdir()
    shutil.copy(fleet_dir / "traces.parquet", only / "traces.parquet")
    _, full = _json(capsys, "fleet", str(fleet_dir), "--group-by", "transformers_version", "--json")
    _, slim = _json(capsys, "fleet", str(only), "--group-by", "transformers_version", "--json")
    assert full == slim and full["findings"] and full["kv_bytes_per_token"]


def test_older_fleet_schema_is_refused_then_reexported(tmp_path, versions, capsys):
    import json as _json_mod

    import pyarrow.parquet as pq

    from kvtrace.fleet.export import MANIFEST, export_parquet

    out = tmp_path / "old"
    export_parquet([str(versions["5.17.0"][0])], out)
    # what fleet schema 1.0 wrote: traces/<trace_id>.parquet without the aggregates
    (out / "traces").mkdir()
    old = pq.read_table(out / "traces.parquet").drop_columns(["findings_by", "kv_layer_types"])
    pq.write_table(old, out / "traces" / f"{old.column('trace_id')[0]}.parquet")
    (out / "traces.parquet").unlink()
    manifest = _json_mod.loads((out / MANIFEST).read_text())
    manifest["fleet_schema_version"] = "1.0"
    (out / MANIFEST).write_text(_json_mod.dumps(manifest))
    code, doc = _json(capsys, "fleet", str(out))
    assert code == exitcodes.UNREADABLE and "export parquet" in doc["err"] and len(doc["err"].splitlines()) == 1
    again = export_parquet([str(versions["5.17.0"][0])], out)  # unchanged input, but an older schema
    assert len(again.exported) == 1 and not again.skipped and not (out / "traces").exists()
    code, _ = _json(capsys, "fleet", str(out))
    assert code == 0


def test_sql_creates_only_the_views_it_names(fleet_dir):
    from kvtrace.fleet.query import connect, tables_named

    assert tables_named("SELECT kv_bytes_valid FROM traces JOIN findings USING (trace_id)") == ("traces", "findings")
    con = connect(fleet_dir, tables_named("select count(*) from KV"))
    names = {r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}
    assert names == {"kv"}


def test_exact_geometry_change_is_caught_without_statistics(tmp_path, capsys):
    """One trace per side is enough for exact metrics: 64 extra valid bytes on every full layer moves
    full-layer bytes per token (regressed) and leaves sliding layers unchanged."""
    import h5py

    from kvtrace.fleet.export import export_parquet
    from tests.fleet.conftest import write_synthetic_trace

    paths = []
    for version, extra in (("A", 0), ("B", 64)):
        p = write_synthetic_trace(tmp_path / f"{version}.kvt.h5", kv_extra_bytes=extra)
        with h5py.File(p, "r+") as f:
            f["meta"].attrs["transformers_version"] = version
        paths.append(str(p))
    export_parquet(paths, tmp_path / "f")
    code, doc = _json(capsys, "fleet", "diff", str(tmp_path / "f"), "--baseline", "transformers_version=A",
                      "--candidate", "transformers_version=B", "--fail-on", "regressed", "--json")
    v = _verdicts(doc)
    assert v["kv bytes per token (qwen3, full layers)"] == "regressed"
    assert v["kv bytes per token (qwen3, sliding layers)"] == "unchanged"
    assert v["findings >= low per trace"] == "insufficient"  # one trace a side: no statistics
    assert code == exitcodes.FINDINGS


def test_damaged_files_and_outputs_inside_the_directory(tmp_path, versions, capsys):
    """A damaged traces.parquet or per-trace file is exit 2 with one line (export refuses to drop its
    rows); no output may go inside the fleet directory, whose files are the input."""
    import shutil

    from kvtrace.fleet.export import export_parquet

    out = tmp_path / "f"
    export_parquet([str(p) for p in versions["5.17.0"]], out)
    code, _ = _json(capsys, "fleet", str(out), "--json-out", str(out / "summary.json"))
    assert code == exitcodes.USAGE and not (out / "summary.json").exists()
    code, _ = _json(capsys, "fleet", "diff", str(out), "--baseline", "model_type=qwen3", "--candidate",
                    "model_type=qwen3", "--json-out", str(out / "traces.parquet"))
    assert code == exitcodes.USAGE
    good = (out / "traces.parquet").read_bytes()
    finding = next((out / "findings").glob("*.parquet"))
    shutil.copy(finding, tmp_path / "finding.keep")
    finding.write_bytes(b"PAR1 not really")
    code, doc = _json(capsys, "fleet", str(out), "--sql", "SELECT count(*) FROM findings")
    assert code == exitcodes.UNREADABLE and "cannot read the exported tables" in doc["err"]
    assert len(doc["err"].strip().splitlines()) == 1
    shutil.copy(tmp_path / "finding.keep", finding)
    (out / "traces.parquet").write_bytes(b"junk")
    code, doc = _json(capsys, "fleet", str(out))
    assert code == exitcodes.UNREADABLE and len(doc["err"].strip().splitlines()) == 1
    code, _, err = run_main(["export", "parquet", str(versions["5.17.0"][0]), "-o", str(out)], capsys)
    assert code == exitcodes.UNREADABLE and "traces.parquet" in err and len(err.strip().splitlines()) == 1
    assert (out / "traces.parquet").read_bytes() == b"junk" and good  # refused, not overwritten
