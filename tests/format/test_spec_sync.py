"""The normative spec and schema.py describe the same tables, fields, enums and attributes."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from kvtrace.format import schema

SPEC = (Path(__file__).resolve().parents[2] / "spec" / "kvtrace-format.md").read_text()

TYPE_NAMES = {"u1": "uint8", "u2": "uint16", "u4": "uint32", "u8": "uint64",
              "i2": "int16", "i4": "int32", "i8": "int64"}


def _spec_type(dt: np.dtype) -> str:
    base = dt.base if dt.shape else dt
    name = f"bytes[{base.itemsize}]" if base.kind == "S" else TYPE_NAMES[base.str[1:]]
    return name + (f"[{','.join(map(str, dt.shape))}]" if dt.shape else "")


def _section(table: str) -> str:
    m = re.search(rf"### [\d.]+ `/{re.escape(table)}`.*?(?=\n### |\n## )", SPEC, re.S)
    assert m, f"spec has no section for /{table}"
    return m.group(0)


def test_every_table_field_documented_with_its_type():
    for table, (dtype, _required) in {**schema.TABLES, "status": (schema.STATUS, True), "stop": (schema.STOP, False)}.items():
        rows = re.findall(r"^\| `(\w+)` \| ([\w\[\],]+) \|", _section(table), re.M)
        assert [n for n, _ in rows] == list(dtype.names), table
        for name, typ in rows:
            assert typ == _spec_type(dtype[name]), (table, name)


def test_enums_documented():
    for enum_type, title in [(schema.LayerType, "LayerType"), (schema.CacheDType, "CacheDType"),
                             (schema.Outcome, "Outcome"), (schema.EventKind, "EventKind"),
                             (schema.ReadingLabel, "ReadingLabel"), (schema.PayloadKind, "PayloadKind"),
                             (schema.Phase, "Phase")]:
        para = re.search(rf"`{title}` \(u8\):(.*?)\n\n", SPEC, re.S).group(1)
        codes = {int(c) for c in re.findall(r"(\d+) [a-z]", para)}
        assert codes == {int(v) for v in enum_type}, title


def test_meta_attributes_documented():
    for name, required in schema.META_ATTRS.items():
        m = re.search(rf"^\| `{name}` \| [^|]+ \| (yes|no) \|", SPEC, re.M)
        assert m, name
        assert (m.group(1) == "yes") == required, name


def test_version_in_spec_title():
    assert f"version {schema.FORMAT_VERSION}" in SPEC.splitlines()[0]
