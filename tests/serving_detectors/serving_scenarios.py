"""Continuous-batching recordings for the serving detectors: clean controls and planted faults,
each recorded by the real recorder around transformers' own generate_batch / manager on the CPU
(tiny random-weight models, kvtrace.testing_models). A fault is planted the way it happens on a
serving host: a pool too small for the load, a page size too large for short requests, prefix
sharing switched off while prompts repeat, one request far longer than the rest. Shared by
tests/serving_detectors and the accuracy suite (tests/accuracy/cases.py)."""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtrace.testing_models import tiny_model

_MODELS: dict[str, Any] = {}
DEVICE = "cpu"  # serving_check.py --device cuda moves the models to the GPU


def model(name: str = "llama") -> Any:
    if name not in _MODELS:
        _MODELS[name] = tiny_model(name).to(DEVICE)
    return _MODELS[name]


def _configs(new: int, **cb: Any) -> tuple[Any, Any]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    # eos -1: no EOS, every request runs exactly `new` tokens
    gc = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    fields = set(getattr(ContinuousBatchingConfig, "__dataclass_fields__", {}))
    if "page_size" in cb and fields and "page_size" not in fields:  # transformers 5.17: block_size
        cb["block_size"] = cb.pop("page_size")
    return gc, ContinuousBatchingConfig(**cb)


def prompts(lengths: list[int], start: int = 3) -> list[list[int]]:
    """Distinct prompts of the given lengths (token ids below the tiny vocabularies)."""
    out = []
    for i, n in enumerate(lengths):
        base = start + 7 * i
        out.append([(base + k) % 200 + 3 for k in range(n)])
    return out


def batch(path: Path, lengths: list[int], new: int, arch: str = "llama", **cb: Any) -> Path:
    import kvtrace

    m = model(arch)
    gc, cfg = _configs(new, **cb)
    with kvtrace.record(m, path):
        m.generate_batch(inputs=prompts(lengths), generation_config=gc, continuous_batching_config=cfg, warmup=False)
    return path


def sequential(path: Path, ids: list[list[int]], new: int, **cb: Any) -> Path:
    """One request at a time through a manager: each is admitted after the previous one finished."""
    import kvtrace

    m = model()
    gc, cfg = _configs(new, **cb)
    with kvtrace.record(m, path):
        manager = m.init_continuous_batching(generation_config=gc, continuous_batching_config=cfg)
        manager.start()
        try:
            for p in ids:
                rid = manager.add_request(p, max_new_tokens=new)
                if manager.get_result(rid, timeout=60) is None:
                    raise RuntimeError(f"request {rid} gave no result")
        finally:
            manager.stop(block=True)
    return path


_RECORDED: dict[str, Path] = {}


def once(fn: Callable[[Path], Path]) -> Callable[[Path], Path]:
    """Record a scenario once per process: a later call copies that trace to its path (the accuracy
    suite and tests/serving_detectors ask for the same recordings in one pytest session)."""

    @functools.wraps(fn)
    def record(path: Path) -> Path:
        done = _RECORDED.get(fn.__name__)
        if done is not None and done.exists():
            shutil.copyfile(done, path)
            return path
        fn(path)
        _RECORDED[fn.__name__] = path
        return path

    return record


MIXED = [4, 7, 12, 5, 9, 6]
PREFIX = list(range(3, 51))  # 48 tokens: 3 complete 16-token blocks


# ---- clean controls -----------------------------------------------------------------------------

@once
def clean_llama(path: Path) -> Path:
    """Six mixed short requests on a pool sized for them (32 blocks of 16 tokens, at most 12 used)."""
    return batch(path, MIXED, 8, page_size=16, num_blocks=32, max_batch_tokens=128)


@once
def clean_gemma3(path: Path) -> Path:
    """gemma3_text: a sliding group (window 8, a ring buffer) and a full group, same load (64 blocks:
    transformers 5.17 splits them between the groups)."""
    return batch(path, MIXED, 12, arch="gemma3_text", page_size=16, num_blocks=64, max_batch_tokens=128)


@once
def clean_prefix_shared(path: Path) -> Path:
    """The same prompt three times, one after another, prefix sharing on: each repeat hits."""
    return sequential(path, [PREFIX + [60, 61]] * 3, 4, page_size=16, num_blocks=32, max_batch_tokens=128)


@once
def clean_budget_queue(path: Path) -> Path:
    """Requests wait for the token budget (64 per step), not for memory: the pool stays under 30%."""
    return batch(path, [40, 40, 40, 40], 4, page_size=16, num_blocks=64, max_batch_tokens=64)


# ---- planted faults -----------------------------------------------------------------------------

@once
def plant_pool_too_small(path: Path) -> Path:
    """Ten 2-block requests offered at once to a 16-block pool: 8 fit, the pool runs full, the rest wait."""
    return batch(path, [20] * 10, 4, page_size=16, num_blocks=16, max_batch_tokens=256)


@once
def plant_large_pages(path: Path) -> Path:
    """128-token pages for 4-8-token requests: each holds a whole block, the 8-block pool fills with tails."""
    return batch(path, [4, 5, 6, 7, 8, 5, 4, 6], 4, page_size=128, num_blocks=8, max_batch_tokens=128)


@once
def plant_preemption(path: Path) -> Path:
    """Four requests growing to 44 tokens (3 blocks) each in a 4-block pool: soft resets recompute them."""
    return batch(path, [4, 3, 5, 3], 40, page_size=16, num_blocks=4, max_batch_tokens=64)


@once
def plant_sharing_off(path: Path) -> Path:
    """The repeated prompt of clean_prefix_shared with allow_block_sharing=False: no repeat hits."""
    return sequential(path, [PREFIX + [60, 61]] * 3, 4, page_size=16, num_blocks=32, max_batch_tokens=128,
                      allow_block_sharing=False)


@once
def plant_context_spike(path: Path) -> Path:
    """Five 10-token requests and one 100-token request (5x the median context)."""
    return batch(path, [6, 6, 6, 6, 6, 96], 4, page_size=16, num_blocks=32, max_batch_tokens=256)


def default_pool(path: Path) -> Path:
    """transformers' own pool sizing (no num_blocks: free memory x max_memory_percent), a light load:
    on a GPU the pool dwarfs what the load uses (over_reservation), the device looks full to NVML.
    200 tokens each: the run spans several NVML samples (5 Hz) for the GPU judgement."""
    return batch(path, MIXED, 200, page_size=16, max_batch_tokens=128)
