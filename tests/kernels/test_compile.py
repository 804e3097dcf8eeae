"""Ahead-of-time compile of the Triton kernels for sm_90 (H100/H200), no GPU needed.

The interpreter tests check semantics; this checks that the same source compiles for the real
target (types, ops, layouts), which the interpreter cannot. Runs ``aot_compile.py --smoke`` in a
subprocess without TRITON_INTERPRET. ``aot_compile.py --all`` covers every autotune config.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _nvidia_backend() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        from triton.backends import backends
    except Exception:
        return False
    return "nvidia" in backends


@pytest.mark.slow
@pytest.mark.skipif(not _nvidia_backend(), reason="triton with its NVIDIA backend (ptxas) is not installed")
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    res = subprocess.run([sys.executable, str(ROOT / "tests/kernels/aot_compile.py"), "--smoke", "--arch", "90"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "0 failed" in res.stdout
