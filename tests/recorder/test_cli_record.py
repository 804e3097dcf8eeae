"""`kvtrace record`, `kvtrace presets`, `kvtrace demo`: exit codes and what they write."""

from __future__ import annotations

import json

import pytest

from kvtrace import exitcodes, presets
from kvtrace.format.reader import Trace
from kvtrace.format.validate import validate
from tests.helpers.cli_run import run_main as run

TINY = ["--model", "preset:llama-3.1-8b", "--layers", "2", "--width", "0.05", "--vocab", "512"]


def test_record_preset_writes_a_valid_trace(tmp_path, capsys):
    out = tmp_path / "r.kvt.h5"
    code, _, err = run(["record", *TINY, "--prompt", "hi", "--prompt", "there", "--max-new-tokens", "3",
                        "--min-new-tokens", "3", "--store-prompts", "-o", str(out)], capsys)
    assert code == 0, err
    assert "peak KV cache" in err and "KiB" in err
    assert validate(out).valid
    with Trace(out) as t:
        req = t.requests[:]
        assert req["prompt_tokens"].tolist() == [2, 5]  # UTF-8 bytes of "hi", "there"
        assert req["new_tokens"].tolist() == [3, 3]
        assert t.text(int(req[1]["prompt_text_off"]), int(req[1]["prompt_text_len"])) == "there"
        assert t.meta.model_id == "preset:llama-3.1-8b"
        cli = t.meta.recorder_settings["cli"]
        assert cli["layers"] == 2 and cli["max_new_tokens"] == 3
        # the kept layers have Llama-3.1-8B's KV geometry: 8 KV heads x 128
        assert {tuple(s[:2]) + (s[3],) for s in t.kv[:]["k_shape"].tolist()} == {(1, 8, 128)}


def test_record_unwritable_output_exits_73_before_loading(tmp_path, capsys, monkeypatch):
    import kvtrace.commands.record as rec_cmd

    def never(*a, **k):
        raise AssertionError("model loaded despite an unwritable output")

    monkeypatch.setattr(rec_cmd, "load_model", never)
    code, _, err = run(["record", *TINY, "--prompt", "x", "--max-new-tokens", "2",
                        "-o", str(tmp_path / "no" / "such" / "dir.kvt.h5")], capsys)
    assert code == exitcodes.CANNOT_WRITE
    assert err.startswith("kvtrace: cannot write -o") and "does not exist" in err and err.count("\n") == 1


def test_record_missing_model_directory_is_a_usage_error(tmp_path, capsys):
    code, _, err = run(["record", "--model", str(tmp_path / "nothing"), "--prompt", "x",
                        "--max-new-tokens", "2", "-o", str(tmp_path / "x.kvt.h5")], capsys)
    assert code == exitcodes.USAGE
    assert "no such model directory" in err and err.count("\n") == 1


def test_record_uncached_hub_id_exits_69(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    code, _, err = run(["record", "--model", "nobody-here/no-such-model", "--prompt", "x",
                        "--max-new-tokens", "2", "-o", str(tmp_path / "x.kvt.h5")], capsys)
    assert code == exitcodes.UNAVAILABLE
    assert "never downloads" in err and err.count("\n") == 1


@pytest.mark.parametrize("argv", [
    ["--max-new-tokens", "2"],  # neither --prompt nor --prompts
    ["--prompt", "x", "--max-new-tokens", "0"],
    ["--prompt", "x", "--max-new-tokens", "2", "--cache-implementation", "hybrid"],
])
def test_record_usage_errors_exit_64(tmp_path, capsys, argv):
    code, _, err = run(["record", *TINY, *argv, "-o", str(tmp_path / "x.kvt.h5")], capsys)
    assert code == exitcodes.USAGE, err
    assert "Traceback" not in err


def test_unknown_preset_is_a_usage_error(tmp_path, capsys):
    code, _, err = run(["record", "--model", "preset:nope", "--prompt", "x", "--max-new-tokens", "2",
                        "-o", str(tmp_path / "x.kvt.h5")], capsys)
    assert code == exitcodes.USAGE and "unknown preset" in err


def test_presets_json_lists_every_preset_with_geometry(capsys):
    code, out, _ = run(["presets", "--json"], capsys)
    assert code == 0
    rows = json.loads(out)
    assert [r["name"] for r in rows] == presets.list_presets()
    by = {r["name"]: r for r in rows}
    # gpt-oss-20b: 8 KV heads x 64, bf16 -> 2 x 8 x 64 x 2 B = 2 KiB per layer per token, 24 layers
    assert by["gpt-oss-20b"]["kv_bytes_per_token_bf16"] == 24 * 2048
    assert by["gpt-oss-20b"]["layer_kinds"] == {"sliding": 12, "full": 12}
    assert by["gpt-oss-20b"]["checkpoint_weight_dtypes"] == {"default": "bf16", "mlp": "mxfp4"}
    assert by["llama-3.1-8b"]["checkpoint_weight_dtypes"] == {"default": "bf16"}
    code, out, _ = run(["presets"], capsys)
    assert "pythia-1.4b" in out and "KiB" in out


def test_demo_writes_and_summarises(tmp_path, capsys, monkeypatch):
    import kvtrace.commands.demo as demo_cmd

    monkeypatch.setattr(demo_cmd, "DEMO_REQUESTS", (6, 3))  # wiring only; the real demo is longer
    code, out, err = run(["demo", "-o", str(tmp_path / "d")], capsys)
    assert code == 0, err
    path = tmp_path / "d" / "demo.kvt.h5"
    assert f"trace written to {path}" in out and "sliding layers" in out and "full layers" in out
    assert validate(path).valid


@pytest.fixture()
def no_model_load(monkeypatch):
    import kvtrace.commands.record as rec_cmd

    def never(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(rec_cmd, "load_model", never)


@pytest.mark.parametrize("model, extra, message", [
    ("preset:llama-3.1-8b", ["--sample-every", "2", "--sample-layers", "7"], "out of range: the model has 2 layers"),
    ("preset:llama-3.1-8b", ["--sample-every", "2", "--sample-heads", "99"], "at most 8 KV heads"),
    ("preset:llama-3.1-8b", ["--sample-heads", "0"], "add --sample-every"),
    ("preset:gemma-4-e2b", ["--sample-every", "2", "--sample-layers", "8,9"], "own no cache"),
    ("preset:deepseek-v2-lite", ["--sample-every", "2", "--sample-heads", "0"], "one latent"),
    ("./nope", [], "no such model directory"),
    ("preset:llama-3.1-8b", ["--sample-every", "2", "--sample-heads", "0,1,3"], "evenly spaced"),
])
def test_record_arguments_checked_before_the_model_loads(tmp_path, capsys, no_model_load, model, extra, message):
    tiny = ["--tiny"] if model.startswith("preset:") else []
    code, _, err = run(["record", "--model", model, *tiny, "--prompt", "x", "--max-new-tokens", "2", *extra,
                        "-o", str(tmp_path / "x.kvt.h5")], capsys)
    assert code == exitcodes.USAGE, err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "x.kvt.h5").exists()  # no trace claiming contents it does not hold


def test_record_model_directory_without_config_is_a_usage_error(tmp_path, capsys, no_model_load):
    (tmp_path / "empty-model").mkdir()
    code, _, err = run(["record", "--model", str(tmp_path / "empty-model"), "--prompt", "x",
                        "--max-new-tokens", "2", "-o", str(tmp_path / "x.kvt.h5")], capsys)
    assert code == exitcodes.USAGE and "config.json" in err


def test_record_sampled_heads_in_range_store_payloads(tmp_path, capsys):
    """The control beside the refusals: a valid selection stores what the flags claim."""
    out = tmp_path / "s.kvt.h5"
    code, _, err = run(["record", "--model", "preset:llama-3.1-8b", "--tiny", "--prompt", "hi",
                        "--max-new-tokens", "4", "--min-new-tokens", "4", "--sample-every", "2",
                        "--sample-layers", "1", "--sample-heads", "0,2", "-o", str(out)], capsys)
    assert code == 0, err
    with Trace(out) as t:
        assert t.meta.contains_tensor_payloads
        index = t.table("payloads/index")
        assert len(index) > 0 and set(index["layer"].tolist()) == {1}
        assert set(index["head_start"].tolist()) == {0} and set(index["head_stride"].tolist()) == {2}


def test_full_size_preset_refused_when_memory_is_short(monkeypatch, capsys):
    """Weights are compared with available memory: 8B parameters x 4 B do not fit in 16 GiB, and
    the refusal names the memory needed and how to shrink; 1 TiB available only warns."""
    import types

    import psutil

    from kvtrace.commands.common import Unavailable
    from kvtrace.loading import check_preset_memory

    config = presets.preset_config_dict("llama-3.1-8b")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=16 << 30))
    with pytest.raises(Unavailable, match=r"needs 29\.9 GiB .* 16\.0 GiB of RAM available: shrink it: --tiny"):
        check_preset_memory(config, 4, "cpu", shrunk=False, name="llama-3.1-8b")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=1 << 40))
    need = check_preset_memory(config, 2, "cpu", shrunk=False, name="llama-3.1-8b")
    assert need == 8_030_261_248 * 2  # Llama-3.1-8B's parameter count, bf16
    assert "warning: preset llama-3.1-8b at full size: 15.0 GiB" in capsys.readouterr().err
    check_preset_memory(config, 2, "cpu", shrunk=True, name="llama-3.1-8b")
    assert capsys.readouterr().err == ""  # shrunk: no warning


def test_record_cached_hub_id_config_is_checked_before_loading(tmp_path):
    """A hub id is looked up in the local cache without torch: its config.json bounds the sample
    selection at once (a fake cache holding only a config; the model itself is never built)."""
    import os
    import subprocess
    import sys

    snap = tmp_path / "hub" / "models--someone--tiny-llama" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(presets.preset_config_dict("llama-3.1-8b", layers=3)))
    (tmp_path / "hub" / "models--someone--tiny-llama" / "refs").mkdir()
    (tmp_path / "hub" / "models--someone--tiny-llama" / "refs" / "main").write_text("abc123")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "kvtrace.cli", "record", "--model", "someone/tiny-llama", "--prompt", "x",
            "--max-new-tokens", "2", "--sample-every", "1", "-o", str(tmp_path / "x.kvt.h5")]
    p = subprocess.run([*argv, "--sample-layers", "3"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == exitcodes.USAGE and "the model has 3 layers" in p.stderr, p.stderr
    p = subprocess.run([*argv[:5], "someone/not-cached", *argv[6:]], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == exitcodes.UNAVAILABLE and "not in the Hugging Face cache" in p.stderr


def test_preset_model_full_size_refused_before_building(monkeypatch):
    """The Python API refuses too: 8B float32 weights against 8 GiB available, before any tensor."""
    import types

    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=8 << 30))
    with pytest.raises(presets.PresetTooLarge, match=r"needs 29\.9 GiB"):
        presets.preset_model("llama-3.1-8b", shrink=False)
    assert presets.preset_model("llama-3.1-8b").config.num_hidden_layers == 2  # shrunk: fits
