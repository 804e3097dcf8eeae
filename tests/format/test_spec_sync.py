"""The normative spec and schema.py describe the same tables, fields, enums and attributes."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from kvtrace.format import schema
from kvtrace.format.reader import Payload, TraceMeta

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


DECLARED = {**schema.TABLE_DECLS, "status": schema.STATUS_TABLE, "stop": schema.STOP_TABLE}


def test_every_table_field_documented_with_its_type():
    for table, decl in DECLARED.items():
        rows = re.findall(r"^\| `(\w+)` \| ([\w\[\],]+) \|", _section(table), re.M)
        assert [n for n, _ in rows] == list(decl.dtype.names), table
        for name, typ in rows:
            assert typ == _spec_type(decl.dtype[name]), (table, name)


def test_units_meaning_and_title_documented():
    """The unit and meaning columns are the schema's declarations (also written into 1.3 files)."""
    for table, decl in DECLARED.items():
        section = _section(table)
        assert decl.title in section.splitlines()[0], table
        rows = re.findall(r"^\| `(\w+)` \| [\w\[\],]+ \| ?([^|]*?) ?\| ?(.*?) ?\|$", section, re.M)
        for (name, unit, meaning), column in zip(rows, decl.columns, strict=True):
            assert (name, unit, meaning) == (column.name, column.unit_label, column.doc), (table, name)
            assert (column.text is not None) == (unit == "text ref"), (table, name)


def test_enums_documented():
    for enum_type, title in [(schema.LayerType, "LayerType"), (schema.CacheDType, "CacheDType"),
                             (schema.Outcome, "Outcome"), (schema.EventKind, "EventKind"),
                             (schema.ReadingLabel, "ReadingLabel"), (schema.PayloadKind, "PayloadKind"),
                             (schema.Phase, "Phase"), (schema.StateKind, "StateKind"),
                             (schema.Owner, "Owner"), (schema.OwnerMoment, "OwnerMoment")]:
        para = re.search(rf"`{title}` \(u8\):(.*?)\n\n", SPEC, re.S).group(1)
        codes = {int(c) for c in re.findall(r"(\d+) [a-z]", para)}
        assert codes == {int(v) for v in enum_type}, title


META_TYPES = {"str": "string", "int": "int64", "bool": "bool", "json": "JSON"}


def test_meta_attributes_documented():
    for attr in schema.META:
        m = re.search(rf"^\| `{attr.name}` \| ([^|]+) \| (yes|no)(?: \(([\d.]+)\))? \|", SPEC, re.M)
        assert m, attr.name
        assert m.group(1) == META_TYPES[attr.kind], attr.name
        assert (m.group(2) == "yes") == attr.required, attr.name
        assert (m.group(3) or "1.0") == attr.since, attr.name
    documented = re.findall(r"^\| `(\w+)` \| (?:string|int64|bool|JSON) \| (?:yes|no)", SPEC, re.M)
    assert sorted(documented) == sorted(schema.META_BY_NAME)


def test_reader_meta_fields_are_the_declared_ones():
    """TraceMeta (the typed view) has a field per required attribute, plus payload_tokens (1.1,
    optional with a default); other optional attributes land in ``extra``."""
    fields = set(TraceMeta.__dataclass_fields__) - {"extra"}
    assert fields == {a.field for a in schema.META if a.required} | {"payload_tokens"}


def test_version_in_spec_title():
    assert f"version {schema.FORMAT_VERSION}" in SPEC.splitlines()[0]


def test_payload_classes_carry_the_declared_description():
    """reader.Payload and writer.EncodedPayload describe a payload with the index's own columns."""
    from dataclasses import fields

    from kvtrace.format.writer import EncodedPayload

    assert set(schema.PAYLOAD_DESCRIPTION) <= set(schema.PAYLOAD_INDEX.names)
    assert [f.name for f in fields(Payload)] == [*schema.PAYLOAD_DESCRIPTION, "data"]
    assert set(schema.PAYLOAD_DESCRIPTION) | {"itemsize", "n_elements", "frames"} == {f.name for f in fields(EncodedPayload)}
