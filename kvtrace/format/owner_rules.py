"""Row rules of the memory-owner table /owners (format 1.5, spec §4.19, §7).

``kvtrace validate`` lists every broken rule; a consumer reading /owners through
:func:`checked_owners` refuses a trace that breaks one (exit 1), so no verdict rests on a class whose
largest block is larger than the class.
"""

from __future__ import annotations

import numpy as np

from kvtrace.format.errors import InvalidTrace


def owner_block_problems(rows: np.ndarray) -> set[str]:
    """The §7 rules of one block of /owners rows, each broken rule named once."""
    found: set[str] = set()
    if not rows.size:
        return found
    if np.any(rows["largest_bytes"] > rows["bytes"]):
        found.add("/owners has rows whose largest block exceeds the class's bytes")
    if np.any((rows["bytes"] > 0) & (rows["blocks"] == 0)):
        found.add("/owners has rows with bytes but no blocks")
    if np.any(rows["request"] < -1):
        found.add("/owners has rows with a request below -1")
    return found


def checked_owners(trace: object) -> np.ndarray:
    """/owners of an open :class:`kvtrace.format.reader.Trace` (empty for traces before 1.5),
    refused with InvalidTrace when a row breaks §7 or names a request absent from /requests."""
    rows = trace["owners"][:]  # type: ignore[attr-defined]
    problems = owner_block_problems(rows)
    if not problems and rows.size:
        known = trace.requests[:]["request"].astype(np.int64)  # type: ignore[attr-defined]
        named = np.unique(rows["request"][rows["request"] >= 0].astype(np.int64))
        orphans = np.setdiff1d(named, known)
        if orphans.size:
            problems.add(f"/owners names requests absent from /requests: {orphans.tolist()[:8]}")
    if problems:
        raise InvalidTrace(f"{trace.path}: {sorted(problems)[0]}")  # type: ignore[attr-defined]
    return rows
