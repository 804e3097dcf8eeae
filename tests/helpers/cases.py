"""The labelled accuracy suite: clean controls and planted pathologies, recorded on the CPU by the
real recorder from tiny random-weight models built from real configs (tests.helpers.models).

Every plant is done the way the bug happens in user code or in a cache implementation, never by
editing a trace. A case names its pathology, the detector that must name it and the finding
kinds that count as naming it; a clean control names none. Shared by the tests
(tests/accuracy/test_accuracy.py) and the table printer (bench/accuracy.py).

Fresh-process cases (a single request in a process that never ran a forward, and the RLIMIT_AS
memory cap) run in children forked from one helper process that imported torch and transformers
and ran nothing: one interpreter start-up for all of them instead of one per case.

    python tests/helpers/cases.py fresh OUTDIR CASE...   # what the suite runs in that helper
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

from tests.helpers.hfcache import cache_kwargs, call_cache, output_cache  # noqa: E402
from tests.helpers.models import tiny_model, tiny_prompt  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "analyzer"))  # the plants the detector tests use, shared
# DUP_*: 16 KV heads x 64 so that copies (quadratic in tokens) dwarf allocator and RSS noise.
from tests.helpers.planted import (  # noqa: E402
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
    owner: str = ""  # planted: text the naming finding's message must hold (the owner / holder it names)
    outcomes: tuple[str, ...] = ("ok",)  # clean: the request outcomes the control must end with


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


# ---- planted: retention by other holders -------------------------------------------------

def _raise_at(step: int, exc: BaseException) -> Any:
    """A stopping criterion (user code) that raises ``exc`` once the sequence has grown ``step`` tokens."""
    from transformers import StoppingCriteria

    class RaiseAt(StoppingCriteria):
        def __init__(self) -> None:
            self.start: int | None = None

        def __call__(self, input_ids: Any, scores: Any, **kw: Any) -> Any:
            import torch

            self.start = input_ids.shape[-1] if self.start is None else self.start
            if input_ids.shape[-1] - self.start >= step:
                raise exc
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    return RaiseAt()


KEPT_ERRORS: list[BaseException] = []


def plant_kept_exception(path: Path) -> Path:
    """A stopping criterion raises during decode; the caller keeps the exception (for a later report).
    Its traceback holds generate's frames, which hold the cache. Outcome: error."""
    model = tiny_model("llama")
    with _quiet(), _record(model, path):
        try:
            _generate(model, stopping_criteria=[_raise_at(3, ValueError("criterion failed"))])
        except ValueError as exc:
            KEPT_ERRORS.append(exc)
        _generate(model, prompt=PROMPT + 1, new=4)
    return path


class _Server:
    """A serving loop object that remembers its last error on an attribute."""

    def __init__(self) -> None:
        self.last_error: BaseException | None = None


SERVER = _Server()


def plant_exception_attribute(path: Path) -> Path:
    """A logits processor raises mid-decode (qwen3); the serving object stores the exception on an
    attribute. Outcome: error."""
    from transformers import LogitsProcessor

    class Fails(LogitsProcessor):
        def __init__(self) -> None:
            self.calls = 0

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            self.calls += 1
            if self.calls >= 4:
                raise RuntimeError("processor failed")
            return scores

    model = tiny_model("qwen3")
    with _quiet(), _record(model, path):
        try:
            _generate(model, logits_processor=[Fails()])
        except RuntimeError as exc:
            SERVER.last_error = exc
        _generate(model, prompt=PROMPT + 2, new=4)
    return path


INTERRUPTS: dict[str, BaseException] = {}


def plant_kept_interrupt(path: Path) -> Path:
    """Ctrl-C during decode (a KeyboardInterrupt from the streamer's put, where a signal would land),
    caught and kept in a dict by the CLI loop (gemma3, hybrid). Outcome: interrupted."""
    from transformers.generation.streamers import BaseStreamer

    class Interrupting(BaseStreamer):
        def __init__(self) -> None:
            self.n = 0

        def put(self, value: Any) -> None:
            self.n += 1
            if self.n >= 4:
                raise KeyboardInterrupt

        def end(self) -> None:
            pass

    model = tiny_model("gemma3_text")
    with _quiet(), _record(model, path):
        try:
            _generate(model, streamer=Interrupting())
        except KeyboardInterrupt as exc:
            INTERRUPTS["last"] = exc
        _generate(model, prompt=PROMPT + 1, new=4)
    return path


SLICES: list[Any] = []


def plant_slice_views(path: Path) -> Path:
    """After each of three requests the user keeps a one-token slice (a view) of layer 1's keys for
    "analysis": each view holds that layer's whole key storage. The issue's 2.1 MiB-per-request case
    (scored info 0.023 three times before): proven, repeated, accumulating."""
    model = tiny_model("llama")
    with _quiet(), _record(model, path):
        for prompt in (PROMPT, PROMPT + 3, PROMPT + 6):
            out = _generate(model, prompt=prompt, return_dict_in_generate=True)
            SLICES.append(output_cache(out).layers[1].keys[:, :, -1:])
            del out
    return path


CALLBACKS: list[Callable[[], int]] = []


def _report_later(cache: Any) -> Callable[[], int]:
    return lambda: cache.get_seq_length()


def plant_closure(path: Path) -> Path:
    """A deferred callback (a closure) captures the returned cache to report its length later
    (deepseek_v3, MLA latent cache): the closure cell holds it."""
    model = tiny_model("deepseek_v3")
    with _quiet(), _record(model, path):
        out = _generate(model, return_dict_in_generate=True)
        CALLBACKS.append(_report_later(output_cache(out)))
        del out
        _generate(model, prompt=PROMPT + 2, new=4)
    return path


# ---- planted: copies of the cache during decode ----------------------------------------

COPIES: list[Any] = []


def _copying_hook(every: int, stack: bool) -> Callable:
    def hook(module: Any, args: Any, kwargs: dict, output: Any) -> None:
        import torch

        cache = cache_of_output_or_call(output, args, kwargs)
        if cache is None:
            return
        hook.n = getattr(hook, "n", 0) + 1  # type: ignore[attr-defined]
        if hook.n % every:  # type: ignore[attr-defined]
            return
        with torch.no_grad():
            if stack:  # one [layers, B, H, T, D] snapshot of every layer's keys and values
                COPIES.append(torch.stack([layer.keys for layer in cache.layers]))
                COPIES.append(torch.stack([layer.values for layer in cache.layers]))
            else:  # per-layer clones of K and V
                COPIES.extend(t.clone() for layer in cache.layers for t in (layer.keys, layer.values))
    return hook


def cache_of_output_or_call(output: Any, args: tuple, kwargs: dict) -> Any:
    from kvtrace.recorder.hooks import cache_of_output

    cache = cache_of_output(output)
    return cache if cache is not None else call_cache(args, kwargs)


def _record_decode(path: Path, model: Any, kept: Any, hook: Callable | None = None, with_kwargs: bool = False,
                   **gen_kw: Any) -> Path:
    """A 32 + 96-token request under 100 Hz RSS sampling with user code (a forward hook, or generate
    kwargs such as a logits processor) keeping things in ``kept``, cleared afterwards."""
    handle = model.register_forward_hook(hook, with_kwargs=with_kwargs) if hook is not None else None
    trim_heap()
    try:
        with _quiet(), _record(model, path, telemetry_hz=100.0):
            _generate(model, prompt=DUP_PROMPT, new=DUP_NEW, **gen_kw)
    finally:
        if handle is not None:
            handle.remove()
        kept.clear()
    return path


def _record_copies(path: Path, arch: str, every: int, stack: bool) -> Path:
    return _record_decode(path, tiny_model(arch, **DUP_EXTRA), COPIES, _copying_hook(every, stack), with_kwargs=True)


def plant_hook_clones(path: Path) -> Path:
    """User code (a forward hook) keeps full clones of every layer's K and V every 2 decode steps."""
    return _record_copies(path, "llama", 2, stack=False)


def plant_stacked_snapshots(path: Path) -> Path:
    """User code keeps a torch.stack of all layers' keys and values every 3 steps (mistral geometry)."""
    return _record_copies(path, "qwen3", 3, stack=True)


# ---- planted: memory growth outside the KV: named by its owner, never duplication -------

KEPT_TEMPS: list[Any] = []


def plant_odd_temporaries(path: Path) -> Path:
    """A forward hook keeps an odd-sized float buffer (not shaped like K/V) every 2 steps."""
    import torch

    model = tiny_model("llama", **DUP_EXTRA)
    state = {"n": 0}

    def hook(module: Any, args: Any, output: Any) -> None:
        state["n"] += 1
        if state["n"] % 2 == 0:
            KEPT_TEMPS.append(torch.ones(1_000_003 // 4 * 3))  # ~2.9 MiB, odd-sized

    return _record_decode(path, model, KEPT_TEMPS, hook)


def plant_unasked_logits(path: Path) -> Path:
    """A logits processor keeps a copy of every step's scores row (vocabulary 131,072) though the call
    never asked generate for output_scores: vocabulary-sized rows nobody requested."""
    from transformers import LogitsProcessor

    class Keeps(LogitsProcessor):
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            KEPT_TEMPS.append(scores.clone())
            return scores

    return _record_decode(path, tiny_model("llama", vocab_size=131072), KEPT_TEMPS, logits_processor=[Keeps()])


STEP_NOTES: dict[int, Any] = {}


def plant_criterion_dict(path: Path) -> Path:
    """A stopping criterion (user code) stores a per-step [1, 777, 333] debug tensor in a dict keyed
    by sequence length (gemma3 geometry)."""
    import torch
    from transformers import StoppingCriteria

    class Notes(StoppingCriteria):
        def __call__(self, input_ids: Any, scores: Any, **kw: Any) -> Any:
            STEP_NOTES[int(input_ids.shape[-1])] = torch.rand(1, 777, 333)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    return _record_decode(path, tiny_model("gemma3_text"), STEP_NOTES, stopping_criteria=[Notes()])


# ---- planted: OOM from retention under a cap ---------------------------------------------

def plant_oom_kept_requests(path: Path) -> Path:
    """RLIMIT_AS = mapped + 640 MiB; every request's output (and so its 64 MiB cache) is kept in a
    list until a request cannot get memory: the post-mortem names earlier requests' KV.
    Only in a forked child: the cap cannot be lifted again."""
    import resource

    model = tiny_model("llama", **DUP_EXTRA, max_position_embeddings=4096)
    with open("/proc/self/statm") as fh:
        vm = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (vm + 640 * MiB, resource.getrlimit(resource.RLIMIT_AS)[1]))
    kept = []
    with _quiet(), _record(model, path):
        for _ in range(40):
            try:
                kept.append(_generate(model, prompt=2040, new=4, return_dict_in_generate=True))
            except (RuntimeError, MemoryError):
                break
    kept.clear()
    return path


# ---- clean: every outcome, growth by design ---------------------------------------------

LOG: list[str] = []


def clean_error_dropped(path: Path) -> Path:
    """A stopping criterion raises; the caller logs str(exc) only and goes on (outcome error)."""
    model = tiny_model("llama")
    with _quiet(), _record(model, path):
        try:
            _generate(model, stopping_criteria=[_raise_at(3, ValueError("criterion failed"))])
        except ValueError as exc:
            LOG.append(str(exc))
        _generate(model, prompt=PROMPT + 1, new=4)
    return path


def clean_interrupt_dropped(path: Path) -> Path:
    """A KeyboardInterrupt mid-decode, handled (printed) and dropped; then the next request (interrupted)."""
    model = tiny_model("qwen3")
    with _quiet(), _record(model, path):
        try:
            _generate(model, stopping_criteria=[_raise_at(2, KeyboardInterrupt())])
        except KeyboardInterrupt:
            LOG.append("interrupted")
        _generate(model, prompt=PROMPT + 1, new=4)
    return path


def clean_error_propagates(path: Path) -> Path:
    """The request's exception leaves the recording's with-block: not yet the caller's to keep (error)."""
    model = tiny_model("gemma3_text")
    try:
        with _quiet(), _record(model, path):
            _generate(model, stopping_criteria=[_raise_at(3, ValueError("criterion failed"))])
    except ValueError as exc:
        LOG.append(str(exc))
    return path


SCORES: list[Any] = []


def clean_scores_logits(path: Path) -> Path:
    """generate(output_scores=True, output_logits=True) on a 131,072-token vocabulary: 1 MiB of
    float32 rows per step the user asked for; the caller keeps the scores and drops the output."""
    model = tiny_model("llama", vocab_size=131072)
    trim_heap()
    with _quiet(), _record(model, path, telemetry_hz=100.0):
        out = _generate(model, prompt=DUP_PROMPT, new=48, return_dict_in_generate=True, output_scores=True,
                        output_logits=True)
        SCORES.append(out.scores)
        del out
        _generate(model, prompt=PROMPT, new=4)
    SCORES.clear()
    return path


def clean_hidden_attentions(path: Path) -> Path:
    """output_hidden_states and output_attentions (eager) kept in the returned output's place."""
    model = tiny_model("gemma3_text", attn_implementation="eager")
    with _quiet(), _record(model, path):
        out = _generate(model, new=12, return_dict_in_generate=True, output_hidden_states=True,
                        output_attentions=True)
        SCORES.append((out.sequences, out.attentions))
        del out
    SCORES.clear()
    return path


def clean_beams_returned(path: Path) -> Path:
    """Beam search, 4 beams, 2 sequences returned."""
    model = tiny_model("qwen3")
    with _quiet(), _record(model, path):
        _generate(model, num_beams=4, num_return_sequences=2)
    return path


def clean_prompt_lookup(path: Path) -> Path:
    """Prompt-lookup assisted decoding (the cache is cropped where drafts are rejected)."""
    import torch

    model = tiny_model("llama")
    prompt = torch.cat([tiny_prompt(8), tiny_prompt(8)], dim=-1)  # repeats: drafts to look up
    with _quiet(), _record(model, path):
        model.generate(prompt, max_new_tokens=10, min_new_tokens=10, do_sample=False, prompt_lookup_num_tokens=3)
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
OUTCOME_CLEAN: list[Case] = [
    Case("clean:outcome:error_dropped", None, None, (), "llama; a stopping criterion raises, the caller keeps str(exc)",
         clean_error_dropped, arch="llama", scenario="outcome", outcomes=("error", "ok")),
    Case("clean:outcome:interrupt_dropped", None, None, (), "qwen3; Ctrl-C mid-decode, handled and dropped",
         clean_interrupt_dropped, arch="qwen3", scenario="outcome", outcomes=("interrupted", "ok")),
    Case("clean:outcome:propagates", None, None, (), "gemma3; the exception leaves the recording's with-block",
         clean_error_propagates, arch="gemma3_text", scenario="outcome", outcomes=("error",)),
]
BY_DESIGN_CLEAN: list[Case] = [
    Case("clean:by_design:scores_logits", None, None, (),
         "llama, vocabulary 131,072; output_scores + output_logits, 48 steps, the caller keeps the scores",
         clean_scores_logits, arch="llama", scenario="by_design", outcomes=("ok", "ok")),
    Case("clean:by_design:hidden_attentions", None, None, (), "gemma3 eager; output_hidden_states + output_attentions",
         clean_hidden_attentions, arch="gemma3_text", scenario="by_design"),
    Case("clean:by_design:beams", None, None, (), "qwen3; num_beams=4, num_return_sequences=2",
         clean_beams_returned, arch="qwen3", scenario="by_design"),
    Case("clean:by_design:prompt_lookup", None, None, (), "llama; prompt_lookup_num_tokens=3 (drafts cropped)",
         clean_prompt_lookup, arch="llama", scenario="by_design"),
]
NON_KV = ("unexplained_memory_growth",)
PLANTED: list[Case] = [
    Case("retention:kept_output", "retention", "post_eos", RET,
         "llama; the caller keeps generate(return_dict_in_generate=True)'s output", plant_kept_output),
    Case("retention:global_list", "retention", "post_eos", RET,
         "gemma3 (hybrid); every generate output's cache appended to a module-level list", plant_global_list),
    Case("retention:forward_hook", "retention", "post_eos", RET,
         "deepseek_v3 (MLA); a forward pre-hook stashes the cache it sees", plant_forward_hook),
    Case("retention:kept_exception", "retention", "post_eos", RET,
         "llama; a stopping criterion raises mid-decode, the caller keeps the exception (outcome error)",
         plant_kept_exception, owner="ValueError exception (its traceback)"),
    Case("retention:exception_attribute", "retention", "post_eos", RET,
         "qwen3; a logits processor raises, the server object keeps it on .last_error (outcome error)",
         plant_exception_attribute, owner="RuntimeError exception (its traceback) < _Server"),
    Case("retention:kept_interrupt", "retention", "post_eos", RET,
         "gemma3 (hybrid); Ctrl-C from the streamer, the KeyboardInterrupt kept in a dict (outcome interrupted)",
         plant_kept_interrupt, owner="KeyboardInterrupt exception (its traceback)"),
    Case("retention:slice_views", "retention", "post_eos", RET,
         "llama; a one-token view of layer 1's keys kept after each of 3 requests (accumulating)",
         plant_slice_views, owner="retention accumulates"),
    Case("retention:closure", "retention", "post_eos", RET,
         "deepseek_v3 (MLA); a deferred callback's closure captures the returned cache",
         plant_closure, owner="closure cell"),
    Case("duplication:arena", "duplication", "growth_curve", DUP,
         "llama 16x64; cache tensors are views into a buffer keeping every earlier version (inside the cache)",
         plant_arena),
    Case("duplication:cat_subclass", "duplication", "growth_curve", DUP,
         "qwen3 16x64; a DynamicLayer subclass (torch.cat) keeps earlier K/V in a list (outside the cache)",
         plant_cat_subclass),
    Case("duplication:hook_clones", "duplication", "growth_curve", DUP,
         "llama 16x64; a forward hook keeps clones of every layer's K and V every 2 steps (user code)",
         plant_hook_clones, owner="sized like the cache's own K/V"),
    Case("duplication:stacked_snapshots", "duplication", "growth_curve", DUP,
         "qwen3 16x64; torch.stack of all layers' K and V kept every 3 steps (5-D copies)",
         plant_stacked_snapshots, owner="sized like the cache's own K/V"),
    Case("non_kv:odd_temporaries", "non_kv_growth", "growth_curve", NON_KV,
         "llama 16x64; a forward hook keeps a 2.9 MiB odd-sized buffer every 2 steps",
         plant_odd_temporaries, owner="unknown"),
    Case("non_kv:unasked_logits", "non_kv_growth", "growth_curve", NON_KV,
         "llama, vocabulary 131,072; a logits processor keeps every scores row nobody asked for",
         plant_unasked_logits, owner="unknown"),
    Case("non_kv:criterion_dict", "non_kv_growth", "growth_curve", NON_KV,
         "gemma3 16x64; a stopping criterion keeps a [1, 777, 333] tensor per step in a dict",
         plant_criterion_dict, owner="unknown"),
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
    Case("oom:kept_requests", "oom", "oom", ("oom_memory_cap", "oom_retained_kv"),
         "llama 16x64; RLIMIT_AS = mapped + 640 MiB, every request's output (64 MiB of KV) kept until one fails",
         plant_oom_kept_requests, fresh=True, owner="KV of earlier requests"),
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
    return clean_cases() + OUTCOME_CLEAN + BY_DESIGN_CLEAN + SERVING_CLEAN + PLANTED


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
