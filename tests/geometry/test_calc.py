"""Capacity planner: arithmetic, TP rules, inputs, formatting, and agreement with measured caches."""

from __future__ import annotations

import json
import re
import warnings

import pytest

from kvtrace import calc
from kvtrace import geometry as G
from tests.helpers.hfcache import output_cache  # noqa: E402

GiB, MiB, KiB = 2**30, 2**20, 2**10


def test_llama_worksheet_numbers():
    p = calc.plan_capacity("llama-3.1-8b", context_len=32768, gpu_memory_bytes=80 * GiB, batch=8)
    assert p.kv_bytes_per_token_total == {"full": 128 * KiB, "total": 128 * KiB}
    assert p.kv_bytes_per_request_total == p.kv_bytes_per_request == 4 * GiB
    assert p.weight_bytes_total == 2 * 8_030_261_248
    assert p.reserve_bytes == 8 * GiB
    assert p.available_kv_bytes == 80 * GiB - 8 * GiB - p.weight_bytes
    assert p.kv_bytes_needed == 32 * GiB and p.fits
    assert p.headroom_bytes == p.available_kv_bytes - 32 * GiB
    assert p.max_concurrent_requests == p.available_kv_bytes // (4 * GiB) == 14
    assert p.concurrency_warning_at == 11
    assert p.mha_equivalent_bytes_per_token_total == 512 * KiB
    too_many = calc.plan_capacity("llama-3.1-8b", context_len=32768, gpu_memory_bytes=80 * GiB, batch=15)
    assert not too_many.fits and too_many.headroom_bytes < 0


def test_window_saturation_and_fp8():
    p = calc.plan_capacity("gpt-oss-120b", context_len=100_000, gpu_memory_bytes=141 * GiB, tp=2,
                           weight_dtype_bytes=0.5)
    sliding = 18 * 128 * 8 * 64 * 2 * 2  # storage spans the whole window in steady decode
    full = 18 * 100_000 * 8 * 64 * 2 * 2
    assert p.kv_bytes_per_request_total == sliding + full
    assert p.kv_bytes_per_request == (sliding + full) // 2  # 8 KV heads split over 2 ranks
    assert p.weight_bytes_total == (116_829_156_672 + 1) // 2
    fp8 = calc.plan_capacity("gpt-oss-120b", context_len=100_000, gpu_memory_bytes=141 * GiB, tp=2,
                             kv_dtype_bytes=1, weight_dtype_bytes=0.5)
    assert fp8.kv_bytes_per_request * 2 == p.kv_bytes_per_request
    assert fp8.max_concurrent_requests >= 2 * p.max_concurrent_requests


def test_tp_head_split_replication_and_mla():
    tp8 = calc.plan_capacity("gpt-oss-120b", context_len=4096, gpu_memory_bytes=80 * GiB, tp=8)
    tp16 = calc.plan_capacity("gpt-oss-120b", context_len=4096, gpu_memory_bytes=80 * GiB, tp=16)
    assert tp8.kv_heads_per_rank == {"sliding": 1, "full": 1} and tp8.kv_replication == 1
    assert tp16.kv_heads_per_rank == {"sliding": 1, "full": 1} and tp16.kv_replication == 2
    assert tp16.kv_bytes_per_request == tp8.kv_bytes_per_request == tp8.kv_bytes_per_request_total // 8
    assert any("replicated 2x" in n for n in tp16.notes)
    ds = calc.plan_capacity("deepseek-v3", context_len=4096, gpu_memory_bytes=141 * GiB, tp=8,
                            weight_dtype_bytes=1)
    assert ds.kv_bytes_per_request == ds.kv_bytes_per_request_total == 61 * 576 * 2 * 4096
    assert ds.kv_replication == 8 and any("MLA latent" in n for n in ds.notes)
    exp = calc.plan_capacity("deepseek-v3", context_len=4096, gpu_memory_bytes=141 * GiB, tp=8,
                             mla_cache="expanded")
    assert exp.kv_bytes_per_request == exp.kv_bytes_per_request_total // 8


def test_kv_sharing_and_static():
    p = calc.plan_capacity("gemma-4-e2b", context_len=8192, gpu_memory_bytes=24 * GiB)
    assert p.kv_bytes_per_request_by_kind["shared_consumer"] == 0
    assert p.kv_bytes_per_request_by_kind["sliding"] == 12 * 512 * 1 * 256 * 2 * 2
    s = calc.plan_capacity("gemma-4-e2b", context_len=8192, gpu_memory_bytes=24 * GiB, cache_kind="static")
    assert s.kv_bytes_per_request == p.kv_bytes_per_request  # static sliding = min(window, len) too
    short = calc.plan_capacity("gemma-4-e2b", context_len=100, gpu_memory_bytes=24 * GiB)
    assert short.kv_bytes_per_request_by_kind["sliding"] == 12 * 100 * 256 * 2 * 2


def test_weights_do_not_fit():
    p = calc.plan_capacity("deepseek-v3", context_len=1024, gpu_memory_bytes=80 * GiB)
    assert p.available_kv_bytes < 0 and not p.fits and p.max_concurrent_requests == 0
    assert any("exceed" in n for n in p.notes) and any("critical" in n for n in p.notes)


def test_inputs(tmp_path):
    from kvtrace import presets

    d = presets.get_preset("qwen3-8b").config_dict()
    (tmp_path / "config.json").write_text(json.dumps(d))
    by_dict = calc.plan_capacity(d, context_len=2048, gpu_memory_bytes=48 * GiB)
    by_file = calc.plan_capacity(str(tmp_path / "config.json"), context_len=2048, gpu_memory_bytes=48 * GiB)
    by_dir = calc.plan_capacity(tmp_path, context_len=2048, gpu_memory_bytes=48 * GiB)
    by_name = calc.plan_capacity("qwen3-8b", context_len=2048, gpu_memory_bytes=48 * GiB)
    strip = lambda p: {k: v for k, v in p.to_dict().items() if k != "model"}  # noqa: E731
    assert strip(by_dict) == strip(by_file) == strip(by_dir) == strip(by_name)
    nested = {"model_type": "gemma3", "text_config": presets.get_preset("gemma-3-4b").config_dict()}
    assert calc.plan_capacity(nested, context_len=64, gpu_memory_bytes=GiB).layer_kinds == {"sliding": 29, "full": 5}
    with pytest.raises(ValueError):
        calc.plan_capacity("not-a-model", context_len=1, gpu_memory_bytes=GiB)
    for bad in (dict(context_len=0), dict(tp=0), dict(reserve_fraction=1.0), dict(batch=0),
                dict(cache_kind="paged"), dict(kv_dtype_bytes=0)):
        kw = dict(context_len=16, gpu_memory_bytes=GiB) | bad
        with pytest.raises(ValueError):
            calc.plan_capacity("qwen3-8b", **kw)


def test_encoder_decoder_cross_tokens():
    cfg = {"model_type": "t5", "d_model": 512, "d_kv": 64, "num_heads": 8, "num_layers": 6, "d_ff": 2048,
           "vocab_size": 32128, "is_encoder_decoder": True}
    p = calc.plan_capacity(cfg, context_len=100, encoder_len=400, gpu_memory_bytes=GiB)
    assert p.kv_bytes_per_request_by_kind == {"full": 6 * 100 * 8 * 64 * 2 * 2, "cross_attention": 6 * 400 * 8 * 64 * 2 * 2}


def test_format_plan_uses_binary_units():
    p = calc.plan_capacity("gpt-oss-20b", context_len=8192, gpu_memory_bytes=80 * GiB, tp=2, batch=4)
    text = calc.format_plan(p)
    assert "binary units" in text and "GiB" in text and "KiB" in text
    assert not re.search(r"\d (GB|MB|KB)\b", text)
    assert "FITS" in text
    json.dumps(p.to_dict())  # serialisable
    assert calc.format_bytes(1536) == "1.50 KiB"
    assert calc.format_bytes(3 * GiB) == "3.00 GiB"
    assert calc.format_bytes(512) == "512 B"
    assert calc.format_bytes(-2 * MiB) == "-2.00 MiB"


@pytest.mark.parametrize("name", ["gpt_oss", "gemma4_text_shared", "deepseek_v3", "llama", "t5"])
@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
def test_planner_kv_equals_measured_cache(name, cache_kind):
    torch = pytest.importorskip("torch")
    from tests.helpers.models import cache_tensor_bytes, tiny_config, tiny_model, tiny_prompt

    prompt_len, new_tokens = 6, 14
    model = tiny_model(name)
    enc_dec = model.config.is_encoder_decoder
    kw = dict(cache_implementation="static", disable_compile=True) if cache_kind == "static" else {}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        out = model.generate(tiny_prompt(prompt_len), min_new_tokens=new_tokens, max_new_tokens=new_tokens,
                             do_sample=False, return_dict_in_generate=True, **kw)
    seen = G.cache_tokens_after_generate(prompt_len, new_tokens, is_encoder_decoder=enc_dec)
    measured = sum(a for a, _ in cache_tensor_bytes(output_cache(out)))
    plan = calc.plan_capacity(tiny_config(name).to_dict(), context_len=seen, gpu_memory_bytes=GiB,
                              kv_dtype_bytes=4, weight_dtype_bytes=4, cache_kind=cache_kind,
                              encoder_len=prompt_len)
    assert plan.kv_bytes_per_request_total == measured
    assert plan.weight_bytes_total == 4 * sum(p.numel() for p in model.parameters())
