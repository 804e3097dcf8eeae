#!/usr/bin/env python
"""How long every README / `--help` example takes, against the README's promise that each runs in
under a minute on a 2-core machine. tests/test_examples.py checks that each example runs
and exits 0; the time is measured here, because tests never assert wall-clock times.

    python bench/bench_examples.py [--json out.json]

Each example runs as its own process in a fresh directory with the inputs it names (the same
preparation as the test). A baseline taken in the same run, `kvtrace --version` (interpreter and
package start-up), gives each example's time as a ratio; the budget column is time / 60 s.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import test_examples as ex  # noqa: E402 - the examples and their preparation, one definition

BUDGET_S = 60.0  # README: every example finishes in under a minute on a 2-core machine


def _timed(args: list[str], cwd: Path) -> tuple[float, int]:
    t0 = time.monotonic()
    p = ex._kvtrace(args, cwd)
    return time.monotonic() - t0, p.returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", dest="json_path", type=Path)
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        (tmp_path / "inputs").mkdir()
        inputs = ex.make_inputs(tmp_path / "inputs")
        base_s = min(_timed(["--version"], tmp_path)[0] for _ in range(3))
        for i, (where, line) in enumerate(ex.EXAMPLES):
            tokens, _, why_not = ex.split_example(where, line)
            if why_not:
                rows.append({"example": line, "skipped": why_not})
                continue
            work = tmp_path / f"ex{i}"
            work.mkdir()
            seconds, code = _timed(ex.prepare(tokens, work, inputs)[1:], work)
            rows.append({"example": line, "seconds": round(seconds, 2), "exit": code,
                         "ratio_to_startup": round(seconds / base_s, 1), "share_of_budget": round(seconds / BUDGET_S, 3)})
    table = Table(title=f"examples (start-up baseline `kvtrace --version`: {base_s:.2f} s; budget {BUDGET_S:.0f} s)")
    for col in ("example", "s", "x start-up", "of budget", "exit"):
        table.add_column(col, justify="left" if col == "example" else "right")
    for r in rows:
        if "skipped" in r:
            continue
        table.add_row(r["example"][:70], f"{r['seconds']:.1f}", f"{r['ratio_to_startup']:.1f}",
                      f"{r['share_of_budget']:.0%}", str(r["exit"]))
    Console().print(table)
    over = [r for r in rows if r.get("seconds", 0) >= BUDGET_S]
    print(f"{len(over)} of {sum('seconds' in r for r in rows)} examples at or over the budget")
    if args.json_path:
        args.json_path.write_text(json.dumps({"baseline_s": base_s, "budget_s": BUDGET_S, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
