"""The planted-pathology suite: traces recorded by the real recorder from tiny random-weight
models (CPU). Every planted defect scores >= 0.5 on its detector; every clean control, across
architectures (full, sliding, hybrid sliding, MoE, MLA, KV-sharing, encoder-decoder), scores
<= 0.1 on every detector.
"""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvtrace  # noqa: E402
from tests.helpers import planted  # noqa: E402

CLEAN_ARCHS = [
    "gpt_neox",  # MHA, cache passed as layer_past
    "llama",  # GQA
    "mistral",  # sliding window on every layer
    "qwen3",
    "gemma3_text",  # hybrid sliding/full
    "gemma4_text_keqv",  # hybrid, full layers with K=V projection and their own head dim
    "gpt_oss",  # hybrid sliding/full + MoE
    "glm4_moe",  # MoE
    "deepseek_v3",  # MLA latent cache + MoE
    "t5",  # encoder-decoder: self + cross attention caches
]


@pytest.fixture(scope="session")
def recorded(tmp_path_factory):
    """Record each case once per session, on first use."""
    import torch

    directory = tmp_path_factory.mktemp("planted")
    cache: dict[str, object] = {}
    keep_alive: list[object] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add contention on shared CI cores

    def get(name: str):
        if name not in cache:
            path = directory / f"{name}.kvt.h5"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if name.startswith("clean:"):
                    cache[name] = planted.record_clean(name.split(":", 1)[1], path)
                elif name == "kept_cache":
                    p, kept = planted.record_kept_cache(path)
                    keep_alive.append(kept)
                    cache[name] = p
                else:
                    fn, is_planted = {
                        "duplication": (planted.record_duplication, True),
                        "duplication_twin": (planted.record_duplication, False),
                        "duplication_list": (planted.record_duplication, "list"),
                        "static_oversized": (planted.record_static, True),
                        "static_twin": (planted.record_static, False),
                        "no_slide": (planted.record_no_slide, True),
                        "no_slide_twin": (planted.record_no_slide, False),
                    }[name]
                    if is_planted == "list":
                        cache[name] = _record_in_fresh_process(path)
                    else:
                        cache[name] = fn(path, planted=is_planted)
        return kvtrace.analyze(cache[name])

    yield get
    torch.set_num_threads(threads)


def _record_in_fresh_process(path):
    """The list plant is seen through process RSS only: in the suite's long-lived process, heap freed
    by earlier tests absorbs the kept copies (RSS does not grow; seen once in a full run), so it is
    recorded in a fresh interpreter whose heap holds nothing else."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = ("import sys, warnings; warnings.simplefilter('ignore'); import torch; torch.set_num_threads(1); "
            "from pathlib import Path; from tests.helpers.planted import record_duplication; "
            "record_duplication(Path(sys.argv[1]), mode='list')")
    done = subprocess.run([sys.executable, "-c", code, str(path)], cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return path


def assert_clean(report, bound: float = 0.1) -> None:
    errors = [(r.name, r.reason) for r in report.results if r.status == "error"]
    assert not errors, errors
    high = {f.detector: (round(f.score, 3), f.message) for f in report.findings if f.score > bound}
    assert not high, high


@pytest.mark.parametrize("arch", CLEAN_ARCHS)
def test_clean_controls_score_low_on_every_detector(recorded, arch):
    r = recorded(f"clean:{arch}")
    assert_clean(r)
    assert r.expectation["source"] == "config"
    ran = {x.name for x in r.results if x.status == "ran"}
    assert {"growth_curve", "post_eos", "layer_anomaly", "cache_density", "layer_uniformity", "aliasing"} <= ran
    assert len(r.requests) == 2 and all(q["outcome"] == "ok" for q in r.requests)


def test_hybrid_is_bimodal_by_design_not_anomalous(recorded):
    r = recorded("clean:gemma3_text")
    (u,) = r.result("layer_uniformity").findings
    assert u.kind == "bimodal_by_design" and u.score == 0
    assert "2 sliding layers hold 7 tokens" in u.message and "1 full layer holds 19 tokens" in u.message
    assert not r.result("layer_anomaly").findings


def test_mla_density_names_the_latent(recorded):
    r = recorded("clean:deepseek_v3")
    (d,) = [f for f in r.result("cache_density").findings if f.kind == "density"]
    assert d.evidence["saved_by_mla_bytes"].value > 0 and "MLA latent" in d.message


def test_kv_shared_model_is_reported_as_sharing_only(recorded):
    r = recorded("clean:gemma4_text_shared")
    assert_clean(r)
    (a,) = r.result("aliasing").findings
    assert a.kind == "sharing" and "layers 3-5 reuse the KV of layers 1-2" in a.message
    assert "3 KV-sharing layers hold none" in r.result("layer_uniformity").findings[0].message


PLANTED = [
    # (case, its clean twin, detector that must fire, finding kind)
    ("kept_cache", "clean:llama", "post_eos", "retained_after_request"),
    ("duplication", "duplication_twin", "growth_curve", "duplication"),
    ("static_oversized", "static_twin", "growth_curve", "static_over_allocation"),
    ("no_slide", "no_slide_twin", "layer_anomaly", "outlier_layer"),
]


@pytest.mark.parametrize("case,twin,detector,kind", PLANTED, ids=[p[0] for p in PLANTED])
def test_planted_defect_fires_and_twin_stays_clean(recorded, case, twin, detector, kind):
    r = recorded(case)
    hits = [f for f in r.result(detector).findings if f.kind == kind]
    assert hits and max(f.score for f in hits) >= 0.5, [(f.kind, f.score, f.message) for f in r.findings]
    assert_clean(recorded(twin))


def test_planted_details(recorded):
    kept = [f for f in recorded("kept_cache").result("post_eos").findings if f.score >= 0.5][0]
    assert kept.layers == [0, 1] and "retention tracking" in kept.message
    assert kept.evidence["kv_alive_bytes"].value == kept.evidence["peak_kv_bytes"].value
    dup = [f for f in recorded("duplication").result("growth_curve").findings if f.kind == "duplication"][0]
    assert dup.layers == [0, 1] and dup.evidence["ratio"].value > 10
    static = recorded("static_oversized").result("growth_curve").findings[0]
    assert static.evidence["capacity_tokens"].value == planted.PROMPT + 256 - 1
    assert static.evidence["used_tokens"].value == planted.PROMPT + 10 - 1
    ns = recorded("no_slide")
    (w,) = [f for f in ns.result("growth_curve").findings if f.kind == "window_not_applied"]
    assert w.layers == [1] and "window 8" in w.message


@pytest.mark.slow
def test_copies_outside_the_cache_on_cpu_have_the_duplication_signature(recorded):
    """Old copies kept in a list are invisible to the cache structure; on a CPU trace only process
    RSS shows them. RSS alone is no proof (heap slack), but an excess that grows exactly as the
    sum of earlier cache sizes is: named duplication with the fitted multiple (~1 copy per step)."""
    r = recorded("duplication_list")
    (f,) = [f for f in r.result("growth_curve").findings if f.kind == "duplication"]
    assert f.score >= 0.5 and f.evidence["signature"].value == 2
    assert 0.7 <= f.evidence["fitted_multiple"].value <= 1.5 and f.evidence["fit_r2"].value >= 0.95
    assert "sum of earlier cache sizes" in f.message and "Process RSS" in f.message
