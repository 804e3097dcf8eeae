"""/owners (format 1.5, spec §4.19, §7): rows a recorder never writes are listed by validate and refused
by analyze (exit 1); a valid reading is read back as the owner phrase an OOM post-mortem prints."""

from __future__ import annotations

import subprocess
import sys

import h5py
import numpy as np
import pytest

import kvtrace
from kvtrace.analyzer import owners as own
from kvtrace.analyzer.replay import ReplayContext
from kvtrace.format import Trace, schema
from kvtrace.format.errors import InvalidTrace
from kvtrace.format.validate import validate
from tests.helpers.tracebuild import LLAMA_LIKE, Req, build

MiB = 1 << 20
OW, M = schema.Owner, schema.OwnerMoment


def _with_owners(path, rows, detail: bytes = b"") -> None:
    with h5py.File(path, "r+") as f:
        off = 0
        if detail:
            text = f["text"]
            off = text.shape[0]
            text.resize((off + len(detail),))
            text[off:] = np.frombuffer(detail, dtype="u1")
        arr = np.array([(*r[:8], off if detail and r[4] == int(OW.KV_EARLIER) else 0,
                         len(detail) if detail and r[4] == int(OW.KV_EARLIER) else 0, r[8]) for r in rows],
                       dtype=schema.OWNERS)
        ds = f["owners"]
        ds.resize((arr.size,))
        ds[:] = arr


def test_a_valid_reading_reads_back_as_shares(tmp_path):
    path = build(tmp_path / "ok.kvt.h5", LLAMA_LIKE, [Req(16, 8), Req(16, 8)], gpu=True)
    rows = [(1, 3, int(M.OOM), 0, int(OW.KV_REQUEST), 61 * MiB, 4, 16 * MiB, 5),
            (1, 3, int(M.OOM), 0, int(OW.WEIGHTS), 22 * MiB, 30, 4 * MiB, 5),
            (1, 3, int(M.OOM), 0, int(OW.KV_EARLIER), 13 * MiB, 4, 4 * MiB, 5),
            (1, 3, int(M.OOM), 0, int(OW.UNKNOWN), 4 * MiB, 2, 3 * MiB, 5),
            (1, 3, int(M.OOM), 0, int(OW.INACTIVE), 9 * MiB, 1, 9 * MiB, 5)]
    _with_owners(path, rows, b'{"requests":[0]}')
    assert not validate(path).problems
    with Trace(path) as t:
        ctx = ReplayContext(t)
        (rd,) = own.latest(ctx, 1, M.OOM)
    assert rd.allocated == 100 * MiB
    assert own.describe(rd) == ("KV of request 1 61% (61.0 MiB), weights 22% (22.0 MiB), KV of earlier request 0 "
                                "13% (13.0 MiB), unknown 4% (4.0 MiB)")


@pytest.mark.parametrize("bad,problem", [
    ((0, -1, int(M.REQUEST_END), 0, int(OW.UNKNOWN), MiB, 1, 2 * MiB, 5), "largest block exceeds"),
    ((0, -1, int(M.REQUEST_END), 0, int(OW.UNKNOWN), MiB, 0, 0, 5), "bytes but no blocks"),
    ((7, -1, int(M.REQUEST_END), 0, int(OW.UNKNOWN), MiB, 1, MiB, 5), "absent from /requests"),
])
def test_damaged_rows_are_listed_and_refused(tmp_path, bad, problem):
    path = build(tmp_path / "bad.kvt.h5", LLAMA_LIKE, [Req(16, 8, retained=8 * MiB, retention_layers=[0])], gpu=True)
    _with_owners(path, [bad])
    assert any(problem in p for p in validate(path).problems), validate(path).problems
    with pytest.raises(InvalidTrace, match=problem):
        kvtrace.analyze(path)
    r = subprocess.run([sys.executable, "-m", "kvtrace.cli", "analyze", str(path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and problem in r.stderr
