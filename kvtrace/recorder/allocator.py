"""Readings of torch's CUDA caching allocator, in the allocator's own vocabulary.

``torch.cuda.memory_stats()`` flattens a nested dict in Python (~70-150 us per call); we read the
nested dict it is built from (``memory_stats_as_nested_dict``, public API) and pick the few
fields we store. Still not cheap: call it per step or from the telemetry thread, never per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# (field stored in the trace, path in the nested stats dict). Names are the allocator's own.
FIELDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("allocated_bytes", ("allocated_bytes", "all", "current")),
    ("reserved_bytes", ("reserved_bytes", "all", "current")),
    ("active_bytes", ("active_bytes", "all", "current")),
    ("inactive_split_bytes", ("inactive_split_bytes", "all", "current")),
    ("num_alloc_retries", ("num_alloc_retries",)),
    ("num_ooms", ("num_ooms",)),
)

# With backend:cudaMallocAsync torch documents these as "always zero": store -1, not a fake 0.
_NOT_MEANINGFUL_ASYNC = frozenset({"active_bytes", "inactive_split_bytes", "num_alloc_retries"})


@dataclass(frozen=True)
class AllocatorReading:
    allocated_bytes: int
    reserved_bytes: int
    active_bytes: int
    inactive_split_bytes: int
    num_alloc_retries: int
    num_ooms: int

    def as_row(self) -> tuple[int, int, int, int, int, int]:
        return (
            self.allocated_bytes, self.reserved_bytes, self.active_bytes,
            self.inactive_split_bytes, self.num_alloc_retries, self.num_ooms,
        )


UNAVAILABLE = AllocatorReading(-1, -1, -1, -1, -1, -1)


def _pick(stats: dict[str, Any], path: tuple[str, ...]) -> int:
    node: Any = stats
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return -1
        node = node[key]
    try:
        return int(node)
    except (TypeError, ValueError):
        return -1


def parse_nested_stats(stats: dict[str, Any], backend: str = "native") -> AllocatorReading:
    """Pick our fields from ``memory_stats_as_nested_dict()`` output; -1 for missing ones."""
    if not stats:
        return UNAVAILABLE
    values = {}
    for name, path in FIELDS:
        value = _pick(stats, path)
        if backend == "cudaMallocAsync" and name in _NOT_MEANINGFUL_ASYNC:
            value = -1
        values[name] = value
    return AllocatorReading(**values)


def probe() -> tuple[bool, str, str]:
    """(available, reason, backend) for the CUDA caching allocator in this process."""
    try:
        import torch
    except ImportError as exc:
        return False, f"torch is not installed ({exc})", ""
    if not torch.cuda.is_available():
        why = "torch is built without CUDA" if torch.version.cuda is None else "no CUDA device visible"
        return False, why, ""
    try:
        backend = str(torch.cuda.get_allocator_backend())
    except Exception:  # noqa: BLE001 - older torch or an allocator that cannot say
        backend = "unknown"
    reason = f"torch.cuda caching allocator (backend {backend})"
    if backend == "cudaMallocAsync":
        reason += "; active/inactive_split/retries are not tracked by this backend and stored as -1"
    return True, reason, backend


def read(device: int, backend: str = "native") -> AllocatorReading:
    """One full reading of ``device``; all -1 if CUDA is not initialised or the call fails."""
    import torch

    try:
        stats = torch.cuda.memory_stats_as_nested_dict(device)
    except Exception:  # noqa: BLE001 - a telemetry read must never raise into the host
        return UNAVAILABLE
    return parse_nested_stats(stats, backend)


def read_allocated_reserved(device: int) -> tuple[int, int]:
    """(allocated, reserved) from one stats call: the step-synchronous reading."""
    import torch

    try:
        stats = torch.cuda.memory_stats_as_nested_dict(device)
    except Exception:  # noqa: BLE001
        return (-1, -1)
    if not stats:
        return (-1, -1)
    return (_pick(stats, FIELDS[0][1]), _pick(stats, FIELDS[1][1]))
