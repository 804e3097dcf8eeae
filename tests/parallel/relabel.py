"""Turn a copy of a one-process trace into a tensor-parallel rank trace (its /meta parallel_json
only): synthetic rank sets for examples and format-level tests. Its /kv rows still hold the whole
model's heads, so rank_balance reports kv_heads_mismatch on such sets: they test plumbing, not
the sharding (tests/parallel/test_tp_gloo.py records a real tensor-parallel run)."""

from __future__ import annotations

import json
from pathlib import Path

import h5py


def relabel_as_rank(path: Path, rank: int, world_size: int, run_id: str) -> Path:
    with h5py.File(path, "r+") as f:
        f["meta"].attrs["parallel_json"] = json.dumps(
            {"mode": "tensor_parallel", "rank": rank, "world_size": world_size, "local_rank": rank,
             "backend": "gloo", "run_id": run_id}, sort_keys=True)
    return path
