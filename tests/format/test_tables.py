"""Table: a request's rows read by its row runs, equal to the table read whole and masked."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtrace.format import schema
from kvtrace.format import tables as tables_mod
from kvtrace.format.reader import Trace
from kvtrace.format.tables import Table

DATA = Path(__file__).resolve().parents[1] / "data"
TRACES = sorted(DATA.rglob("*.kvt.h5"))


class TableTrace:
    """An in-memory /kv with the reader calls a Table uses; counts the rows it hands out."""

    path = Path("in-memory")

    def __init__(self, kv: np.ndarray) -> None:
        self.kv, self.rows_read = kv, 0

    def has(self, table: str) -> bool:
        return True

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
def test_rows_of_each_request_equal_the_masked_table(path):
    with Trace(path) as t:
        whole = t.kv[:]
        for r in t.requests[:]["request"]:
            got = t.kv.where(request=int(r))
            assert got.tobytes() == whole[whole["request"] == r].tobytes()
            steps = np.unique(got["step"])
            if steps.size:
                s = int(steps[-1])
                want = whole[(whole["request"] == r) & (whole["step"] == s)]
                assert t.kv.where(request=int(r), step=s).tobytes() == want.tobytes()
            steps_rows = t.steps[:]
            assert t.steps.where(request=int(r)).tobytes() == steps_rows[steps_rows["request"] == r].tobytes()
        assert t.kv.where(request=10**9).size == 0  # control: a request the trace does not hold
        assert len(t.kv) == whole.size and t["kv"] is t.kv


def test_runs_cross_slice_boundaries_and_interleave(monkeypatch):
    monkeypatch.setattr(tables_mod, "SCAN_ROWS", 3)  # boundaries inside runs
    reqs = [0, 0, 0, 0, 1, 1, 0, 2, 2, 2, 2, 2, 1]
    t = TableTrace(kv_rows(reqs))
    kv = Table(t, "kv")  # type: ignore[arg-type]
    assert kv.runs == {0: [(0, 4), (6, 7)], 1: [(4, 6), (12, 13)], 2: [(7, 12)]}
    t.rows_read = 0
    for r in (0, 1, 2):
        assert kv.where(request=r)["step"].tolist() == [i for i, q in enumerate(reqs) if q == r]
    assert t.rows_read == len(reqs)  # each row read once: its own runs, never the whole table


def test_many_runs_read_as_one_span(monkeypatch):
    monkeypatch.setattr(tables_mod, "MAX_RUNS", 2)
    reqs = [5, 0, 1, 0, 1, 0, 1, 7]
    t = TableTrace(kv_rows(reqs))
    kv = Table(t, "kv")  # type: ignore[arg-type]
    kv.runs  # noqa: B018
    t.rows_read = 0
    assert kv.where(request=0)["step"].tolist() == [1, 3, 5]
    assert t.rows_read == 5  # the span 1..5, masked: not 0 or 7


def test_tables_are_read_by_slices_and_small_ones_kept_read_only():
    path = DATA / "gpu_gemma3_tiny.kvt.h5"
    with Trace(path) as t:
        with pytest.raises(TypeError, match="row slices"):
            t.kv[0]  # noqa: B018 - a row number is not a request: refused, not guessed
        assert t.kv[1:3].tobytes() == t.kv[:][1:3].tobytes()
        assert t.requests[:] is t.requests[:] and not t.requests[:].flags.writeable
        with pytest.raises(KeyError, match="no table"):
            t["nope"]  # noqa: B018
