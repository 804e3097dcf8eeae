"""Today's JSON outputs equal the committed golden documents (refactors preserve behaviour)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from golden_cases import EXPECTED, commands, document  # noqa: E402

CASES = commands()


def test_every_case_has_a_golden_file() -> None:
    have = {p.stem for p in EXPECTED.glob("*.json")}
    assert have == set(CASES), "regenerate with python tests/golden/make_golden.py"


@pytest.mark.parametrize("name", sorted(CASES))
def test_output_equals_golden(name: str) -> None:
    expected = json.loads((EXPECTED / f"{name}.json").read_text())
    got = json.loads(json.dumps(document(CASES[name]), sort_keys=True))
    assert got == expected
