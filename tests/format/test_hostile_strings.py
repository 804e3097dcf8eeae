"""Text from traces is data: fuzzed strings through every command's text and JSON output.

Traces written by the real TraceWriter carry hostile strings in the fields commands print: the
model id and type, the torch and transformers versions, the device name and a recorder error (a
note). The strings mix rich markup (``[/bold]x``, ``[link=...]``), terminal escapes (CSI, OSC 8
hyperlinks, C1 controls, CR and backspace), bidi overrides and isolates, forged lines, emoji codes,
undecodable bytes (a lone surrogate once read) and, in one example, a megabyte. Every command that
prints them runs in-process through the CLI entry point: info, validate, analyze (and --contents),
diff, report, whatif, export parquet, fleet, fleet diff, calc --trace, text and --json. Asserted:

- no traceback and never exit 70 (every exit is 0, or 64 for a fleet selector that names no trace);
- JSON output parses and holds the string exactly as the reader decoded it;
- text output holds no raw control character, bidi control or surrogate (only ``\\n`` and ``\\t``),
  and stays small (a 1 MB model id is cut, its length said).

hypothesis runs derandomized (tests/conftest.py) so CI sees the same strings every time.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
from pathlib import Path

import h5py
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvtrace import exitcodes
from kvtrace.cli import main
from kvtrace.textsafe import MAX_CHARS, visible
from tests.helpers.tracebuild import write_synthetic_trace

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore:Glyph:UserWarning")]  # matplotlib: no glyph for ESC

SPECIALS = [
    "[/bold]x", "[link=https://evil.example]click[/link]", "[bold red]r[/]", "\\[bold]", "x\\",
    "\x1b[31mred\x1b[0m", "\x1b]8;;https://evil.example\x1b\\link\x1b]8;;\x1b\\", "\x1b[2J\x1b[H", "\x9b31m",
    "a\rb", "ab\x08\x08", "\x07", "\x7f", "\u202eevil\u202c", "\u2066iso\u2069", "\u200f\u061c", "\u2028\u2029",
    "line\n0 finding(s), worst: none", "\t", ":smile:", "%s%n{0}", "\ufeff", "é漢字🙂",
]
# h5py stores attribute strings as UTF-8 without NUL; lone surrogates do not encode (undecodable
# bytes are tried separately, as raw attribute bytes)
_CHARS = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")
HOSTILE = st.lists(st.one_of(st.sampled_from(SPECIALS), st.text(_CHARS, max_size=6)), min_size=1, max_size=6).map("".join)
MEGABYTE = ("[/bold]\x1b[31m\u202e" * 100_000)[:1_000_000]

# Characters no text output may hold raw (newline and tab are layout)
UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029\ud800-\udfff]")
TEXT_LIMIT = 64 * MAX_CHARS  # every command's text output, whatever the trace holds


def _cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0) if not isinstance(exc.code, str) else 1
    return code, out.getvalue(), err.getvalue()


def _hostile_trace(path: Path, text: str, raw_type: bytes | None = None) -> Path:
    write_synthetic_trace(path, model_id=text, recorder_error=text, payloads=True, requests=1, new_tokens=6)
    with h5py.File(path, "a") as f:
        meta = f["meta"].attrs
        meta["model_type"] = raw_type if raw_type is not None else text[:4096]
        meta["torch_version"] = text[:512]
        meta["transformers_version"] = text[-512:]
        dev = f["devices"][:]
        dev["name"][0] = text.encode("utf-8", "replace")[: dev.dtype["name"].itemsize]
        f["devices"][:] = dev
    return path


def _commands(t: Path, base: Path, out: Path, text: str) -> dict[str, list[str]]:
    s, b = str(t), str(base)
    fleet = str(out / "fleet")
    return {
        "info": ["info", s], "info --json": ["info", "--json", s],
        "validate": ["validate", s], "validate --json": ["validate", "--json", s],
        "analyze": ["analyze", s], "analyze --json": ["analyze", "--json", s],
        "analyze --contents": ["analyze", "--contents", s],
        "diff": ["diff", b, s], "diff --json": ["diff", "--json", s, b],
        "report": ["report", s, "-o", str(out / "r.html")],
        "report --json": ["report", s, "-o", str(out / "r2.html"), "--no-whatif", "--json"],
        "whatif": ["whatif", s, "--policy", "knorm", "--policy", "kivi:nbits=4", "--ratio", "0.5"],
        "whatif --json": ["whatif", s, "--policy", "knorm", "--ratio", "0.5", "--json"],
        "calc --trace": ["calc", "--trace", s, "--context", "4k", "--gpu-memory", "80GiB"],
        "export parquet": ["export", "parquet", b, s, "-o", fleet],
        "fleet": ["fleet", fleet], "fleet --json": ["fleet", fleet, "--json"],
        "fleet --sql": ["fleet", fleet, "--sql", "SELECT model_id, model_type, device, torch_version FROM traces"],
        "fleet --sql --json": ["fleet", fleet, "--sql", "SELECT model_id, model_type FROM traces", "--json"],
        "fleet diff": ["fleet", "diff", fleet, "--baseline", "model_id=synthetic/tiny-qwen3-hybrid",
                       "--candidate", f"model_id={text[:200]}"],
        "fleet diff --json": ["fleet", "diff", fleet, "--baseline", "model_id=synthetic/tiny-qwen3-hybrid",
                              "--candidate", f"model_id={text[:200]}", "--json"],
    }


FLEET = all(importlib.util.find_spec(m) is not None for m in ("duckdb", "pyarrow"))  # the fleet extra


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_trace(tmp_path_factory.mktemp("base") / "base.kvt.h5", payloads=True, requests=1,
                                 new_tokens=6)


def check_every_command(trace: Path, base: Path, out: Path, text: str) -> dict[str, int]:
    """Run every command on ``trace``; assert the contract; return name -> exit code."""
    from kvtrace.format import Trace

    with Trace(trace) as t:
        model_id = t.meta.model_id  # as the reader decodes it (undecodable bytes: U+FFFD)
    codes = {}
    for name, argv in _commands(trace, base, out, text).items():
        if name.startswith(("fleet", "export parquet")) and not FLEET:
            continue
        code, stdout, stderr = _cli(argv)
        codes[name] = code
        assert code != exitcodes.INTERNAL and "Traceback" not in stdout + stderr, (name, stderr[-2000:])
        assert code in (0, exitcodes.USAGE) if name.startswith("fleet diff") else code == 0, (name, code, stderr[-500:])
        assert not UNSAFE.search(stderr), (name, UNSAFE.search(stderr))
        if name.endswith("--json") and code == 0:
            doc = json.loads(stdout)  # exact JSON, whatever the strings hold
            if name in ("info --json", "analyze --json"):  # the string exactly as the reader decoded it
                assert (doc if name == "info --json" else doc["reports"][0])["model"]["id"] == model_id
        else:
            bad = UNSAFE.search(stdout)
            assert bad is None, (name, bad, stdout[max(0, bad.start() - 80):bad.end() + 80])
            assert len(stdout) + len(stderr) < TEXT_LIMIT, (name, len(stdout), len(stderr))
    return codes


@pytest.mark.slow
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(text=HOSTILE)
@example(text="[/bold]x")
@example(text="\x1b]8;;https://evil.example\x1b\\[link=https://evil.example]x[/link]\u202e\nkvtrace: forged line\r")
@example(text=MEGABYTE)
def test_hostile_strings_through_every_command(text, base, tmp_path_factory):
    d = tmp_path_factory.mktemp("strings")
    trace = _hostile_trace(d / "hostile.kvt.h5", text)
    check_every_command(trace, base, d, text)


@pytest.mark.slow
def test_undecodable_bytes_print_as_replacement(base, tmp_path):
    """A model type of raw bytes that are not UTF-8 (a lone surrogate's encoding, a stray 0xff):
    read as U+FFFD, never a surrogate that no terminal or JSON writer accepts."""
    trace = _hostile_trace(tmp_path / "bytes.kvt.h5", "ok", raw_type=b"\xed\xa0\x80x\xff\x1b[31m")
    codes = check_every_command(trace, base, tmp_path, "ok")
    assert set(codes.values()) <= {0, exitcodes.USAGE}
    code, out, _ = _cli(["info", str(trace)])
    assert "\ufffd" in out and "\\x1b[31m" in out


def test_visible_escapes_what_acts_on_a_terminal():
    assert visible("a\x1b[31mb\u202ec\nd\te") == "a\\x1b[31mb\\u202ec\\x0ad\\x09e"
    assert visible("a\nb\tc\rd", multiline=True) == "a\nb\tc\\x0dd"
    assert visible("x\udc80y") == "x\\udc80y"
    assert visible("[/bold]é漢🙂") == "[/bold]é漢🙂"  # markup is the console's business; text stays text
    cut = visible("a" * 10_000)
    assert cut.startswith("a" * MAX_CHARS) and cut.endswith(f"... [{10_000 - MAX_CHARS:,} more characters]")


def test_a_terminal_console_prints_markup_and_escapes_as_text():
    """On a real terminal (colours on) rich writes its own escapes; the trace's stay visible text."""
    from rich.table import Table

    from kvtrace.analyzer.terminal import _PipeConsole

    buf = io.StringIO()
    c = _PipeConsole(file=buf, force_terminal=True, color_system="truecolor", markup=False, width=200)
    hostile = "[/bold]x\x1b[31mRED\x1b]8;;https://e\x1b\\:smile:\u202e"
    c.print(hostile, style="bold")
    t = Table(title=hostile)
    t.add_column(hostile)
    t.add_row(hostile)
    c.print(t)
    out = buf.getvalue()
    assert "\x1b[31mRED" not in out and "\x1b]8;;https://e" not in out and "\u202e" not in out
    assert "\\x1b[31mRED" in out and "[/bold]x" in out and ":smile:" in out
