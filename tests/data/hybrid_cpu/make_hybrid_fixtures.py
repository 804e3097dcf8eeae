"""Record the hybrid-cache fixtures of tests/data/hybrid_cpu (format 1.5 /state) on the CPU.

Each trace is a tiny random-weight model of tests.helpers.models' hybrid set (real transformers
config classes, nothing downloaded), recorded with structure_every=1: request 0 is one sequence
(prompt 12, 16 new tokens), request 1 a batch of 2 (prompt 20, 16 new tokens). Run from the repo
root: ``.venv/bin/python tests/data/hybrid_cpu/make_hybrid_fixtures.py``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

import kvtrace
from tests.helpers.models import tiny_model, tiny_prompt

HERE = Path(__file__).resolve().parent
MODELS = ("qwen3_next", "falcon_h1", "jamba", "lfm2", "minimax", "nemotron_h")
NEW = 16


def record(name: str) -> Path:
    m = tiny_model(name)
    path = HERE / f"{name}.kvt.h5"
    path.unlink(missing_ok=True)
    with kvtrace.record(m, path, structure_every=1, model_id=f"tiny/{name}"):
        for prompt, batch in ((12, 1), (20, 2)):
            with torch.no_grad():
                m.generate(tiny_prompt(prompt, batch=batch), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    return path


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    for name in sys.argv[1:] or MODELS:
        print(record(name))
