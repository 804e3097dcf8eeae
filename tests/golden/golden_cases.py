"""The golden JSON outputs that pin kvtrace's behaviour across refactors (a redesign must not change them).

Every trace under tests/data goes through `analyze --json`, `info --json` and `calc --trace ...
--json`; each trace is also diffed against the first GPU fixture with `diff --json`. The documents
are committed under tests/golden/expected/ (made by `python tests/golden/make_golden.py`), and
tests/golden/test_golden.py asserts today's outputs equal them. A deliberate behaviour change
regenerates them in the same commit, which then shows the change as a JSON diff.

Outputs are produced in-process (click's runner) with paths relative to the repository root, so
the documents do not depend on where the checkout lives.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from kvtrace.cli import cli

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = Path(__file__).resolve().parent / "expected"
DIFF_BASE = "tests/data/gpu/gpu_clean.kvt.h5"


# The GPU clean matrix (66 near-identical tiny traces) has its own test; it would add 264 documents here.
EXCLUDED = ("tests/data/accuracy_matrix/",)


def traces() -> list[str]:
    found = (str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "data").rglob("*.kvt.h5"))
    return sorted(t for t in found if not t.startswith(EXCLUDED))


def commands() -> dict[str, list[str]]:
    """golden file name -> CLI arguments."""
    out: dict[str, list[str]] = {}
    for rel in traces():
        stem = rel.removeprefix("tests/data/").removesuffix(".kvt.h5").replace("/", "__")
        out[f"analyze__{stem}"] = ["analyze", "--json", rel]
        out[f"info__{stem}"] = ["info", "--json", rel]
        out[f"calc__{stem}"] = ["calc", "--trace", rel, "--context", "32k", "--gpu-memory", "80GiB", "--json"]
        if rel != DIFF_BASE:
            out[f"diff__{stem}"] = ["diff", "--json", DIFF_BASE, rel]
    return out


def run(args: list[str]) -> tuple[int, Any]:
    """(exit code, parsed JSON stdout) of one CLI call, run from the repository root."""
    here = os.getcwd()
    os.chdir(ROOT)
    try:
        result = CliRunner().invoke(cli, args, catch_exceptions=False)
    finally:
        os.chdir(here)
    try:
        doc = json.loads(result.stdout)
    except ValueError:
        doc = {"not_json": result.stdout[-2000:]}
    return result.exit_code, doc


def document(args: list[str]) -> dict[str, Any]:
    code, doc = run(args)
    return {"args": args, "exit_code": code, "stdout": doc}
