"""Whether a content-sampling selection (layers, KV heads) matches anything in a model: one rule for
the CLI (checked before the model loads) and the Python API (checked before recording starts). A
selection matching nothing would store no payloads in a trace that says it holds tensor contents."""

from __future__ import annotations

from typing import Any

from kvtrace.geometry.config import model_geometry, text_config
from kvtrace.geometry.model import LayerGeometry


def selection_problem(config: dict[str, Any], layers: list[int] | None,
                      heads: list[int] | None) -> tuple[str, str] | None:
    """(message, which option) when the selection cannot store anything; None when it can, or when
    the config says too little to tell."""
    if layers is None and heads is None:
        return None
    try:
        geo = model_geometry(config).layers
    except (ValueError, KeyError, TypeError):  # a model type geometry does not know: counts only
        text = text_config(config)
        n = text.get("num_hidden_layers")
        kv = text.get("num_key_value_heads") or text.get("num_attention_heads")
        if not isinstance(n, int) or not isinstance(kv, int):
            return None
        geo = [LayerGeometry(i, "full", "full", kv, 0, 0) for i in range(n)]
    if layers is not None:
        bad = [i for i in layers if not 0 <= i < len(geo)]
        if bad:
            return (f"layer(s) {', '.join(map(str, bad))} out of range: the model has {len(geo)} layers "
                    f"(0..{len(geo) - 1})", "layers")
    chosen = [g for g in geo if (layers is None or g.index in layers) and g.stores_kv]
    if not chosen:
        return "the selected layers reuse other layers' KV and own no cache to sample", "layers"
    if heads is not None:
        per_head = [g for g in chosen if g.kind != "latent"]
        if not per_head:
            return "MLA layers cache one latent shared by every head: no head to select", "heads"
        most = max(g.num_kv_heads for g in per_head)
        bad = [h for h in heads if not 0 <= h < most]
        if bad:
            return (f"KV head(s) {', '.join(map(str, bad))} out of range: the sampled layers have at most "
                    f"{most} KV heads (0..{most - 1})", "heads")
    return None
