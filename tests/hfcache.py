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
