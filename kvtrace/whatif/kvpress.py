"""What the what-if replay takes from NVIDIA kvpress 0.5.5 beyond the scoring formulas: which
layers a press acts on (sliding-window layers, per model), and the hand-off -- the kvpress press
(class and arguments) that reproduces a what-if policy at a ratio (``kvtrace whatif --emit
kvpress``), or why kvpress cannot.

Read from kvpress 0.5.5 (``kvpress/presses/base_press.py``: ``BasePress.__call__`` hooks every
attention layer of ``model.model.layers``, skipping the sliding-window layers of
``Gemma3ForConditionalGeneration`` only; the package requires ``transformers>=4.56.0,<5.3``).
Plain Python: no torch, no kvpress import.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["KVPRESS_VERSION", "SLIDING_MODES", "TRANSFORMERS_RANGE", "presses_sliding", "transformers_supported"]

KVPRESS_VERSION = "0.5.5"
TRANSFORMERS_RANGE = ((4, 56, 0), (5, 3, 0))  # kvpress 0.5.5: transformers>=4.56.0,<5.3
SLIDING_MODES = ("auto", "press", "keep")

# model_type values whose sliding-window layers kvpress leaves alone (Gemma3ForConditionalGeneration
# is the "gemma3" model type; Gemma3ForCausalLM, "gemma3_text", is hooked on every layer)
_KVPRESS_SKIPS_SLIDING = {"gemma3": "Gemma3ForConditionalGeneration"}


def presses_sliding(cfg: dict[str, Any] | None, mode: str = "auto") -> tuple[bool, str]:
    """(whether eviction presses sliding-window layers, why). ``mode`` auto: kvpress's choice for
    the model (``cfg`` is the model's config dict: its ``model_type``, else ``architectures``);
    press / keep: the user's."""
    if mode not in SLIDING_MODES:
        raise ValueError(f"sliding mode must be one of {', '.join(SLIDING_MODES)}, got {mode!r}")
    if mode == "press":
        return True, "--sliding press: sliding-window layers are pressed like full-attention ones"
    if mode == "keep":
        return False, "--sliding keep: sliding-window layers keep their window unpressed"
    cfg = cfg if isinstance(cfg, dict) else {}
    mtype = cfg.get("model_type") if isinstance(cfg.get("model_type"), str) else ""
    archs = [a for a in cfg.get("architectures") or [] if isinstance(a, str)]
    for t, arch in _KVPRESS_SKIPS_SLIDING.items():
        if mtype == t or arch in archs:
            return False, (f"kvpress {KVPRESS_VERSION} leaves the sliding-window layers of {arch} unpressed "
                           "(base_press.py): so does the replay")
    who = f"model type {mtype}" if mtype else "this model"
    return True, (f"kvpress {KVPRESS_VERSION} presses every attention layer of {who}, sliding-window ones included "
                  "(base_press.py): so does the replay")


def _version(text: str) -> tuple[int, int, int] | None:
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    return (int(m[1]), int(m[2]), int(m[3] or 0)) if m else None


def transformers_supported(version: str) -> tuple[bool, str]:
    """(whether kvpress 0.5.5 supports this transformers version, the reason when not)."""
    v = _version(version)
    lo, hi = TRANSFORMERS_RANGE
    rng = f"transformers>={'.'.join(map(str, lo))},<{hi[0]}.{hi[1]}"
    if v is None:
        return False, f"transformers version {version!r} is not a version kvpress {KVPRESS_VERSION} can be checked against ({rng})"
    if lo <= v < hi:
        return True, ""
    return False, f"kvpress {KVPRESS_VERSION} requires {rng}; this environment has transformers {version}"
