"""No kvtrace command writes onto one of its inputs or onto an existing trace (issue 14, item 2).

Every case checks the exit code (64: the command line names a file it must not write; 73: the
output cannot be created), a one-line message, and that the protected file is byte-for-byte
unchanged. The clean controls beside them show the same options do write where they may.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from cli_run import run_main as run

from kvtrace import exitcodes

FIXTURE = Path(__file__).parent / "data" / "gpu_gemma3_tiny.kvt.h5"


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture()
def files(tmp_path):
    a, b = tmp_path / "a.kvt.h5", tmp_path / "b.kvt.h5"
    shutil.copyfile(FIXTURE, a)
    shutil.copyfile(FIXTURE, b)
    link = tmp_path / "link-to-a.json"
    link.symlink_to(a)
    hard = tmp_path / "hard-a.out"
    os.link(a, hard)
    return {"a": a, "b": b, "link": link, "hard": hard, "dir": tmp_path}


# (argv template, what it protects). {a} is the command's input, {b} another existing trace,
# {link} a symlink to {a}, {hard} a hard link to {a}.
REFUSED = [
    (["info", "{a}", "--json-out", "{a}"], "a"),
    (["info", "{a}", "--json-out", "{link}"], "a"),
    (["info", "{a}", "--json-out", "{hard}"], "a"),
    (["info", "{a}", "--json-out", "{b}"], "b"),
    (["validate", "{a}", "--json-out", "{a}"], "a"),
    (["analyze", "{a}", "--json-out", "{a}"], "a"),
    (["analyze", "{a}", "{b}", "--json-out", "{b}"], "b"),
    (["analyze", "{a}", "--json", "{b}.json"], "a"),  # the old `--json FILE`: a usage error now
    (["diff", "{a}", "{b}", "--json-out", "{b}"], "b"),
    (["report", "{a}", "-o", "{a}"], "a"),
    (["report", "{a}", "-o", "{link}"], "a"),
    (["report", "{a}", "-o", "{b}"], "b"),
    (["report", "{a}", "-o", "{dir}/r.html", "--json-out", "{dir}/r.html"], "a"),
    (["report", "{a}", "-o", "{dir}/r.html", "--figures", "{b}"], "b"),
    (["export", "perfetto", "{a}", "-o", "{a}"], "a"),
    (["export", "perfetto", "{a}", "-o", "{b}"], "b"),
    (["export", "perfetto", "{a}", "-o", "{dir}/t.json", "--json-out", "{a}"], "a"),
    (["export", "prometheus-textfile", "{a}", "-o", "{hard}"], "a"),
    (["export", "zenodo", "{a}", "-o", "{a}", "--creator", "Doe, Jane"], "a"),
    (["export", "zenodo", "{a}", "-o", "{b}", "--creator", "Doe, Jane"], "b"),
    (["calc", "--trace", "{a}", "--context", "4096", "--gpu-memory", "80GiB", "--json-out", "{a}"], "a"),
    (["presets", "--json-out", "{b}"], "b"),
    (["record", "--model", "preset:llama-3.1-8b", "--tiny", "--prompt", "x", "--max-new-tokens", "2",
      "-o", "{dir}"], "a"),  # a directory as the trace file: 64 like click's own path checks
]


@pytest.mark.parametrize("argv, protected", REFUSED, ids=[" ".join(a[:3]) for a, _ in REFUSED])
def test_outputs_never_replace_inputs_or_traces(files, capsys, argv, protected):
    keep = {k: digest(files[k]) for k in ("a", "b")}
    code, _, err = run([part.format(**files) for part in argv], capsys)
    assert code == exitcodes.USAGE, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert digest(files[protected]) == keep[protected]
    assert digest(files["a"]) == keep["a"] and digest(files["b"]) == keep["b"]


def test_analyze_json_before_traces_reads_both_and_writes_neither(files, capsys):
    """The reported case: `analyze --json a b` replaced a with JSON. Now --json is a flag."""
    keep = digest(files["a"])
    code, out, err = run(["analyze", "--json", str(files["a"]), str(files["b"])], capsys)
    assert code == 0, err
    assert len(json.loads(out)["reports"]) == 2
    assert digest(files["a"]) == keep


@pytest.mark.parametrize("argv", [
    ["info", "{a}", "--json-out", "{dir}/no/such/dir/x.json"],
    ["report", "{a}", "-o", "{dir}/no/such/dir/r.html"],
    ["export", "perfetto", "{a}", "-o", "{dir}/no/such/dir/t.json"],
    ["analyze", "{a}", "--json-out", "{dir}/no/such/dir/r.json"],
])
def test_uncreatable_outputs_exit_73(files, capsys, argv):
    code, _, err = run([part.format(**files) for part in argv], capsys)
    assert code == exitcodes.CANNOT_WRITE, err
    assert err.count("\n") == 1


def test_json_out_writes_what_json_prints(files, capsys):
    """The clean control: --json-out writes a new file, identical to what --json prints."""
    out_file = files["dir"] / "info.json"
    code, printed, err = run(["info", str(files["a"]), "--json", "--json-out", str(out_file)], capsys)
    assert code == 0, err
    assert json.loads(out_file.read_text()) == json.loads(printed)
    # an existing non-trace output (a previous JSON) may be replaced: only traces and inputs are protected
    code, _, err = run(["validate", str(files["a"]), "--json-out", str(out_file)], capsys)
    assert code == 0, err
    assert json.loads(out_file.read_text())["valid"] is True


def test_record_refuses_existing_output_and_its_prompts_file(files, capsys, monkeypatch):
    import kvtrace.commands.record as rec_cmd

    def never(*a, **k):
        raise AssertionError("model loaded despite a refused output")

    monkeypatch.setattr(rec_cmd, "load_model", never)
    base = ["record", "--model", "preset:llama-3.1-8b", "--tiny", "--max-new-tokens", "2"]
    keep = digest(files["a"])
    code, _, err = run([*base, "--prompt", "x", "-o", str(files["a"])], capsys)
    assert code == exitcodes.USAGE and "--force" in err and err.count("\n") == 1
    prompts = files["dir"] / "prompts.txt"
    prompts.write_text("hello\n")
    code, _, err = run([*base, "--prompts", str(prompts), "-o", str(prompts), "--force"], capsys)
    assert code == exitcodes.USAGE and "input" in err
    assert prompts.read_text() == "hello\n" and digest(files["a"]) == keep
    code, _, err = run([*base, "--prompt", "x", "-o", str(files["dir"] / "m.kvt.h5"),
                        "--prometheus-textfile", str(files["dir"] / "m.kvt.h5")], capsys)
    assert code == exitcodes.USAGE and "same file" in err
