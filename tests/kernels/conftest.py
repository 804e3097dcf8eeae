"""Kernel tests: run the Triton kernels on CUDA when there is a GPU, else in Triton's CPU interpreter.

TRITON_INTERPRET must be set before triton is imported (``triton.jit`` reads it when a kernel is
decorated), so the root tests/conftest.py decides it, before any test module is collected. An
explicit TRITON_INTERPRET in the environment is respected. The interpreter runs on CPU tensors.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@pytest.fixture(scope="session")
def tri_device() -> str:
    """Device for Triton-vs-reference tests; skips when the kernels cannot run at all."""
    if not HAS_TORCH:
        pytest.skip("torch is not installed")
    if not HAS_TRITON:
        pytest.skip("triton is not installed: Triton-vs-reference tests need it (pip install kvtrace[gpu])")
    if INTERPRET:
        return "cpu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1")


def pytest_configure(config: pytest.Config) -> None:
    # The interpreter evaluates masked-out lanes too (e.g. inf * 0 before a tl.where); numpy warns
    # about those lanes, which never reach an output.
    config.addinivalue_line("filterwarnings", "ignore::RuntimeWarning:triton.runtime.interpreter")
