"""Layout reading and accounting on hand-built caches: aliasing, sharing, expanded MLA, tuples."""

from __future__ import annotations

import torch
from rec_helpers import model, record_run
from transformers.cache_utils import DynamicCache, DynamicLayer

from kvtrace.format.reader import Trace
from kvtrace.format.schema import LayerType
from kvtrace.recorder.accounting import account
from kvtrace.recorder.layouts import LayoutContext, context_from_config, read_cache, storage_of
from tests.helpers.hfcache import cache_kwargs, output_cache  # noqa: E402
from tests.helpers.models import tiny_prompt


def _layer(keys: torch.Tensor, values: torch.Tensor) -> DynamicLayer:
    layer = DynamicLayer()
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    return layer


def test_k_is_v_counted_once_and_equal_values_twice():
    kv = torch.randn(1, 2, 5, 4)
    twin = kv.clone()  # equal values, distinct storage: must cost twice
    cache = DynamicCache()
    cache.layers = [_layer(kv, kv), _layer(kv, twin)]
    readings = read_cache(cache, LayoutContext(num_layers=2))
    acc = account(readings)
    nb = kv.numel() * 4
    assert acc.allocated == [nb, 2 * nb]
    assert readings[0].bytes_valid == nb  # same view: valid counted once too
    assert acc.unique_per_layer == [nb, nb]  # layer 1's K aliases layer 0: only V is new
    assert acc.naive == 4 * nb and acc.unique == 2 * nb


def test_view_into_a_larger_storage_counts_the_storage():
    base = torch.randn(1, 2, 10, 4)
    cache = DynamicCache()
    cache.layers = [_layer(base[:, :, -3:], base[:, :, :3])]  # two views of one storage
    (r,) = read_cache(cache, LayoutContext(num_layers=1))
    assert r.tokens_kept == 3
    assert account([r]).allocated == [base.numel() * 4]
    assert r.bytes_valid == 2 * 3 * 2 * 4 * 4


def test_expanded_mla_layout_is_read_as_per_head_kv():
    ctx = context_from_config(model("deepseek_v3").config)
    assert ctx.kv_lora_rank == 32
    heads, t = 4, 6
    k = torch.randn(1, heads, t, 16 + 8)  # qk_nope + qk_rope per head (older transformers)
    v = torch.randn(1, heads, t, 16)
    cache = DynamicCache()
    cache.layers = [_layer(k, v)]
    (r,) = read_cache(cache, ctx)
    assert r.layer_type == LayerType.FULL
    assert r.expanded_bytes == (k.numel() + v.numel()) * 4 == account([r]).allocated[0]
    latent = _layer(torch.randn(1, 1, t, 32), torch.randn(1, 1, t, 8))
    cache.layers = [latent]
    (r,) = read_cache(cache, ctx)
    assert r.layer_type == LayerType.LATENT
    assert r.expanded_bytes == t * heads * (24 + 16) * 4


def test_storage_identity_key():
    t = torch.zeros(3, 4)
    key, nbytes = storage_of(t[1:])
    assert key == (-1, t.untyped_storage().data_ptr(), 48) and nbytes == 48
    assert storage_of(torch.tensor([])) is None


def test_cache_built_from_tuples(tmp_path):
    """A legacy tuple-of-tuples cache handed to generate: its tokens count from the first step."""
    m = model("llama")
    ids = tiny_prompt(10)  # the prompt record_run passes: its first 6 tokens are pre-cached
    with torch.no_grad():
        pkv = output_cache(m(ids[:, :6], use_cache=True))
    legacy = tuple((layer.keys.clone(), layer.values.clone()) for layer in pkv.layers)
    cache = DynamicCache(legacy)
    path, rec = record_run(tmp_path, "llama", prompt_len=10, new=3, **cache_kwargs(m, cache))
    assert rec.recorder_errors == 0
    with Trace(path) as t:
        kv = t.kv[:]
    per_token = 2 * 16 * 4 * 2  # heads x dim x fp32 x (K+V)
    first = kv[kv["step"] == 0]
    # generate only forwards the 4 uncached tokens, but the cache then holds all 10
    assert first["tokens_seen"].tolist() == [10, 10]
    assert first["bytes_allocated"].tolist() == [10 * per_token] * 2
