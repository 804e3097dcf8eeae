"""The numbers behind the report's figures, checked against how the synthetic traces were built."""

from __future__ import annotations

import numpy as np
import pytest

from kvtrace.format import Trace
from kvtrace.report import contents, data, quality
from tests.helpers.synth_trace import (
    CONTEXT,
    PER_TOKEN,
    SEGMENT,
    WEIGHTS,
    kept,
    stored,
    write_synthetic_trace,
)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth")
    return {
        "plain": write_synthetic_trace(d / "plain.kvt.h5"),
        "leaky": write_synthetic_trace(d / "leaky.kvt.h5", residual_bytes=5 * 1024**2, requests=3),
        "payloads": write_synthetic_trace(d / "payloads.kvt.h5", payloads=True),
        "wrong": write_synthetic_trace(d / "wrong.kvt.h5", kv_extra_bytes=256),
        "messy": write_synthetic_trace(d / "messy.kvt.h5", dropped_samples=7, recorder_error="nvml poll failed",
                                       telemetry_gap_ms=40, unavailable=("process", "nvml")),
        "crashed": write_synthetic_trace(d / "crashed.kvt.h5", close=False),
    }


def test_timeline_series_and_kv_totals(traces):
    with Trace(traces["plain"]) as t:
        (tl,) = data.memory_timelines(t)
        names = {s.name: s for s in tl.series}
        assert tl.device == 0 and "Synthetic GPU" in tl.label
        assert set(names) == {"nvml_used", "nvml_process_used", "allocator_reserved", "allocator_allocated",
                              "allocator_inactive_split", "kv_bytes"}
        kv = names["kv_bytes"]
        # one point per step of each request, each the sum of the four layers' storage bytes
        assert kv.values.size == 2 * 12 + 2  # and a 0 at each request's end (idle)
        expected = [sum(stored(layer, p + s, p if s == 0 else 1) * PER_TOKEN for layer in range(4))
                    for p in (5, 8) for s in range(12)]
        assert kv.values.tolist() == expected[:12] + [0] + expected[12:] + [0]
        assert np.all(np.diff(kv.t_ns) > 0)
        alloc = names["allocator_allocated"].values
        assert alloc.min() == WEIGHTS and alloc.max() == WEIGHTS + max(expected)
        nvml = names["nvml_used"].values
        assert nvml.min() >= CONTEXT + SEGMENT
        assert data.time_zero_ns(t) <= int(kv.t_ns[0])


def test_timeline_drops_na_readings(traces):
    with Trace(traces["plain"]) as t:
        (tl,) = data.memory_timelines(t)
        # the synthetic steps carry reserved_bytes = -1 (not measured): no series may contain -1
        assert all(int(s.values.min()) >= 0 for s in tl.series)


def test_layer_footprint_at_peak(traces):
    with Trace(traces["plain"]) as t:
        fp = data.layer_footprint(t)
    assert (fp.request, fp.step, fp.tokens_seen) == (1, 11, 19)
    assert fp.bytes_valid.tolist() == [kept(layer, 19) * PER_TOKEN for layer in range(4)]
    # a saturated sliding layer's storage spans window - 1 kept tokens plus the new one
    assert fp.bytes_allocated.tolist() == [8 * PER_TOKEN, 19 * PER_TOKEN] * 2
    assert [data.layer_type_name(c) for c in fp.layer_types] == ["sliding", "full", "sliding", "full"]


def test_growth_matches_geometry_exactly(traces):
    with Trace(traces["plain"]) as t:
        gc = data.growth_curves(t)
    assert gc.expected is not None, gc.expectation_note
    for name in ("full", "sliding", "total"):
        assert np.array_equal(gc.measured[name], gc.expected[name]), name
    # the sliding layers saturate at window - 1 = 7 tokens
    assert set(gc.measured["sliding"].tolist()) == {2 * 7 * PER_TOKEN}


def test_growth_detects_disagreement(traces):
    with Trace(traces["wrong"]) as t:
        gc = data.growth_curves(t)
    diff = gc.measured["total"] - gc.expected["total"]
    assert set(diff.tolist()) == {2 * 256}  # two full layers, 256 extra bytes each
    assert np.array_equal(gc.measured["sliding"], gc.expected["sliding"])


def test_post_eos_residual_and_allocator_gap(traces):
    with Trace(traces["leaky"]) as t:
        mems = data.request_memory(t)
    assert [m.request for m in mems] == [0, 1, 2]
    for i, m in enumerate(mems):
        assert m.baseline_allocated == WEIGHTS + i * 5 * 1024**2
        assert m.residual_allocated == 5 * 1024**2
        assert m.end_gap is not None and 0 < m.end_gap <= 2 * SEGMENT
        assert m.end_inactive_split == SEGMENT // 4
    with Trace(traces["plain"]) as t:
        assert all(m.residual_allocated == 0 for m in data.request_memory(t))


def test_decimate_keeps_extremes():
    t = np.arange(100_000, dtype=np.int64)
    v = np.zeros(100_000, dtype=np.int64)
    v[54_321] = 10**9
    v[7] = -5
    td, vd = data.decimate(t, v, 400)
    assert td.size <= 400 and vd.max() == 10**9 and vd.min() == -5
    assert np.all(np.diff(td) > 0)


def test_quality_counts_what_was_written(traces):
    with Trace(traces["plain"]) as t:
        q = quality.assess(t)
    assert q.complete and q.dropped_samples == 0 and q.recorder_errors == 0 and q.clock_gaps == 0
    assert q.problems == ["source process unavailable: process sampling disabled in this synthetic trace"]
    with Trace(traces["messy"]) as t:
        q = quality.assess(t)
    assert q.dropped_samples == 7 and q.dropped_sample_events == 1
    assert q.recorder_error_messages == ["nvml poll failed"]
    assert set(q.unavailable_sources) == {"process", "nvml"}
    # one stall of 40 ms with 1 ms sampling, seen in both telemetry tables
    assert q.clock_gaps == 2
    assert {g.table for g in q.clock_gap_list} == {"telemetry/nvml", "telemetry/allocator"}
    assert all(g.gap_ns > 40_000_000 and g.period_ns == 1_000_000 for g in q.clock_gap_list)
    with Trace(traces["crashed"]) as t:
        q = quality.assess(t)
    assert not q.complete
    assert any(p.startswith("incomplete") for p in q.problems)


def test_head_norm_heatmap(traces):
    with Trace(traces["payloads"]) as t:
        maps = contents.head_norm_heatmaps(t)
    assert [m.title.split()[0] for m in maps] == ["key", "value"]
    for hm in maps:
        assert hm.layers == [0, 1, 2, 3] and hm.heads == [0, 1]
        # head 1 was scaled x4: its mean norm is about 4x head 0 (random normal rows, d = 16)
        ratio = hm.values[:, 1] / hm.values[:, 0]
        assert np.all((ratio > 2.5) & (ratio < 6.5)), ratio


def test_entropy_heatmap(traces):
    with Trace(traces["payloads"]) as t:
        hm = contents.entropy_heatmap(t)
    assert hm.layers == [1, 3] and hm.heads == [0, 1, 2, 3]
    # query head 0 is zero: uniform attention, normalised entropy exactly 1
    assert np.allclose(hm.values[:, 0], 1.0, atol=1e-12)
    # query head 2 = 10 x the last key of its KV head: attention concentrates on that key
    assert np.all(hm.values[:, 2] < 0.2)
    assert np.all((hm.values >= 0) & (hm.values <= 1 + 1e-12))


def test_no_payloads_no_heatmaps(traces):
    with Trace(traces["plain"]) as t:
        assert contents.head_norm_heatmaps(t) == []
        assert contents.entropy_heatmap(t) is None
