"""The serving detectors on recordings made with transformers 5.17 (the GPU machines' version, whose
paged cache is a BlockManager with per-group tensors): serving_check.py run with PYTHONPATH=/tmp/tf517
(transformers 5.17.0 side-installed, as tests/recorder/test_serving_v517.py does); skipped, saying so,
where that install is absent."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TF517 = Path("/tmp/tf517")
SCRIPT = Path(__file__).resolve().parent / "serving_check.py"


@pytest.mark.slow
@pytest.mark.skipif(not (TF517 / "transformers").is_dir(), reason="transformers 5.17 is not side-installed at /tmp/tf517")
def test_serving_detectors_on_transformers_517_recordings():
    env = {**os.environ, "PYTHONPATH": str(TF517), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300, env=env)
    assert "transformers 5.17" in p.stdout, p.stdout + p.stderr[-2000:]
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]
