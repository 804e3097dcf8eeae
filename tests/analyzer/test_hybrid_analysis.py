"""Hybrid caches through the analyser (format 1.5 /state), from the committed tiny recordings in
tests/data/hybrid_cpu: the state is cache memory that does not grow with tokens. It is named beside
the KV (cache_density, layer_uniformity, the requests table), counted per sequence in capacity,
never an anomaly, never evictable by a what-if token policy, drawn in the per-layer figure and
exported to fleets. Pure python (no torch)."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

import kvtrace
from kvtrace.format import schema
from kvtrace.format.reader import Trace
from tests.helpers.cli_run import run_main

DATA = Path(__file__).resolve().parents[1] / "data"
HYBRID = DATA / "hybrid_cpu"
# request 1 of every fixture is a batch of 2 at 35 tokens: state bytes of the whole batch
FALCON_STATE, QWEN_STATE = 13312, 21504


def _doc(path: Path, capsys) -> dict:
    rc, out, err = run_main(["analyze", str(path), "--json"], capsys)
    assert rc == 0, err
    return json.loads(out)["reports"][0]


def _finding(doc: dict, detector: str) -> dict:
    return next(f for f in doc["findings"] if f["detector"] == detector)


def test_requests_carry_the_state_and_findings_name_it(capsys):
    doc = _doc(HYBRID / "falcon_h1.kvt.h5", capsys)
    req = {r["request"]: r for r in doc["requests"]}
    assert req[1]["state_bytes"] == FALCON_STATE and req[1]["state_layers"] == 2
    assert req[0]["state_bytes"] == FALCON_STATE // 2  # batch 1: half the state of the batch of 2
    density = _finding(doc, "cache_density")
    assert density["evidence"]["state_bytes"]["value"] == FALCON_STATE
    assert "13.0 KiB of conv/recurrent state, constant in tokens" in density["message"]
    uniform = _finding(doc, "layer_uniformity")
    assert uniform["kind"] == "uniform" and uniform["score"] == 0.0  # a flat state is by design
    assert "by design, not in the CV" in uniform["message"]
    assert all(f["score"] == 0.0 for f in doc["findings"])  # a clean hybrid recording: no anomaly
    rc, text, _ = run_main(["analyze", str(HYBRID / "falcon_h1.kvt.h5")], capsys)
    assert rc == 0 and "state" in text.split("Requests", 1)[1].split("\n")[2]  # the table's header row


def test_attention_only_documents_keep_their_keys(capsys):
    doc = _doc(DATA / "gpu_gemma3_tiny.kvt.h5", capsys)
    assert not [r for r in doc["requests"] if "state_bytes" in r]
    rc, text, _ = run_main(["analyze", str(DATA / "gpu_gemma3_tiny.kvt.h5")], capsys)
    assert rc == 0 and " state " not in text.split("Findings", 1)[0]


def _on_a_gpu(src: Path, dst: Path, total: int, resident: int) -> Path:
    """The recording as if made on a GPU of ``total`` bytes with ``resident`` bytes reserved before
    each request (the KV and state rows are unchanged)."""
    dst.write_bytes(src.read_bytes())
    with h5py.File(dst, "r+") as f:
        dev = f["devices"][:]
        dev["device"], dev["name"], dev["total_memory_bytes"] = 0, b"Synthetic GPU", total
        f["devices"][:] = dev
        rd = f["readings"][:]
        rd["device"] = 0
        rd["allocated_bytes"] = rd["reserved_bytes"] = resident
        f["readings"][:] = rd
    return dst


def test_capacity_counts_state_per_sequence(tmp_path):
    total, resident = 1 << 20, 1 << 19
    trace = _on_a_gpu(HYBRID / "qwen3_next.kvt.h5", tmp_path / "gpu.kvt.h5", total, resident)
    with Trace(trace) as t:
        kv = int(t.steps.where(request=1)["kv_bytes_unique"].max())
        report = kvtrace.analyze(t)
    cap = next(f for f in report.findings if f.detector == "capacity")
    per_seq = kv / 2 + QWEN_STATE / 2
    assert cap.evidence["state_per_sequence_bytes"].value == QWEN_STATE // 2
    assert cap.evidence["max_concurrent_sequences"].value == int((total - resident) // per_seq)
    assert cap.evidence["max_concurrent_sequences"].value < int((total - resident) // (kv / 2))
    assert "of conv/recurrent state (constant in tokens)" in cap.message


def test_retained_state_counts_as_retention(tmp_path):
    """A request whose cache (KV and state) stays alive: post_eos judges the retained storages against
    the peak KV + state, and says which tensors they are."""
    trace = tmp_path / "kept.kvt.h5"
    trace.write_bytes((HYBRID / "falcon_h1.kvt.h5").read_bytes())
    with h5py.File(trace, "r") as f:
        state = f["state"][:]
        kv = f["kv"][:]
    last = state[(state["request"] == 0) & (state["step"] == state["step"][state["request"] == 0].max())]
    kv_last = kv[(kv["request"] == 0) & (kv["step"] == kv["step"][kv["request"] == 0].max())]
    rows = [(0, int(r["layer"]), -1, int(r["storage"]), int(r["bytes_allocated"]), 0, 0) for r in last]
    rows += [(0, int(r["layer"]), -1, int(r[s]), int(r[f"{s}_bytes"]), 0, 0)
             for r in kv_last for s in ("k_storage", "v_storage")]
    with h5py.File(trace, "r+") as f:
        ds = f["retention"]
        ds.resize((len(rows),))
        ds[:] = np.array(rows, dtype=schema.RETENTION)
    with Trace(trace) as t:
        report = kvtrace.analyze(t)
    f = next(x for x in report.findings if x.detector == "post_eos" and 0 in x.requests)
    peak_kv = f.evidence["peak_kv_bytes"].value
    assert f.kind == "retained_after_request" and f.score > 0.9
    assert f.evidence["state_bytes"].value == FALCON_STATE // 2
    assert f.evidence["ratio"].value == pytest.approx(1.0, abs=0.01)  # all of KV + state kept
    assert f.evidence["retained_bytes"].value == peak_kv + FALCON_STATE // 2
    assert "KV + state" in f.message and "KV and state tensors" in f.message


def test_whatif_state_is_not_evictable(capsys):
    rc, out, err = run_main(["whatif", str(HYBRID / "qwen3_next.kvt.h5"), "--policy", "streaming_llm", "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    st = doc["baseline"]["state"]
    assert st["evictable"] is False and st["bytes_peak"] == QWEN_STATE
    assert st["with_state_peak"] == doc["baseline"]["bytes_peak"] + QWEN_STATE  # constant state: peaks add
    for res in doc["policies"][0]["results"]:
        b = res["bytes"]
        assert b["kept_with_state_peak"] == b["kept_peak"] + QWEN_STATE
        assert b["saved_peak"] == doc["baseline"]["bytes_peak"] - b["kept_peak"]  # savings are of the KV alone
    rc, text, _ = run_main(["whatif", str(HYBRID / "qwen3_next.kvt.h5"), "--policy", "streaming_llm"], capsys)
    assert "which no token policy can evict" in " ".join(text.split())


def test_report_draws_state_layers():
    from kvtrace.report import data

    with Trace(HYBRID / "falcon_h1.kvt.h5") as t:
        fp = data.layer_footprint(t)
    assert fp.state_layers.tolist() == [0, 1] and fp.state_bytes.tolist() == [FALCON_STATE // 2] * 2
    assert fp.layers.tolist() == [0, 1]  # parallel hybrid: both layers hold KV too


def test_fleet_exports_state(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    pytest.importorskip("duckdb")
    out = tmp_path / "fleet"
    rc, _, err = run_main(["export", "parquet", str(HYBRID / "minimax.kvt.h5"), "-o", str(out), "-q"], capsys)
    assert rc == 0, err
    rc, text, err = run_main(["fleet", str(out), "--sql", "SELECT count(*) AS n, max(bytes_valid) AS b, "
                              "min(kind) AS k FROM state", "--json"], capsys)
    assert rc == 0, err
    got = json.loads(text)
    rows = got["result"]
    with Trace(HYBRID / "minimax.kvt.h5") as t:
        state = t["state"][:]
    assert rows[0]["n"] == state.size and rows[0]["k"] == "other"
    rc, text, err = run_main(["fleet", str(out), "--sql", "SELECT request, state_bytes FROM requests ORDER BY request",
                              "--json"], capsys)
    got = json.loads(text)
    rows = got["result"]
    assert [r["state_bytes"] for r in rows] == [8192, 16384]
