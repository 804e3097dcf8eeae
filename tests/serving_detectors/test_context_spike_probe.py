"""context_spike on load-test recordings: the long phase's one long request is the load
test's own probe, reported at info with its KV while the pool holds it; a long request planted among
the concurrent ones is still a spike; a probe that takes the pool past 80 % is scored as any spike.
Recorded like kvtrace loadtest's traces: Recorder.mark_phase before each phase, transformers' own
generate_batch on the CPU (tiny llama, serving_scenarios.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers.generation.continuous_batching")

import serving_scenarios as S  # noqa: E402

import kvtrace  # noqa: E402
from kvtrace.analyzer.base import INFO_MAX_SCORE  # noqa: E402
from kvtrace.analyzer.detectors.context_spike import probe_memory_level  # noqa: E402

SHORT, LONG, NEW = 20, 160, 4  # contexts 24 and 164 tokens: 6.8x


def _protocol(path, *, concurrent: list[int], num_blocks: int):
    """single (1 short), concurrent (the given prompt lengths at once), long (1 long), then "end"."""
    model = S.model("llama")
    gc, cfg = S._configs(NEW, page_size=16, num_blocks=num_blocks, max_batch_tokens=256)
    with kvtrace.record(model, path) as rec:
        for name, lengths in (("single", [SHORT]), ("concurrent", concurrent), ("long", [LONG])):
            rec.mark_phase(name)
            model.generate_batch(inputs=S.prompts(lengths), generation_config=gc, continuous_batching_config=cfg,
                                 warmup=False)
        rec.mark_phase("end")
    return kvtrace.analyze(path).result("context_spike")


@pytest.fixture(autouse=True)
def _one_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_long_phase_probe_is_info_with_its_kv(tmp_path):
    result = _protocol(tmp_path / "probe.kvt.h5", concurrent=[SHORT] * 10, num_blocks=64)
    (f,) = result.findings
    assert f.kind == "long_context_probe" and f.score <= INFO_MAX_SCORE, f.message
    assert "(phase 'long') is the load test's long-context probe: a 164-token context, 6.8x the typical 24" in f.message
    # 164 tokens in 16-token blocks: 11 blocks of the 64-block pool (17%)
    assert f.evidence["spike_share_of_pool"].value == pytest.approx(11 / 64, abs=1e-3)
    assert "its blocks held" in f.message and "of the pool" in f.message
    held = f.evidence["phase_pool_use_held"].value
    assert held is not None and held < 0.8 and "Its phase held the pool's use at 17%" in f.message
    assert "under the 80% warning" in f.message
    assert f.evidence["phase_device_use_outside_pool_held"].value is None  # CPU: no NVML


def test_a_long_request_among_the_concurrent_ones_still_fires(tmp_path):
    result = _protocol(tmp_path / "planted.kvt.h5", concurrent=[SHORT] * 9 + [LONG], num_blocks=64)
    spike, probe = result.findings
    assert spike.kind == "context_spike" and spike.score >= 0.5, spike.message
    assert "(phase 'concurrent') reached a 164-token context, 6.8x the typical 24" in spike.message
    assert "besides the load test's long-context probe" in spike.message
    assert spike.evidence["requests_at_2x"].value == 1 and len(spike.requests) == 1
    assert probe.kind == "long_context_probe" and probe.score <= INFO_MAX_SCORE


def test_a_probe_that_fills_the_pool_is_scored_as_a_spike(tmp_path):
    """12 blocks: the probe's 11 are 92 % of the pool, held over its decode steps: critical memory."""
    result = _protocol(tmp_path / "full.kvt.h5", concurrent=[SHORT] * 4, num_blocks=12)
    (f,) = result.findings
    assert f.kind == "long_context_probe" and f.score >= 0.8, f.message
    assert f.evidence["phase_pool_use_held"].value >= 0.9
    assert "Its phase held the pool's use at 92%" in f.message and "past the 90% critical threshold" in f.message


def test_the_probe_rule():
    assert probe_memory_level(None, None) == "not measured"
    assert probe_memory_level(0.5, None) == "ok" and probe_memory_level(None, 0.79) == "ok"
    assert probe_memory_level(0.2, 0.8) == "warning" and probe_memory_level(0.85, 0.1) == "warning"
    assert probe_memory_level(0.9, None) == "critical"
