"""spec/fleet.md lists every fleet table with exactly the columns and types the exporter writes."""

from __future__ import annotations

import re
from pathlib import Path

from kvtrace.fleet.tables import TABLE_NAMES, empty_schema

SPEC = Path(__file__).resolve().parents[2] / "spec" / "fleet.md"


def _documented() -> dict[str, list[tuple[str, str]]]:
    text = SPEC.read_text(encoding="utf-8").split("## Table schemas", 1)[1]
    out = {}
    for name, body in re.findall(r"### `(\w+)`\n\n(.+)\n", text):
        # columns are "`name` type" joined by ", "; nested types (list<struct<a t, b t>>) contain
        # ", " too but never a backtick after it
        out[name] = [tuple(col.strip("`").split("` ", 1)) for col in re.split(r", (?=`)", body)]
    return out


def _spelled(arrow_type: object) -> str:
    return str(arrow_type).replace("item: ", "").replace(": ", " ")


def test_spec_lists_every_table_and_column():
    doc = _documented()
    assert list(doc) == list(TABLE_NAMES)
    for name in TABLE_NAMES:
        assert doc[name] == [(f.name, _spelled(f.type)) for f in empty_schema(name)], name
