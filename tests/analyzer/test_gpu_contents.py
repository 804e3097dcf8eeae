"""The CPU analysis path against Triton results computed on a real GPU (tests/data/gpu_contents/).

The traces were recorded on an H200 with sampled K/V/Q (real CUDA allocator and NVML rows), and
``*_triton.json`` is what ``analyze_contents(device="cuda")`` returned there. Here the torch
reference must reproduce those numbers from the same traces on CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from contents_compare import contents_disagree

pytest.importorskip("torch")
from kvtrace.analyzer.contents import analyze_contents  # noqa: E402
from kvtrace.format import open_trace  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data" / "gpu_contents"


@pytest.mark.parametrize("name", ["llama", "gemma3_text"])
def test_cpu_reproduces_the_gpu_analysis(name):
    path = DATA / f"{name}.kvt.h5"
    with open_trace(path) as tr:  # really recorded on a GPU: NVML and the CUDA allocator were there
        assert tr.meta.sources["nvml"]["available"] and tr.meta.sources["allocator"]["available"]
        assert tr.meta.payload_tokens == "new"
    gpu = json.loads((DATA / f"{name}_triton.json").read_text())
    cpu = analyze_contents(path, device="cpu").to_dict()
    assert contents_disagree(gpu, cpu) is None, contents_disagree(gpu, cpu)
    assert gpu["entropy"] and gpu["dead_heads"] and gpu["eviction"]


def test_a_disagreement_is_reported():
    gpu = json.loads((DATA / "llama_triton.json").read_text())
    cpu = json.loads(json.dumps(gpu))
    cpu["backend"] = "torch/cpu"
    assert contents_disagree(gpu, cpu) is None
    cpu["entropy"][0]["mean_norm_entropy"][0] += 1e-2
    assert "entropy" in contents_disagree(gpu, cpu) or "Not equal" in contents_disagree(gpu, cpu)
