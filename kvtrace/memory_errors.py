"""How an out-of-memory error reads. One rule, used by the recorder to classify and stamp a
request's outcome and by the analyser to read the events of any trace (older ones included).

Host (CPU) allocator failures: torch's CPU allocator raises RuntimeError ("DefaultCPUAllocator:
can't allocate memory" / "not enough memory"), C++ code std::bad_alloc, and Python MemoryError;
none is torch.OutOfMemoryError.

Device failures: torch's caching allocator names the device that failed (its torch ordinal) and
the size asked for. torch >= 2.1 (2.11 and 2.13 included; XPU words it the same way):
  "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 23.99 GiB of which ..."
torch <= 2.0:
  "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 1; 23.99 GiB total capacity; ...)"
OOMs raised elsewhere (cuBLAS workspaces, a bare "CUDA out of memory") name no device.
"""

from __future__ import annotations

import re

CPU_OOM_TEXT = re.compile(r"can't allocate memory|not enough memory|Cannot allocate memory|std::bad_alloc|MemoryError")
_NAMED_GPU = re.compile(r"\bGPU (\d+) has a total capacity|\(GPU (\d+);")
# A size as torch and the CPU allocator print it: (number)(unit), two groups.
SIZE_TEXT = r"([0-9.]+)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|bytes)"
_TRIED = re.compile(r"[Tt]ried to allocate\s+" + SIZE_TEXT)
_SCALE = {"B": 1, "bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
          "KB": 1000, "MB": 1000**2, "GB": 1000**3}


def is_cpu_oom_text(text: str) -> bool:
    return bool(CPU_OOM_TEXT.search(text or ""))


def is_host_oom(exc: BaseException) -> bool:
    """A host allocation failure: MemoryError, or a RuntimeError whose message is the allocator's."""
    return isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and is_cpu_oom_text(str(exc)))


def named_gpu(text: str) -> int | None:
    """The device ordinal a device OOM message names, else None."""
    m = _NAMED_GPU.search(text or "")
    return None if m is None else int(m.group(1) or m.group(2))


def size_bytes(m: re.Match[str] | None) -> int | None:
    """Bytes of a ``SIZE_TEXT`` match (its number and unit groups), None without a match."""
    return int(float(m.group(1)) * _SCALE[m.group(2)]) if m else None


def requested_bytes(text: str) -> int | None:
    """The size the failed allocation asked for: torch's CUDA message (binary units) or the CPU
    allocator's ("you tried to allocate N bytes")."""
    return size_bytes(_TRIED.search(text or ""))
