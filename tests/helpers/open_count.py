"""Counters for the one-open tests: how often a Trace is opened, and which open traces built
their /kv request index (tests/report/test_one_open.py, tests/export/test_one_open.py)."""

from __future__ import annotations

from functools import cached_property

import pytest

from kvtrace.format import reader
from kvtrace.format.tables import Table


def count_opens(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths every reader.Trace is opened with from now on, in order."""
    count: list[str] = []
    real = reader.Trace.__init__

    def counting(self, path, *a, **kw):
        count.append(str(path))
        real(self, path, *a, **kw)

    monkeypatch.setattr(reader.Trace, "__init__", counting)
    return count


def count_kv_indexes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """ids of the open traces that build their /kv request index from now on."""
    built: list[int] = []
    index = Table.runs.func

    def counted(self):
        if self.path == "kv":
            built.append(id(self.trace))
        return index(self)

    prop = cached_property(counted)
    prop.__set_name__(Table, "runs")
    monkeypatch.setattr(Table, "runs", prop)
    return built
