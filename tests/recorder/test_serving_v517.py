"""The transformers 5.17 paged-cache adapter, proven against a real 5.17: serving_v517_check.py runs
in a subprocess with transformers 5.17 side-installed (no-deps, with a huggingface-hub < 2 beside it)
at ``$KVTRACE_TF517`` (default /tmp/tf517):

    .venv/bin/python -m pip install --no-deps --target /tmp/tf517 transformers==5.17.0 "huggingface-hub>=1.5,<2"

Skipped, saying so, where that side install is absent. The GPU machines (5.17 installed) run the
script directly: ``python tests/recorder/serving_v517_check.py --device cuda``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SIDE = Path(os.environ.get("KVTRACE_TF517", "/tmp/tf517"))
SCRIPT = Path(__file__).with_name("serving_v517_check.py")


def _side_version() -> str | None:
    init = SIDE / "transformers" / "__init__.py"
    if not init.is_file():
        return None
    for line in init.read_text().splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip("\"'")
    return None


@pytest.mark.slow
@pytest.mark.skipif(not (_side_version() or "").startswith("5.17."),
                    reason=f"transformers 5.17 is not side-installed at {SIDE} (see this module's docstring)")
def test_v517_adapter_equals_the_517_cache_at_every_step() -> None:
    env = {**os.environ, "PYTHONPATH": str(SIDE), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    lines = [line for line in p.stdout.splitlines() if line.startswith("OK ")]
    assert [line.split(":")[0] for line in lines] == ["OK gemma3", "OK llama_prefix", "OK llama_preempt",
                                                          "OK llama_fork"]
    assert '"prefix_hit": 1' in lines[1] and '"block_evicted": 1' in lines[1]
