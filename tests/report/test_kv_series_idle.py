"""The report's (and Perfetto's) KV series is the KV alive: it returns to 0 at each finished
request's end instead of holding its last value, which read like a leak, unless the
retention check proved KV alive after the request (then it falls to that:
tests/report/test_report_retention.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvtrace.format import Trace
from kvtrace.report import data

DATA = Path(__file__).resolve().parents[1] / "data"


def test_kv_series_drops_to_zero_at_each_request_end():
    with Trace(DATA / "gpu" / "gpu_clean.kvt.h5") as t:
        ends = [int(e) for e in t.requests[:]["end_ns"]]
        (ts, values), = data.kv_totals_by_device(t).values()
    assert len(ends) == 2
    for end in ends:  # a 0 exactly at each end, after the request's own nonzero points
        i = int(np.flatnonzero(ts == end)[0])
        assert values[i] == 0 and values[i - 1] > 0
    assert values[-1] == 0
    assert np.all(np.diff(ts) >= 0)
    # control: between the two requests' ends the series rises again (the second request's KV)
    between = (ts > ends[0]) & (ts < ends[1])
    assert values[between].max() > 0
