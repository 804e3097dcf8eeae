"""rank_balance on synthetic rank sets (RankTrace summaries built directly, no files): each finding
planted beside a balanced control."""

from __future__ import annotations

from kvtrace.analyzer.detectors.rank_balance import RankBalance
from kvtrace.analyzer.ranks import RankTrace, group, shard_config

CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
          "num_key_value_heads": 4, "head_dim": 8, "intermediate_size": 128, "vocab_size": 256}
# 13 tokens x 2 layers x (K+V) x heads x 8 dims x 4 B (float32): 1664 B per KV head
PER_HEAD = 13 * 2 * 2 * 8 * 4


def member(rank, *, world=2, heads=2, kv=None, outcome="ok", alive=0, alloc=None, run="r", config=CONFIG):
    kv = PER_HEAD * heads if kv is None else kv
    m = RankTrace(path=f"run.rank{rank}.kvt.h5", rank=rank, world_size=world, run_id=run, backend="gloo",
                  kv_heads_local=heads, kv_heads_total=4, kv_heads_recorded=heads, config=config, itemsize=4)
    m.requests[0] = (outcome, 13, 1, kv, kv, alive)
    m.max_allocated_bytes = alloc
    return m


def kinds(members):
    (rs,) = group(members)
    return {f.kind: f for f in RankBalance().run_set(rs)}, rs


def test_balanced_control():
    found, rs = kinds([member(0), member(1)])
    assert list(found) == ["balanced"] and found["balanced"].score == 0.0
    d = rs.to_dict()
    assert d["requests"][0]["adds_up"] is True and d["requests"][0]["model_kv_bytes"] == 4 * PER_HEAD


def test_kv_imbalance_names_both_ranks():
    found, _ = kinds([member(0), member(1, kv=PER_HEAD * 4)])
    f = found["kv_imbalance"]
    assert f.ranks == [0, 1] and f.score >= 0.5 and "rank 1 holds" in f.message
    assert "kv_bytes_mismatch" in found  # and the sum is no longer the model's


def test_heads_mismatch():
    found, _ = kinds([member(0), member(1, heads=4)])
    assert found["kv_heads_mismatch"].ranks == [1]


def test_rank_oom_is_attributed():
    found, _ = kinds([member(0), member(1, outcome="oom")])
    f = found["rank_outcome"]
    assert f.ranks == [1] and f.score == 1.0 and "rank 1 oom" in f.message


def test_memory_imbalance_names_the_fuller_rank():
    found, _ = kinds([member(0, alloc=10 << 30), member(1, alloc=20 << 30)])
    f = found["memory_imbalance"]
    assert f.ranks == [1] and f.score > 0.5


def test_duplicate_rank_and_world_disagreement():
    found, rs = kinds([member(0), member(0), member(1, world=3)])
    assert found["inconsistent_ranks"].score == 1.0
    assert any("given twice" in p for p in rs.problems) and any("world size" in p for p in rs.problems)


def test_replicated_heads_add_up_per_copy():
    """4 ranks, 2 KV heads: each rank keeps 1 head, every head on 2 ranks; the sum counts each copy."""
    cfg = {**CONFIG, "num_key_value_heads": 2}
    ms = [member(r, world=4, heads=1, config=cfg) for r in range(4)]
    for m in ms:
        m.kv_heads_total = 2
    found, rs = kinds(ms)
    assert list(found) == ["balanced"]
    assert rs.to_dict()["requests"][0]["model_kv_bytes"] == 4 * PER_HEAD


def test_runs_are_kept_apart():
    sets = group([member(0, run="a"), member(1, run="b"), member(1, run="a")])
    assert [(s.run_id, s.ranks) for s in sets] == [("a", [0, 1]), ("b", [1])]


class _Meta:
    def __init__(self, config, parallel):
        self.model_config = config
        self.extra = {"parallel": parallel} if parallel else {}


def test_shard_config_divides_kv_and_query_heads_keeps_head_dim():
    mha = {"model_type": "gpt_neox", "hidden_size": 64, "num_attention_heads": 4}
    out = shard_config(_Meta(mha, {"mode": "tensor_parallel", "kv_heads_local": 2, "kv_heads_total": 4}))
    assert out["num_key_value_heads"] == 2 and out["num_attention_heads"] == 2 and out["head_dim"] == 16
    assert shard_config(_Meta(mha, None)) == mha
    assert shard_config(_Meta(mha, {"mode": "device_map"})) == mha
    nested = {"model_type": "x", "text_config": dict(CONFIG)}
    out = shard_config(_Meta(nested, {"mode": "tensor_parallel", "kv_heads_local": 1, "kv_heads_total": 4}))
    assert out["text_config"]["num_key_value_heads"] == 1 and out["text_config"]["num_attention_heads"] == 2
