"""A tiny model directory that `transformers serve` (and so `kvtrace serve`) loads offline: random
llama weights from tests.helpers.models plus kvtrace's word-level tokenizer (built in code, with a
chat template). Its vocabulary holds the load test's prompt words (kvtrace.serving.phases.WORDS), one
token each, so a prompt of N words is N tokens and two prompts differ from their first token."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from kvtrace.serving.wordtok import word_tokenizer
from tests.helpers.models import TINY_VOCAB, tiny_model


def tiny_tokenizer():
    """kvtrace's word-level tokenizer (kvtrace.serving.wordtok) over the tiny models' ids: pad 0,
    bos 1, eos 2, the load test's words one id each."""
    return word_tokenizer(TINY_VOCAB, bos=1, eos=2, pad=0)


def save_tiny_server_model(path: Path) -> Path:
    """Save tiny llama (2 layers, GQA 4/2 heads, 1,024 positions) and its tokenizer to ``path``."""
    model = tiny_model("llama", max_position_embeddings=1024)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path



def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Poll GET url/health until 200; fail with the server's output if it exits or times out."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"server exited {proc.returncode} before it was healthy:\n{out}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise AssertionError(f"server at {url} not healthy within {timeout_s} s")


def kvtrace_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvtrace.cli", *args]


def server_env() -> dict[str, str]:
    # the checkout first on the path: child processes import the test support code as tests.helpers
    checkout = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (checkout, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=path)
    return env


def stop_server(proc: subprocess.Popen, timeout_s: float = 60.0) -> tuple[int, str]:
    """SIGTERM the server and wait for it: (exit code, everything it printed)."""
    import signal

    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"server did not stop on SIGTERM within {timeout_s:.0f} s:\n{out}") from None
    return proc.returncode, out
