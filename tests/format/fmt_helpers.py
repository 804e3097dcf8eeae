"""Small builders for format tests: rows built by name with the schema's row types."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvtrace.format import DeviceInfo, TraceWriter, schema


def zero_row(dtype: np.dtype) -> tuple:
    return np.zeros((), dtype=dtype).item()


def request_row(request: int, outcome: int = schema.Outcome.RUNNING) -> tuple:
    return schema.RequestRow(request=request, outcome=int(outcome), batch_size=1, prompt_tokens=0,
                             new_tokens=0, eos_step=-1, start_ns=0, end_ns=0, prompt_sha256=b"0" * 64)


def write_minimal(path: Path, **writer_kwargs) -> None:
    with TraceWriter(path, {"model_id": "test/minimal", "model_type": "llama"},
                     [DeviceInfo(-1, "cpu", -1)], **writer_kwargs) as w:
        w.begin_request(request_row(0))
        w.update_request(0, outcome=int(schema.Outcome.OK), new_tokens=3)
