"""Rows a reader skipped because a newer minor added their codes (spec §2), and how that is said.

The reader (Trace) leaves such rows out and records them per table; while a command runs, the CLI
collects the traces that skipped rows (:func:`collect_skipped`) and prints :func:`skipped_notes`, one
line per trace file, after the command has answered. A library caller reads ``Trace.skipped``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvtrace.format import schema

# How the note names the rows: table -> (one row, several rows); column -> its codes.
ROW_NOUNS = {"events": ("event", "events"), "requests": ("request", "requests"), "layers": ("layer", "layers"),
             "readings": ("reading", "readings"), "steps": ("step", "steps"),
             "payloads/index": ("payload", "payloads"), "sched_groups": ("/sched_groups row", "/sched_groups rows")}
COLUMN_NOUNS = {"kind": "kinds", "outcome": "outcomes", "layer_type": "layer types", "k_dtype": "key dtypes",
                "v_dtype": "value dtypes", "dtype": "dtypes", "phase": "phases", "label": "labels"}


@dataclass(frozen=True)
class Skipped:
    """Rows of one table a reader skipped: they hold codes a newer minor added."""

    rows: int
    codes: dict[str, list[int]]  # column -> its unknown codes (at most 8)


def skipped_note(skipped: dict[str, Skipped], version: str) -> str | None:
    """One line naming the rows skipped from a trace of format ``version`` (None when none were);
    tables in the spec's order."""
    if not skipped:
        return None
    order = list(schema.TABLES)
    parts = []
    for name, s in sorted(skipped.items(), key=lambda item: order.index(item[0])):
        noun = ROW_NOUNS.get(name, (f"/{name} row", f"/{name} rows"))[s.rows != 1]
        what = " or ".join(COLUMN_NOUNS.get(c, c + "s") for c in s.codes)
        shown = "; ".join(f"{c} {', '.join(map(str, v))}" for c, v in s.codes.items())
        parts.append(f"{s.rows:,} {noun} of {what} added after format {schema.FORMAT_VERSION} ({shown})")
    listed = parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"
    verb = "was" if len(parts) == 1 and next(iter(skipped.values())).rows == 1 else "were"
    return f"note: {listed} {verb} skipped (written by format {version}); a newer kvtrace reads them"


# The collections open now (a command's, while it runs): each trace that skips rows joins them.
_LISTENERS: list[list[Any]] = []


def notify_skipped(trace: Any) -> None:
    """Called by a Trace the first time it skips rows of a table."""
    for sink in _LISTENERS:
        if trace not in sink:
            sink.append(trace)


@contextmanager
def collect_skipped() -> Iterator[list[Any]]:
    """The traces (reader Trace objects) that skipped rows inside the block, in the order they did."""
    sink: list[Any] = []
    _LISTENERS.append(sink)
    try:
        yield sink
    finally:
        _LISTENERS.remove(sink)


def skipped_notes(traces: list[Any]) -> list[str]:
    """One line per trace file, ``PATH: note: ...`` (a file opened twice is named once)."""
    seen: dict[str, str] = {}
    for t in traces:
        note = t.skipped_note()
        if note and str(t.path) not in seen:
            seen[str(t.path)] = f"{t.path}: {note}"
    return list(seen.values())
