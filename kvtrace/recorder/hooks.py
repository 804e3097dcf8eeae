"""Finding attention modules generically and installing (then removing) the recorder's hooks.

An attention module is any module with an integer ``layer_idx`` whose forward receives a
transformers ``Cache`` under any keyword (``cache`` since transformers 5.24, ``past_key_values``,
``layer_past``) or positionally: caches are found by type, never by argument name. Decoder layers
often match too; the deepest matching module per (layer, self/cross) wins. Cross-attention is told
apart by a non-None ``key_value_states`` / ``encoder_hidden_states`` argument, the transformers
convention. Model names are never consulted.

Discovery hooks live only for the first forward of a session; the per-step work uses two hooks
on the top-level model. Every hook body runs under :func:`guarded`: an exception inside the
recorder is counted and reported, never propagated into the model.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

try:
    from transformers.cache_utils import Cache
except ImportError:  # pragma: no cover - the recorder needs transformers
    Cache = ()  # type: ignore[assignment,misc]

_CROSS_KWARGS = ("key_value_states", "encoder_hidden_states")


class HookClock:
    """Wall time spent inside the recorder's step hooks: its own cost, measured directly
    (two perf_counter_ns calls per hook), so overhead can be read without A/B noise."""

    __slots__ = ("calls", "ns")

    def __init__(self) -> None:
        self.ns = 0
        self.calls = 0


def guarded(
    site: str, on_error: Callable[[str, BaseException], None], clock: HookClock | None = None
) -> Callable[[Callable], Callable]:
    """Run a hook body so that an ``Exception`` is reported via ``on_error`` and swallowed
    (KeyboardInterrupt and other BaseExceptions still propagate: they belong to the user)."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the model must never see recorder errors
                try:
                    on_error(site, exc)
                except Exception:  # noqa: BLE001
                    pass
            if clock is not None:
                clock.ns += time.perf_counter_ns() - t0
                clock.calls += 1
            return None  # a hook returning None changes nothing in the model's call

        return _compile_opaque(inner)

    return wrap


def _compile_opaque(fn: Callable) -> Callable:
    """Keep torch.compile (generate auto-compiles static caches on GPUs) from tracing hook bodies:
    they read storage pointers, which fake tensors do not have."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    if disable is None:  # pragma: no cover - torch < 2.1
        return fn
    try:
        return disable(fn)
    except Exception:  # noqa: BLE001
        return fn


def find_cache(args: tuple, kwargs: dict) -> Any:
    """The first transformers Cache among a call's arguments, or None (by type: the keyword was
    renamed from ``past_key_values`` to ``cache`` in transformers 5.24 and may move again)."""
    for v in kwargs.values():
        if isinstance(v, Cache):
            return v
    for v in args:
        if isinstance(v, Cache):
            return v
    return None


def cache_of_output(output: Any) -> Any:
    """The transformers Cache a forward returned, or None. Read from the output's values by type:
    asking for ``output.past_key_values`` by name makes transformers >= 5.24 print a deprecation
    warning on the user's terminal (the field is ``cache`` there)."""
    values = output.values() if isinstance(output, Mapping) else output if isinstance(output, tuple) else ()
    for v in values:
        if isinstance(v, Cache):
            return v
    return None


def cache_keyword(forward: Callable) -> str:
    """The keyword under which ``forward`` (a model's forward or ``generate``) takes a cache:
    ``cache`` where the installed transformers has it (5.24+), else ``past_key_values``. Read from
    the signature, not a version number, so that both old and new releases get their own name and
    no deprecation shim prints on the user's terminal."""
    import inspect

    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def is_cross_call(kwargs: dict) -> bool:
    return any(kwargs.get(k) is not None for k in _CROSS_KWARGS)


def layer_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Modules carrying an integer ``layer_idx`` (attention candidates)."""
    out = []
    for name, module in model.named_modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and not isinstance(idx, bool):
            out.append((name, module))
    return out


class Discovery:
    """Pre-hooks that note which ``layer_idx`` modules receive a Cache; removed after one forward."""

    def __init__(self, model: torch.nn.Module, on_error: Callable[[str, BaseException], None]) -> None:
        self.model = model
        self.on_error = on_error
        self.seen: dict[tuple[int, str], list[str]] = {}
        self.last_cache: Any = None  # a weakref.ref to the cache, or None
        self._handles: list[Any] = []

    def install(self) -> None:
        import weakref

        for name, module in layer_modules(self.model):
            def pre(mod: torch.nn.Module, args: tuple, kwargs: dict, _name: str = name) -> None:
                cache = find_cache(args, kwargs)
                if cache is None:
                    return
                part = "cross" if is_cross_call(kwargs) else "self"
                names = self.seen.setdefault((int(mod.layer_idx), part), [])
                if _name not in names:
                    names.append(_name)
                if self.last_cache is None:
                    self.last_cache = weakref.ref(cache)

            hook = guarded("discovery", self.on_error)(pre)
            self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def module_names(self) -> dict[tuple[int, str], str]:
        """(layer_idx, "self"|"cross") -> name of the deepest module that received the cache."""
        out = {}
        for key, names in self.seen.items():
            best = names[0]
            for n in names[1:]:
                if n.startswith(best + ".") or len(n.split(".")) > len(best.split(".")):
                    best = n
            out[key] = best
        return out


class StepHooks:
    """Pre- and post-forward hooks (with kwargs) on the top-level model: one call each per step."""

    def __init__(self, model: torch.nn.Module, pre: Callable, post: Callable,
                 on_error: Callable[[str, BaseException], None]) -> None:
        self.model = model
        self.clock = HookClock()
        self._pre = guarded("step-start", on_error, self.clock)(pre)
        self._post = guarded("step-end", on_error, self.clock)(post)
        self._handles: list[Any] = []

    def install(self) -> None:
        self._handles.append(self.model.register_forward_pre_hook(self._pre, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(self._post, with_kwargs=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
