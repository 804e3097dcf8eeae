"""The cache argument and output field under whatever name the installed transformers uses
(``past_key_values`` before 5.24, ``cache`` since): tests find caches by type and pass them by the
name the model's own signature declares, so that no test encodes one release's spelling."""

from __future__ import annotations

from typing import Any

from kvtrace.recorder.hooks import cache_keyword, cache_of_output, find_cache

__all__ = ["call_cache", "cache_kwargs", "output_cache"]


def output_cache(output: Any) -> Any:
    """The Cache a forward or ``generate(return_dict_in_generate=True)`` returned."""
    cache = cache_of_output(output)
    assert cache is not None, f"no Cache in {type(output).__name__}"
    return cache


def call_cache(args: tuple, kwargs: dict) -> Any:
    """The Cache a forward (pre-)hook sees among its call's arguments, or None."""
    return find_cache(args, kwargs)


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for ``model(...)`` and ``model.generate(...)`` (renamed together)."""
    return {cache_keyword(model.forward): cache}


def cb_config(**options: Any) -> Any:
    """A ContinuousBatchingConfig from today's option names; ``page_size`` is passed as
    ``block_size`` to releases whose config has that field instead (5.17)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    fields = set(getattr(ContinuousBatchingConfig, "__dataclass_fields__", {}))
    if "page_size" in options and fields and "page_size" not in fields and "block_size" in fields:
        options["block_size"] = options.pop("page_size")
    return ContinuousBatchingConfig(**options)


def padded_layers(measured: list[tuple[int, int]], layers: int) -> list[tuple[int, int]]:
    """Per-layer (allocated, valid) bytes of a cache padded with (0, 0) to the model's layer count:
    the KV-sharing consumers hold no tensors in every release, but 5.17 leaves them out of
    ``cache.layers`` while 5.23+ keeps a DummyLayer for each."""
    return list(measured) + [(0, 0)] * max(0, layers - len(measured))


def spy_paged_caches(monkeypatch: Any) -> list:
    """Weak references to every continuous-batching PagedAttentionCache built from now on (the test
    keeps none alive), by wrapping its ``__init__`` for the test's duration."""
    import weakref

    from transformers.generation.continuous_batching import cache as cb_cache

    built: list = []
    init = cb_cache.PagedAttentionCache.__init__

    def spy(self: Any, *a: Any, **k: Any) -> None:
        init(self, *a, **k)
        built.append(weakref.ref(self))

    monkeypatch.setattr(cb_cache.PagedAttentionCache, "__init__", spy)
    return built
