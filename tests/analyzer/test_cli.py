"""`kvtrace analyze` and `kvtrace diff`: exit codes, JSON schema, one-line errors."""

import json
import os
import subprocess
import sys

import h5py
import pytest

from kvtrace import exitcodes
from kvtrace.analyzer.report import SCHEMA_NAME, SCHEMA_VERSION
from tests.helpers.synth import GPT_OSS_LIKE, LLAMA_LIKE, MISTRAL_LIKE, MiB, Req, build


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "400"}  # one finding per line: messages are not wrapped
    return subprocess.run([sys.executable, "-m", "kvtrace.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    return {
        "clean": build(d / "clean.kvt.h5", LLAMA_LIKE, [Req(6, 10)], model_id="tiny/clean"),
        "noslide": build(d / "noslide.kvt.h5", MISTRAL_LIKE, [Req(6, 20, no_slide={1})]),
        "leak": build(d / "leak.kvt.h5", LLAMA_LIKE, [Req(6, 10, retained=4 * MiB, retention_layers=[0])],
                      gpu=True),
        "clean_gpu": build(d / "clean_gpu.kvt.h5", LLAMA_LIKE, [Req(6, 10)], gpu=True),
        "hybrid": build(d / "hybrid.kvt.h5", GPT_OSS_LIKE, [Req(200, 16)], gpu=True),
    }


def test_analyze_terminal_names_trace_model_device(traces):
    p = run("analyze", str(traces["hybrid"]))
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert str(traces["hybrid"]) in out and "synthetic (gpt_oss)" in out and "NVIDIA H100" in out
    assert "bimodal by design" in out and "binary units" in out
    assert "MB" not in out.replace("MiB", "")  # binary units only


def test_fail_on_gates_ci(traces):
    assert run("analyze", str(traces["clean"]), "--fail-on", "low").returncode == 0
    p = run("analyze", str(traces["noslide"]), "--fail-on", "high")
    assert p.returncode == exitcodes.FINDINGS
    assert run("analyze", str(traces["noslide"]), "--fail-on", "critical").returncode == exitcodes.FINDINGS
    # info findings exist on every trace: failing on info means "fail on any finding"
    assert run("analyze", str(traces["clean"]), "--fail-on", "info").returncode == exitcodes.FINDINGS


def test_json_report_schema(traces, tmp_path):
    out = tmp_path / "r.json"
    p = run("analyze", str(traces["leak"]), str(traces["clean"]), "--json-out", str(out), "-q")
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    assert doc["schema"] == SCHEMA_NAME and doc["schema_version"] == SCHEMA_VERSION
    assert len(doc["reports"]) == 2
    rep = doc["reports"][0]
    assert set(rep) == {"trace", "model", "devices", "software", "expectation", "summary", "requests", "memory",
                        "detectors", "findings"}
    assert rep["trace"]["path"] == str(traces["leak"]) and rep["model"]["type"] == "llama"
    assert rep["devices"][0]["label"] == "cuda:0"
    top = rep["findings"][0]
    assert top["detector"] == "post_eos" and top["severity"] == "critical"
    assert top["evidence"]["retained_bytes"] == {"value": 4 * MiB, "unit": "bytes"}
    assert [d["name"] for d in rep["detectors"]][:2] == ["growth_curve", "post_eos"]
    for f in rep["findings"]:
        assert set(f) == {"detector", "kind", "score", "severity", "message", "evidence", "requests", "steps",
                          "layers", "device"}
        for e in f["evidence"].values():
            assert e["unit"] in {"bytes", "ns", "tokens", "ratio", "count", "bytes/token", "bytes/s", "layer",
                                 "step"}
    req = rep["requests"][0]
    assert req["retained_allocated_bytes"] == 4 * MiB and req["layers"][0]["layer"] == 0


def test_json_to_stdout_and_detector_selection(traces):
    p = run("analyze", str(traces["clean"]), "--json", "--detector", "aliasing")
    assert p.returncode == 0
    doc = json.loads(p.stdout)
    assert [d["name"] for d in doc["reports"][0]["detectors"]] == ["aliasing"]
    # the old spelling `--json -` still means stdout
    assert json.loads(run("analyze", str(traces["clean"]), "--json", "-", "--detector", "aliasing").stdout) == doc


def test_bad_arguments_and_inputs(traces, tmp_path):
    p = run("analyze", str(traces["clean"]), "--detector", "nope")
    assert p.returncode == exitcodes.USAGE and "unknown detector" in p.stderr
    junk = tmp_path / "junk.kvt.h5"
    junk.write_bytes(b"not a trace at all")
    p = run("analyze", str(junk))
    assert p.returncode == exitcodes.UNREADABLE and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
    assert run("analyze", str(tmp_path / "missing.kvt.h5")).returncode == exitcodes.UNREADABLE
    newer = tmp_path / "newer.kvt.h5"
    with h5py.File(newer, "w") as f:
        f.attrs["format"] = "kvtrace"
        f.attrs["format_version"] = "9.0"
    p = run("analyze", str(newer))
    assert p.returncode == exitcodes.VERSION and "newer" in p.stderr
    invalid = tmp_path / "invalid.kvt.h5"
    invalid.write_bytes(traces["clean"].read_bytes())
    with h5py.File(invalid, "r+") as f:
        del f["meta"].attrs["model_config_json"]
    p = run("analyze", str(invalid))
    assert p.returncode == exitcodes.INVALID and "model_config" in p.stderr and "Traceback" not in p.stderr
    # A bad trace among good ones: the good ones are still reported, the exit code says what failed.
    p = run("analyze", str(traces["clean"]), str(junk))
    assert p.returncode == exitcodes.UNREADABLE and "tiny/clean" in p.stdout
    p = run("analyze", str(traces["clean"]), "--json-out", str(tmp_path / "no" / "dir" / "r.json"))
    assert p.returncode == exitcodes.CANNOT_WRITE


def test_list_detectors():
    p = run("analyze", "--list-detectors")
    assert p.returncode == 0 and "growth_curve" in p.stdout and "oom" in p.stdout
    assert run("analyze").returncode == exitcodes.USAGE


def test_diff_traces_and_saved_reports(traces, tmp_path):
    p = run("diff", str(traces["clean_gpu"]), str(traces["leak"]))
    assert p.returncode == 0, p.stderr
    assert "appeared in B" in p.stdout and "post_eos" in p.stdout and "binary units" in p.stdout
    saved = tmp_path / "base.json"
    assert run("analyze", str(traces["leak"]), "--json-out", str(saved), "-q").returncode == 0
    p = run("diff", str(saved), str(traces["leak"]), "--json")
    d = json.loads(p.stdout)
    assert d["schema"] == "kvtrace-analysis-diff"
    assert d["findings"]["appeared"] == [] and d["findings"]["disappeared"] == [] and d["findings"]["changed"] == []
    assert all(r["peak_kv_bytes"]["delta"] == 0 for r in d["requests"])
    p = run("diff", str(traces["leak"]), str(traces["clean_gpu"]), "--json")
    d = json.loads(p.stdout)
    assert [f["detector"] for f in d["findings"]["disappeared"]] == ["post_eos"]
    # A CPU trace cannot say anything about allocator findings: not compared, not "disappeared".
    d = json.loads(run("diff", str(traces["leak"]), str(traces["clean"]), "--json").stdout)
    assert "fragmentation" in {n["detector"] for n in d["findings"]["not_compared"]}
    assert d["findings"]["disappeared"] == []
    assert d["requests"][0]["retained_allocated_bytes"]["a"] == 4 * MiB


def test_diff_per_layer_deltas(tmp_path):
    a = build(tmp_path / "a.kvt.h5", MISTRAL_LIKE, [Req(6, 20)])
    b = build(tmp_path / "b.kvt.h5", MISTRAL_LIKE, [Req(6, 20, no_slide={1})])
    d = json.loads(run("diff", str(a), str(b), "--json").stdout)
    changed = [row for row in d["layers"] if row["bytes_valid"]["delta"]]
    assert [row["layer"] for row in changed] == [1]
    assert changed[0]["tokens_kept"] == {"a": 7, "b": 25, "delta": 18}
    kinds = {(c["detector"], c["kind"]) for c in d["findings"]["appeared"]}
    assert ("growth_curve", "window_not_applied") in kinds
    p = run("diff", str(a), str(tmp_path / "nope.kvt.h5"))
    assert p.returncode == exitcodes.UNREADABLE
