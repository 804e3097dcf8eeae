"""The small text forms options are written in, parsed once: comma lists (``--group-by a,b``,
``--ratio 0.25,0.5``, ``--phases single,long``) and KEY=VALUE items (``--baseline key=value``,
``--policy NAME:k=v,...``). Imports nothing: the commands, the fleet, the what-if replay and the
report all use it. Each caller says what a bad item is (its own message and exit code)."""

from __future__ import annotations


def split_list(text: str, sep: str = ",") -> list[str]:
    """``'a, b,,c '`` -> ``['a', 'b', 'c']``: items stripped, empty ones dropped."""
    return [item for item in (part.strip() for part in text.split(sep)) if item]


def split_key_value(item: str) -> tuple[str, str] | None:
    """``'k=v'`` -> ``('k', 'v')``, split at the first ``=`` and kept as written (the caller strips
    where spaces do not count); None when there is no ``=``."""
    key, eq, value = item.partition("=")
    return (key, value) if eq else None
