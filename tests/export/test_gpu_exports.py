"""GPU-only: a real CUDA recording (NVML + allocator telemetry, labelled readings) through the
report, Perfetto, the Prometheus replay and the measured-vs-predicted check.

Run on the GPU machine:  pytest tests/export/test_gpu_exports.py -m gpu -q
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def cuda_trace(tmp_path_factory):
    import kvtrace
    from tests.helpers.models import tiny_model

    path = tmp_path_factory.mktemp("gpu") / "gpu.kvt.h5"
    model = tiny_model("gpt_oss", dtype=torch.bfloat16).to("cuda")
    ids = torch.randint(3, 200, (1, 16), device="cuda")
    with kvtrace.record(model, path, structure_every=1):  # every step is checked below
        for _ in range(2):
            model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    return path


def test_kv_prediction_exact_on_cuda(cuda_trace):
    from kvtrace.format import Trace
    from kvtrace.report.kvcheck import check_kv

    with Trace(cuda_trace) as t:
        check = check_kv(t)
    assert check.checked == 48 and check.first_mismatch is None, (check.note, check.first_mismatch)


def test_report_sections_filled_on_cuda(cuda_trace, tmp_path):
    pytest.importorskip("matplotlib")
    from kvtrace.format import Trace
    from kvtrace.report import build_report, data

    result = build_report(cuda_trace, tmp_path / "r.html", tmp_path / "figs", run_analyzer=True)
    assert set(result.absent) <= {"heatmaps"}, result.absent
    with Trace(cuda_trace) as t:
        timelines = {tl.device: tl for tl in data.memory_timelines(t)}
        mems = data.request_memory(t)
    # the GPU's own timeline, and the host's (process RSS) beside it
    names = {s.name for s in timelines[0].series}
    assert {"nvml_used", "allocator_reserved", "allocator_allocated", "kv_bytes"} <= names
    assert {s.name for s in timelines[-1].series} == {"process_rss"}
    assert all(m.baseline_allocated is not None and m.end_gap is not None for m in mems)


def test_perfetto_and_prometheus_on_cuda(cuda_trace, tmp_path):
    from kvtrace.export.perfetto import write_perfetto
    from kvtrace.export.prometheus import exporter_from_trace
    from kvtrace.format import Trace

    out, _ = write_perfetto(cuda_trace, tmp_path / "p.json", run_analyzer=False)
    names = {e["name"] for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "C"}
    assert {"nvml used", "allocator reserved", "allocator allocated", "kv cache"} <= names
    with Trace(cuda_trace) as t:
        text = exporter_from_trace(t, tmp_path / "m.prom").render()
    assert 'kvtrace_gpu_memory_used_bytes{device="0"}' in text
    assert 'kvtrace_allocator_reserved_bytes{device="0"}' in text
