"""A set of tensor-parallel rank traces read as one recording (spec §3.1: ``/meta parallel_json``).

Under tensor parallelism every rank records its own trace holding its shard of the KV heads of
every layer. This module groups rank traces by ``run_id``, checks that the set is whole (world
size agreed, every rank present once) and sums the ranks: KV heads per layer and KV bytes per
request, against the model's (kvtrace.geometry on the unsharded config, each head counted once
per rank that holds it). What it cannot reconcile is a finding of the ``rank_balance`` detector
(analyzer/detectors/rank_balance.py); each rank is still analysed on its own by the usual detectors,
which measure it against its shard of the model (:func:`shard_config`).

numpy, kvtrace.format and kvtrace.geometry only: no torch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtrace import geometry as geo
from kvtrace.format import schema

TP = "tensor_parallel"
# Config keys that count KV heads (per attention layer): divided by the shard ratio on a rank.
_KV_HEAD_KEYS = ("num_key_value_heads", "num_global_key_value_heads", "num_kv_heads", "multi_query_group_num")


def parallel_of(meta: Any) -> dict[str, Any] | None:
    """The decoded ``parallel_json`` of a trace's meta (a dict with a string ``mode``), else None."""
    extra = getattr(meta, "extra", None) or {}
    par = extra.get("parallel") if isinstance(extra, Mapping) else None
    if isinstance(par, Mapping) and isinstance(par.get("mode"), str):
        return dict(par)
    return None


def _int(par: Mapping[str, Any], key: str) -> int | None:
    v = par.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def shard_config(meta: Any) -> dict[str, Any]:
    """The model config a trace's /kv rows should be measured against: the recorded config, with its
    KV-head counts divided by ``kv_heads_total / kv_heads_local`` on a tensor-parallel rank (the
    rank holds that share of every layer's heads). Unchanged for anything else."""
    config = dict(meta.model_config or {})
    par = parallel_of(meta)
    if not config or par is None or par.get("mode") != TP:
        return config
    local, total = _int(par, "kv_heads_local"), _int(par, "kv_heads_total")
    if not local or not total or local >= total or total % local:
        return config  # replicated heads (fewer KV heads than ranks) or unknown: keep the model's
    ratio = total // local

    def shard(cfg: dict[str, Any]) -> dict[str, Any]:
        out = dict(cfg)
        heads = out.get("num_attention_heads")
        if "head_dim" not in out and isinstance(heads, int) and heads and isinstance(out.get("hidden_size"), int):
            out["head_dim"] = out["hidden_size"] // heads  # keep it: it is derived from the unsharded heads
        if not any(isinstance(out.get(k), int) for k in _KV_HEAD_KEYS) and isinstance(heads, int):
            out["num_key_value_heads"] = heads  # MHA: as many KV heads as query heads
        for key in (*_KV_HEAD_KEYS, "num_attention_heads"):  # query heads are split the same way
            v = out.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v >= ratio and v % ratio == 0:
                out[key] = v // ratio
        return out

    if isinstance(config.get("text_config"), Mapping) and config["text_config"]:
        config["text_config"] = shard(dict(config["text_config"]))
        return config
    return shard(config)


# ---- one rank ----------------------------------------------------------------------------------


@dataclass
class RankTrace:
    """What the rank-set checks read of one rank's trace."""

    path: str
    rank: int
    world_size: int | None
    run_id: str
    backend: str
    kv_heads_local: int | None  # as the recorder read it from the rank's key projection
    kv_heads_total: int | None
    kv_heads_recorded: int | None  # KV heads of the rank's /kv rows (median over layers that store KV)
    config: dict[str, Any]
    itemsize: int
    # per request id: (outcome name, final tokens, batch, KV bytes at the last step, peak KV bytes,
    # KV bytes still alive after the request)
    requests: dict[int, tuple[str, int, int, int, int, int]] = field(default_factory=dict)
    max_allocated_bytes: int | None = None  # allocator telemetry, all devices of the rank; None: not recorded
    devices: list[int] = field(default_factory=list)

    @property
    def peak_kv_bytes(self) -> int:
        return max((r[4] for r in self.requests.values()), default=0)

    @property
    def kv_alive_bytes(self) -> int:
        return sum(r[5] for r in self.requests.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "path": self.path, "world_size": self.world_size, "backend": self.backend or None,
            "kv_heads_per_layer": self.kv_heads_recorded, "kv_heads_local_meta": self.kv_heads_local,
            "peak_kv_bytes": self.peak_kv_bytes, "kv_alive_after_requests_bytes": self.kv_alive_bytes,
            "max_allocated_bytes": self.max_allocated_bytes, "requests": len(self.requests),
            "devices": self.devices,
        }


def rank_trace(trace: Any) -> RankTrace | None:
    """The rank summary of an open trace of a tensor-parallel rank trace, else None."""
    par = parallel_of(trace.meta)
    if par is None or par.get("mode") != TP or _int(par, "rank") is None:
        return None
    steps = trace.steps[:]
    retention = trace.retention[:]
    kv_head = trace.kv[:256]
    heads = None
    itemsize = 2
    if kv_head.size:
        stores = kv_head[kv_head["layer_type"] != int(schema.LayerType.SHARED_CONSUMER)]
        if stores.size:
            heads = int(np.median(stores["k_shape"][:, 1]))
            try:
                itemsize = schema.DTYPE_ITEMSIZE[schema.CacheDType(int(stores[0]["k_dtype"]))]
            except (ValueError, KeyError):
                pass
    out = RankTrace(
        path=str(trace.path), rank=int(par["rank"]), world_size=_int(par, "world_size"),
        run_id=str(par.get("run_id") or ""), backend=str(par.get("backend") or ""),
        kv_heads_local=_int(par, "kv_heads_local"), kv_heads_total=_int(par, "kv_heads_total"),
        kv_heads_recorded=heads, config=_bounded_config(trace), itemsize=itemsize,
    )
    for r in trace.requests[:]:
        rid = int(r["request"])
        s = steps[steps["request"] == rid]
        s = s[np.argsort(s["step"], kind="stable")]
        alive = retention[retention["request"] == rid]
        if alive.size:
            _, first = np.unique(np.stack([alive["device"].astype(np.int64), alive["storage"].astype(np.int64)], 1),
                                 axis=0, return_index=True)
            alive_bytes = int(alive["nbytes"][first].sum())
        else:
            alive_bytes = 0
        try:
            outcome = schema.Outcome(int(r["outcome"])).name.lower()
        except ValueError:
            outcome = "error"
        out.requests[rid] = (
            outcome, int(s["tokens_seen"][-1]) if s.size else 0, max(int(r["batch_size"]), 1),
            int(s["kv_bytes_unique"][-1]) if s.size else 0, int(s["kv_bytes_unique"].max()) if s.size else 0,
            alive_bytes,
        )
    alloc = trace.allocator[:]
    alloc = alloc[alloc["allocated_bytes"] >= 0] if alloc.size else alloc
    if alloc.size:
        out.max_allocated_bytes = int(alloc["allocated_bytes"].max())
    out.devices = sorted({int(d["device"]) for d in trace.devices[:]})
    return out


# ---- the set -----------------------------------------------------------------------------------


@dataclass
class RankSet:
    """The rank traces of one run, ordered by rank, with what is missing or contradictory."""

    run_id: str
    members: list[RankTrace]
    world_size: int | None
    problems: list[str] = field(default_factory=list)
    repeated: list[str] = field(default_factory=list)  # files given more than once (a command-line slip)
    claimed_twice: list[int] = field(default_factory=list)  # ranks two different files claim (forged or mixed up)

    @property
    def ranks(self) -> list[int]:
        return [m.rank for m in self.members]

    @property
    def missing(self) -> list[int]:
        if not self.world_size:
            return []
        have = set(self.ranks)
        return [r for r in range(self.world_size) if r not in have]

    @property
    def complete(self) -> bool:
        return not self.missing and not self.problems

    def rank_heads(self) -> tuple[int | None, int]:
        """(KV heads per layer of the model, heads one rank should hold) for this world size."""
        total = next((m.kv_heads_total for m in self.members if m.kv_heads_total), None)
        if total is None:
            total = model_kv_heads(self.members[0].config) if self.members else None
        tp = self.world_size or len(self.members)
        if not total:
            return None, 0
        return total, (1 if total < tp else math.ceil(total / tp))

    def model_kv_bytes(self, request: int) -> int | None:
        """The whole model's KV bytes at a request's last step (geometry, unsharded config): what
        the ranks' bytes add up to, each head counted once (replicated heads once per holder)."""
        first = next((m for m in self.members if request in m.requests), None)
        if first is None or not first.config:
            return None
        _, tokens, batch, _, _, _ = first.requests[request]
        try:
            g = geo.model_geometry(first.config)
        except (ValueError, TypeError, KeyError):
            return None
        total = 0
        for layer in g.layers:
            if layer.kind == "cross_attention":
                return None
            total += int(geo.layer_kv_bytes(layer, tokens, first.itemsize, batch)[0])
        heads, per_rank = self.rank_heads()
        tp = self.world_size or len(self.members)
        if heads and per_rank * tp > heads:  # heads replicated over ranks: each copy is held
            total = total * per_rank * tp // heads
        return total

    def to_dict(self) -> dict[str, Any]:
        heads, per_rank = self.rank_heads()
        reqs = sorted({r for m in self.members for r in m.requests})
        per_request = []
        for rid in reqs:
            got = {m.rank: m.requests[rid][3] for m in self.members if rid in m.requests}
            model = self.model_kv_bytes(rid)
            per_request.append({
                "request": rid, "final_kv_bytes_by_rank": {str(k): v for k, v in sorted(got.items())},
                "final_kv_bytes_sum": sum(got.values()), "model_kv_bytes": model,
                "adds_up": (sum(got.values()) == model) if model is not None and not self.missing else None,
            })
        recorded = [m.kv_heads_recorded for m in self.members]
        return {
            "run_id": self.run_id, "mode": TP, "world_size": self.world_size, "ranks_present": self.ranks,
            "missing_ranks": self.missing, "problems": list(self.problems),
            "model_kv_heads_per_layer": heads, "expected_kv_heads_per_rank": per_rank or None,
            "kv_heads_sum": sum(h for h in recorded if h) if all(recorded) else None,
            "ranks": [m.to_dict() for m in self.members], "requests": per_request,
        }


def model_kv_heads(config: Mapping[str, Any]) -> int | None:
    """KV heads per attention layer of the unsharded model (the largest over layers), or None."""
    try:
        g = geo.model_geometry(config)
    except (ValueError, TypeError, KeyError):
        return None
    heads = [layer.num_kv_heads for layer in g.layers if layer.stores_kv]
    return max(heads) if heads else None


def group(members: Sequence[RankTrace]) -> list[RankSet]:
    """Rank traces grouped by run_id (first-seen order), each set ordered by rank and checked."""
    by_run: dict[str, list[RankTrace]] = {}
    for m in members:
        by_run.setdefault(m.run_id, []).append(m)
    out = []
    for run_id, ms in by_run.items():
        ms = sorted(ms, key=lambda m: (m.rank, m.path))
        sizes = sorted({m.world_size for m in ms if m.world_size})
        problems = []
        if len(sizes) > 1:
            problems.append(f"the rank traces disagree on the world size ({', '.join(map(str, sizes))})")
        seen: dict[int, str] = {}
        kept = []
        repeated, claimed = [], []
        for m in ms:
            if m.rank in seen:
                problems.append(f"rank {m.rank} is given twice ({seen[m.rank]} and {m.path})")
                if _same_file(seen[m.rank], m.path):
                    repeated.append(m.path)
                else:
                    claimed.append(m.rank)
                continue
            seen[m.rank] = m.path
            kept.append(m)
        world = max(sizes) if sizes else None
        if world is not None:
            for m in kept:
                if m.rank >= world:
                    problems.append(f"{m.path} says rank {m.rank} of a world of {world}")
        out.append(RankSet(run_id, kept, world, problems, repeated, claimed))
    return out


def _bounded_config(trace: Any) -> dict[str, Any]:
    """The rank's model config, or {} when its sizes are out of bounds (the per-rank sums are then
    not checked; analyze and report refuse such a trace, info still summarises it)."""
    from kvtrace.geometry.bounds import config_problems

    config = trace.meta.model_config or {}
    return {} if config_problems(config) else dict(config)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def ranks_text(ranks: Sequence[int], limit: int = 16) -> str:
    """'2, 3, 5' for the lines that name ranks; past `limit` the rest is counted (a world may hold
    up to 2^16 ranks, spec §3.1: one line never lists them all)."""
    text = ", ".join(str(r) for r in ranks[:limit])
    return text + (f", ... ({len(ranks)} in all)" if len(ranks) > limit else "")


def missing_message(rs: RankSet) -> str | None:
    """One line naming the missing rank files of a set (None when it is whole)."""
    if not rs.missing:
        return None
    have = ", ".join(f"rank {m.rank} ({m.path})" for m in rs.members)
    miss = ranks_text(rs.missing)
    return (f"run {rs.run_id}: rank trace(s) {miss} of world size {rs.world_size} not given (have {have}); "
            "pass every rank's file, e.g. run.rank*.kvt.h5")
