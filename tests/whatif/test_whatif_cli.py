"""`kvtrace whatif` CLI: JSON contract keys, exit codes for bad input."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.cli_run import run_main

LLAMA = str(Path(__file__).parents[1] / "data" / "gpu_contents" / "llama.kvt.h5")


def test_json_and_table(capsys, tmp_path):
    out = tmp_path / "w.json"
    code, text, _ = run_main(["whatif", LLAMA, "--policy", "knorm", "--policy", "fp8", "--ratio", "0.5",
                              "--json-out", str(out)], capsys)
    assert code == 0 and "knorm" in text and "KiB" in text
    doc = json.loads(out.read_text())
    assert doc["kvtrace_whatif"] == 1 and [p["policy"] for p in doc["policies"]] == ["knorm", "fp8"]
    spec = (Path(__file__).parents[2] / "spec" / "whatif-json.md").read_text()
    for key in ("kept_peak", "saved_mean", "attention_mass_recall", "attention_output_error", "key_cosine"):
        assert key in spec
    assert set(doc["policies"][0]["results"][0]["overall"]) == {"attention_mass_recall", "attention_output_error"}
    code, text, _ = run_main(["whatif", LLAMA, "--policy", "knorm", "--ratio", "0.5", "--json"], capsys)
    assert code == 0 and json.loads(text)["ratios"] == [0.5]


def test_bad_input_exit_codes(capsys, tmp_path):
    assert run_main(["whatif", LLAMA, "--policy", "nope"], capsys)[0] == 64
    assert run_main(["whatif", LLAMA, "--policy", "kivi:nbits=3"], capsys)[0] == 64
    assert run_main(["whatif", LLAMA, "--ratio", "1.0"], capsys)[0] == 64
    assert run_main(["whatif", str(tmp_path)], capsys)[0] == 2
    bad = tmp_path / "x.kvt.h5"
    bad.write_text("not hdf5")
    code, _, err = run_main(["whatif", str(bad)], capsys)
    assert code == 2 and err.count("\n") == 1
    assert run_main(["whatif", LLAMA, "--json-out", LLAMA], capsys)[0] == 64


def test_steps_option(capsys):
    code, text, _ = run_main(["whatif", LLAMA, "--policy", "knorm", "--ratio", "0.5", "--steps", "all", "--json"], capsys)
    doc = json.loads(text)
    assert code == 0 and doc["steps"] == "all" and len(doc["policies"][0]["results"][0]["layers"]) == 6
    assert run_main(["whatif", LLAMA, "--steps", "some"], capsys)[0] == 64


def test_progress_is_told_every_unit_and_prints_nothing_off_a_terminal(capsys):
    from contextlib import contextmanager

    from kvtrace.whatif import parse_policy
    from kvtrace.whatif.run import run_whatif

    seen: list[tuple[int, list[str]]] = []

    @contextmanager
    def bar(total):
        stages: list[str] = []
        seen.append((total, stages))
        yield stages.append

    doc = run_whatif(LLAMA, [parse_policy("knorm")], [0.5], steps="all", progress=bar)
    assert seen == [(doc["sampled_units"], [f"request 0 layer {ly} step {s}" for ly in (0, 1) for s in (0, 4, 8)])]
    # the CLI's bar (kvtrace.progress) draws on a terminal only: captured stderr is not one
    code, _, err = run_main(["whatif", LLAMA, "--policy", "knorm", "--ratio", "0.5", "--steps", "all"], capsys)
    assert code == 0 and err == ""


def test_sliding_option_and_unsupported_rows_in_the_table(capsys):
    gemma = str(Path(LLAMA).with_name("gemma3_text.kvt.h5"))
    code, text, _ = run_main(["whatif", gemma, "--policy", "knorm", "--policy", "snapkv:window_size=4", "--ratio",
                              "0,0.5", "--sliding", "keep"], capsys)
    assert code == 0 and "not pressed (--sliding keep" in text and "layout effects" in text
    assert "not pressed: sliding-window layer" in text and "unsupported: snapkv: no sampled query" in text
    code, text, _ = run_main(["whatif", gemma, "--policy", "knorm", "--ratio", "0", "--json"], capsys)
    doc = json.loads(text)
    assert code == 0 and doc["sliding"]["pressed"] and doc["policies"][0]["results"][0]["bytes"]["saved_peak"] == 0
    assert run_main(["whatif", gemma, "--sliding", "sometimes"], capsys)[0] == 64
