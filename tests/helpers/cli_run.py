"""Run the kvtrace CLI in-process, as `python -m kvtrace.cli` would (exit code, stdout, stderr)."""

from __future__ import annotations

import pytest

from kvtrace.cli import main


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(argv)
        raise SystemExit(0)
    out = capsys.readouterr()
    return int(info.value.code or 0), out.out, out.err
