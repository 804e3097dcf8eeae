"""Perfetto / Chrome trace-event JSON: structure against the format's rules, values against the trace."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from kvtrace.cli import cli
from kvtrace.export.perfetto import HOST_PID, device_pid, trace_events, write_perfetto
from kvtrace.format import EventKind, Trace
from kvtrace.report import data
from kvtrace.report.findings import FindingRow
from tests.helpers.synth_trace import write_synthetic_trace

PHASES = {"B", "E", "X", "i", "I", "C", "M", "b", "e", "n", "s", "t", "f", "P", "O", "N", "D"}
METADATA_NAMES = {"process_name", "process_labels", "process_sort_index", "thread_name", "thread_sort_index"}


def check_trace_event_format(doc: dict) -> None:
    """The rules of the Trace Event Format (JSON object form) that Perfetto's importer relies on."""
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list)
    assert doc.get("displayTimeUnit", "ms") in ("ms", "ns")
    named_pids = set()
    for e in doc["traceEvents"]:
        assert e["ph"] in PHASES, e
        assert isinstance(e["name"], str) and e["name"], e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        if e["ph"] == "M":
            assert e["name"] in METADATA_NAMES, e
            key = "sort_index" if e["name"].endswith("sort_index") else "name"
            assert key in e["args"], e
            if e["name"] == "process_name":
                named_pids.add(e["pid"])
            continue
        assert isinstance(e["ts"], (int, float)) and math.isfinite(e["ts"]) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
        if e["ph"] == "C":
            assert e["args"] and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                     for v in e["args"].values()), e
        if e["ph"] in ("i", "I"):
            assert e.get("s", "t") in ("g", "p", "t"), e
    used = {e["pid"] for e in doc["traceEvents"] if e["ph"] != "M"}
    assert used <= named_pids, f"pids without process_name: {used - named_pids}"
    # complete events on one thread must nest or be disjoint
    by_thread: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            by_thread.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_thread.values():
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack: list[float] = []
        for start, end in spans:
            while stack and stack[-1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1], f"overlapping spans {spans}"
            stack.append(end)
    json.dumps(doc, allow_nan=False)  # strict JSON: no NaN or Infinity


@pytest.fixture(scope="module")
def two_devices(tmp_path_factory):
    return write_synthetic_trace(tmp_path_factory.mktemp("pf") / "t.kvt.h5", devices=2, requests=2)


def test_structure_and_processes(two_devices):
    with Trace(two_devices) as t:
        doc = trace_events(t)
    check_trace_event_format(doc)
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert set(names) == {HOST_PID, device_pid(0), device_pid(1)}
    assert names[device_pid(1)].startswith("cuda:1")


def test_counters_equal_trace_values(two_devices):
    with Trace(two_devices) as t:
        doc = trace_events(t)
        t0 = data.time_zero_ns(t)
        nvml = t.nvml[:]
        kv_by_dev = data.kv_totals_by_device(t)
    ev = doc["traceEvents"]
    for dev in (0, 1):
        rows = nvml[nvml["device"] == dev]
        counter = [e for e in ev if e["ph"] == "C" and e["name"] == "nvml used" and e["pid"] == device_pid(dev)]
        assert [e["args"]["bytes"] for e in counter] == rows["used_bytes"].tolist()
        assert np.allclose([e["ts"] for e in counter], (rows["t_ns"].astype(np.int64) - t0) / 1000)
        kv = [e["args"]["bytes"] for e in ev if e["ph"] == "C" and e["name"] == "kv cache"
              and e["pid"] == device_pid(dev)]
        assert kv == kv_by_dev[dev][1].tolist() and len(kv) == 24 + 2  # a 0 at each request's end
    # layers 0-1 on device 0 (sliding + full), 2-3 on device 1: same geometry, same bytes per step
    assert kv_by_dev[0][1].tolist() == kv_by_dev[1][1].tolist()
    series = {e["name"] for e in ev if e["ph"] == "C"}
    assert series == {"nvml used", "nvml process used", "allocator reserved", "allocator allocated",
                      "allocator inactive split", "kv cache"}


def test_phases_spans_and_findings(two_devices):
    finding = FindingRow("post_eos", "warning", 0.7, "request 1 keeps memory", request=1,
                         evidence={"residual_bytes": 1024})
    with Trace(two_devices) as t:
        doc = trace_events(t, [finding])
        eos = t.events.where(kind=EventKind.EOS)
        requests = t.requests[:]
    ev = doc["traceEvents"]
    check_trace_event_format(doc)
    assert len([e for e in ev if e["ph"] == "i" and e["name"] == "eos"]) == eos.size == 2
    for kind in ("prefill_start", "prefill_end", "gc", "empty_cache", "request_end"):
        assert any(e["ph"] == "i" and e["name"] == kind for e in ev), kind
    spans = [e for e in ev if e["ph"] == "X"]
    assert sorted(e["name"] for e in spans) == ["decode", "decode", "prefill", "prefill", "request 0", "request 1"]
    (f,) = [e for e in ev if e.get("cat") == "finding"]
    assert f["s"] == "g" and f["name"] == "warning: post_eos"
    assert f["args"]["evidence"] == {"residual_bytes": 1024}
    end1 = int(requests[requests["request"] == 1]["end_ns"][0])
    assert f["ts"] == pytest.approx((end1 - doc_t0(two_devices)) / 1000)


def doc_t0(path) -> int:
    with Trace(path) as t:
        return data.time_zero_ns(t)


def test_crashed_trace_still_exports(tmp_path):
    path = write_synthetic_trace(tmp_path / "c.kvt.h5", close=False)
    out, info = write_perfetto(path, tmp_path / "c.json", run_analyzer=False)
    check_trace_event_format(json.loads(out.read_text()))
    assert info["findings"] is None


def test_cli(tmp_path, two_devices):
    out = tmp_path / "p.json"
    res = CliRunner().invoke(cli, ["export", "perfetto", str(two_devices), "-o", str(out), "--no-analysis",
                                   "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    assert info["output"] == str(out) and info["events"] == len(json.loads(out.read_text())["traceEvents"])
    res = CliRunner().invoke(cli, ["export", "perfetto", str(tmp_path / "none.h5"), "-o", str(out)])
    assert res.exit_code == 2
    assert "Examples:" in CliRunner().invoke(cli, ["export", "perfetto", "--help"]).output
