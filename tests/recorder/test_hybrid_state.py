"""Hybrid caches (format 1.5 /state): every state tensor a hybrid model's cache holds is recorded,
exactly, beside the attention layers' KV.

For every hybrid family the installed transformers builds from a tiny config (random weights, CPU),
the /state rows of each recorded step must equal the live cache's own tensors: the conv and
recurrent states of its ``LinearAttentionCacheLayerMixin`` layers and, for MiniMax, the tensors of
``MiniMaxCache.linear_cache``. The reference is read here by type from ``transformers.cache_utils``
and by the one model-specific attribute, independently of the recorder's generic walk.
"""

from __future__ import annotations

import gc

import pytest
import torch
from rec_helpers import model, text

import kvtrace
from kvtrace.format.reader import Trace
from kvtrace.format.schema import TORCH_DTYPE_NAMES, StateKind
from kvtrace.format.state_rules import checked_state
from kvtrace.format.validate import validate
from tests.helpers.models import TINY_HYBRID_NAMES, tiny_prompt

cache_utils = pytest.importorskip("transformers.cache_utils")
MIXIN = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
pytestmark = pytest.mark.skipif(MIXIN is None, reason="this transformers has no linear-attention cache layers")

PROMPT, NEW, BATCH = 12, 6, 2


def live_states(cache) -> list[tuple[int, int, torch.Tensor]]:
    """(layer, StateKind, tensor) of every state the cache holds, by type."""
    out = []
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, MIXIN):
            out += [(i, int(StateKind.CONV), t) for t in layer.conv_states.values() if t is not None]
            out += [(i, int(StateKind.RECURRENT), t) for t in layer.recurrent_states.values() if t is not None]
    for i, t in enumerate(getattr(cache, "linear_cache", None) or ()):  # MiniMaxCache
        if isinstance(t, torch.Tensor):
            out.append((i, int(StateKind.OTHER), t))
    return out


def live_kv_bytes(cache) -> int:
    """K and V bytes of the attention layers (dynamic layers: a storage is its tensor)."""
    total = 0
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if isinstance(keys, torch.Tensor) and keys.numel():
            total += keys.untyped_storage().nbytes() + layer.values.untyped_storage().nbytes()
    return total


def record(tmp_path, name: str, **options):
    m = model(name)
    path = tmp_path / f"{name}.kvt.h5"
    ids = tiny_prompt(PROMPT, batch=BATCH)
    with kvtrace.record(m, path, **options):
        out = m.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    cache = getattr(out, "cache", None)
    return path, cache if cache is not None else out.past_key_values


@pytest.mark.slow
@pytest.mark.parametrize("name", TINY_HYBRID_NAMES)
def test_state_rows_are_the_cache_tensors(tmp_path, name):
    path, cache = record(tmp_path, name, structure_every=1)
    live = live_states(cache)
    assert live, f"{name}: the reference found no state (the test would prove nothing)"
    with Trace(path) as t:
        state, steps, kv = checked_state(t), t.steps[:], t.kv[:]
        assert sorted(set(state["step"].tolist())) == sorted(steps["step"].tolist())  # every structure step
        last = state[state["step"] == steps["step"].max()]
        assert len(last) == len(live)
        by_key = {(int(r["layer"]), int(r["kind"]), int(r["storage"])): r for r in last}
        for layer, kind, tensor in live:
            r = by_key[(layer, kind, tensor.untyped_storage().data_ptr())]
            assert int(r["bytes_valid"]) == tensor.nbytes
            assert int(r["bytes_allocated"]) == tensor.untyped_storage().nbytes()
            assert tuple(r["shape"][: r["ndim"]]) == tuple(tensor.shape)
            assert int(r["dtype"]) == TORCH_DTYPE_NAMES[str(tensor.dtype).removeprefix("torch.")]
            assert int(r["device"]) == -1
            assert text(t, r["source_off"], r["source_len"])
        storages = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for _, _, x in live}
        assert int(last["bytes_unique"].sum()) == sum(storages.values())
        assert int(last["bytes_valid"].sum()) == sum(x.nbytes for _, _, x in live)
        # the state does not grow with tokens: every step holds the same bytes
        per_step = {int(s): int(state[state["step"] == s]["bytes_unique"].sum()) for s in steps["step"]}
        assert set(per_step.values()) == {sum(storages.values())}, per_step
        # the attention layers' KV stays exact and /steps stays KV-only
        kv_last = kv[kv["step"] == steps["step"].max()]
        assert int(kv_last["bytes_unique"].sum()) == live_kv_bytes(cache)
        assert int(steps["kv_bytes_unique"][-1]) == live_kv_bytes(cache)
    assert validate(path).valid, validate(path).problems


def test_minimax_state_is_found_on_its_own_cache_class(tmp_path):
    """MiniMax keeps its lightning-attention state in MiniMaxCache.linear_cache (no layer object):
    the generic walk of the cache's attributes finds it, tied to its layers."""
    path, cache = record(tmp_path, "minimax", structure_every=1)
    assert type(cache).__name__ == "MiniMaxCache"
    with Trace(path) as t:
        state = checked_state(t)
        sources = {text(t, r["source_off"], r["source_len"]) for r in state}
    assert sources == {f"linear_cache[{i}]" for i, _, _ in live_states(cache)}
    assert set(state["kind"].tolist()) == {int(StateKind.OTHER)}
    assert set(state["layer"].tolist()) == {i for i, _, _ in live_states(cache)}


def test_state_is_read_only_at_structure_steps(tmp_path):
    """structure_every = 4: /state rows exist exactly at the steps whose /kv rows were read (the
    prefill, every 4th decode step, the last), never at the others."""
    path, _ = record(tmp_path, "qwen3_next", structure_every=4)
    with Trace(path) as t:
        state_steps = sorted(set(checked_state(t)["step"].tolist()))
        kv_steps = sorted(set(t.kv[:]["step"].tolist()))
    assert state_steps == kv_steps == [0, 4, NEW - 1]


def test_retained_state_is_reported_as_retention(tmp_path):
    """A caller keeping generate's output keeps the state too: its storages appear in /retention of
    that request, beside the KV ones."""
    m = model("falcon_h1")
    path = tmp_path / "kept.kvt.h5"
    ids = tiny_prompt(PROMPT)
    with kvtrace.record(m, path) as rec:
        kept = m.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False, return_dict_in_generate=True)
        m.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)
    assert rec is not None
    cache = getattr(kept, "cache", None) or kept.past_key_values
    states = {t.untyped_storage().data_ptr() for _, _, t in live_states(cache)}
    with Trace(path) as t:
        retained = {int(r["storage"]) for r in t.retention.where(request=0)}
    assert states <= retained
    del kept, cache
    gc.collect()


@pytest.mark.parametrize("name", ["qwen3_next", "falcon_h1"])
def test_continuous_batching_on_a_hybrid_says_what_transformers_did(tmp_path, name):
    """transformers' paged cache (generate_batch, generate(cache_implementation="paged"), serve)
    holds attention KV blocks only: 5.17 and 5.24 refuse hybrid layer types ("Invalid group type" /
    "Invalid layer type"). The trace then says so in a NOTE naming the layer types, before the error
    reaches the caller; a release that accepts them is recorded like any continuous batching."""
    from transformers import GenerationConfig

    from kvtrace.format.schema import EventKind

    m = model(name)
    path = tmp_path / "cb.kvt.h5"
    prompts = [tiny_prompt(6)[0].tolist(), tiny_prompt(9, seed=1)[0].tolist()]
    gc_ = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=-1, pad_token_id=0)
    refused = None
    with kvtrace.record(m, path):
        try:
            m.generate_batch(prompts, generation_config=gc_)
        except ValueError as exc:
            refused = exc
    with Trace(path) as t:
        notes = [text(t, e["text_off"], e["text_len"]) for e in t.events.where(kind=EventKind.NOTE)]
        requests, sched = t.nrows("requests"), t.nrows("sched")
    if refused is None:
        assert requests == 2 and sched > 0
        return
    said = [n for n in notes if n.startswith("continuous batching refused by transformers")]
    assert said, notes
    layer_type = "hybrid" if name == "falcon_h1" else "linear_attention"
    assert str(refused)[:40] in said[0] and f"this model's {layer_type} layers keep a conv/recurrent state" in said[0]
    assert requests == 0
