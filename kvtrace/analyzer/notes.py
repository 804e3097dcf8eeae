"""The recorder's NOTE events (spec §4.5, kind 15), as `kvtrace info` and `kvtrace analyze` show them:
what a reader of the trace must know that no table says (a continuous-batching manager's forwards
leave no per-layer rows and ran with these CUDA-graph / async settings; an unsupported transformers
version; a last step whose structure was not readable; samples skipped).

Identical texts are grouped (one entry, its count and first requests). Notes that carry data shown
elsewhere are left out: phase markers of a recorder without PHASE events ("phase: NAME", the phases
line), the first serving floor's occupancy samples ("paged cache occupancy {...}", read by
kvtrace loadtest), the retention check's bookkeeping ("retention checked at ...", one per
request, read by post_eos) and an engine trace's block stores ("kv blocks stored ...", spec §10, read by
kvtrace whatif --pool-sizes). Bounded for hostile traces: the texts of the first MAX_READ events are
read, at most MAX_LISTED entries listed, MAX_TEXT characters a text; what is left off is counted.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtrace.format.schema import EventKind

DATA_NOTES = ("phase: ", "paged cache occupancy ", "retention checked at ", "kv blocks stored ")
MAX_LISTED = 256  # distinct texts in the JSON documents
MAX_TEXT = 2000  # characters of one text
MAX_REQUESTS = 16  # request ids named per entry
MAX_READ = 10_000  # NOTE events whose text is read (one small read each)
SHOWN = 8  # lines in the terminal


def trace_notes(trace: Any) -> tuple[list[dict[str, Any]], int]:
    """(entries in time order of their first event, NOTE events not listed). An entry: {"text",
    "count", "first_t_ns", "requests"} (requests: the first MAX_REQUESTS ids >= 0). Not listed: the
    events of texts past MAX_LISTED distinct ones, and those past the first MAX_READ events (each
    text is one read of /text). ``trace``: an open Trace."""
    rows = trace.events.where(kind=EventKind.NOTE) if trace.has("events") else None
    if rows is None or not rows.size:
        return [], 0
    rows = np.sort(rows, order="t_ns", kind="stable")
    unlisted = max(rows.size - MAX_READ, 0)
    by_text: dict[str, dict[str, Any]] = {}
    for e in rows[:MAX_READ]:
        text = trace.text(int(e["text_off"]), int(e["text_len"]))
        if text.startswith(DATA_NOTES):
            continue
        if len(text) > MAX_TEXT:
            text = text[:MAX_TEXT] + f" [... {len(text) - MAX_TEXT:,} characters more]"
        entry = by_text.get(text)
        if entry is None:
            if len(by_text) >= MAX_LISTED:
                unlisted += 1
                continue
            entry = by_text[text] = {"text": text, "count": 0, "first_t_ns": int(e["t_ns"]), "requests": []}
        entry["count"] += 1
        rid = int(e["request"])
        if rid >= 0 and len(entry["requests"]) < MAX_REQUESTS and rid not in entry["requests"]:
            entry["requests"].append(rid)
    return list(by_text.values()), unlisted


def note_lines(notes: list[dict[str, Any]], unlisted: int, shown: int = SHOWN) -> list[str]:
    """At most ``shown`` entries, one line each, then one line counting the rest."""
    lines = []
    for n in notes[:shown]:
        who = ""
        if n["requests"]:
            more = ", ..." if len(n["requests"]) >= MAX_REQUESTS else ""
            who = (f"request {n['requests'][0]}: " if len(n["requests"]) == 1 and n["count"] == 1
                   else f"requests {', '.join(map(str, n['requests']))}{more}: ")
        lines.append(f"{who}{n['text']}" + (f" (x{n['count']:,})" if n["count"] > 1 else ""))
    rest = len(notes) - len(lines)
    if rest > 0:
        lines.append(f"... and {rest:,} more distinct note(s) (--json lists them)")
    if unlisted:
        lines.append(f"... and {unlisted:,} note event(s) not listed anywhere (past {MAX_LISTED} distinct texts "
                     f"or the first {MAX_READ:,} events)")
    return lines
