"""Memory limits the process runs under, read once when the recording starts.

An out-of-memory error is only explained when the limit that was hit is known: the device's
size is one limit, but ``torch.cuda.set_per_process_memory_fraction`` makes the caching
allocator refuse anything above ``fraction x total`` long before the device is full, and on a
CPU an ``RLIMIT_AS`` / ``RLIMIT_DATA`` or a cgroup's ``memory.max`` does the same. Stored in
``/meta sources_json`` under ``limits`` (spec section 3); -1 / absent where a limit is not set or
cannot be read. Never raises.
"""

from __future__ import annotations

from typing import Any

_UNLIMITED = -1


def _rlimit(name: str) -> int:
    try:
        import resource
    except ImportError:  # not on POSIX
        return _UNLIMITED
    try:
        soft, _hard = resource.getrlimit(getattr(resource, name))
    except (AttributeError, ValueError, OSError):
        return _UNLIMITED
    return _UNLIMITED if soft == resource.RLIM_INFINITY or soft < 0 else int(soft)


def _cgroup_memory_max() -> int:
    """cgroup v2 memory.max (or v1 limit_in_bytes) of this process; -1 when unlimited/unknown."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as fh:
                text = fh.read().strip()
        except OSError:
            continue
        if text == "max" or not text.isdigit():
            return _UNLIMITED
        value = int(text)
        # cgroup v1 reports "no limit" as a huge page-rounded number near 2^63
        return _UNLIMITED if value >= 1 << 60 else value
    return _UNLIMITED


def process_limits() -> dict[str, int]:
    """Host-memory limits of this process (bytes; -1 = not set or unknown)."""
    return {
        "rlimit_as_bytes": _rlimit("RLIMIT_AS"),
        "rlimit_data_bytes": _rlimit("RLIMIT_DATA"),
        "cgroup_memory_max_bytes": _cgroup_memory_max(),
    }


def device_limits(devices: list[int]) -> dict[str, dict[str, Any]]:
    """Per CUDA device: total memory, the per-process memory fraction the caching allocator
    enforces, and the resulting allowed bytes (keys are the ordinals as strings, JSON objects)."""
    out: dict[str, dict[str, Any]] = {}
    if not devices:
        return out
    try:
        import torch
    except ImportError:
        return out
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    for d in devices:
        entry: dict[str, Any] = {"total_bytes": -1, "per_process_memory_fraction": None, "allowed_bytes": -1}
        try:
            entry["total_bytes"] = int(torch.cuda.get_device_properties(d).total_memory)
        except Exception:  # noqa: BLE001 - a bad ordinal or no CUDA: leave it unknown
            pass
        if getter is not None:
            try:
                entry["per_process_memory_fraction"] = float(getter(d))
            except Exception:  # noqa: BLE001
                pass
        frac = entry["per_process_memory_fraction"]
        if frac is not None and entry["total_bytes"] > 0:
            entry["allowed_bytes"] = int(frac * entry["total_bytes"])
        out[str(d)] = entry
    return out


def read_limits(devices: list[int]) -> dict[str, Any]:
    """The ``limits`` entry of sources_json."""
    return {
        "available": True,
        "reason": "read at recording start: torch.cuda.get_per_process_memory_fraction per device, "
                  "RLIMIT_AS/RLIMIT_DATA and cgroup memory.max for the process",
        "devices": device_limits(devices),
        "process": process_limits(),
    }
