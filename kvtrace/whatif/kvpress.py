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

__all__ = ["KVPRESS_VERSION", "SLIDING_MODES", "TRANSFORMERS_RANGE", "press_for", "presses_sliding",
           "transformers_supported"]

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


# ------------------------------------------------------------------------------------- hand-off

# what-if policy -> (kvpress class, module under kvpress.presses, {our parameter: kvpress argument})
_PRESSES: dict[str, tuple[str, str, dict[str, str]]] = {
    "knorm": ("KnormPress", "knorm_press", {}),
    "keydiff": ("KeyDiffPress", "keydiff_press", {}),
    "random": ("RandomPress", "random_press", {"seed": "seed"}),
    "streaming_llm": ("StreamingLLMPress", "streaming_llm_press", {"n_sink": "n_sink"}),
    "observed_attention": ("ObservedAttentionPress", "observed_attention_press", {}),
    "tova": ("TOVAPress", "tova_press", {}),
    "snapkv": ("SnapKVPress", "snapkv_press", {"window_size": "window_size", "kernel_size": "kernel_size"}),
    "expected_attention": ("ExpectedAttentionPress", "expected_attention_press",
                           {"n_sink": "n_sink", "use_covariance": "use_covariance", "use_vnorm": "use_vnorm",
                            "epsilon": "epsilon"}),
}

# where the press does not do what the what-if policy measured (docs/whatif.md has the whole list)
_DIFFERS: dict[str, str] = {
    "random": "kvpress draws with torch's generator, kvtrace with numpy's: the same seed keeps other tokens",
    "streaming_llm": ("below a budget of n_sink kvpress keeps n of its sinks (topk's tie order); kvtrace kept all "
                      "n_sink sinks, over budget"),
    "observed_attention": ('needs attn_implementation="eager" (the press asserts the attention matrix); offline '
                           "here it is scored with the sampled queries only"),
    "tova": "kvpress scores with the newest position's query; offline kvtrace with the newest sampled one",
    "snapkv": ("kvpress's window is every one of the last window_size queries; offline kvtrace used the sampled "
               "ones among them (window_queries in each row)"),
    "expected_attention": ("kvtrace's offline version is a stand-in (statistics of sampled post-RoPE queries); "
                           "the press uses the pre-RoPE prefill queries rotated over n_future_positions=512"),
}

_NO_PRESS: dict[str, str] = {
    "paging": "paging is a memory layout (pages of page_size tokens), not an eviction: kvpress has no press for it",
    "kivi": "kvpress has no KIVI press (a quantised cache, not an eviction)",
    "quanto": "kvpress has no quantisation press; transformers' QuantizedCache is that cache (kvpress presses work "
              "on it): cache_implementation=\"quantized\" with the cache_config below",
    "hqq": "kvpress has no quantisation press; transformers' QuantizedCache is that cache (kvpress presses work on "
           "it): cache_implementation=\"quantized\" with the cache_config below",
    "fp8": "kvpress has no fp8 press (a cast of K and V, not an eviction)",
}


def press_for(policy: Any, ratio: float | None, cfg: dict[str, Any] | None = None, sliding: str = "auto",
              transformers_version: str | None = None) -> dict[str, Any]:
    """The kvpress 0.5.5 press reproducing ``policy`` at ``ratio``: ``available`` and then
    ``press`` (class), ``module``, ``kwargs``, ``code``; else ``reason``. ``differs``: what the
    press does otherwise than the what-if measured; ``runs_here``: whether kvpress supports the
    given transformers version (``runs_here_reason`` if not); ``sliding``: how the press treats
    sliding-window layers of the model ``cfg`` against the what-if's ``sliding`` mode."""
    name = policy.name
    params = policy.params()
    out: dict[str, Any] = {"policy": name, "label": policy.label(), "ratio": ratio, "kvpress": KVPRESS_VERSION}
    if name == "streaming_llm" and params.get("window"):
        out.update(available=False, reason=(f"streaming_llm with window={params['window']} keeps n_sink + window "
                                            "tokens whatever the length; kvpress's StreamingLLMPress keeps a ratio of "
                                            "the prefill (StreamingLLMPress(compression_ratio=1 - (n_sink + window) / "
                                            "T, n_sink=...) for a known length T)"))
    elif name in _PRESSES:
        cls, module, names = _PRESSES[name]
        kwargs: dict[str, Any] = {"compression_ratio": float(ratio or 0.0)}
        kwargs.update({theirs: params[ours] for ours, theirs in names.items()})
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        out.update(available=True, press=cls, module=f"kvpress.presses.{module}", kwargs=kwargs,
                   code=f"from kvpress import {cls}\npress = {cls}({args})\nwith press(model):\n"
                        "    model(input_ids, past_key_values=cache)  # the prefill is pressed")
        if name in _DIFFERS:
            out["differs"] = [_DIFFERS[name]]
    else:
        out.update(available=False, reason=_NO_PRESS.get(name, f"kvpress {KVPRESS_VERSION} has no press for {name}"))
        if name in ("quanto", "hqq"):
            out["cache_config"] = {"backend": name, "nbits": params["nbits"], "q_group_size": params["q_group_size"],
                                   "residual_length": params["residual_length"]}
    if transformers_version is None:
        try:
            import importlib.metadata as md

            transformers_version = md.version("transformers")
        except Exception:  # noqa: BLE001 - not installed: the hand-off still prints
            transformers_version = ""
    if transformers_version:
        ok, why = transformers_supported(transformers_version)
        out["transformers"] = transformers_version
        out["runs_here"] = ok
        if not ok:
            out["runs_here_reason"] = why + (": run the press in its own environment (pip install --target DIR "
                                             f"kvpress=={KVPRESS_VERSION} 'transformers<5.3')")
    if out.get("available") and cfg:
        kvp, why = presses_sliding(cfg, "auto")
        mine, _ = presses_sliding(cfg, sliding)
        note = why.replace(": so does the replay", "")
        if kvp != mine:
            out.setdefault("differs", []).append(f"{note}; the what-if ran with --sliding {sliding}")
        out["sliding"] = note
    return out
