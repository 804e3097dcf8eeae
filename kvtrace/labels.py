"""Names printed for format codes: layer types and devices, one spelling everywhere.

A leaf module over kvtrace.format.schema (no torch): the recorder, the analyser, the renderers and
the commands all import it, so it sits beside the format rather than in any one of them.
"""

from __future__ import annotations

from kvtrace.format import schema


def layer_type_name(code: int) -> str:
    """'full', 'sliding', ... for a /layers or /kv layer_type code; 'type_N' for a code this
    version does not know (a newer recorder's), never an error."""
    try:
        return schema.LayerType(int(code)).name.lower()
    except ValueError:
        return f"type_{int(code)}"


def device_where(index: int) -> str:
    """'cuda:0', or 'cpu' for the format's device -1 (any negative index)."""
    return "cpu" if int(index) < 0 else f"cuda:{int(index)}"


def device_text(index: int, name: str = "") -> str:
    """'cuda:0 NVIDIA H100 80GB HBM3', 'cpu' (not 'cpu cpu' nor '-1: cpu': a CPU's recorded name
    is "cpu")."""
    where = device_where(index)
    name = name.strip()
    return where if name.lower() in ("", where) else f"{where} {name}"
