"""Real recordings of the tiny architecture matrix (kvtrace.record on CPU, random weights):
predicted KV bytes (kvtrace.geometry / kvtrace calc) equal the recorded ones exactly at every
step, and the report and the Perfetto export work on real traces, sampled contents included."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvtrace  # noqa: E402
from kvtrace import calc as planner  # noqa: E402
from kvtrace.format import Phase, Trace  # noqa: E402
from kvtrace.report import build_report, data  # noqa: E402
from kvtrace.report.kvcheck import check_kv  # noqa: E402
from tests.helpers.models import TINY_MODEL_NAMES, tiny_model  # noqa: E402

PROMPT, NEW = 5, 12  # 5 + 12 tokens saturate the tiny window of 8


def _record(name: str, path, **options) -> None:
    model = tiny_model(name)
    ids = torch.randint(3, 200, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    with kvtrace.record(model, path, **{"structure_every": 1, **options}):  # every step
        model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    d = tmp_path_factory.mktemp("matrix")
    out = {}
    for name in TINY_MODEL_NAMES:
        _record(name, d / f"{name}.kvt.h5")
        out[name] = d / f"{name}.kvt.h5"
    return out


@pytest.mark.parametrize("name", TINY_MODEL_NAMES)
def test_predicted_equals_measured_every_step(recorded, name):
    with Trace(recorded[name]) as t:
        check = check_kv(t)
        steps = t.steps[:]
        gc = data.growth_curves(t)
        config = t.meta.model_config
    assert check.checked == NEW, check.note
    assert check.first_mismatch is None, check.first_mismatch
    assert check.equal == NEW
    # the capacity planner's KV per request equals the recorded cache at the last decode step
    last = steps[steps["phase"] == int(Phase.DECODE)][-1]
    plan = planner.plan_capacity(config, context_len=int(last["tokens_seen"]), gpu_memory_bytes=1024**3,
                                 kv_dtype_bytes=4, weight_dtype_bytes=4, encoder_len=PROMPT)
    assert plan.kv_bytes_per_request_total == int(last["kv_bytes_unique"])
    # valid bytes drawn in the report's growth curves match geometry too
    assert gc.expected is not None, gc.expectation_note
    for kind, values in gc.measured.items():
        assert values.tolist() == gc.expected[kind].tolist(), kind


def test_report_and_perfetto_on_real_trace(recorded, tmp_path):
    pytest.importorskip("matplotlib")
    from kvtrace.export.perfetto import write_perfetto

    result = build_report(recorded["gpt_oss"], tmp_path / "r.html", run_analyzer=True)
    # CPU run: no CUDA allocator readings, no sampled contents; everything else is drawn
    assert set(result.absent) <= {"heatmaps", "allocator-state", "post-eos"}, result.absent
    assert "heatmaps" in result.absent
    assert result.findings is not None
    page = result.html.read_text()
    assert "Measured valid KV bytes equal the expectation at 12 of 12 steps" in page
    out, info = write_perfetto(recorded["gpt_oss"], tmp_path / "p.json", run_analyzer=False)
    doc = json.loads(out.read_text())
    assert any(e["ph"] == "C" and e["name"] == "kv cache" for e in doc["traceEvents"])
    assert sorted(e["name"] for e in doc["traceEvents"] if e["ph"] == "X") == ["decode", "prefill", "request 0"]


def test_heatmaps_from_recorded_samples(tmp_path):
    pytest.importorskip("matplotlib")
    from kvtrace.recorder.sampling import SamplingSettings

    path = tmp_path / "s.kvt.h5"
    _record("llama", path, sampling=SamplingSettings(every_n_steps=4, queries=True))
    result = build_report(path, tmp_path / "r.html", tmp_path / "figs", run_analyzer=False)
    assert "heatmaps" not in result.absent
    names = {p.stem.rsplit("_r", 1)[0] for p in result.figures}  # one set per request: name_r<request>
    assert {"heatmap_key_norms", "heatmap_value_norms", "heatmap_attention_entropy"} <= names
