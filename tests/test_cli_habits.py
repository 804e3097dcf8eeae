"""CLI habits: a closed stdout pipe, 80-column output, help on every option,
no command named anywhere that does not exist."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest

from kvtrace import exitcodes
from kvtrace.cli import COMMANDS, cli

ROOT = Path(__file__).resolve().parents[1]
GPU_TRACE = ROOT / "tests" / "data" / "gpu" / "gpu_clean.kvt.h5"  # every Requests column measured
CPU_TRACE = ROOT / "tests" / "data" / "gpu_gemma3_tiny.kvt.h5"


def _closed_pipe_run(*args: str) -> subprocess.CompletedProcess:
    """Run the CLI with stdout a pipe whose reader closed before the first write, as
    `kvtrace ... | head -1` does once head has its line (deterministic: no race on the buffer)."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run([sys.executable, "-m", "kvtrace.cli", *args], stdout=w, stderr=subprocess.PIPE,
                              text=True, timeout=120, env={**os.environ, "COLUMNS": "80"})
    finally:
        os.close(w)


@pytest.mark.parametrize("args", [("info", str(CPU_TRACE)), ("analyze", str(GPU_TRACE))])
def test_closed_stdout_exits_quietly(args):
    proc = _closed_pipe_run(*args)
    assert proc.returncode == exitcodes.BROKEN_PIPE == 141, proc.stderr
    assert proc.stderr == ""  # no "internal error: BrokenPipeError", no "Exception ignored"


def test_head_in_a_real_shell_pipeline(tmp_path):
    """The user's own words: `kvtrace info TRACE | head -1` prints the first line, nothing on stderr."""
    script = (f'"{sys.executable}" -m kvtrace.cli info "{CPU_TRACE}" 2>"{tmp_path / "err"}" | head -1; '
              'echo "rc=${PIPESTATUS[0]}"')
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120).stdout
    first, rc = out.splitlines()
    assert first.startswith(str(CPU_TRACE)) and "format" in first
    # 0 when the whole output fit the pipe before head closed it, 141 when a write hit the closed pipe
    assert rc in ("rc=0", "rc=141"), out
    assert (tmp_path / "err").read_text() == ""


def _widest(text: str) -> int:
    return max((len(line) for line in text.splitlines()), default=0)


def test_analyze_requests_table_fits_80_columns():
    from kvtrace.analyzer import analyze
    from kvtrace.analyzer.terminal import console_for, render

    report = analyze(GPU_TRACE)
    for width in (80, 200):
        buf = io.StringIO()
        render(report, console_for(buf, width=width))
        text = buf.getvalue()
        assert _widest(text) <= width, text
        assert "…" not in text  # no header or cell cut short
        for header in ("outcome", "prompt", "peak KV", "peak alloc", "KV alive after", "retained"):
            assert header in text, header
    # the control: at 200 columns one table holds every column; at 80 it folds into two
    assert "Requests: tokens" in _render(report, 80) and "Requests: memory" in _render(report, 80)
    assert "Requests: tokens" not in _render(report, 200)


def _render(report, width: int) -> str:
    from kvtrace.analyzer.terminal import console_for, render

    buf = io.StringIO()
    render(report, console_for(buf, width=width))
    return buf.getvalue()


def test_info_fits_80_columns():
    env = {**os.environ, "COLUMNS": "80"}
    out = subprocess.run([sys.executable, "-m", "kvtrace.cli", "info", str(GPU_TRACE)], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert _widest(out.stdout) <= 80, out.stdout
    assert re.search(r"^structure  read at \d+ steps", out.stdout, re.M)  # not "N steps": rows are reads
    assert "-1:" not in out.stdout and "cpu cpu" not in out.stdout


def _walk(cmd: click.Command, path: str):
    yield path, cmd
    if isinstance(cmd, click.Group):
        ctx = click.Context(cmd)
        for name in cmd.list_commands(ctx):
            yield from _walk(cmd.get_command(ctx, name), f"{path} {name}")


def test_every_option_and_argument_has_help():
    """Options need help=; click arguments have no help field, so each one must be named in
    its command's docstring (upper-case metavar, e.g. TRACE)."""
    missing = []
    commands = list(_walk(cli, "kvtrace"))
    assert len(commands) > len(COMMANDS)  # the group, every command, and export's subcommands
    for path, cmd in commands:
        if not (cmd.help or "").strip():
            missing.append(f"{path}: no command help")
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.hidden and not (p.help or "").strip():
                missing.append(f"{path} {p.opts[0]}")
            if isinstance(p, click.Argument) and p.human_readable_name not in (cmd.help or ""):
                missing.append(f"{path} argument {p.human_readable_name} not described")
    assert not missing, missing


def test_required_options_say_so():
    """Every required option shows "[required]" in its command's --help; --creator is one."""
    checked = 0
    for path, cmd in _walk(cli, "kvtrace"):
        required = [p for p in cmd.params if isinstance(p, click.Option) and p.required]
        if not required:
            continue
        text = cmd.get_help(click.Context(cmd, info_name=path))
        assert text.count("required]") >= len(required), (path, [p.opts[0] for p in required])
        checked += len(required)
    export = cli.get_command(click.Context(cli), "export")
    zenodo = export.get_command(click.Context(export), "zenodo")
    assert next(p for p in zenodo.params if p.name == "creators").required
    assert checked >= 8


# `kvtrace X` where X reads as a command: in backticks, at the start of a (code) line, in a quoted
# string, or after "see / run / try / with / use".
_NAMED = re.compile(r"(?:`|^\s*(?:\$ )?|['\"(]|\bsee |\brun |\btry |\bwith |\buse )kvtrace ([a-z][\w-]*)", re.M)
# Words that follow "kvtrace " in prose without being commands: the Perfetto "kvtrace host"
# process, "kvtrace capacity plan" (calc's title), "kvtrace analysis of" (analyze's title), verbs.
_NOT_COMMANDS = {"host", "capacity", "analysis", "records", "writes", "exits", "opens"}


def _named_commands(text: str) -> set[str]:
    return set(_NAMED.findall(text)) - _NOT_COMMANDS


def test_every_named_command_exists():
    """Hints, help texts, README, docs and the spec name only real commands (the issue saw a hint
    naming a `kvtrace zenodo` command; it is `kvtrace export zenodo`)."""
    sources = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "spec").glob("*.md"),
               *(ROOT / "kvtrace").rglob("*.py"), *(ROOT / "grafana").rglob("*.json")]
    bad = [f"{f.relative_to(ROOT)}: kvtrace {name}" for f in sources
           for name in _named_commands(f.read_text(encoding="utf-8")) if name not in COMMANDS]
    assert not bad, bad
    # the check sees a bad name in each of the forms it reads
    for text in ("run kvtrace zenodo DIR", "see 'kvtrace zenodo'", "`kvtrace zenodo`", "  kvtrace zenodo x"):
        assert _named_commands(text) == {"zenodo"}, text


def test_spec_cli_md_lists_every_exit_code():
    """exitcodes.py cites spec/cli.md: the file exists and its table is exitcodes.py's, as is the command
    reference's (docs/commands.md, which README.md links for them)."""
    spec = (ROOT / "spec" / "cli.md").read_text(encoding="utf-8")
    readme = (ROOT / "docs" / "commands.md").read_text(encoding="utf-8")
    codes = {name: value for name, value in vars(exitcodes).items() if name.isupper() and isinstance(value, int)}
    rows = dict(re.findall(r"^\| (\d+) \| `([A-Z_]+)` \|", spec, re.M))
    assert {v: int(k) for k, v in rows.items()} == codes
    for value in codes.values():
        assert re.search(rf"^\| {value} \|", readme, re.M), value
