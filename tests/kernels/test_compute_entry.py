"""kvtrace.kernels.compute: the analyser's one optional entry into torch and the kernels."""

from __future__ import annotations

import numpy as np
import pytest

from kvtrace.kernels import compute


def test_without_torch_the_entry_returns_the_reason(monkeypatch):
    monkeypatch.setattr(compute, "torch_available", lambda: (False, "torch is not installed"))
    assert compute.open_compute("cpu", "torch") == "torch is not installed"


def test_with_torch_the_entry_runs_on_the_device_asked():
    pytest.importorskip("torch")
    c = compute.open_compute("cpu", "torch")
    assert isinstance(c, compute.Compute) and c.label == "torch/cpu" and c.device_note == ""
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = c.tensor(a)
    assert str(t.device) == "cpu" and np.array_equal(t.numpy(), a)
    with pytest.raises(ValueError, match="auto, cuda or cpu"):
        compute.open_compute("tpu")
