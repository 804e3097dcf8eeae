"""The cross-layer KV-sharing rule (gemma3n / gemma4 ``num_kv_shared_layers``), once for the
config-dict reader (kvtrace.geometry) and the recorder (which reads a live transformers config)."""

from __future__ import annotations

from collections.abc import Sequence


def kv_sharing_map(
    n_layers: int,
    *,
    num_shared: int = 0,
    modes: Sequence[str | None] | None = None,
    types: Sequence[str] | None = None,
    strict: bool = False,
) -> dict[int, int]:
    """consumer layer -> producer layer.

    Consumers are the layers ``modes`` marks ``"reuse"`` (transformers >= 5.2x ``kv_sharing_modes``,
    used when it has one entry per layer), else the last ``num_shared`` layers. A consumer reads the
    last layer before the first consumer with its own layer type (any type when ``types`` is empty).
    ``strict`` raises ValueError where no producer exists; otherwise such a consumer is left out.
    """
    if modes is not None and len(modes) == n_layers:
        consumers = [i for i, m in enumerate(modes) if m == "reuse"]
    else:
        num_shared = int(num_shared or 0)
        if num_shared <= 0:
            return {}
        if num_shared >= n_layers:
            if strict:
                raise ValueError(f"num_kv_shared_layers={num_shared} leaves no producer layer among {n_layers}")
            return {}
        consumers = list(range(n_layers - num_shared, n_layers))
    if not consumers:
        return {}
    first = min(consumers)
    taken = set(consumers)
    typed = bool(types) and len(types or ()) == n_layers
    out: dict[int, int] = {}
    for c in consumers:
        kind = types[c] if typed else None  # type: ignore[index]
        producer = next((p for p in range(first - 1, -1, -1)
                         if p not in taken and (kind is None or types[p] == kind)), None)  # type: ignore[index]
        if producer is not None:
            out[c] = producer
        elif strict:
            raise ValueError(f"shared layer {c} ({kind}) has no producer of the same type")
    return out
