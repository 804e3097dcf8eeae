"""How the recorded model is spread over devices and processes (``/meta parallel_json``, spec §3.1).

Two shapes of a model too large for one GPU, as transformers builds them:

* **device_map** (one process): ``from_pretrained(device_map=...)`` / accelerate's
  ``dispatch_model`` put layers on several devices, offloaded ones included; the model carries the
  placement as ``hf_device_map``. The /kv rows already carry each layer's device; the map is kept
  so that offloaded modules (weights on ``meta``/``disk``, executed elsewhere) stay visible.
* **tensor_parallel** (one process per rank, ``tp_plan="auto"`` under torchrun): every rank holds
  its share of the KV heads of every layer. Each rank records its own trace, so the output path is
  templated by rank (``run.kvt.h5`` -> ``run.rank1.kvt.h5``, or ``{rank}`` where the caller put it)
  and every rank's trace carries the same ``run_id``.

``run_id`` comes from ``KVTRACE_RUN_ID``, else torchrun's ``TORCHELASTIC_RUN_ID``, else rank 0
draws one and broadcasts it. That broadcast is a collective: under torch.distributed without
either variable, every rank of the group must start its recording (they all do in the intended
use, each recording its own shard).
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path
from typing import Any

import torch

RUN_ID_ENV = "KVTRACE_RUN_ID"
_SUFFIXES = (".kvt.h5", ".h5", ".hdf5")
_KV_PROJ = ("k_proj", "key", "k")  # names of the key projection in transformers attention modules


def distributed() -> tuple[int, int] | None:
    """(rank, world size) of an initialised torch.distributed group of two or more; else None."""
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    world = int(dist.get_world_size())
    return (int(dist.get_rank()), world) if world > 1 else None


def rank_path(path: str | os.PathLike[str], rank: int | None = None) -> str:
    """The trace path of this rank: ``{rank}`` in the path is replaced; otherwise ``.rank{rank}`` goes
    before the suffix (``run.kvt.h5`` -> ``run.rank0.kvt.h5``). Unchanged outside torch.distributed,
    so that ranks never write one file."""
    text = os.fspath(path)
    if rank is None:
        d = distributed()
        if d is None:
            return text
        rank = d[0]
    if "{rank}" in text:
        return text.replace("{rank}", str(rank))
    p = Path(text)
    name = p.name
    if re.search(r"\.rank\d+(\.|$)", name):  # already templated by the caller
        return text
    for suffix in _SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return str(p.with_name(f"{name[: -len(suffix)]}.rank{rank}{suffix}"))
    return str(p.with_name(f"{name}.rank{rank}"))


def describe(model: torch.nn.Module) -> dict[str, Any] | None:
    """The ``parallel_json`` object for ``model`` (tensor parallel wins over a device map), or None
    for a model in one piece on one device in one process."""
    tp = _tensor_parallel(model)
    if tp is not None:
        return tp
    return _device_map(model)


# ---- tensor parallel ----------------------------------------------------------------------------


def _tensor_parallel(model: torch.nn.Module) -> dict[str, Any] | None:
    d = distributed()
    tp_size = getattr(model, "tp_size", None) or getattr(model, "_tp_size", None)
    if d is None or not isinstance(tp_size, int) or tp_size < 2:
        return None
    import torch.distributed as dist

    rank, world = d
    proj = _key_projection(model)
    mesh = getattr(getattr(proj, "weight", None), "device_mesh", None)
    if mesh is not None and mesh.size() == tp_size:  # the TP group may be a sub-mesh (TP x DP)
        rank = int(mesh.get_local_rank())
    out: dict[str, Any] = {
        "mode": "tensor_parallel",
        "world_size": int(tp_size),
        "rank": rank,
        "local_rank": int(os.environ.get("LOCAL_RANK", rank)),
        "backend": str(dist.get_backend()),
        "run_id": _run_id(),
    }
    if tp_size != world:
        out["process_group_size"] = world
    plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
    if isinstance(plan, dict):
        out["tp_plan"] = {str(k): str(v) for k, v in plan.items()}
    total = _config_kv_heads(model)
    if total:
        out["kv_heads_total"] = total
    local = _local_kv_heads(model, proj)
    if local:
        out["kv_heads_local"] = local
    elif total and total % tp_size == 0:
        out["kv_heads_local"] = total // tp_size
    hf_map = getattr(model, "hf_device_map", None)
    if isinstance(hf_map, dict) and hf_map:
        out["device_map"] = _placements(hf_map)
    return out


def _run_id() -> str:
    for var in (RUN_ID_ENV, "TORCHELASTIC_RUN_ID"):
        value = os.environ.get(var, "").strip()
        if value and value.lower() != "none":
            return value[:128]
    import torch.distributed as dist

    box = [secrets.token_hex(8) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)  # collective: every rank starts its recording
    return str(box[0])


def _text_config(model: torch.nn.Module) -> Any:
    cfg = getattr(model, "config", None)
    get = getattr(cfg, "get_text_config", None)
    return get() if callable(get) else cfg


def _config_kv_heads(model: torch.nn.Module) -> int | None:
    cfg = _text_config(model)
    heads = getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_attention_heads", None)
    return int(heads) if isinstance(heads, int) and heads > 0 else None


def _head_dim(model: torch.nn.Module) -> int | None:
    cfg = _text_config(model)
    dim = getattr(cfg, "head_dim", None)
    if isinstance(dim, int) and dim > 0:
        return dim
    hidden, heads = getattr(cfg, "hidden_size", None), getattr(cfg, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def _key_projection(model: torch.nn.Module) -> torch.nn.Module | None:
    """The key projection of the first attention module that has one (``layer_idx`` marks them)."""
    for module in model.modules():
        if getattr(module, "layer_idx", None) is None:
            continue
        for name in _KV_PROJ:
            proj = getattr(module, name, None)
            if isinstance(proj, torch.nn.Linear):
                return proj
    return None


def _local_kv_heads(model: torch.nn.Module, proj: torch.nn.Module | None) -> int | None:
    """KV heads this rank's key projection produces: its local output rows / head_dim."""
    weight = getattr(proj, "weight", None)
    dim = _head_dim(model)
    if weight is None or not dim:
        return None
    local = weight.to_local() if hasattr(weight, "to_local") else weight  # DTensor: this rank's shard
    rows = int(local.shape[0])
    return rows // dim if rows % dim == 0 and rows >= dim else None


# ---- device map ---------------------------------------------------------------------------------


def _placements(hf_map: dict[str, Any]) -> dict[str, str]:
    """hf_device_map values as text: an int is a CUDA ordinal ("cuda:1"); "cpu"/"disk"/"meta" stay."""
    out: dict[str, str] = {}
    for name, place in hf_map.items():
        if isinstance(place, int) and not isinstance(place, bool):
            out[str(name)] = f"cuda:{place}"
        elif isinstance(place, torch.device):
            out[str(name)] = str(place) if place.index is not None or place.type == "cpu" else f"{place.type}:0"
        else:
            out[str(name)] = str(place)
    return out


def _device_map(model: torch.nn.Module) -> dict[str, Any] | None:
    hf_map = getattr(model, "hf_device_map", None)
    if not isinstance(hf_map, dict) or not hf_map:
        return None
    placements = _placements(hf_map)
    if len(set(placements.values())) < 2:
        return None  # everything on one device: one piece, nothing to describe
    return {"mode": "device_map", "device_map": placements}
