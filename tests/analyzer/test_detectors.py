"""Each detector on synthetic traces shaped like the recorder's: fires on its defect, stays quiet
on clean data, skips with a reason when its data is absent."""

import pytest

import kvtrace
from kvtrace.analyzer import detector_names, register
from kvtrace.analyzer.base import REGISTRY, Detector
from kvtrace.format import schema
from tests.helpers.synth import (
    GEMMA4_SHARED,
    GPT_OSS_LIKE,
    LLAMA_LIKE,
    MISTRAL_LIKE,
    GiB,
    MiB,
    Req,
    assert_clean,
    build,
    scores,
)


def findings(report, detector, kind=None):
    return [f for f in report.result(detector).findings if kind is None or f.kind == kind]


def test_gpt_oss_geometry_is_bimodal_by_design(tmp_path):
    # 4,032-token prompt + 64 new: the final state of the reference's 4,096-token run in 64 steps.
    p = build(tmp_path / "g.kvt.h5", GPT_OSS_LIKE, [Req(4032, 64)], gpu=True)
    r = kvtrace.analyze(p)
    assert_clean(r)
    (u,) = findings(r, "layer_uniformity")
    assert u.kind == "bimodal_by_design" and u.score == 0
    assert u.evidence["cv"].value == pytest.approx(0.9398, abs=1e-4)
    assert u.evidence["sliding_median_bytes"].value == 260_096  # 127 tokens x 8 heads x 64 x 2 B x 2
    assert u.evidence["full_median_bytes"].value == 8_386_560  # 4,095 tokens
    assert "18 sliding layers hold 127 tokens (254.0 KiB each)" in u.message
    assert "18 full layers hold 4,095 tokens (8.0 MiB each)" in u.message
    assert "CV 0.94: bimodal by design" in u.message
    assert not findings(r, "layer_anomaly")  # sliding and full layers are never outliers of each other


def test_linear_ramp_with_duplication_is_flagged_no_plateau_guard(tmp_path):
    clean = kvtrace.analyze(build(tmp_path / "c.kvt.h5", LLAMA_LIKE, [Req(8, 40)]))
    assert_clean(clean)
    # Every layer holds exactly twice the expected bytes: still a perfectly linear ramp.
    dup = kvtrace.analyze(build(tmp_path / "d.kvt.h5", LLAMA_LIKE,
                                [Req(8, 40, layer_scale={i: 2.0 for i in range(4)})]))
    (f,) = findings(dup, "growth_curve", "duplication")
    assert f.score >= 0.5 and f.layers == [0, 1, 2, 3]
    assert f.evidence["ratio"].value == pytest.approx(2.0, rel=0.01)
    assert not findings(dup, "growth_curve", "superlinear_growth")  # linear, and measured as such
    assert "2.0x" in f.message


def test_superlinear_storage_growth(tmp_path):
    r = kvtrace.analyze(build(tmp_path / "a.kvt.h5", LLAMA_LIKE, [Req(8, 40, arena={1})]))
    (s,) = findings(r, "growth_curve", "superlinear_growth")
    assert s.score >= 0.5 and s.layers == [1]
    assert findings(r, "growth_curve", "duplication")[0].layers == [1]


def test_sliding_layer_that_does_not_slide(tmp_path):
    r = kvtrace.analyze(build(tmp_path / "s.kvt.h5", MISTRAL_LIKE, [Req(6, 20, no_slide={1})]))
    (w,) = findings(r, "growth_curve", "window_not_applied")
    assert w.score >= 0.5 and w.layers == [1]
    assert "window 8" in w.message and "25 tokens" in w.message
    (a,) = findings(r, "layer_anomaly")
    assert a.score >= 0.5 and a.layers == [1]
    assert r.score("layer_uniformity") >= 0.5


def test_static_over_allocation(tmp_path):
    fit = kvtrace.analyze(build(tmp_path / "f.kvt.h5", LLAMA_LIKE, [Req(6, 10, static_len=15)]))
    assert_clean(fit)
    r = kvtrace.analyze(build(tmp_path / "o.kvt.h5", LLAMA_LIKE, [Req(6, 10, static_len=512)]))
    (f,) = findings(r, "growth_curve", "static_over_allocation")
    assert f.score >= 0.5
    assert f.evidence["capacity_tokens"].value == 512 and f.evidence["used_tokens"].value == 15
    assert "97%" in f.message
    assert not findings(r, "growth_curve", "duplication")  # preallocation is not duplication


def test_post_eos_on_allocator_bytes_with_attribution(tmp_path):
    reqs = [Req(16, 32), Req(16, 32, retained=8 * MiB, retention_layers=[0, 1, 2, 3])]
    r = kvtrace.analyze(build(tmp_path / "p.kvt.h5", LLAMA_LIKE, reqs, gpu=True))
    fs = findings(r, "post_eos")
    leak = [f for f in fs if f.requests == [1]][0]
    assert leak.score == 1.0 and leak.layers == [0, 1, 2, 3]
    assert leak.evidence["retained_bytes"].value == 8 * MiB
    assert "allocator allocated bytes" in leak.message and "GenerateDecoderOnlyOutput" in leak.message
    # The first request released everything: its own baseline, not a global one.
    assert all(f.score == 0 for f in fs if f.requests == [0])


def test_post_eos_per_request_baseline_does_not_blame_later_requests(tmp_path):
    # Request 0 leaks; requests 1 and 2 are clean and start from a higher baseline.
    reqs = [Req(16, 32, retained=64 * MiB, retention_layers=[0]), Req(16, 32), Req(16, 32)]
    r = kvtrace.analyze(build(tmp_path / "b.kvt.h5", LLAMA_LIKE, reqs, gpu=True))
    by_req = {f.requests[0]: f.score for f in findings(r, "post_eos")}
    assert by_req[0] == 1.0 and by_req.get(1, 0) == 0 and by_req.get(2, 0) == 0


def test_fragmentation_split_vs_releasable(tmp_path):
    clean = kvtrace.analyze(build(tmp_path / "c.kvt.h5", LLAMA_LIKE, [Req(16, 32)], gpu=True))
    (c,) = findings(clean, "fragmentation")
    assert c.score == 0 and c.kind == "allocator_cache" and "releasable" in c.message
    frag = kvtrace.analyze(build(tmp_path / "f.kvt.h5", LLAMA_LIKE, [Req(16, 32)], gpu=True,
                                 split_fn=lambda step: step * 40 * MiB))
    (f,) = findings(frag, "fragmentation")
    assert f.score >= 0.5 and f.kind == "split_fragmentation"
    assert f.evidence["max_inactive_split_bytes"].value == 31 * 40 * MiB
    assert f.evidence["split_trend_bytes_per_s"].value > 0 and "grew by" in f.message
    assert f.device == 0


def test_prefill_spike(tmp_path):
    cfg = {**LLAMA_LIKE, "num_attention_heads": 32, "num_key_value_heads": 8}
    # An ordinary long eager prefill on an 80 GiB device: named, with its cause, but information.
    r = kvtrace.analyze(build(tmp_path / "s.kvt.h5", cfg, [Req(4096, 8, peak_extra=6 * GiB)], gpu=True))
    (f,) = findings(r, "prefill_spike")
    assert f.score <= 0.1 and f.kind == "eager_attention_spike" and "eager attention" in f.message
    assert f.evidence["eager_scores_per_layer_bytes"].value == 32 * 4096 * 4096 * 2
    # The same spike on a 9 GiB device peaks at 89% of its memory: critical (the next prompt fails).
    near = kvtrace.analyze(build(tmp_path / "n.kvt.h5", cfg, [Req(4096, 8, peak_extra=6 * GiB)], gpu=True,
                                 total_memory=9 * GiB))
    (f,) = findings(near, "prefill_spike")
    assert f.score >= 0.8 and f.evidence["peak_share_of_limit"].value >= 0.85, f.message
    clean = kvtrace.analyze(build(tmp_path / "c.kvt.h5", cfg, [Req(4096, 8, peak_extra=16 * MiB)], gpu=True,
                                  total_memory=9 * GiB))
    assert clean.score("prefill_spike") == 0


def test_capacity_headroom(tmp_path):
    ok = kvtrace.analyze(build(tmp_path / "o.kvt.h5", GPT_OSS_LIKE, [Req(64, 64)], gpu=True))
    (c,) = findings(ok, "capacity")
    assert c.score == 0 and c.evidence["max_concurrent_sequences"].value > 100
    full = kvtrace.analyze(build(tmp_path / "f.kvt.h5", GPT_OSS_LIKE, [Req(64, 64)], gpu=True,
                                 total_memory=80 * GiB, weights=79 * GiB))
    (c,) = findings(full, "capacity")
    assert c.score >= 0.8 and "NVIDIA H100" in c.message


def test_oom_state_and_cause(tmp_path):
    text = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB"
    r = kvtrace.analyze(build(tmp_path / "o.kvt.h5", LLAMA_LIKE,
                              [Req(16, 32, outcome=schema.Outcome.OOM, oom_text=text)], gpu=True))
    (f,) = findings(r, "oom")
    assert f.score == 1.0 and f.severity.label == "critical"
    assert f.evidence["requested_bytes"].value == 2 * GiB
    assert f.kind == "oom_fragmentation"  # 8 GiB sat in split blocks at the OOM reading
    clean = kvtrace.analyze(build(tmp_path / "c.kvt.h5", LLAMA_LIKE, [Req(16, 32)], gpu=True))
    assert not findings(clean, "oom")


def test_kv_sharing_is_reported_as_sharing_only(tmp_path):
    r = kvtrace.analyze(build(tmp_path / "s.kvt.h5", GEMMA4_SHARED, [Req(6, 14)]))
    assert_clean(r)
    (a,) = findings(r, "aliasing")
    assert a.kind == "sharing" and "layers 3-5 reuse the KV of layers 1-2" in a.message
    (u,) = findings(r, "layer_uniformity")
    assert u.score == 0 and "3 KV-sharing layers hold none" in u.message


def test_undeclared_shared_storage_is_flagged(tmp_path):
    r = kvtrace.analyze(build(tmp_path / "u.kvt.h5", LLAMA_LIKE, [Req(6, 10, same_storage=(0, 2))]))
    (f,) = findings(r, "aliasing", "unexpected_sharing")
    assert f.score >= 0.5 and f.layers == [0, 2]


def test_cpu_trace_skips_what_needs_a_gpu_with_reasons(tmp_path):
    r = kvtrace.analyze(build(tmp_path / "c.kvt.h5", LLAMA_LIKE, [Req(6, 10)]))
    status = {x.name: (x.status, x.reason) for x in r.results}
    for name in ("fragmentation", "prefill_spike"):
        assert status[name][0] == "skipped" and "allocator" in status[name][1] and "no CUDA device" in status[name][1]
    assert status["capacity"][0] == "skipped"
    # No allocator, no NVML and no retention tracking: post_eos says so instead of guessing.
    assert status["post_eos"][0] == "skipped" and "retention" in status["post_eos"][1]
    assert status["growth_curve"][0] == "ran"


def test_device_growth_beyond_the_cache(tmp_path):
    r = kvtrace.analyze(build(tmp_path / "g.kvt.h5", LLAMA_LIKE, [Req(16, 32, device_leak_per_step=1 * MiB)],
                              gpu=True))
    (f,) = findings(r, "growth_curve", "unexplained_memory_growth")
    assert f.score >= 0.5 and "Allocated memory grew 30.0 MiB over 30 decode steps" in f.message


def test_detector_selection_and_error_isolation(tmp_path):
    p = build(tmp_path / "c.kvt.h5", LLAMA_LIKE, [Req(6, 10)])
    r = kvtrace.analyze(p, detectors=["aliasing"])
    assert [x.name for x in r.results] == ["aliasing"]

    @register
    class Broken(Detector):
        name = "broken_for_test"
        summary = "raises"

        def run(self, ctx):
            raise RuntimeError("boom")

    try:
        r = kvtrace.analyze(p, detectors=["broken_for_test", "aliasing"])
        assert r.result("broken_for_test").status == "error" and "boom" in r.result("broken_for_test").reason
        assert r.result("aliasing").status == "ran"
    finally:
        REGISTRY.pop("broken_for_test")
    assert "broken_for_test" not in detector_names()


def test_clean_synthetic_traces_score_low_everywhere(tmp_path):
    for i, (cfg, gpu) in enumerate([(LLAMA_LIKE, True), (MISTRAL_LIKE, False), (GPT_OSS_LIKE, True),
                                    (GEMMA4_SHARED, True)]):
        r = kvtrace.analyze(build(tmp_path / f"{i}.kvt.h5", cfg, [Req(12, 20), Req(30, 5, batch=2)], gpu=gpu))
        assert_clean(r)
        assert all(x.status != "error" for x in r.results), scores(r)
