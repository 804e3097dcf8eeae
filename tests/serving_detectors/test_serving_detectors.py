"""The serving detectors on real continuous-batching recordings (serving_scenarios.py: tiny models on
the CPU, transformers' own scheduler and paged cache): clean controls stay at info, each planted
fault is named by its detector with the numbers the trace holds; traces without /sched skip them."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("transformers.generation.continuous_batching")

import serving_scenarios as S  # noqa: E402

import kvtrace  # noqa: E402
from kvtrace.analyzer.base import Severity  # noqa: E402
from kvtrace.analyzer.detectors._serving import NO_SCHED  # noqa: E402
from kvtrace.analyzer.view import TraceView  # noqa: E402
from kvtrace.format import schema  # noqa: E402
from kvtrace.format.reader import open_trace  # noqa: E402

SERVING = ("serving_capacity", "concurrency_headroom", "block_waste", "preemption", "queueing", "prefix_cache",
           "over_reservation", "context_spike")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """name -> (trace path, report), each scenario recorded once."""
    import torch

    out: dict[str, tuple] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("serving")

    def get(name: str):
        if name not in out:
            path = getattr(S, name)(tmp / f"{name}.kvt.h5")
            out[name] = (path, kvtrace.analyze(path))
        return out[name]

    yield get
    torch.set_num_threads(threads)


def _one(report, detector: str):
    result = report.result(detector)
    assert result.status == "ran", (detector, result.reason)
    (f,) = result.findings
    return f


@pytest.mark.parametrize("name", ["clean_llama", "clean_gemma3", "clean_prefix_shared", "clean_budget_queue"])
def test_clean_serving_runs_say_nothing_above_info(recorded, name):
    _, report = recorded(name)
    ran = {r.name for r in report.results if r.status == "ran"}
    assert set(SERVING) <= ran
    loud = [(f.detector, f.kind, round(f.score, 3), f.message) for f in report.findings if f.severity >= Severity.LOW]
    assert not loud, loud


def test_budget_queueing_is_told_apart_from_memory(recorded):
    path, report = recorded("clean_budget_queue")
    f = _one(report, "queueing")
    assert f.kind == "queued_on_budget" and f.score == 0.0 and "token budget" in f.message
    with open_trace(path) as t:
        assert int(t.sched()["waiting"].max()) == f.evidence["max_waiting"].value > 0


def test_pool_too_small_is_named_by_capacity_concurrency_and_queueing(recorded):
    path, report = recorded("plant_pool_too_small")
    cap, conc, queue = (_one(report, d) for d in ("serving_capacity", "concurrency_headroom", "queueing"))
    with open_trace(path) as t:
        sched = t.sched()
    usage = (sched["pool_bytes"] - sched["free_bytes"]) / sched["pool_bytes"]
    assert cap.kind == "pool_usage" and cap.severity == Severity.CRITICAL
    assert cap.evidence["peak_block_usage"].value == pytest.approx(usage.max(), abs=1e-4) == 1.0
    assert cap.evidence["steps_at_or_above_80pct"].value == int(np.sum(usage >= 0.8)) >= 2
    # 2-block requests (16.0 KiB) in a 16-block pool: 8 fit; 10 offered at step 0
    assert conc.evidence["requests_that_fit"].value == 8 and conc.evidence["offered_at_once"].value == 10
    assert conc.severity == Severity.CRITICAL
    assert queue.kind == "queued_on_memory" and queue.score >= 0.5


def test_large_pages_waste_the_pool_and_smaller_pages_are_computed(recorded):
    path, report = recorded("plant_large_pages")
    f = _one(report, "block_waste")
    assert f.severity == Severity.CRITICAL and f.evidence["tokens_per_block"].value == 128
    with open_trace(path) as t:
        groups, blocks = t.sched_groups(), t.blocks()
    step = f.steps[0]
    g = groups[groups["step"] == step][0]
    b = blocks[blocks["step"] == step]
    per_token = int(g["bytes_per_block"]) // int(g["tokens_per_block"])
    for page in (16, 128, 256):  # the evidence equals the tails computed from /blocks by hand
        tails = sum(math.ceil(int(v) / page) * page - int(v) for v in b["tokens_valid"])
        assert f.evidence[f"waste_bytes_page_{page}"].value == tails * per_token
    assert f.evidence["waste_bytes_page_16"].value < f.evidence["waste_bytes_page_128"].value
    assert "smallest at 16 tokens per block" in f.message


def test_preemption_counts_recomputed_tokens_and_names_requests(recorded):
    path, report = recorded("plant_preemption")
    f = _one(report, "preemption")
    with open_trace(path) as t:
        pre = t.events(schema.EventKind.PREEMPTED)
        sched = t.sched()
    assert f.evidence["preemptions"].value == pre.size > 0 and f.evidence["offloads"].value == 0
    assert f.evidence["tokens_recomputed"].value == int(pre["value"].sum())
    assert f.evidence["tokens_scheduled"].value == int(sched["prefill_tokens"].sum() + sched["decode_tokens"].sum())
    assert f.requests == sorted(set(pre["request"].tolist())) and f.severity >= Severity.HIGH


def test_sharing_off_misses_the_repeated_prompts(recorded):
    _, report = recorded("plant_sharing_off")
    f = _one(report, "prefix_cache")
    # 51-token prompt, 16-token pages: 3 complete blocks (48 tokens) per repeat, 2 repeats
    assert f.kind == "missed_prefix_hits" and f.evidence["expected_hit_tokens"].value == 96
    assert f.evidence["missed_hit_tokens"].value == 96 and f.severity == Severity.CRITICAL
    assert "sharing is off" in f.message
    _, shared = recorded("clean_prefix_shared")
    g = _one(shared, "prefix_cache")
    assert g.evidence["hit_tokens"].value == 96 and g.evidence["missed_hit_tokens"].value == 0 and g.score == 0.0


def test_context_spike_against_the_median(recorded):
    path, report = recorded("plant_context_spike")
    f = _one(report, "context_spike")
    with open_trace(path) as t:
        cb = TraceView(t).cb_requests
    context = cb["prompt_tokens"].astype(int) + cb["new_tokens"].astype(int)
    assert f.evidence["context_tokens"].value == context.max() == 100
    assert f.evidence["typical_context_tokens"].value == np.median(context) == 10
    assert f.severity == Severity.CRITICAL and f.requests == [int(cb["request"][np.argmax(context)])]


def test_generate_traces_skip_the_serving_detectors(tmp_path):
    from tracebuild import write_minimal

    path = tmp_path / "plain.kvt.h5"
    write_minimal(path)
    report = kvtrace.analyze(path)
    for name in SERVING:
        r = report.result(name)
        assert (r.status, r.reason, r.findings) == ("skipped", NO_SCHED, [])


def test_findings_name_the_load_test_phase(tmp_path):
    """Phase markers (Recorder.mark_phase, as kvtrace loadtest writes them) name the phase in which the
    pool filled, the most requests were offered and the spike arrived."""
    model = S.model("llama")
    gc, cfg = S._configs(4, page_size=16, num_blocks=16, max_batch_tokens=256)
    path = tmp_path / "phases.kvt.h5"
    with kvtrace.record(model, path) as rec:
        rec.mark_phase("single")
        model.generate_batch(inputs=S.prompts([6]), generation_config=gc, continuous_batching_config=cfg, warmup=False)
        rec.mark_phase("concurrent")
        model.generate_batch(inputs=S.prompts([20] * 10), generation_config=gc, continuous_batching_config=cfg,
                             warmup=False)
    report = kvtrace.analyze(path)
    for detector in ("serving_capacity", "concurrency_headroom"):
        (f,) = [f for f in report.result(detector).findings if f.score >= 0.5]
        assert "(phase 'concurrent')" in f.message, f.message
