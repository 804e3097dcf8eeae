"""Agreement of two content analyses (``ContentsReport.to_dict()``): Triton on a GPU vs torch on CPU.

Tolerances are docs/kernels.md's GPU-vs-reference ones: entropy within 5e-4, mean norms within
rtol 2e-5, identical dead heads and eviction sizes, retained mass within 2e-3.
"""

from __future__ import annotations

import numpy as np


def contents_disagree(gpu: dict, cpu: dict) -> str | None:
    """None when the analyses agree, else the first disagreement in words."""
    try:
        assert gpu["backend"] == "triton/cuda" and cpu["backend"] == "torch/cpu", (gpu["backend"], cpu["backend"])
        assert gpu["entropy"], "no entropy rows"
        for a, b in zip(gpu["entropy"], cpu["entropy"], strict=True):
            assert (a["request"], a["layer"], a["queries_used"]) == (b["request"], b["layer"], b["queries_used"])
            np.testing.assert_allclose(a["mean_norm_entropy"], b["mean_norm_entropy"], atol=5e-4)
        for a, b in zip(gpu["dead_heads"], cpu["dead_heads"], strict=True):
            np.testing.assert_allclose(a["value_mean_norm"], b["value_mean_norm"], rtol=2e-5)
            np.testing.assert_allclose(a["key_mean_norm"], b["key_mean_norm"], rtol=2e-5)
            assert a["dead"] == b["dead"]
        for a, b in zip(gpu["eviction"], cpu["eviction"], strict=True):
            assert (a["policy"], a["kept"], a["bytes_freed"]) == (b["policy"], b["kept"], b["bytes_freed"])
            if a["mass_retained_mean"] is not None:
                assert abs(a["mass_retained_mean"] - b["mass_retained_mean"]) < 2e-3
    except (AssertionError, ValueError) as exc:  # zip(strict=True) raises ValueError on a length mismatch
        return str(exc) or type(exc).__name__
    return None
