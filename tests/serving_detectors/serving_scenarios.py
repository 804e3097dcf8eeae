"""Continuous-batching recordings for the serving detectors: clean controls and planted faults,
each recorded by the real recorder around transformers' own generate_batch / manager on the CPU
(tiny random-weight models, tests.helpers.models). A fault is planted the way it happens on a
serving host: a pool too small for the load, a page size too large for short requests, prefix
sharing switched off while prompts repeat, one request far longer than the rest. Shared by
tests/serving_detectors and the accuracy suite (tests/helpers/cases.py)."""

from __future__ import annotations

import functools
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtrace.format.schema import EventKind
from tests.helpers.models import tiny_model

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:  # run as a script on the GPU machines: tests.helpers.hfcache from the checkout
    sys.path.insert(0, _ROOT)

_MODELS: dict[str, Any] = {}
DEVICE = "cpu"  # serving_check.py --device cuda moves the models to the GPU


# Architectures tests.helpers.models does not build: the same tiny geometry (hidden 64, 2 layers,
# GQA 4:2 x 16) on the real config classes, seeded like tiny_model.
_EXTRA: dict[str, dict[str, Any]] = {
    "phi3": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, max_position_embeddings=256),  # fused qkv projection
    "qwen2": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, max_position_embeddings=256),
}


def _extra_model(name: str) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(name, vocab_size=256, bos_token_id=1, eos_token_id=2, pad_token_id=0, **_EXTRA[name])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def model(name: str = "llama") -> Any:
    if name not in _MODELS:
        _MODELS[name] = (_extra_model(name) if name in _EXTRA else tiny_model(name)).to(DEVICE)
    return _MODELS[name]


def _configs(new: int, **cb: Any) -> tuple[Any, Any]:
    from transformers import GenerationConfig

    from tests.helpers.hfcache import cb_config

    # eos -1: no EOS, every request runs exactly `new` tokens
    gc = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    return gc, cb_config(**cb)


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


def sequential(path: Path, ids: list[list[int]], new: int, arch: str = "llama", **cb: Any) -> Path:
    """One request at a time through a manager: each is admitted after the previous one finished."""
    import kvtrace

    m = model(arch)
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


def waves(path: Path, plan: list[list[tuple[list[int], int]]], arch: str = "llama", cancel: int | None = None,
          **cb: Any) -> Path:
    """Bursty arrivals through a manager: `plan` is a list of waves of (prompt, max_new_tokens); a wave
    is added once the first request of the previous wave has returned (arrivals follow the service,
    not a wall clock). `cancel`: the index (over all requests) of one request cancelled right after
    that first result, while it still runs."""
    import kvtrace

    m = model(arch)
    gc, cfg = _configs(max(n for wave in plan for _, n in wave), **cb)
    ids: list[str] = []
    got: set[str] = set()  # results returned (in any order: the manager has one output queue)
    with kvtrace.record(m, path):
        manager = m.init_continuous_batching(generation_config=gc, continuous_batching_config=cfg)
        manager.start()
        try:
            for wave in plan:
                first = len(ids)
                ids += [manager.add_request(p, max_new_tokens=n) for p, n in wave]
                _wait(manager, ids[first], got)
                if cancel is not None and first <= cancel < len(ids):
                    manager.cancel_request(ids[cancel])
                    got.add(ids[cancel])  # a cancelled request returns no result
            for rid in ids:
                _wait(manager, rid, got)
        finally:
            manager.stop(block=True)
    return path


def _wait(manager: Any, rid: str, got: set[str], timeout: float = 60.0) -> None:
    """Take results off the manager's queue until `rid`'s has come (others are noted in `got`)."""
    import time

    deadline = time.monotonic() + timeout
    while rid not in got:
        if time.monotonic() > deadline:
            raise RuntimeError(f"request {rid} gave no result in {timeout:.0f} s")
        result = manager.get_result(timeout=1.0)
        if result is not None:
            got.add(result.request_id)


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


# ---- the broader matrix: other architectures, other arrival patterns, other ways to the same fault ----

def _wave(lengths: list[int], new: int, start: int = 3) -> list[tuple[list[int], int]]:
    return [(p, new) for p in prompts(lengths, start)]


@once
def clean_qwen3(path: Path) -> Path:
    """qwen3 (q/k norms), the mixed short load of clean_llama."""
    return batch(path, MIXED, 8, arch="qwen3", page_size=16, num_blocks=32, max_batch_tokens=128)


@once
def clean_mistral(path: Path) -> Path:
    """mistral: every layer sliding (window 8, one ring-buffer group); 12 new tokens pass the window."""
    return batch(path, MIXED, 12, arch="mistral", page_size=16, num_blocks=32, max_batch_tokens=128)


@once
def clean_gpt_oss(path: Path) -> Path:
    """gpt-oss: hybrid sliding + full groups and MoE experts."""
    return batch(path, MIXED, 12, arch="gpt_oss", page_size=16, num_blocks=64, max_batch_tokens=128)


@once
def clean_phi3(path: Path) -> Path:
    """phi3 (fused qkv projection), the mixed short load."""
    return batch(path, MIXED, 8, arch="phi3", page_size=16, num_blocks=32, max_batch_tokens=128)


@once
def unsupported_deepseek_v3(path: Path) -> Path:
    """deepseek_v3 (MLA latent cache), the mixed short load: transformers 5.23's paged cache sizes its
    pages for num_kv_heads x head_dim K/V, not the MLA latent, and every request fails at the first
    forward (index_copy_ shape mismatch): the trace records them failed, with the error."""
    return batch(path, MIXED, 8, arch="deepseek_v3", page_size=16, num_blocks=32, max_batch_tokens=128)


@once
def clean_bursty(path: Path) -> Path:
    """qwen2 manager: three waves of requests, each added when the previous wave's first request returned."""
    plan = [_wave([6, 9, 5], 10), _wave([8, 4, 11, 7], 10, start=40), _wave([5, 10], 10, start=90)]
    return waves(path, plan, arch="qwen2", page_size=16, num_blocks=32, max_batch_tokens=64)


@once
def clean_long_tail(path: Path) -> Path:
    """A legitimate long tail: nine 8-token prompts and three 4x longer (32) in one load, a quarter of
    the requests: a mode of the traffic, not a spike."""
    lengths = [8, 8, 32, 8, 8, 8, 32, 8, 8, 8, 32, 8]
    return batch(path, lengths, 8, page_size=16, num_blocks=64, max_batch_tokens=256)


@once
def clean_cancel(path: Path) -> Path:
    """llama manager: four requests, the long one (40 new tokens) cancelled after the first short returned."""
    plan = [[(prompts([6])[0], 4), (prompts([7], 20)[0], 40), (prompts([5], 40)[0], 6), (prompts([8], 60)[0], 6)]]
    return waves(path, plan, cancel=1, page_size=16, num_blocks=32, max_batch_tokens=64)


SYSTEM = list(range(3, 51))  # a 48-token shared prefix (3 complete 16-token blocks)


@once
def clean_prefix_hits(path: Path) -> Path:
    """Prompts sharing a 48-token system prefix with distinct questions: one request first, then four
    at once; the four find the prefix blocks in the cache (clean hits)."""
    q = prompts([5, 6, 4, 7, 5], start=100)
    plan = [[(SYSTEM + q[0], 6)], [(SYSTEM + x, 6) for x in q[1:]]]
    return waves(path, plan, page_size=16, num_blocks=64, max_batch_tokens=256)


@once
def clean_hybrid_repeats(path: Path) -> Path:
    """gpt-oss (a sliding group) serving one prompt three times in turn, sharing allowed: transformers'
    sliding allocators cannot share blocks, so no repeat hits, and nothing can be switched on."""
    return sequential(path, [PREFIX + [60, 61]] * 3, 4, arch="gpt_oss", page_size=16, num_blocks=64,
                      max_batch_tokens=128)


@once
def clean_eos_sampled(path: Path) -> Path:
    """qwen2, sampling on and EOS live (28 of the 256 ids end a request): 20 prompts of 3-40 tokens
    whose answers end anywhere from 1 to 24 tokens, the spread of real traffic."""
    import random

    from transformers import GenerationConfig

    import kvtrace

    m = model("qwen2")
    lengths = [random.Random(5).randint(3, 40) for _ in range(20)]
    gc = GenerationConfig(max_new_tokens=24, do_sample=True, temperature=1.0, eos_token_id=list(range(2, 30)),
                          pad_token_id=0)
    _, cfg = _configs(24, page_size=16, num_blocks=96, max_batch_tokens=256, seed=5)
    with kvtrace.record(m, path):
        m.generate_batch(inputs=prompts(lengths), generation_config=gc, continuous_batching_config=cfg, warmup=False)
    return path


@once
def clean_well_used(path: Path) -> Path:
    """A pool sized for its load: six 2-block requests (30-token contexts) in a 22-block pool, peak
    block usage 55% (25 points under the 80% warning, 15 under the 70% knee of serving_capacity)
    and 6 offered where 11 fit (55%, under the 60% knee of concurrency_headroom)."""
    return batch(path, [20] * 6, 10, page_size=16, num_blocks=22, max_batch_tokens=256)


@once
def clean_many_short(path: Path) -> Path:
    """gemma3_text: 24 short requests (3-6 tokens, 4 new) admitted in turns on a 64-token budget (192
    blocks: 5.17 splits them between the two groups, 5.23 gives each group its own)."""
    lengths = [3, 4, 5, 6] * 6
    return batch(path, lengths, 4, arch="gemma3_text", page_size=16, num_blocks=192, max_batch_tokens=64)


def _memory_percent(blocks: int, arch: str = "qwen3", **cb: Any) -> float:
    """The max_memory_percent that makes transformers size a pool of about `blocks` blocks itself.

    Every release sizes the pool as (free memory x max_memory_percent) minus what it reserves for
    activations, masks and logits, and what it reserves changed between releases (5.24 sets aside
    per-request logit rows). Rather than model one release's accounting, measure it: record two
    pools at two percentages, fit pool = a x percent - b (the sizing is affine in the percentage)
    and solve for the bytes of `blocks` blocks (plus half a block, so that rounding to the pool's
    allocation unit cannot drop one). cb: the scenario's own batching options, which size the
    reservations."""
    import psutil

    free = psutil.virtual_memory().total - psutil.Process().memory_info().rss
    # Probes near the target: the host's free memory moves between runs (RSS), and that error
    # scales with the percentage, so a fit from far away misses small pools by several blocks.
    (p1, (b1, per_block)), (p2, (b2, _)) = [(p, _probe_pool(p, arch, **cb)) for p in ((1 << 20) / free,
                                                                                        (2 << 20) / free)]
    slope = (b2 - b1) / (p2 - p1)
    target = (blocks + 0.5) * per_block
    guess = p1 + (target - b1) / slope
    got, _ = _probe_pool(guess, arch, **cb)  # one secant step at the answer itself
    return guess + (target - got) / slope


def _probe_pool(percent: float, arch: str, **cb: Any) -> tuple[int, int]:
    """The pool bytes transformers allocates at `percent` and the bytes of one block (every
    attention type's block together), read from a one-request recording."""
    import tempfile

    import kvtrace

    with tempfile.TemporaryDirectory() as d:
        path = batch(Path(d) / "probe.kvt.h5", [4], 1, arch=arch, max_memory_percent=percent, **cb)
        with kvtrace.open(path) as t:
            pools, groups = t.sched[:]["pool_bytes"], t.sched_groups[:]
    pools = pools[pools > 0]
    if not len(pools) or not len(groups):
        raise RuntimeError(f"no paged pool recorded at max_memory_percent={percent:.3g}")
    first = groups[groups["step"] == groups["step"].min()]
    return int(pools.max()), int(first["bytes_per_block"].sum())


@once
def clean_sized_pool(path: Path) -> Path:
    """qwen3, no num_blocks: transformers sizes the pool itself from max_memory_percent (set to give
    8192 blocks here, 64 MiB, not 60% of the host), the mixed short load uses a fraction of a percent."""
    return batch(path, MIXED, 8, arch="qwen3", page_size=16, max_batch_tokens=128,
                 max_memory_percent=_memory_percent(8192, page_size=16, max_batch_tokens=128))


@once
def plant_memory_percent(path: Path) -> Path:
    """max_memory_percent set so low that the pool transformers sizes itself from it (no num_blocks)
    holds 5 blocks: six requests growing to 40 tokens (3 blocks each) preempt each other."""
    return batch(path, [4, 5, 6, 4, 5, 6], 36, arch="qwen3", page_size=16, max_batch_tokens=32,
                 max_requests_per_batch=8,
                 max_memory_percent=_memory_percent(5, page_size=16, max_batch_tokens=32, max_requests_per_batch=8))


@once
def plant_budget_starved(path: Path) -> Path:
    """max_batch_tokens set to 8 for ten 24-token prompts: each prefill takes three steps, requests
    queue behind the budget while most of the pool stays free."""
    return batch(path, [24] * 10, 4, page_size=16, num_blocks=64, max_batch_tokens=8)


@once
def plant_long_generation(path: Path) -> Path:
    """gpt-oss manager: uniform traffic (ten 10-token prompts, 6 new) and one request that generates 60
    tokens, arriving in the second wave: a 70-token context, 4.4x the rest."""
    plan = [_wave([10] * 5, 6), [(prompts([10], 50)[0], 60)] + _wave([10] * 5, 6, start=80)]
    return waves(path, plan, arch="gpt_oss", page_size=16, num_blocks=64, max_batch_tokens=128)


@once
def plant_default_pages(path: Path) -> Path:
    """qwen3 manager at transformers' default page size (256 tokens) for 4-9-token chat turns in two
    waves: each request holds a whole 256-token block, 7 at once in the 8-block pool, nearly all tail."""
    plan = [_wave([5, 7, 4, 9, 6, 8, 5], 6), _wave([6, 8, 5, 4], 6, start=60)]
    return waves(path, plan, arch="qwen3", page_size=256, num_blocks=8, max_batch_tokens=256)


@once
def plant_prefix_evicted(path: Path) -> Path:
    """Prefix sharing on, but a pool of 8 blocks: the first prompt's cached blocks are evicted by the
    distinct prompts served after it, so its repeat finds nothing (transformers 5.23, whose cache
    evicts cached blocks to keep a safety margin free; 5.17 evicts the newer ones first and the
    repeat hits: no fault there)."""
    first = PREFIX + [60, 61]
    others = [p + [60, 61] for p in prompts([48, 48, 48], start=90)]
    sequential(path, [first, *others, first], 4, page_size=16, num_blocks=8, max_batch_tokens=128)
    _require_fault(path, "the repeated prompt (the last request) found no cached block",
                   lambda t: not any(e["value"] > 0 and e["request"] == t.requests[:]["request"].max()
                                     for e in t.events.where(kind=EventKind.PREFIX_HIT)))
    return path


def _require_fault(path: Path, fault: str, present: Callable[[Any], bool]) -> None:
    """Skip (saying why) where the installed release's own policy keeps a plant's fault from
    happening, judged from the trace's raw rows, never from a detector's verdict."""
    import kvtrace

    with kvtrace.open(path) as t:
        if not present(t):
            import pytest
            import transformers

            pytest.skip(f"transformers {transformers.__version__}: the plant's fault did not happen ({fault})")


@once
def plant_burst_queue(path: Path) -> Path:
    """A burst into a busy pool: eight 17-token prompts hold 2 of the 16 16-token blocks each from
    admission (and never need a third: 32 tokens at most); one returns after 2 tokens, the other seven
    decode 15 while a second wave of six arrives and waits for memory."""
    plan = [[(prompts([17])[0], 2)] + [(p, 15) for p in prompts([17] * 7, 30)], _wave([17] * 6, 4, start=90)]
    return waves(path, plan, page_size=16, num_blocks=16, max_batch_tokens=512)
