"""`kvtrace calc` counts weights in the checkpoint's own dtypes (not the compute dtype)."""

from __future__ import annotations

import pytest

from kvtrace import calc, presets
from kvtrace import geometry as G

GiB = 2**30


def test_gpt_oss_counts_mxfp4_experts_and_bf16_rest():
    pc = G.param_count(presets.get_preset("gpt-oss-120b").config_dict())
    p = calc.plan_capacity("gpt-oss-120b", context_len=131072, gpu_memory_bytes=80 * GiB)
    expected = pc.mlp * 0.53125 + (pc.total - pc.mlp) * 2
    assert p.weight_bytes_total == int(-(-expected // 1))
    # the released checkpoint's safetensors are ~65 GB (60.8 GiB): within 1% of this count
    assert 60 * GiB < p.weight_bytes_total < 61 * GiB
    assert p.fits and p.weight_dtype == "mxfp4 MLP/experts, bf16 rest"
    bf16 = calc.plan_capacity("gpt-oss-120b", context_len=131072, gpu_memory_bytes=80 * GiB, weight_dtype_bytes=2)
    assert bf16.weight_bytes_total == 2 * pc.total and not bf16.fits


def test_presets_without_quantised_checkpoints_stay_bf16():
    for name in ("llama-3.1-8b", "qwen3-8b", "gemma-3-4b"):
        p = calc.plan_capacity(name, context_len=1024, gpu_memory_bytes=80 * GiB)
        assert p.weight_bytes_total == 2 * p.param_count and p.weight_dtype == "bf16"


@pytest.mark.parametrize("config, expected", [
    ({"quantization_config": {"quant_method": "mxfp4"}}, {"default": "bf16", "mlp": "mxfp4"}),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}},
     {"default": "bf16", "attention": "fp8", "mlp": "fp8"}),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}},
     {"default": "bf16", "attention": "int4", "mlp": "int4"}),
    ({"torch_dtype": "float32"}, {"default": "fp32"}),
    ({"dtype": "float16"}, {"default": "fp16"}),
    ({"text_config": {"dtype": "bfloat16"}}, {"default": "bf16"}),
    ({}, {"default": "bf16"}),
])
def test_checkpoint_dtypes_from_config(config, expected):
    assert calc.checkpoint_weight_dtypes({"model_type": "llama", **config}) == expected


def test_unknown_weight_dtype_is_refused():
    with pytest.raises(ValueError):
        calc.plan_capacity("qwen3-8b", context_len=16, gpu_memory_bytes=GiB, weight_dtypes={"default": "fp3"})
    with pytest.raises(ValueError):
        calc.plan_capacity("qwen3-8b", context_len=16, gpu_memory_bytes=GiB, weight_dtypes={"experts": "fp8"})
