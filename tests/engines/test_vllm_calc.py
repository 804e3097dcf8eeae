"""kvtrace calc --engine vllm without vLLM: the pool rule on configs, and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtrace import exitcodes
from kvtrace.engines.vllm_calc import predict
from kvtrace.errors import BadOption
from tests.helpers.cli_run import run_main

LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
         "hidden_size": 128, "head_dim": 64, "torch_dtype": "float32"}


def test_pool_rule() -> None:
    pool = predict(LLAMA, 1 << 20, 512, 32)  # float32 runs in bf16: 32 x 2 x 2 x 64 x 2 B = 16 KiB a layer
    assert (pool.page_bytes_per_layer, pool.num_blocks, pool.tokens) == (16384, 32, 1024)
    assert pool.line(512) == "KV cache size: 1,024 tokens, Maximum concurrency for 512 tokens per request: 2.00x"
    assert predict(LLAMA, (1 << 20) - 1, 512, 32).num_blocks == 31  # whole blocks only
    assert predict(LLAMA, 1 << 20, 512, 32, kv_dtype="fp8").num_blocks == 64
    assert predict({**LLAMA, "torch_dtype": "bfloat16"}, 1 << 20, 100, 32).max_concurrency == pytest.approx(32 / 4)


@pytest.mark.parametrize("cfg", [{**LLAMA, "kv_lora_rank": 512}, {**LLAMA, "layer_types": ["sliding_attention"]},
                                 {"model_type": "x"}])
def test_refuses_what_it_cannot_predict(cfg: dict) -> None:
    with pytest.raises(BadOption):
        predict(cfg, 1 << 20, 512, 32)


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    code, out, err = run_main(["calc", "--engine", "vllm", "--config", str(tmp_path), "--context", "1024",
                               "--gpu-memory", "2MiB", "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["block_size"] == 16 and doc["kv_dtype"] == "float16" and doc["num_blocks"] == 128
    code, _, err = run_main(["calc", "--engine", "vllm", "--trace", str(Path(__file__).parents[1] / "data" /
                                                                        "gpu_gemma3_tiny.kvt.h5"),
                             "--context", "1024", "--gpu-memory", "2MiB"], capsys)
    assert code == exitcodes.INVALID and "engine trace" in err and "Traceback" not in err


def test_element_bytes_resolves_auto() -> None:
    from kvtrace.engines.vllm_calc import element_bytes

    assert element_bytes(LLAMA, 32, 16384 * 2) == 2  # vLLM's 32 KiB blocks of the tests' model: bf16
    assert element_bytes(LLAMA, 32, 16384) == 1
    assert element_bytes(LLAMA, 32, 16384 * 3) == -1 and element_bytes({}, 32, 4096) == -1
