"""Planted pathologies recorded by the real recorder from tiny random-weight models (CPU).

Each case records one trace and names the detector that must fire on it (score >= 0.5); the
clean controls must stay <= 0.1 on every detector. Plants are done the way such bugs happen in
user code or a cache implementation, never by editing the trace.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kvtrace
from tests.helpers.models import tiny_model, tiny_prompt

PROMPT = 6
NEW = 14


def trim_heap() -> None:
    """glibc malloc_trim(0): freed heap pages go back to the OS, so process RSS shows the live
    memory of an RSS-only case again (a long test session otherwise reuses resident free pages)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # with window 8 the sliding layers saturate after 8 tokens


@dataclass(frozen=True)
class Case:
    name: str
    detector: str | None  # the detector that must fire (None: a clean control)
    note: str


def _generate(model: Any, prompt: int = PROMPT, new: int = NEW, **kw: Any) -> Any:
    kw.setdefault("do_sample", False)
    return model.generate(tiny_prompt(prompt), max_new_tokens=new, min_new_tokens=new, **kw)


def record_clean(name: str, path: Path, **extra: Any) -> Path:
    model = tiny_model(name, **extra)
    with kvtrace.record(model, path):
        _generate(model)
        _generate(model, prompt=PROMPT + 3, new=NEW - 4)  # a second request: per-request baselines
    return path


def record_kept_cache(path: Path) -> tuple[Path, Any]:
    """User code keeps `out.past_key_values` after generate: the whole cache stays alive."""
    model = tiny_model("llama")
    with kvtrace.record(model, path):
        out = _generate(model, return_dict_in_generate=True)
        kept = out.past_key_values
    return path, kept


@contextlib.contextmanager
def _patched(owner: Any, attr: str, make: Callable[[Any], Any]) -> Iterator[None]:
    original = getattr(owner, attr)
    setattr(owner, attr, make(original))
    try:
        yield
    finally:
        setattr(owner, attr, original)


# Duplication: 16 KV heads x 64 dims so the kept copies (quadratic in tokens) dwarf RSS noise.
DUP_EXTRA = {"num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 64}
DUP_PROMPT, DUP_NEW = 32, 96  # 96 steps: >= 6 RSS samples at 100 Hz even at ~1 ms per step


def keep_every_version(layer: Any) -> None:
    """The arena plant, after a cache layer's update: append its new full K/V to a growing buffer
    that still holds every earlier version, and point the layer's tensors into that buffer (the
    copies live in the cache's own storage)."""
    import torch

    for name in ("keys", "values"):
        cur = getattr(layer, name)
        old = layer.__dict__.get(f"_arena_{name}")
        flat = cur.reshape(-1)
        arena = flat.clone() if old is None else torch.cat([old, flat])
        layer.__dict__[f"_arena_{name}"] = arena
        setattr(layer, name, arena[-flat.numel():].view(cur.shape))


def record_duplication(path: Path, *, planted: bool = True, mode: str = "arena") -> Path:
    """A cache layer that keeps its old copies when it grows.

    mode "arena": each update appends the new full K/V to a growing buffer that still holds every
    earlier version, and the cache points into it (the copies live in the cache's own storage).
    mode "list": the old tensors are kept alive in a list on the layer, invisible to the cache
    structure; only memory telemetry shows them (allocator bytes on a GPU; on a CPU, process RSS,
    which cannot tell them from heap fragmentation).
    """
    from transformers.cache_utils import DynamicLayer

    def make(update: Callable) -> Callable:
        def arena_update(self: Any, key_states: Any, value_states: Any, *a: Any, **kw: Any) -> Any:
            if planted and mode == "list" and self.is_initialized:
                self.__dict__.setdefault("_old_copies", []).append((self.keys, self.values))
            out = update(self, key_states, value_states, *a, **kw)
            if planted and mode == "arena":
                keep_every_version(self)
            return out
        return arena_update

    model = tiny_model("llama", **DUP_EXTRA)
    if mode == "list":  # seen through RSS only: return freed heap first (see trim_heap's docstring)
        trim_heap()
    # 100 Hz RSS samples: a fast CPU decodes the 48 steps in ~0.2 s, too few 20 Hz samples to fit
    hz = 100.0 if mode == "list" else 20.0
    with _patched(DynamicLayer, "update", make), kvtrace.record(model, path, telemetry_hz=hz):
        _generate(model, prompt=DUP_PROMPT, new=DUP_NEW)
    return path


def record_static(path: Path, *, planted: bool = True) -> Path:
    """A static cache sized for 256 new tokens by a request that stops after 10 (planted), or
    sized exactly (clean)."""
    from transformers import StoppingCriteria

    class StopAfter(StoppingCriteria):
        def __init__(self, n: int) -> None:
            self.n = n

        def __call__(self, input_ids: Any, scores: Any, **kw: Any) -> Any:
            import torch

            done = input_ids.shape[-1] >= PROMPT + self.n
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool)

    model = tiny_model("llama")
    with kvtrace.record(model, path):
        if planted:
            model.generate(tiny_prompt(PROMPT), max_new_tokens=256, do_sample=False,
                           cache_implementation="static", disable_compile=True,
                           stopping_criteria=[StopAfter(10)])
        else:
            _generate(model, new=10, cache_implementation="static", disable_compile=True)
    return path


NOSLIDE_LAYERS = 4


def record_no_slide(path: Path, *, planted: bool = True) -> Path:
    """Layer 1 of a 4-layer sliding-window model never drops old tokens: its cache layer was left
    in "record past" mode (transformers' assisted-decoding switch), so it keeps every token."""
    from transformers import DynamicCache

    def make(init: Callable) -> Callable:
        def init_then_break_layer_1(self: Any, *a: Any, **kw: Any) -> None:
            init(self, *a, **kw)
            if planted:
                self.layers[1].activate_past_recording()
        return init_then_break_layer_1

    model = tiny_model("mistral", num_hidden_layers=NOSLIDE_LAYERS)
    with _patched(DynamicCache, "__init__", make), kvtrace.record(model, path):
        _generate(model)
    return path
