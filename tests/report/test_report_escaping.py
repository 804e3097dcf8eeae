"""Strings from a trace never land raw in the report's HTML; privacy lines come from contents."""

from __future__ import annotations

import h5py

from kvtrace.report import build_report
from tests.helpers.synth_trace import write_synthetic_trace

HOSTILE_ID = 'evil</td><script>alert("x")</script>\n<img src=x onerror=alert(1)>'


def test_hostile_model_id_and_lying_flags(tmp_path):
    trace = write_synthetic_trace(tmp_path / "evil.kvt.h5", model_id=HOSTILE_ID, payloads=True, requests=1)
    with h5py.File(trace, "a") as f:  # the flag denies the sampled tensors the trace holds
        f["meta"].attrs["contains_tensor_payloads"] = False
    result = build_report(trace, tmp_path / "r.html", run_analyzer=False)
    page = result.html.read_text()
    assert "<script>" not in page and "<img src=x" not in page and "</td><script>" not in page
    assert "evil&lt;/td&gt;&lt;script&gt;" in page  # shown, escaped
    assert "tensor contents stored" in page and "contains_tensor_payloads is false" in page
    assert "heatmaps" not in result.absent  # the sampled contents were drawn despite the flag
