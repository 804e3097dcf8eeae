"""A tiny model directory that `transformers serve` (and so `kvtrace serve`) loads offline: random
llama weights from kvtrace.testing_models plus a word-level tokenizer built here in code, with a
chat template. Its vocabulary holds the load test's prompt words (kvtrace.serving.phases.WORDS), one
token each, so a prompt of N words is N tokens and two prompts differ from their first token."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvtrace.serving.phases import WORDS
from kvtrace.testing_models import TINY_VOCAB, tiny_model

SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2: the tiny models' pad / bos / eos
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant {% endif %}")


def tiny_tokenizer():
    """A PreTrainedTokenizerFast over TINY_VOCAB words (specials, role names, the load test's words,
    then "wN" fillers), whitespace pre-tokenised; unknown words map to "<unk>"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [*SPECIALS, "<unk>", "user", "assistant", "system", *WORDS]
    words += [f"w{i}" for i in range(len(words), TINY_VOCAB)]
    assert len(words) == TINY_VOCAB == len(set(words))
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_server_model(path: Path) -> Path:
    """Save tiny llama (2 layers, GQA 4/2 heads, 1,024 positions) and its tokenizer to ``path``."""
    model = tiny_model("llama", max_position_embeddings=1024)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env
