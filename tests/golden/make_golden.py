"""Regenerate tests/golden/expected/ (see golden_cases.py): run from anywhere with the kvtrace venv."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from golden_cases import EXPECTED, commands, document  # noqa: E402


def main() -> None:
    shutil.rmtree(EXPECTED, ignore_errors=True)
    EXPECTED.mkdir(parents=True)
    for name, args in commands().items():
        doc = document(args)
        (EXPECTED / f"{name}.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        print(f"{name}: exit {doc['exit_code']}")


if __name__ == "__main__":
    main()
