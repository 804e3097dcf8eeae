"""kvtrace calc: argument parsing, output modes, and the measured-vs-predicted trace check."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvtrace import calc as planner
from kvtrace.cli import cli, main
from kvtrace.commands.calc import parse_size, parse_tokens
from tests.helpers.synth_trace import write_synthetic_trace


def run(capsys, *args: str) -> tuple[int, str, str]:
    try:
        main(["calc", *args])
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_parse_size_and_tokens():
    assert parse_size("80GiB") == parse_size("80G") == parse_size("80 gib") == 80 * 1024**3
    assert parse_size("141GB") == 141 * 10**9
    assert parse_size("1.5TiB") == int(1.5 * 1024**4)
    assert parse_size("1024") == 1024
    assert parse_tokens("128k") == parse_tokens("128Ki") == 131072
    assert parse_tokens("8192") == 8192
    for bad in ("80 GiBs", "-1G", "lots"):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(ValueError):
        parse_tokens("1.5k")


def test_preset_json_equals_planner(capsys):
    code, out, err = run(capsys, "--preset", "llama-3.1-8b", "--context", "8k", "--gpu-memory", "80GiB",
                         "--kv-dtype", "fp8", "--tp", "2", "--batch", "4", "--json")
    assert code == 0, err
    doc = json.loads(out)
    plan = planner.plan_capacity("llama-3.1-8b", context_len=8192, gpu_memory_bytes=80 * 1024**3, tp=2,
                                 kv_dtype_bytes=1, batch=4)
    assert doc == json.loads(json.dumps(plan.to_dict()))
    # llama-3.1-8b: 32 layers x 8 KV heads x 128 x (K + V), fp8 -> 64 KiB per token
    assert doc["kv_bytes_per_token_total"]["total"] == 32 * 8 * 128 * 2


def test_text_and_quiet(capsys, tmp_path):
    # the help's own example: gpt-oss-120b's checkpoint keeps its experts in MXFP4 (60.7 GiB), so it fits;
    # counted as bf16 it would not
    code, out, _ = run(capsys, "--preset", "gpt-oss-120b", "--context", "128k", "--gpu-memory", "80GiB")
    assert code == 0 and "FITS" in out and "DOES NOT FIT" not in out and "mxfp4 MLP/experts" in out
    code, out, _ = run(capsys, "--preset", "gpt-oss-120b", "--context", "128k", "--gpu-memory", "80GiB",
                       "--weight-dtype", "bf16")
    assert code == 0 and "DOES NOT FIT" in out and "GiB" in out
    code, out, _ = run(capsys, "--preset", "gpt-oss-20b", "--context", "8k", "--gpu-memory", "80GiB",
                       "--weight-dtype", "mxfp4", "-q")
    assert code == 0 and out == "FITS\n"
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                               "vocab_size": 256}))
    code, out, _ = run(capsys, "--config", str(tmp_path), "--context", "100", "--gpu-memory", "1GiB", "--json")
    assert code == 0 and json.loads(out)["kv_bytes_per_request_total"] == 2 * 2 * 16 * 2 * 2 * 100


def test_usage_errors(capsys, tmp_path):
    assert run(capsys, "--context", "8k", "--gpu-memory", "80GiB")[0] == 64
    assert run(capsys, "--preset", "llama-3.1-8b", "--config", "x", "--context", "8k", "--gpu-memory", "8G")[0] == 64
    code, _, err = run(capsys, "--preset", "no-such-model", "--context", "8k", "--gpu-memory", "80GiB")
    assert code == 64 and "preset" in err and "\n" == err[-1] and err.count("\n") == 1
    assert run(capsys, "--preset", "llama-3.1-8b", "--context", "8k", "--gpu-memory", "eighty")[0] == 64
    assert run(capsys, "--trace", str(tmp_path / "none.h5"), "--context", "8k", "--gpu-memory", "8G")[0] == 2
    assert "Examples:" in CliRunner().invoke(cli, ["calc", "--help"]).output


def test_trace_check(capsys, tmp_path):
    good = write_synthetic_trace(tmp_path / "good.kvt.h5")
    code, out, _ = run(capsys, "--trace", str(good), "--context", "4096", "--gpu-memory", "24GiB")
    assert code == 0
    assert "trace check: request 1 step 11 (19 tokens): recorded 6.8 KiB (6912 B), predicted 6.8 KiB (6912 B): equal" in out
    bad = write_synthetic_trace(tmp_path / "bad.kvt.h5", kv_extra_bytes=64)
    code, out, _ = run(capsys, "--trace", str(bad), "--context", "4096", "--gpu-memory", "24GiB", "--json")
    check = json.loads(out)["trace_check"]
    assert check["equal"] is False and check["measured_bytes"] - check["predicted_bytes"] == 128
    assert [m["layer"] for m in check["mismatched_layers"]] == [1, 3]
