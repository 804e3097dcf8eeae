"""Prove the transformers 5.17 paged-cache adapter (kvtrace/recorder/serving_v517.py): record
continuous batching with the installed transformers 5.17 and check that at every recorded scheduler
step the /sched, /sched_groups and /blocks rows equal the cache's own counters, read by a probe
that wraps ``prepare_next_batch`` beneath the recorder (the same state both see).

The cache's terms in 5.17: ``num_blocks``, ``key_cache``/``value_cache`` tensors (the pool's bytes
are their bytes without the two trash blocks), ``_block_manager`` (uninitialised = free,
initialised = cached, ``get_num_free_blocks()`` = both), ``group_cache_managers[i].block_table`` and
``blocks_in_use(request_id)``.

Standalone (no pytest), so that it runs where 5.17 is the installed transformers:

    python tests/recorder/serving_v517_check.py                # CPU
    python tests/recorder/serving_v517_check.py --device cuda  # GPU machine; adds CPU-offload and async cases

and here through tests/recorder/test_serving_v517.py with ``PYTHONPATH=/tmp/tf517``. Prints one line
per scenario and exits 0, 1 on a mismatch (AssertionError), 2 when transformers is not 5.17.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


class Probe:
    def __init__(self) -> None:
        from transformers.generation.continuous_batching import continuous_api

        self.cls = continuous_api.ContinuousBatchProcessor
        self.original = self.cls.__dict__["prepare_next_batch"]
        self.steps: list[dict[str, Any]] = []
        probe = self

        def prepare(processor: Any, *args: Any, **kwargs: Any) -> Any:
            found = probe.original(processor, *args, **kwargs)
            if found:
                probe.steps.append(probe.read(processor))
            return found

        self.cls.prepare_next_batch = prepare  # installed before the recorder: it wraps this

    def close(self) -> None:
        self.cls.prepare_next_batch = self.original

    @staticmethod
    def read(processor: Any) -> dict[str, Any]:
        cache = processor.cache
        bm = cache._block_manager
        n = int(cache.num_blocks)
        tensor_bytes = sum(t.numel() * t.element_size() for t in (*cache.key_cache, *cache.value_cache))
        block_bytes = tensor_bytes // (n + 2)  # the tensors hold num_blocks + 2 (trash) blocks
        groups = {}
        for cm in cache.group_cache_managers:
            groups[cm._index] = {
                "tables": {rid: len(b) for rid, b in cm.block_table.items()},
                "distinct": len({b for blocks in cm.block_table.values() for b in blocks}),
                "cached": sum(1 for b in bm._init_block_ids if bm._id_to_block[b].group_id == cm._index),
                "window": getattr(cm, "sliding_window", -1)}
        active = processor.scheduler.active_requests
        return {"pool": n * block_bytes, "block_bytes": block_bytes, "free_blocks": len(bm._uninit_block_ids),
                "num_free": cache.get_num_free_blocks(), "cached": len(bm._init_block_ids),
                "positions": {rid: s.position_offset for rid, s in active.items()},
                "in_use": {rid: cache.blocks_in_use(rid) for rid in active},
                "waiting": len(processor.scheduler.waiting_requests), "groups": groups}


def check(path: Path, probe: Probe) -> int:
    """Every row against the probe's reading of its step; returns the number of steps checked."""
    from kvtrace.format.reader import open_trace
    from kvtrace.format.validate import validate

    with open_trace(path) as t:
        sched, groups, blocks, reqs = t.sched[:], t.sched_groups[:], t.blocks[:], t.requests[:]
        cb_of = {int(r["request"]): json.loads(t.text(r["gen_args_off"], r["gen_args_len"]))["cb_request_id"]
                 for r in reqs}
    assert sched.size == len(probe.steps) > 0, (sched.size, len(probe.steps))
    for row, live in zip(sched, probe.steps, strict=True):
        step = int(row["step"])
        bb = live["block_bytes"]
        assert int(row["pool_bytes"]) == live["pool"], (step, int(row["pool_bytes"]), live["pool"])
        assert int(row["free_bytes"]) == live["free_blocks"] * bb
        # get_num_free_blocks counts cached blocks as free (it reclaims them on demand)
        assert int(row["free_bytes"]) + int(row["blocks_cached"]) * bb == live["num_free"] * bb
        assert int(row["blocks_cached"]) == live["cached"]
        assert int(row["running"]) == len(live["positions"]) and int(row["waiting"]) == live["waiting"]
        mine = groups[groups["step"] == step]
        assert sorted(mine["group"].tolist()) == sorted(live["groups"])
        used = 0
        per_request: dict[str, int] = {}
        for g in mine:
            lg = live["groups"][int(g["group"])]
            assert (int(g["blocks_in_use"]), int(g["blocks_cached"])) == (lg["distinct"], lg["cached"]), step
            assert int(g["bytes_per_block"]) == bb and int(g["blocks_free"]) == -1
            used += (int(g["blocks_in_use"]) + int(g["blocks_cached"])) * bb
            rows = blocks[(blocks["step"] == step) & (blocks["group"] == g["group"])]
            got = {cb_of[int(b["request"])]: int(b["blocks"]) for b in rows}
            assert got == {rid: k for rid, k in lg["tables"].items() if k}, (step, got, lg["tables"])
            for b in rows:
                cb = cb_of[int(b["request"])]
                per_request[cb] = per_request.get(cb, 0) + int(b["blocks"])
                pos = live["positions"][cb]
                assert int(b["tokens_valid"]) == (min(pos, lg["window"]) if lg["window"] > 0 else pos)
        assert per_request == {rid: k for rid, k in live["in_use"].items() if k}  # cache.blocks_in_use(rid)
        assert int(row["pool_bytes"]) - int(row["free_bytes"]) == used, step
    report = validate(path)
    assert report.valid, report.problems
    return int(sched.size)


def run(name: str, device: str, work: Path, body: Any) -> dict[str, Any]:
    import kvtrace
    from kvtrace.format.reader import open_trace
    from tests.helpers.models import tiny_model

    model = tiny_model("gemma3_text" if name == "gemma3" else "llama").to(device)
    probe = Probe()
    path = work / f"{name}.kvt.h5"
    try:
        with kvtrace.record(model, path) as rec:
            body(model)
    finally:
        probe.close()
    assert rec.recorder_errors == 0, rec.errors
    steps = check(path, probe)
    with open_trace(path) as t:
        kinds = {k.name.lower(): int(len(t.events.where(kind=k))) for k in _kinds()}
        readings, pool = t.readings[:], int(t.sched[:]["pool_bytes"].max())
        first = sorted(int(s) for s in t.events.where(kind=_kinds()[1])["step"])
    # the manager's loop: BASELINE before it builds the pool, AFTER_RETURN after its last step (pool held)
    labels = readings["label"][readings["request"] == -1].tolist()
    assert labels[0] == 1 and labels[-1] == 3, labels
    if device.startswith("cuda"):
        base = readings[readings["label"] == 1]["allocated_bytes"][0]
        after = readings[readings["label"] == 3]["allocated_bytes"][-1]
        assert after - base >= pool, (int(base), int(after), pool)  # the up-front pool, seen by the allocator
    print(f"OK {name}: {steps} steps equal the 5.17 cache's counters; events {json.dumps(kinds)}")
    return {**kinds, "first_token_steps": first}


def _kinds() -> list[Any]:
    from kvtrace.format.schema import EventKind as K

    return [K.SCHEDULED, K.FIRST_TOKEN, K.PREEMPTED, K.OFFLOADED, K.PREFIX_HIT, K.BLOCK_EVICTED, K.REQUEST_END]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    import transformers
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    if not transformers.__version__.startswith("5.17."):
        print(f"transformers {transformers.__version__} is not 5.17 ({transformers.__file__})", file=sys.stderr)
        return 2
    from kvtrace.recorder.serving_cache import adapter_for

    adapter = adapter_for()
    assert adapter is not None and type(adapter).__name__ == "V517", adapter

    def gc(new: int) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)

    def cfg(**kw: Any) -> ContinuousBatchingConfig:
        return ContinuousBatchingConfig(block_size=16, max_batch_tokens=kw.pop("max_batch_tokens", 64), **kw)

    prompts = [list(range(3, 13)), list(range(20, 23)), list(range(30, 48))]
    prefix = list(range(3, 51))

    def prefix_run(model: Any) -> None:
        manager = model.init_continuous_batching(generation_config=gc(4), continuous_batching_config=cfg(
            num_blocks=8, max_batch_tokens=128))
        manager.start()
        try:
            for prompt in (prefix + [60, 61], prefix + [70, 71, 72], list(range(100, 200))):
                rid = manager.add_request(prompt, max_new_tokens=4)
                assert manager.get_result(rid, timeout=120) is not None
        finally:
            manager.stop(block=True)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        run("gemma3", args.device, work, lambda m: m.generate_batch(
            inputs=prompts, generation_config=gc(12), continuous_batching_config=cfg(num_blocks=32), warmup=False))
        kinds = run("llama_prefix", args.device, work, prefix_run)
        assert kinds["prefix_hit"] == 1, kinds
        kinds = run("llama_preempt", args.device, work, lambda m: m.generate_batch(
            inputs=[[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13, 14, 15]], generation_config=gc(40),
            continuous_batching_config=cfg(num_blocks=4), warmup=False))
        assert kinds["preempted"] > 0, kinds
        kinds = run("llama_fork", args.device, work, lambda m: m.generate_batch(
            inputs=[list(range(3, 23))], generation_config=GenerationConfig(
                max_new_tokens=5, do_sample=True, num_return_sequences=3, eos_token_id=-1, pad_token_id=0),
            continuous_batching_config=cfg(num_blocks=16), warmup=False))
        assert kinds["request_end"] == 3, kinds  # the two forked sequences are requests too
        if args.device.startswith("cuda"):  # a pinned CPU swap pool needs CUDA
            kinds = run("llama_offload", args.device, work, lambda m: m.generate_batch(
                inputs=[[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13, 14, 15]], generation_config=gc(40),
                continuous_batching_config=cfg(num_blocks=4, cpu_offload_space=0.01), warmup=False))
            assert kinds["offloaded"] > 0, kinds
            # async batching (CUDA only): batch N is updated after N+1 was scheduled; the three prompts
            # are prefilled together at step 0, so their first tokens belong to step 0
            kinds = run("llama_async", args.device, work, lambda m: m.generate_batch(
                inputs=prompts, generation_config=gc(8), continuous_batching_config=cfg(
                    num_blocks=32, use_async_batching=True), warmup=False))
            assert kinds["first_token_steps"] == [0, 0, 0], kinds
    return 0


if __name__ == "__main__":
    sys.exit(main())
