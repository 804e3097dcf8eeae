"""Analysis kernels: Triton implementations, each with a plain-torch reference of the same semantics.

Importing this package imports neither torch nor triton (the analyser must run without them);
the public names below are loaded on first access. ``available()`` says whether the Triton
kernels can run here and, if not, why.

Modules:
    compute    the analyser's one entry: open_compute(device, backend) -> Compute | reason
               (imports torch when called; kvtrace.analyzer imports no torch itself)
    norms      per-token / per-head L2 norms of K or V             (torch)
    attention  entropy, LSE and received mass (H2O) from samples  (torch)
    mla        Gram matrix and spectrum of MLA latents              (torch)
    spectrum   spectral summary of a Gram matrix                    (numpy only)
    analyses   dead heads, entropy classes, eviction what-ifs       (numpy; torch only if given tensors)
    whatif     keep-set attention measures and quantisation error   (torch; Triton on CUDA)
    whatif_config  how the what-if kernels run (KernelConfig) and what
               a run replaced (KernelFallbacks)                     (no torch)
"""

from __future__ import annotations

import importlib
from typing import Any

from kvtrace.kernels._env import available, cuda_available, torch_available, triton_available

_LAZY = {
    "Compute": "compute",
    "open_compute": "compute",
    "HeadNorms": "norms",
    "head_norms": "norms",
    "head_norms_reference": "norms",
    "head_norms_triton": "norms",
    "AttentionStats": "attention",
    "attention_stats": "attention",
    "attention_stats_chunked": "attention",
    "attention_stats_reference": "attention",
    "attention_stats_triton": "attention",
    "received_attention": "attention",
    "latent_gram": "mla",
    "latent_gram_reference": "mla",
    "latent_gram_triton": "mla",
    "mla_spectrum": "mla",
    "MLASpectrum": "spectrum",
    "spectrum_from_eigenvalues": "spectrum",
    "spectrum_from_gram": "spectrum",
}

__all__ = ["available", "cuda_available", "torch_available", "triton_available", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'kvtrace.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"kvtrace.kernels.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
