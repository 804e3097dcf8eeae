"""`kvtrace calc` on hybrid models: the per-sequence conv/recurrent state counted beside the KV in
capacity, and `calc --trace` checking the prediction against the recorded /state rows of the
committed tiny recordings (tests/data/hybrid_cpu). Pure python: no torch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtrace import calc
from kvtrace import presets as P
from kvtrace.geometry.hybrid import state_geometry
from tests.helpers.cli_run import run_main

DATA = Path(__file__).resolve().parents[1] / "data" / "hybrid_cpu"
GiB = 1 << 30
HYBRID_PRESETS = ("qwen3-next-80b-a3b", "falcon-h1-7b", "jamba-v0.1", "lfm2-1.2b", "nemotron-h-8b")


@pytest.mark.parametrize("path", sorted(DATA.glob("*.kvt.h5")), ids=lambda p: p.name)
def test_calc_trace_checks_state_and_kv(path, capsys):
    rc, out, err = run_main(["calc", "--trace", str(path), "--context", "1k", "--gpu-memory", "1GiB", "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    check = doc["trace_check"]
    assert check["equal"] is True, check
    state = check["state"]
    assert state["equal"] is True and state["measured_bytes"] == state["predicted_bytes"] > 0, state
    assert state["batch_size"] == 2  # the last request of each fixture is a batch of 2
    assert doc["state_layers"] > 0 and doc["state_bytes_per_sequence_total"] * 2 == state["predicted_bytes"]
    rc, text, _ = run_main(["calc", "--trace", str(path), "--context", "1k", "--gpu-memory", "1GiB"], capsys)
    assert "state check: request 1 step 15 (batch 2)" in text and ": equal" in text.split("state check")[1]


def test_capacity_counts_state_per_sequence():
    p = calc.plan_capacity("falcon-h1-7b", context_len=32768, gpu_memory_bytes=80 * GiB)
    state = state_geometry(P.get_preset("falcon-h1-7b").config_dict()).bytes_per_sequence(2)
    assert p.state_layers == 44 and p.state_bytes_per_sequence_total == state == 139_673_600
    # 44 layers x (conv (3072 + 2*256) x 4 bf16 + recurrent 24 x 128 x 256 float32)
    assert state == 44 * ((3072 + 512) * 4 * 2 + 24 * 128 * 256 * 4)
    per_seq = p.kv_bytes_per_request + state
    assert p.max_concurrent_requests == p.available_kv_bytes // per_seq
    assert p.kv_bytes_needed == per_seq
    kv_only = p.available_kv_bytes // p.kv_bytes_per_request
    assert p.max_concurrent_requests < kv_only  # counting the state fits fewer sequences
    assert p.param_count == 7_585_513_568  # transformers' own count (Preset.params)


def test_short_contexts_are_dominated_by_state():
    """Qwen3-Next-80B: the 36 gated delta-net layers hold 2 MiB (float32 recurrent) + 64 KiB (bf16
    conv) each per sequence: 74.25 MiB, the KV of 3,168 tokens of its 12 attention layers."""
    p = calc.plan_capacity("qwen3-next-80b-a3b", context_len=1024, gpu_memory_bytes=141 * GiB, tp=2)
    assert p.state_bytes_per_sequence_total == 36 * (2 * 1024 * 1024 + 64 * 1024)
    assert p.state_bytes_by_kind == {"conv": 36 * 64 * 1024, "recurrent": 36 * 2 * 1024 * 1024}
    assert p.state_bytes_per_sequence_total // p.kv_bytes_per_token_total["total"] == 3168
    assert p.state_bytes_per_sequence == p.state_bytes_per_sequence_total // 2
    text = calc.format_plan(p)
    assert "state per request 74.25 MiB in 36 layers, constant in tokens" in text
    assert "(KV + state each;" in text


def test_fp8_kv_keeps_conv_state_in_bf16():
    bf16 = calc.plan_capacity("jamba-v0.1", context_len=4096, gpu_memory_bytes=80 * GiB, kv_dtype_bytes=2)
    fp8 = calc.plan_capacity("jamba-v0.1", context_len=4096, gpu_memory_bytes=80 * GiB, kv_dtype_bytes=1)
    assert fp8.state_bytes_per_sequence_total == bf16.state_bytes_per_sequence_total
    assert fp8.kv_bytes_per_request * 2 == bf16.kv_bytes_per_request


def test_attention_only_documents_are_unchanged():
    d = calc.plan_capacity("llama-3.1-8b", context_len=8192, gpu_memory_bytes=80 * GiB).to_dict()
    assert not [k for k in d if k.startswith("state_")]


@pytest.mark.parametrize("name", HYBRID_PRESETS)
def test_hybrid_presets_plan(name, capsys):
    rc, out, err = run_main(["calc", "--preset", name, "--context", "8k", "--gpu-memory", "141GB", "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["state_layers"] > 0 and doc["param_count_exact"] is True
    per_seq = doc["kv_bytes_per_request"] + doc["state_bytes_per_sequence"]
    assert doc["max_concurrent_requests"] == max(doc["available_kv_bytes"], 0) // per_seq
