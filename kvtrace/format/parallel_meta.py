"""The rules of ``/meta parallel_json`` (spec §3.1): what opening a trace checks, so that no consumer
(info, the rank sets of analyze/report/calc/diff, shard_config) meets a rank outside its world, a
world of 10^12 ranks or a device map that is not a map. Unknown keys are allowed (a newer minor
may add them); unknown modes too, in a trace of a newer minor (a new mode is like a new code)."""

from __future__ import annotations

from typing import Any

MODES = ("device_map", "tensor_parallel")
# key -> (smallest, largest) valid value. The largest are above any machine built: a tensor-parallel
# group lives in one NVLink domain (72 GPUs in the largest racks sold), a host holds a few dozen GPUs,
# a model's KV heads per layer are at most a few hundred, the largest clusters hold ~10^5 GPUs. A
# larger value is damage; a consumer that lists the missing ranks of a world of 10^12 would not finish.
INTS = {"world_size": (1, 1 << 16), "rank": (0, 1 << 16), "local_rank": (0, 1 << 16),
        "kv_heads_local": (1, 1 << 16), "kv_heads_total": (1, 1 << 16), "process_group_size": (1, 1 << 24)}
MAX_STRING = 256  # run_id, backend: the recorder writes at most 128 characters
STRINGS = ("backend", "run_id")
MAPS = ("tp_plan", "device_map")  # name -> string


def parallel_problems(par: Any, *, newer_minor: bool = False) -> list[str]:
    """Every way ``par`` (the decoded parallel_json) breaks spec §3.1, one line each."""
    where = "/meta parallel_json"
    if not isinstance(par, dict):
        return [f"{where} must hold a JSON object (holds {type(par).__name__})"]
    out = []
    mode = par.get("mode")
    if not isinstance(mode, str):
        out.append(f"{where} lacks 'mode' (a string: {', '.join(MODES)})")
    elif mode not in MODES and not newer_minor:
        out.append(f"{where} mode {mode[:40]!r} is not one of {', '.join(MODES)}")
    ints = {}
    for key, (low, high) in INTS.items():
        if key not in par:
            continue
        v = par[key]
        if isinstance(v, bool) or not isinstance(v, int):
            out.append(f"{where} {key} must be an integer")
        elif not low <= v <= high:
            out.append(f"{where} {key} {_short(v)} is not in [{low}, {high}]")
        else:
            ints[key] = v
    if "rank" in ints and "world_size" in ints and ints["rank"] >= ints["world_size"]:
        out.append(f"{where} rank {ints['rank']} is not below world_size {ints['world_size']}")
    if "kv_heads_local" in ints and "kv_heads_total" in ints and ints["kv_heads_local"] > ints["kv_heads_total"]:
        out.append(f"{where} kv_heads_local {ints['kv_heads_local']} exceeds kv_heads_total {ints['kv_heads_total']}")
    for key in STRINGS:
        if key in par and not (isinstance(par[key], str) and len(par[key]) <= MAX_STRING):
            out.append(f"{where} {key} must be a string of at most {MAX_STRING} characters")
    for key in MAPS:
        if key in par and not (isinstance(par[key], dict) and all(isinstance(v, str) for v in par[key].values())):
            out.append(f"{where} {key} must be an object of strings (module -> {'device' if key == 'device_map' else 'style'})")
    return out


def _short(v: int) -> str:
    text = str(v)
    return text if len(text) <= 24 else f"{text[:12]}...({len(text)} digits)"
