"""How a model is named on the command line (``record --model``, ``serve MODEL``, ``whatif --rerun``,
``calc`` reading a trace, kvtrace.loading): ``preset:NAME``, a built-in geometry with random weights
(kvtrace/presets.py), or else a local model directory or a Hugging Face hub id in the local cache,
which kvtrace.loading tells apart. This module reads the preset form and expands ``--tiny``; it
imports nothing heavy (the presets only when --tiny is expanded)."""

from __future__ import annotations

PRESET = "preset:"


def preset_name(spec: str) -> str | None:
    """NAME of ``preset:NAME`` (as written: the presets module resolves aliases and reports an unknown
    name); None for anything else (a directory or a hub id)."""
    return spec[len(PRESET):] if spec.startswith(PRESET) else None


def tiny_shrink(name: str, layers: int | None = None, width: float | None = None,
                vocab: int | None = None) -> tuple[int | None, float | None, int | None]:
    """``--tiny`` for preset NAME: its CPU-sized (layers, width scale, vocab), each value given
    explicitly (``--layers`` ...) kept. KeyError, naming the presets, for an unknown NAME."""
    from kvtrace import presets

    small = presets.tiny_shrink_args(name)
    return (small["layers"] if layers is None else layers,
            small["width_scale"] if width is None else width,
            small["vocab"] if vocab is None else vocab)
