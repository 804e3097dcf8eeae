"""Row rules of the cache-state table /state (format 1.5, spec §4.18, §7).

``kvtrace validate`` lists every broken rule; a consumer reading /state through
:func:`checked_state` refuses a trace that breaks one (exit 1), so no analysis sums bytes that
contradict the shapes they describe. The rules are what every recording satisfies: a state row's
valid bytes are its tensor's (elements x item size), never more than its storage, and its share of
the de-duplicated total is at most its storage.
"""

from __future__ import annotations

import numpy as np

from kvtrace.format import schema
from kvtrace.format.errors import InvalidTrace

# dtype code -> item size, for the dtypes whose element count fixes the bytes (not unknown, not
# int4_packed: two elements per byte)
_ITEMSIZE = np.zeros(256, dtype=np.float64)
for _code, _size in schema.DTYPE_ITEMSIZE.items():
    if _code != schema.CacheDType.INT4_PACKED:
        _ITEMSIZE[int(_code)] = float(_size)


def state_block_problems(rows: np.ndarray) -> set[str]:
    """The §7 rules of one block of /state rows, each broken rule named once."""
    found: set[str] = set()
    if not rows.size:
        return found
    if np.any(rows["bytes_valid"] > rows["bytes_allocated"]):
        found.add("/state has rows with more valid than allocated bytes")
    if np.any(rows["bytes_unique"] > rows["bytes_allocated"]):
        found.add("/state has rows adding more unique bytes than their storage holds")
    ndim = rows["ndim"].astype(np.int64)
    if np.any(ndim > schema.STATE_MAX_NDIM):
        found.add(f"/state has rows with ndim above {schema.STATE_MAX_NDIM}")
        return found
    shape = rows["shape"]
    if np.any(shape < 0):
        found.add("/state has rows with negative shape entries")
        return found
    past = np.arange(schema.STATE_MAX_NDIM)[None, :] >= ndim[:, None]
    if np.any(shape[past] != 0):
        found.add("/state has rows with shape entries past ndim")
    # float product: a hostile shape cannot wrap int64 into a matching value
    used = np.where(past, 1.0, shape.astype(np.float64))
    elements = np.prod(used, axis=1)
    item = _ITEMSIZE[rows["dtype"].astype(np.int64) & 0xFF]
    known = item > 0
    if np.any(known & (elements * item != rows["bytes_valid"].astype(np.float64))):
        found.add("/state has rows whose valid bytes are not their shape's elements x item size")
    return found


def checked_state(trace: object) -> np.ndarray:
    """/state of an open :class:`kvtrace.format.reader.Trace` (empty for traces before 1.5),
    refused with InvalidTrace when a row breaks §7."""
    rows = trace["state"][:]  # type: ignore[attr-defined]
    problems = state_block_problems(rows)
    if problems:
        raise InvalidTrace(f"{trace.path}: {'; '.join(sorted(problems))}")  # type: ignore[attr-defined]
    return rows
