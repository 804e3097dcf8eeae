"""One tensor-parallel recording on the CPU (gloo, 2 processes under torchrun), shared by the
tests of this directory: rank 1 keeps generate's outputs (planted retention), rank 0 does not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("tp_record.py")


@pytest.fixture(scope="session")
def tp_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tp")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KVTRACE_RUN_ID": "tp-cpu-test"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
           "--out", str(out), "--backend", "gloo", "--keep-output-rank", "1"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        pytest.fail(f"torchrun failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return out
