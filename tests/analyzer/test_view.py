"""TraceView: /kv sliced per request by its row runs, equal to the table read whole and masked."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtrace.analyzer import view as view_mod
from kvtrace.analyzer.view import TraceView
from kvtrace.format import schema
from kvtrace.format.reader import Trace

DATA = Path(__file__).resolve().parents[1] / "data"
TRACES = sorted(DATA.rglob("*.kvt.h5"))


class TableTrace:
    """An in-memory /kv with the two reader calls TraceView uses; counts the rows it hands out."""

    def __init__(self, kv: np.ndarray) -> None:
        self.kv, self.rows_read = kv, 0

    def nrows(self, table: str) -> int:
        return self.kv.size

    def table(self, name: str, rows: slice | None = None) -> np.ndarray:
        out = self.kv[rows if rows is not None else slice(None)]
        self.rows_read += out.size
        return out


def kv_rows(requests: list[int]) -> np.ndarray:
    kv = np.zeros(len(requests), schema.KV)
    kv["request"] = requests
    kv["step"] = np.arange(len(requests))
    return kv


@pytest.mark.parametrize("path", TRACES, ids=lambda p: str(p.relative_to(DATA)))
def test_kv_of_each_request_equals_the_masked_table(path):
    with Trace(path) as t:
        whole = t.kv()
        v = TraceView(t)
        for r in v.requests["request"]:
            got = v.kv(int(r))
            assert got.tobytes() == whole[whole["request"] == r].tobytes()
            steps = np.unique(got["step"])
            if steps.size:
                s = int(steps[-1])
                assert v.kv(int(r), s).tobytes() == whole[(whole["request"] == r) & (whole["step"] == s)].tobytes()
        assert v.kv(10**9).size == 0  # control: a request the trace does not hold


def test_runs_cross_slice_boundaries_and_interleave(monkeypatch):
    monkeypatch.setattr(view_mod, "SCAN_ROWS", 3)  # boundaries inside runs
    reqs = [0, 0, 0, 0, 1, 1, 0, 2, 2, 2, 2, 2, 1]
    t = TableTrace(kv_rows(reqs))
    v = TraceView(t)  # type: ignore[arg-type]
    assert v.kv_runs == {0: [(0, 4), (6, 7)], 1: [(4, 6), (12, 13)], 2: [(7, 12)]}
    t.rows_read = 0
    for r in (0, 1, 2):
        assert v.kv(r)["step"].tolist() == [i for i, q in enumerate(reqs) if q == r]
    assert t.rows_read == len(reqs)  # each row read once: its own runs, never the whole table


def test_many_runs_read_as_one_span(monkeypatch):
    monkeypatch.setattr(view_mod, "MAX_RUNS", 2)
    reqs = [5, 0, 1, 0, 1, 0, 1, 7]
    t = TableTrace(kv_rows(reqs))
    v = TraceView(t)  # type: ignore[arg-type]
    v.kv_runs  # noqa: B018
    t.rows_read = 0
    assert v.kv(0)["step"].tolist() == [1, 3, 5]
    assert t.rows_read == 5  # the span 1..5, masked: not 0 or 7
