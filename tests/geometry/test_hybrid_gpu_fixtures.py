"""The hybrid caches recorded on an NVIDIA H200 (tests/data/hybrid_gpu, made by its
make_hybrid_gpu_fixtures.py with transformers 5.24: Qwen3-Next-80B-A3B and Falcon-H1-7B geometry,
cut to 4 layers, bf16): the trace validates, `calc --trace` predicts the recorded state and KV
exactly, the state is flat within a request and scales with the batch, and a clean hybrid run
raises no finding. The analyser and calc need no GPU."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kvtrace
from kvtrace.analyzer.base import Severity
from tests.helpers.cli_run import run_main

DATA = Path(__file__).resolve().parents[1] / "data" / "hybrid_gpu"
FIXTURES = sorted(DATA.glob("*.kvt.h5"))


@pytest.fixture(params=FIXTURES, ids=lambda p: p.name)
def fixture(request) -> Path:
    return request.param


def test_both_families_are_committed():
    assert {p.name for p in FIXTURES} == {"qwen3_next.kvt.h5", "falcon_h1.kvt.h5"}


def test_recorded_on_a_gpu_and_valid(fixture, capsys):
    rc, out, err = run_main(["validate", str(fixture)], capsys)
    assert rc == 0, out + err
    with kvtrace.open(fixture) as t:
        devices = t.table("devices")
    assert [bytes(n).decode() for n in devices["name"]] == ["NVIDIA H200"]


def test_state_is_flat_per_request_and_scales_with_the_batch(fixture):
    with kvtrace.open(fixture) as t:
        rows = t.table("state")
        reqs = t.table("requests")
    assert rows.size > 0 and {1, 2} <= set(rows["kind"].tolist())  # conv and recurrent state
    totals = {}
    for r in (0, 1):
        mine = rows[rows["request"] == r]
        per_step = [int(mine["bytes_unique"][mine["step"] == s].sum()) for s in np.unique(mine["step"])]
        assert len(per_step) > 16 and len(set(per_step)) == 1, per_step[:8]  # constant in tokens seen
        totals[r] = per_step[0]
    batch = {int(q["request"]): int(q["batch_size"]) for q in reqs}
    assert batch == {0: 1, 1: 2}
    assert totals[1] == 2 * totals[0]


def test_calc_trace_predicts_state_and_kv(fixture, capsys):
    rc, out, err = run_main(["calc", "--trace", str(fixture), "--context", "4k", "--gpu-memory", "80GiB", "--json"],
                            capsys)
    assert rc == 0, err
    check = json.loads(out)["trace_check"]
    assert check["equal"] is True, check
    assert check["state"]["equal"] is True and check["state"]["measured_bytes"] > 0, check["state"]


def test_a_clean_hybrid_run_raises_no_finding(fixture):
    report = kvtrace.analyze(fixture)
    assert all(x.status != "error" for x in report.results), [(x.name, x.reason) for x in report.results]
    loud = [(f.detector, f.severity, f.message) for f in report.findings if f.severity >= Severity.LOW]
    assert not loud, loud
