"""`kvtrace whatif --emit kvpress`: the kvpress press that reproduces a policy at a ratio, built
here with the side-installed kvpress 0.5.5 from what was printed; where kvpress cannot, why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtrace.whatif import REGISTRY, parse_policy
from kvtrace.whatif.kvpress import press_for, presses_sliding, transformers_supported
from tests.helpers.cli_run import run_main

GEMMA = str(Path(__file__).parents[1] / "data" / "gpu_contents" / "gemma3_text.kvt.h5")
EVICTION = ["knorm", "keydiff", "random:seed=3", "streaming_llm:n_sink=2", "observed_attention", "tova",
            "snapkv:window_size=16,kernel_size=3", "expected_attention:n_sink=2,use_covariance=false"]


def test_printed_presses_build_with_kvpress(capsys):
    pytest.importorskip("torch")
    from test_kvpress_parity import _press  # the side-installed kvpress, or a skip saying where to put it

    args = ["whatif", "--emit", "kvpress", "--ratio", "0.25,0.5", "--json"]
    for p in EVICTION:
        args += ["--policy", p]
    code, out, _ = run_main(args, capsys)
    assert code == 0
    doc = json.loads(out)
    assert doc["kvtrace_whatif_emit"] == 1 and len(doc["presses"]) == 2 * len(EVICTION)
    for row in doc["presses"]:
        assert row["available"], row
        cls = _press(row["module"].rsplit(".", 1)[1], row["press"])
        press = cls(**row["kwargs"])  # what was printed constructs
        assert press.compression_ratio == row["ratio"]
        pol = parse_policy(row["label"])
        for ours, value in pol.params().items():
            if hasattr(press, ours):
                assert getattr(press, ours) == value, (row["label"], ours)
        assert f"{row['press']}(compression_ratio={row['ratio']!r}" in row["code"]


def test_what_kvpress_lacks_is_said(capsys):
    names = {p.split(":")[0] for p in EVICTION}
    code, out, _ = run_main(["whatif", "--emit", "kvpress", "--json", "--ratio", "0.5"]
                            + [x for n in REGISTRY if n not in names for x in ("--policy", n)]
                            + ["--policy", "streaming_llm:window=8"], capsys)
    assert code == 0
    rows = json.loads(out)["presses"]
    assert {r["policy"] for r in rows} == {"paging", "kivi", "quanto", "hqq", "fp8", "streaming_llm"}
    assert not any(r["available"] for r in rows) and all(r["reason"] for r in rows)
    quanto = next(r for r in rows if r["policy"] == "quanto")
    assert quanto["cache_config"] == {"backend": "quanto", "nbits": 4, "q_group_size": 64, "residual_length": 128}
    code, text, _ = run_main(["whatif", "--emit", "kvpress", "--policy", "paging", "--policy", "knorm"], capsys)
    assert code == 0 and "paging" in text and "no kvpress press" in text and "KnormPress(compression_ratio=0.25)" in text


def test_transformers_versions_kvpress_does_not_support_are_said():
    assert transformers_supported("5.2.1") == (True, "")
    assert transformers_supported("4.56.0")[0] and not transformers_supported("4.55.2")[0]
    ok, why = transformers_supported("5.24.0")
    assert not ok and "transformers>=4.56.0,<5.3" in why and "5.24.0" in why
    row = press_for(parse_policy("knorm"), 0.5, transformers_version="5.24.0")
    assert row["available"] and row["runs_here"] is False and "own environment" in row["runs_here_reason"]
    assert press_for(parse_policy("knorm"), 0.5, transformers_version="5.1.0")["runs_here"] is True


def test_sliding_layers_follow_kvpress_per_model_and_a_different_choice_is_said(capsys):
    assert presses_sliding({"model_type": "gemma3"})[0] is False  # Gemma3ForConditionalGeneration
    assert presses_sliding({"architectures": ["Gemma3ForConditionalGeneration"]})[0] is False
    assert presses_sliding({"model_type": "gemma3_text"})[0] is True  # Gemma3ForCausalLM: every layer hooked
    assert presses_sliding({"model_type": "mistral"})[0] is True
    row = press_for(parse_policy("knorm"), 0.5, {"model_type": "gemma3"}, sliding="press")
    assert any("Gemma3ForConditionalGeneration" in d and "--sliding press" in d for d in row["differs"])
    code, out, _ = run_main(["whatif", GEMMA, "--emit", "kvpress", "--policy", "knorm", "--ratio", "0.5",
                             "--sliding", "keep", "--json"], capsys)
    row = json.loads(out)["presses"][0]
    assert code == 0 and "gemma3_text" in row["sliding"] and any("--sliding keep" in d for d in row["differs"])
    assert run_main(["whatif", "--emit", "kvpress", "--rerun", "x", "--text", "y"], capsys)[0] == 64
