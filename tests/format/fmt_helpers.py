"""Small builders for format tests: rows in each table's field order."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvtrace.format import DeviceInfo, TraceWriter, schema


def zero_row(dtype: np.dtype) -> tuple:
    return np.zeros((), dtype=dtype).item()


def request_row(request: int, outcome: int = schema.Outcome.RUNNING) -> tuple:
    row = list(zero_row(schema.REQUESTS))
    row[0] = request
    row[1] = int(outcome)
    row[2] = 1
    row[5] = -1
    row[8] = b"0" * 64
    return tuple(row)


def write_minimal(path: Path, **writer_kwargs) -> None:
    with TraceWriter(path, {"model_id": "test/minimal", "model_type": "llama"},
                     [DeviceInfo(-1, "cpu", -1)], **writer_kwargs) as w:
        w.begin_request(request_row(0))
        w.update_request(0, outcome=int(schema.Outcome.OK), new_tokens=3)
