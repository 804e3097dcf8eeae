"""The labelled accuracy suite: clean controls and planted pathologies, recorded on the CPU by the
real recorder from tiny random-weight models built from real configs (kvtrace.testing_models).

Every plant is done the way the bug happens in user code or in a cache implementation, never by
editing a trace. A case names its pathology, the detector that must name it and the finding
kinds that count as naming it; a clean control names none. Shared by the tests
(tests/accuracy/test_accuracy.py) and the table printer (bench/accuracy.py).

Fresh-process cases (a single request in a process that never ran a forward, and the RLIMIT_AS
memory cap) run in children forked from one helper process that imported torch and transformers
and ran nothing: one interpreter start-up for all of them instead of one per case.

    python tests/accuracy/cases.py fresh OUTDIR CASE...   # what the suite runs in that helper
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from the checkout
    sys.path.insert(0, str(ROOT))

from kvtrace.testing_models import tiny_model, tiny_prompt  # noqa: E402
from tests.hfcache import cache_kwargs, call_cache, output_cache  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "analyzer"))  # the plants the detector tests use, shared
# DUP_*: 16 KV heads x 64 so that copies (quadratic in tokens) dwarf allocator and RSS noise.
from planted import (  # noqa: E402
    DUP_EXTRA,
    DUP_NEW,
    DUP_PROMPT,
    _patched,  # noqa: E402
    keep_every_version,
    trim_heap,
)

MiB = 1 << 20
PROMPT, NEW = 6, 8
LONG_PROMPT = 160  # tiny configs allow 256 positions; eager attention materialises 160 x 160 scores
HOLD: list[Any] = []  # objects a planted case keeps alive until the test session ends


@dataclass(frozen=True)
class Case:
    name: str
    pathology: str | None  # None: a clean control
    detector: str | None  # the detector that must name it
    kinds: tuple[str, ...]  # finding kinds that count as naming it
    mechanism: str
    record: Callable[[Path], Any] = field(compare=False, repr=False)
    fresh: bool = False  # recorded in a forked fresh process
    arch: str = ""
    scenario: str = ""


# ---- recording helpers --------------------------------------------------------------------------

def _generate(model: Any, prompt: int = PROMPT, new: int = NEW, batch: int = 1, **kw: Any) -> Any:
    kw.setdefault("do_sample", False)
    return model.generate(tiny_prompt(prompt, batch=batch), max_new_tokens=new, min_new_tokens=new, **kw)


def _record(model: Any, path: Path, **opts: Any) -> Any:
    import kvtrace

    return kvtrace.record(model, path, **opts)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# Architectures of the clean matrix: (name, tiny model, extra generate kwargs). Static and
# quantized caches are cache implementations on a llama geometry.
QUANT = {"cache_implementation": "quantized",
         "cache_config": {"backend": "quanto", "nbits": 4, "residual_length": 4, "q_group_size": 16}}
STATIC = {"cache_implementation": "static", "disable_compile": True}
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt_neox": ("gpt_neox", {}),  # MHA, cache passed as layer_past
    "llama": ("llama", {}),  # GQA
    "mistral": ("mistral", {}),  # sliding window on every layer
    "qwen3": ("qwen3", {}),
    "gemma3_text": ("gemma3_text", {}),  # hybrid sliding/full
    "gemma4_shared": ("gemma4_text_shared", {}),  # KV-shared layers
    "gpt_oss": ("gpt_oss", {}),  # hybrid + MoE
    "deepseek_v3": ("deepseek_v3", {}),  # MLA latent cache
    "glm4_moe": ("glm4_moe", {}),
    "t5": ("t5", {}),  # encoder-decoder
    "llama_static": ("llama", STATIC),  # static cache sized to the request
    "llama_quantized": ("llama", QUANT),  # quanto 4-bit QuantizedCache
}
SCENARIOS = ("short", "long_eager", "batch4", "sampling", "multi", "fresh")


def _has_quanto() -> bool:
    try:
        import optimum.quanto  # noqa: F401
    except Exception:  # noqa: BLE001 - absent or broken: the quantized control is skipped
        return False
    return True


def record_clean(arch: str, scenario: str, path: Path) -> Path:
    model_name, gen_kw = ARCHS[arch]
    kw = dict(gen_kw)
    opts: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    if scenario == "long_eager":
        extra["attn_implementation"] = "eager"
    model = tiny_model(model_name, **extra)
    if scenario == "sampling":
        from kvtrace.recorder.sampling import SamplingSettings

        opts["sampling"] = SamplingSettings(every_n_steps=4)
    with _quiet(), _record(model, path, **opts):
        if scenario == "long_eager":
            _generate(model, prompt=LONG_PROMPT, **kw)
        elif scenario == "batch4":
            _generate(model, batch=4, **kw)
        elif scenario == "multi":
            for prompt, new in ((PROMPT, NEW), (PROMPT + 3, NEW - 2), (PROMPT + 6, NEW + 2)):
                _generate(model, prompt=prompt, new=new, **kw)
        else:  # short, sampling, fresh
            _generate(model, **kw)
    return path


# ---- planted: retention -------------------------------------------------------------------------

def plant_kept_output(path: Path) -> Path:
    """generate(return_dict_in_generate=True) and the caller keeps the output object."""
    model = tiny_model("llama")
    with _quiet(), _record(model, path):
        out = _generate(model, return_dict_in_generate=True)
        HOLD.append(out)
        _generate(model, prompt=PROMPT + 2)
    return path


GLOBAL_CACHES: list[Any] = []


def plant_global_list(path: Path) -> Path:
    """User code appends every request's cache to a module-level list (a "cache of
    caches" that is never trimmed), on a hybrid sliding/full model."""
    model = tiny_model("gemma3_text")
    with _quiet(), _record(model, path):
        for prompt in (PROMPT, PROMPT + 4):
            out = _generate(model, prompt=prompt, return_dict_in_generate=True)
            GLOBAL_CACHES.append(output_cache(out))
            del out
    return path


def plant_forward_hook(path: Path) -> Path:
    """A debugging forward pre-hook that stashes the cache it sees in a list, on an MLA model."""
    model = tiny_model("deepseek_v3")
    seen: list[Any] = []
    HOLD.append(seen)

    def stash(module: Any, args: Any, kwargs: dict) -> None:
        cache = call_cache(args, kwargs)
        if cache is not None and (not seen or seen[-1] is not cache):
            seen.append(cache)

    handle = model.register_forward_pre_hook(stash, with_kwargs=True)
    try:
        with _quiet(), _record(model, path):
            _generate(model)
            _generate(model, prompt=PROMPT + 3)
    finally:
        handle.remove()
    return path


# ---- planted: duplication -----------------------------------------------------------------------

def plant_arena(path: Path) -> Path:
    """Inside the cache: each update appends the new full K/V to a growing buffer that keeps every
    earlier version, and the cache's tensors are views into it."""
    from transformers.cache_utils import DynamicLayer

    def make(update: Callable) -> Callable:
        def arena_update(self: Any, key_states: Any, value_states: Any, *a: Any, **kw: Any) -> Any:
            out = update(self, key_states, value_states, *a, **kw)
            keep_every_version(self)
            return out
        return arena_update

    model = tiny_model("llama", **DUP_EXTRA)
    with _quiet(), _patched(DynamicLayer, "update", make), _record(model, path):
        _generate(model, prompt=DUP_PROMPT, new=DUP_NEW // 2)
    return path


def _cat_layer_class() -> type:
    import torch
    from transformers.cache_utils import DynamicLayer

    class KeepingCatLayer(DynamicLayer):
        """The old torch.cat pattern, with the previous tensors kept "for later" in a list: the
        cache looks normal, every earlier K/V version stays alive outside it."""

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            else:
                self.__dict__.setdefault("history", []).append((self.keys, self.values))
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            return self.keys, self.values

    return KeepingCatLayer


def plant_cat_subclass(path: Path) -> Path:
    """Outside the cache: a DynamicLayer subclass (the torch.cat pattern) keeps every earlier
    K/V tensor in a list; the user passes a DynamicCache of those layers to generate."""
    from transformers import DynamicCache

    model = tiny_model("qwen3", **DUP_EXTRA)
    trim_heap()
    # 100 Hz RSS samples (the default 20 Hz sees ~6 samples of this 0.3 s decode on a fast CPU)
    with _quiet(), _record(model, path, telemetry_hz=100.0):
        cache = DynamicCache()
        cache.layer_class_to_replicate = _cat_layer_class()
        _generate(model, prompt=DUP_PROMPT, new=DUP_NEW, **cache_kwargs(model, cache))
        del cache
    return path


# ---- planted: static over-allocation --------------------------------------------------------------

def _stop_after(n_new: int, prompt: int) -> Any:
    from transformers import StoppingCriteria

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids: Any, scores: Any, **kw: Any) -> Any:
            import torch

            done = input_ids.shape[-1] >= prompt + n_new
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool)

    return StopAfter()


def plant_static_max_new(path: Path) -> Path:
    """cache_implementation="static" sized for max_new_tokens=256 by a request that stops after 10."""
    model = tiny_model("llama")
    with _quiet(), _record(model, path):
        model.generate(tiny_prompt(PROMPT), max_new_tokens=256, do_sample=False, **STATIC,
                       stopping_criteria=[_stop_after(10, PROMPT)])
    return path


def plant_static_user_cache(path: Path) -> Path:
    """The user builds StaticCache(max_cache_len=200) for a 6 + 8 token request, on a hybrid model."""
    from transformers import StaticCache

    model = tiny_model("gemma3_text")
    with _quiet(), _record(model, path):
        cache = StaticCache(config=model.config, max_cache_len=200)
        _generate(model, **cache_kwargs(model, cache), disable_compile=True)
        del cache
    return path


# ---- planted: missing sliding window --------------------------------------------------------------

def plant_record_past(path: Path) -> Path:
    """Layer 1 of a 4-layer sliding model left in "record past" mode (transformers' assisted-
    decoding switch): it keeps every token."""
    from transformers import DynamicCache

    def make(init: Callable) -> Callable:
        def init_then_break_layer_1(self: Any, *a: Any, **kw: Any) -> None:
            init(self, *a, **kw)
            if len(self.layers) > 1 and hasattr(self.layers[1], "activate_past_recording"):
                self.layers[1].activate_past_recording()
        return init_then_break_layer_1

    model = tiny_model("mistral", num_hidden_layers=4)
    try:
        with _quiet(), _patched(DynamicCache, "__init__", make), _record(model, path):
            _generate(model, new=14)
    except RuntimeError as exc:
        import pytest
        import transformers

        # Some releases (5.17) build the attention mask for the window, so a layer that keeps more
        # than the window breaks generate itself: the fault cannot reach a user's trace there.
        pytest.skip(f"transformers {transformers.__version__}: a record-past layer breaks generate itself ({exc})")
    return path


def plant_configless_cache(path: Path) -> Path:
    """The user passes DynamicCache() built without the config to a hybrid model: every layer is
    a plain DynamicLayer, so the sliding layers never drop a token."""
    from transformers import DynamicCache

    model = tiny_model("gpt_oss")
    with _quiet(), _record(model, path):
        _generate(model, new=14, **cache_kwargs(model, DynamicCache()))
    return path


# ---- planted: out of memory -----------------------------------------------------------------------

# 2^20 tokens: the first quadratic tensor (the causal mask, 1 TiB as bool; the eager scores 16 TiB)
# is refused outright by any host, while everything before it stays below ~1 GiB. A smaller prompt
# (2^17) would first build a 16 GiB bool mask that a CI host might actually try to fill.
HUGE_PROMPT = 1 << 20


def plant_oom_host(path: Path) -> Path:
    """Real exhaustion: an eager prefill whose score matrices cannot exist on this host (the
    allocation is refused at once under Linux's default overcommit heuristic; nothing is touched)."""
    model = tiny_model("gpt_neox", attn_implementation="eager", max_position_embeddings=HUGE_PROMPT + 8)
    with _quiet(), _record(model, path):
        _generate(model)  # one good request first
        try:
            _generate(model, prompt=HUGE_PROMPT, new=2)
        except (RuntimeError, MemoryError):
            pass
    return path


CAP_HEADROOM = 768 * MiB  # address space left above what the process maps when the cap is set


def plant_oom_rlimit(path: Path) -> Path:
    """A memory cap: RLIMIT_AS set to what the process maps plus 768 MiB, then an eager prefill of
    8,192 tokens (4 heads x 8,192^2 x fp32 = 1 GiB per score matrix).
    Only in a forked child: the cap cannot be lifted again."""
    import resource

    model = tiny_model("llama", attn_implementation="eager", max_position_embeddings=16384)
    with open("/proc/self/statm") as fh:
        vm = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = vm + CAP_HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
    with _quiet(), _record(model, path):
        _generate(model)
        try:
            _generate(model, prompt=8192, new=2)
        except (RuntimeError, MemoryError):
            pass
    return path


# ---- the case list ------------------------------------------------------------------------------

def clean_cases() -> list[Case]:
    out = []
    for arch in ARCHS:
        if arch == "llama_quantized" and not _has_quanto():
            continue
        for sc in SCENARIOS:
            out.append(Case(f"clean:{arch}:{sc}", None, None, (), f"{arch}, {sc}",
                            lambda p, a=arch, s=sc: record_clean(a, s, p), fresh=sc == "fresh",
                            arch=arch, scenario=sc))
    return out


RET, DUP = ("retained_after_request",), ("duplication",)
PLANTED: list[Case] = [
    Case("retention:kept_output", "retention", "post_eos", RET,
         "llama; the caller keeps generate(return_dict_in_generate=True)'s output", plant_kept_output),
    Case("retention:global_list", "retention", "post_eos", RET,
         "gemma3 (hybrid); every generate output's cache appended to a module-level list", plant_global_list),
    Case("retention:forward_hook", "retention", "post_eos", RET,
         "deepseek_v3 (MLA); a forward pre-hook stashes the cache it sees", plant_forward_hook),
    Case("duplication:arena", "duplication", "growth_curve", DUP,
         "llama 16x64; cache tensors are views into a buffer keeping every earlier version (inside the cache)",
         plant_arena),
    Case("duplication:cat_subclass", "duplication", "growth_curve", DUP,
         "qwen3 16x64; a DynamicLayer subclass (torch.cat) keeps earlier K/V in a list (outside the cache)",
         plant_cat_subclass),
    Case("static:max_new_tokens", "static_over_allocation", "growth_curve", ("static_over_allocation",),
         "llama; static cache for max_new_tokens=256, stops after 10", plant_static_max_new),
    Case("static:user_cache", "static_over_allocation", "growth_curve", ("static_over_allocation",),
         "gemma3 (hybrid); user-built StaticCache(max_cache_len=200) for 6 + 8 tokens", plant_static_user_cache),
    Case("window:record_past", "missing_window", "growth_curve", ("window_not_applied",),
         "mistral, 4 layers; layer 1 left in record-past mode", plant_record_past),
    Case("window:configless_cache", "missing_window", "growth_curve", ("window_not_applied",),
         "gpt_oss (hybrid); DynamicCache() built without the config", plant_configless_cache),
    Case("oom:host_exhausted", "oom", "oom", ("oom_prefill", "oom_device_exhausted"),
         "gpt_neox eager; a 1,048,576-token prompt whose causal mask alone needs 1 TiB", plant_oom_host),
    Case("oom:rlimit_cap", "oom", "oom", ("oom_memory_cap",),
         "llama eager; RLIMIT_AS = mapped + 768 MiB, then an 8,192-token prompt", plant_oom_rlimit, fresh=True),
]


# ---- serving (continuous batching): tests/serving_detectors/serving_scenarios.py records them -------

sys.path.insert(0, str(ROOT / "tests" / "serving_detectors"))
import serving_scenarios as serving  # noqa: E402

SERVING_CLEAN: list[Case] = [
    Case("clean:serving:llama", None, None, (), "llama generate_batch, 6 mixed short requests, 32 x 16-token blocks",
         serving.clean_llama, arch="llama", scenario="serving"),
    Case("clean:serving:gemma3_text", None, None, (), "gemma3 (sliding + full groups), the same load",
         serving.clean_gemma3, arch="gemma3_text", scenario="serving"),
    Case("clean:serving:prefix_shared", None, None, (), "llama manager; one prompt 3 times in turn, sharing on",
         serving.clean_prefix_shared, arch="llama", scenario="serving_prefix"),
    Case("clean:serving:budget_queue", None, None, (), "llama; 4 x 40-token prompts wait on a 64-token budget",
         serving.clean_budget_queue, arch="llama", scenario="serving_queue"),
    # the broader matrix: architectures and loads the detectors were not calibrated on
    Case("clean:serving:qwen3", None, None, (), "qwen3 generate_batch, the 6 mixed short requests",
         serving.clean_qwen3, arch="qwen3", scenario="serving"),
    Case("clean:serving:mistral", None, None, (), "mistral (every layer sliding, one ring-buffer group), 12 new tokens",
         serving.clean_mistral, arch="mistral", scenario="serving"),
    Case("clean:serving:gpt_oss", None, None, (), "gpt-oss (sliding + full groups, MoE), the mixed short load",
         serving.clean_gpt_oss, arch="gpt_oss", scenario="serving"),
    Case("clean:serving:phi3", None, None, (), "phi3 (fused qkv), the mixed short load",
         serving.clean_phi3, arch="phi3", scenario="serving"),
    Case("clean:serving:bursty", None, None, (), "qwen2 manager; 3 waves of requests, each when the last wave's first returned",
         serving.clean_bursty, arch="qwen2", scenario="serving_bursty"),
    Case("clean:serving:long_tail", None, None, (), "llama; nine 8-token prompts and three 4x longer (a quarter of the load)",
         serving.clean_long_tail, arch="llama", scenario="serving_long_tail"),
    Case("clean:serving:cancel", None, None, (), "llama manager; the long one of four requests cancelled while it runs",
         serving.clean_cancel, arch="llama", scenario="serving_cancel"),
    Case("clean:serving:prefix_hits", None, None, (), "llama manager; a 48-token system prefix, four distinct questions hit it",
         serving.clean_prefix_hits, arch="llama", scenario="serving_prefix"),
    Case("clean:serving:hybrid_repeats", None, None, (), "gpt-oss manager; one prompt 3 times in turn: sliding groups cannot share",
         serving.clean_hybrid_repeats, arch="gpt_oss", scenario="serving_prefix"),
    Case("clean:serving:eos_sampled", None, None, (), "qwen2; sampling with EOS live: 20 prompts of 3-40, answers of 1-24",
         serving.clean_eos_sampled, arch="qwen2", scenario="serving_sampling"),
    Case("clean:serving:well_used", None, None, (), "llama; six 2-block requests in 22 blocks: 55% peak use",
         serving.clean_well_used, arch="llama", scenario="serving_well_used"),
    Case("clean:serving:sized_pool", None, None, (), "qwen3; no num_blocks: a 19 MiB pool sized from max_memory_percent",
         serving.clean_sized_pool, arch="qwen3", scenario="serving"),
    Case("clean:serving:many_short", None, None, (), "gemma3_text; 24 requests of 3-6 tokens on a 64-token budget",
         serving.clean_many_short, arch="gemma3_text", scenario="serving_many_short"),
]
# over_reservation needs a GPU of known size: tests/serving_detectors/test_serving_gpu_synthetic.py
SERVING_PLANTED: list[Case] = [
    Case("serving:pool_full", "pool_full", "serving_capacity", ("pool_usage",),
         "llama; ten 2-block requests offered at once to a 16-block pool", serving.plant_pool_too_small),
    Case("serving:over_offered", "concurrency", "concurrency_headroom", ("concurrency",),
         "llama; the same: 8 fit, 10 offered", serving.plant_pool_too_small),
    Case("serving:queued_on_memory", "queueing", "queueing", ("queued_on_memory",),
         "llama; the same: 2 wait while the pool is full", serving.plant_pool_too_small),
    Case("serving:large_pages", "block_waste", "block_waste", ("block_tail_waste",),
         "llama; 128-token pages for 4-8-token requests, 8-block pool", serving.plant_large_pages),
    Case("serving:preemption", "preemption", "preemption", ("preemption",),
         "llama; four requests growing to 3 blocks in a 4-block pool (soft resets)", serving.plant_preemption),
    Case("serving:sharing_off", "prefix_cache", "prefix_cache", ("missed_prefix_hits",),
         "llama manager; one prompt 3 times in turn, allow_block_sharing=False", serving.plant_sharing_off),
    Case("serving:context_spike", "context_spike", "context_spike", ("context_spike",),
         "llama; five 10-token requests and one of 100", serving.plant_context_spike),
    # the same faults caused other ways
    Case("serving:memory_percent_full", "pool_full", "serving_capacity", ("pool_usage",),
         "qwen3; max_memory_percent so low that transformers sizes a 5-block pool", serving.plant_memory_percent),
    Case("serving:memory_percent_preemption", "preemption", "preemption", ("preemption",),
         "qwen3; the same: six requests growing to 3 blocks preempt each other", serving.plant_memory_percent),
    Case("serving:burst_over_offered", "concurrency", "concurrency_headroom", ("concurrency",),
         "llama manager; a second wave of 6 arrives while 7 fill a pool of 8", serving.plant_burst_queue),
    Case("serving:burst_queue", "queueing", "queueing", ("queued_on_memory",),
         "llama manager; the same: the second wave waits for memory", serving.plant_burst_queue),
    Case("serving:budget_starved", "queueing", "queueing", ("queued_on_budget",),
         "llama; max_batch_tokens 8 below 24-token prompts, the pool idles", serving.plant_budget_starved),
    Case("serving:default_pages", "block_waste", "block_waste", ("block_tail_waste",),
         "qwen3 manager; the default 256-token pages for 4-9-token turns", serving.plant_default_pages),
    Case("serving:prefix_evicted", "prefix_cache", "prefix_cache", ("missed_prefix_hits",),
         "llama manager; an 8-block pool evicts the cached prompt before it repeats", serving.plant_prefix_evicted),
    Case("serving:long_generation", "context_spike", "context_spike", ("context_spike",),
         "gpt-oss manager; one request generates 60 tokens among 10-token turns", serving.plant_long_generation),
]
PLANTED += SERVING_PLANTED


def all_cases() -> list[Case]:
    return clean_cases() + SERVING_CLEAN + PLANTED


def by_name() -> dict[str, Case]:
    return {c.name: c for c in all_cases()}


# ---- recording in a fresh process ---------------------------------------------------------------

def record_fresh(outdir: Path, names: list[str], timeout: float = 600.0) -> dict[str, str]:
    """Record the named fresh-process cases; {name: error} for those that failed."""
    outdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "fresh", str(outdir), *names],
                          capture_output=True, text=True, timeout=timeout, env=env)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {n: f"helper failed (exit {proc.returncode}): {proc.stderr[-800:]}" for n in names}


def trace_path(outdir: Path, name: str) -> Path:
    return outdir / (name.replace(":", "__") + ".kvt.h5")


def _fresh_main(outdir: Path, names: list[str]) -> int:
    import torch  # noqa: F401 - imported once here, before forking; nothing runs in this process
    import transformers  # noqa: F401

    cases = by_name()
    errors: dict[str, str] = {}
    for name in names:
        pid = os.fork()
        if pid == 0:  # the child: a process that never ran a forward
            code = 0
            try:
                import torch as t

                t.set_num_threads(1)
                cases[name].record(trace_path(outdir, name))
            except BaseException as exc:  # noqa: BLE001 - reported to the parent by exit code
                sys.stderr.write(f"{name}: {type(exc).__name__}: {exc}\n")
                code = 1
            finally:
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            errors[name] = f"child exited with status {status}"
    print(json.dumps(errors))
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "fresh":
        sys.exit(_fresh_main(Path(sys.argv[2]), sys.argv[3:]))
    print(__doc__)
    sys.exit(64)
