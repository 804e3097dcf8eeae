"""What the real-vLLM tests share: the server's constants and description, free ports, /health."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
VENV = Path(os.environ.get("KVTRACE_VLLM_VENV", "/tmp/kvtrace-vllm-venv"))
PYTHON = VENV / "bin" / "python"
BLOCK = 32
POOL_BYTES = 1 << 20  # 32 blocks of 32 tokens x 2 layers x K,V x 2 heads x 64 x bf16
START_S = float(os.environ.get("KVTRACE_VLLM_START_S", "400"))


@dataclass
class VllmServer:
    url: str
    events: str
    replay: str
    topic: str
    model_dir: Path
    log: Path



def health(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False
