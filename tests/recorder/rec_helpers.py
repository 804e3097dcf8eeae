"""Shared helpers for the recorder-core tests (tiny models, one recorded run, trace reading)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

import kvtrace
from kvtrace.format.reader import Trace
from tests.helpers.models import tiny_model, tiny_prompt

PROMPT = 12
NEW = 12  # > TINY_WINDOW (8): every sliding layer saturates


@functools.cache
def model(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Tiny models are built once per test session (generate does not change their weights)."""
    return tiny_model(name, dtype=dtype)


def generate(m: torch.nn.Module, prompt_len: int = PROMPT, new: int = NEW, batch: int = 1,
             **kwargs: Any) -> Any:
    ids = tiny_prompt(prompt_len, batch=batch)
    return m.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kwargs)


def record_run(tmp: Path, name: str, *, calls: int = 1, record_kwargs: dict | None = None,
               **gen_kwargs: Any) -> tuple[Path, Any]:
    m = model(name)
    path = tmp / f"{name}.kvt.h5"
    with kvtrace.record(m, path, **(record_kwargs or {})) as rec:
        for _ in range(calls):
            generate(m, **gen_kwargs)
    return path, rec


def text(trace: Trace, off: int, length: int) -> str:
    return trace.text(int(off), int(length)) if length else ""


def sampled_cache_at(path: Path, step: int, layer: int, kind: int, kept: int) -> Any:
    """What the samples say layer ``layer`` of request 0 held after ``step``: increments joined
    (spec §6.1), restricted to the last ``kept`` positions (the cache's own length)."""
    from kvtrace.format.assemble import ContentsAssembler

    with Trace(path) as t:
        joined = ContentsAssembler(t)
        p = joined.at(0, layer, kind, step)
        end = p.token_start + p.shape[2]
        return joined.at(0, layer, kind, step, first=end - kept)
