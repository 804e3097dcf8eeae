"""Environment probes and backend selection for kvtrace.kernels.

Nothing here imports torch or triton at module level: the analyser imports this package in
environments that have neither, and must get a clear "why not" instead of an ImportError.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

BACKENDS = ("auto", "triton", "torch")


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


@lru_cache(maxsize=1)
def torch_available() -> tuple[bool, str]:
    """(present, reason): whether ``import torch`` works here."""
    try:
        import torch
    except Exception as exc:  # ImportError, or a broken install raising something else
        return False, f"torch is not importable: {type(exc).__name__}: {exc}"
    return True, f"torch {torch.__version__}"


@lru_cache(maxsize=1)
def triton_available() -> tuple[bool, str]:
    """(present, reason): whether ``import triton`` works here (says nothing about a GPU)."""
    try:
        import triton
    except Exception as exc:
        return False, f"triton is not importable: {type(exc).__name__}: {exc} (install the 'gpu' extra)"
    return True, f"triton {triton.__version__}"


def cuda_available() -> tuple[bool, str]:
    """(present, reason): whether torch sees a CUDA device."""
    ok, why = torch_available()
    if not ok:
        return False, why
    import torch

    if not torch.cuda.is_available():
        return False, f"no CUDA device visible to torch ({why}, built for CUDA {torch.version.cuda})"
    return True, f"CUDA device {torch.cuda.get_device_name()}"


def available() -> tuple[bool, str]:
    """(usable, reason): whether the Triton kernels can run here.

    True with a CUDA device and triton, or with triton's CPU interpreter (``TRITON_INTERPRET=1``,
    slow, for tests). When False the dispatchers fall back to the plain-torch implementations.
    """
    for probe in (torch_available, triton_available):
        ok, why = probe()
        if not ok:
            return False, why
    if interpreting():
        return True, f"{triton_available()[1]} in interpreter mode (TRITON_INTERPRET=1, CPU tensors)"
    ok, why = cuda_available()
    if not ok:
        return False, why
    return True, f"{triton_available()[1]} on {why}"


def resolve_backend(backend: str, tensor: Any) -> str:
    """Map a user ``backend`` to ``"triton"`` or ``"torch"`` for a given input tensor.

    ``auto`` picks triton for CUDA tensors when triton imports, torch otherwise. ``triton`` is
    honoured for CUDA tensors, and for CPU tensors only under the interpreter.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    tri_ok, tri_why = triton_available()
    on_cuda = bool(getattr(tensor, "is_cuda", False))
    if backend == "auto":
        return "triton" if (tri_ok and on_cuda) else "torch"
    if not tri_ok:
        raise RuntimeError(f"backend='triton' requested but {tri_why}")
    if not on_cuda and not interpreting():
        raise RuntimeError(
            "backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors); "
            f"got a tensor on {getattr(tensor, 'device', '?')}"
        )
    return "triton"
