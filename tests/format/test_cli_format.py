"""`kvtrace --version`, `info` (text and JSON) and `validate` on a good trace."""

from __future__ import annotations

import json

from click.testing import CliRunner
from fmt_helpers import write_minimal

from kvtrace._version import __version__
from kvtrace.cli import cli
from kvtrace.format import schema


def test_version():
    res = CliRunner().invoke(cli, ["--version"])
    assert res.exit_code == 0 and __version__ in res.output


def test_info_text_and_json(tmp_path):
    path = tmp_path / "m.kvt.h5"
    write_minimal(path)
    res = CliRunner().invoke(cli, ["info", str(path)])
    assert res.exit_code == 0, res.output
    assert "test/minimal" in res.output and "1 ok" in res.output and "KiB" in res.output
    res = CliRunner().invoke(cli, ["info", "--json", str(path)])
    data = json.loads(res.output)
    assert data["format_version"] == schema.FORMAT_VERSION and data["complete"] is True
    assert data["requests"]["outcomes"] == {"ok": 1}
    assert data["payloads"]["tokens"] == "all"  # no /meta payload_tokens: whole samples (1.0 meaning)
    assert data["rows"]["requests"] == 1


def test_validate_good_trace(tmp_path):
    path = tmp_path / "m.kvt.h5"
    write_minimal(path)
    res = CliRunner().invoke(cli, ["validate", str(path)])
    assert res.exit_code == 0 and "valid kvtrace trace" in res.output
