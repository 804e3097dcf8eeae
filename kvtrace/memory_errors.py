"""How a host (CPU) allocator failure reads. torch's CPU allocator raises RuntimeError
("DefaultCPUAllocator: can't allocate memory" / "not enough memory"), C++ code std::bad_alloc, and
Python MemoryError; none is torch.OutOfMemoryError. One rule, used by the recorder to classify a
request's outcome and by the analyser to recognise such failures in older traces (where they were
recorded as plain exceptions)."""

from __future__ import annotations

import re

CPU_OOM_TEXT = re.compile(r"can't allocate memory|not enough memory|Cannot allocate memory|std::bad_alloc|MemoryError")


def is_cpu_oom_text(text: str) -> bool:
    return bool(CPU_OOM_TEXT.search(text or ""))


def is_host_oom(exc: BaseException) -> bool:
    """A host allocation failure: MemoryError, or a RuntimeError whose message is the allocator's."""
    return isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and is_cpu_oom_text(str(exc)))
