"""The analyser's one entry into the kernels: torch is imported here, never in kvtrace.analyzer.

``kvtrace.analyzer.contents`` calls :func:`open_compute` and gets either a :class:`Compute` (torch
on one device, the kernels the content analyses run, and the label of the backend that runs
them) or the reason the content analyses cannot run here. Importing this module imports
neither torch nor triton.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from kvtrace.kernels._env import cuda_available, resolve_backend, torch_available
from kvtrace.kernels.whatif_config import DEFAULT_CONFIG, KernelConfig, KernelFallbacks


def select_device(device: str = "auto") -> tuple[str, str]:
    """(torch device, note) for ``device`` in auto | cuda | cpu.

    ``cuda`` without a CUDA device runs on the CPU and says so in the note instead of failing:
    the torch references compute the same numbers, only slower (decision documented in
    docs/kernels.md). Raises ValueError for other names.
    """
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device must be auto, cuda or cpu, got {device!r}")
    if device == "cpu":
        return "cpu", ""
    ok, why = cuda_available()
    if ok:
        return "cuda", ""
    if device == "cuda":
        return "cpu", f"GPU asked for but {why}: ran the torch reference on the CPU (same numbers, slower)"
    return "cpu", f"no GPU ({why}): ran the torch reference on the CPU"


class Compute:
    """torch on one device with the kernels bound to one backend (auto | triton | torch). The
    what-if kernels run with ``kernel_config`` and record the kernels they had to replace in
    ``kernel_fallbacks``, one record for this object's lifetime (a run)."""

    head_norms: Callable[..., Any]
    attention_stats: Callable[..., Any]
    mla_spectrum: Callable[..., Any]
    kv_head_report: Callable[..., Any]
    classify_entropy: Callable[..., Any]
    h2o_eviction: Callable[..., Any]
    streaming_eviction: Callable[..., Any]
    keep_measures: Callable[..., Any]  # what-if replay: keep-set recall and output error
    output_error: Callable[..., Any]
    quant_error: Callable[..., Any]

    def __init__(self, device: str, backend: str, device_note: str = "",
                 kernel_config: KernelConfig = DEFAULT_CONFIG) -> None:
        import torch

        from kvtrace.kernels import analyses, attention, mla, norms, whatif

        self._torch = torch
        self.device, self.backend, self.device_note = device, backend, device_note
        self.head_norms, self.attention_stats, self.mla_spectrum = (
            norms.head_norms, attention.attention_stats, mla.mla_spectrum)
        self.kv_head_report, self.classify_entropy = analyses.kv_head_report, analyses.classify_entropy
        self.h2o_eviction, self.streaming_eviction = analyses.h2o_eviction, analyses.streaming_eviction
        self.kernel_config, self.kernel_fallbacks = kernel_config, KernelFallbacks()
        run = dict(config=kernel_config, fallbacks=self.kernel_fallbacks)
        self.keep_measures = functools.partial(whatif.keep_measures, **run)
        self.output_error = functools.partial(whatif.output_error, **run)
        self.quant_error = whatif.quant_error

    @property
    def label(self) -> str:
        """'triton/cuda', 'torch/cuda', 'torch/cpu' or 'triton-interpreter/cpu': what runs the kernels."""
        which = resolve_backend(self.backend, self._torch.empty(0, device=self.device))
        if which == "triton" and self.device == "cpu":
            return "triton-interpreter/cpu"
        return f"{which}/{self.device}"

    def tensor(self, array: np.ndarray) -> Any:
        """A numpy array as a tensor on this device (the array's dtype kept)."""
        return self._torch.from_numpy(np.ascontiguousarray(array)).to(self.device)


def open_compute(device: str = "auto", backend: str = "auto",
                 kernel_config: KernelConfig = DEFAULT_CONFIG) -> Compute | str:
    """A :class:`Compute` on ``device`` (see :func:`select_device`) whose what-if kernels run with
    ``kernel_config``, or why torch cannot run here. Raises ValueError for an unknown device name."""
    ok, why = torch_available()
    if not ok:
        return why
    dev, note = select_device(device)
    return Compute(dev, backend, note, kernel_config)
