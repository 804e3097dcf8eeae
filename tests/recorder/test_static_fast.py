"""The static-cache step reader (kvtrace.recorder.static_fast) writes exactly the rows the general
reader writes, without reading the cache's token count from the device. Varied by how the cache
holds tokens: full static layers, static sliding layers beside full ones, a batch of two, a
user-built StaticCache passed in, and a cache whose layers are swapped mid-request (the plan must
notice and fall back)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvtrace  # noqa: E402
from kvtrace.recorder import static_fast, steps  # noqa: E402
from tests.helpers.hfcache import cache_kwargs  # noqa: E402
from tests.helpers.models import tiny_model, tiny_prompt  # noqa: E402

# What two recordings of the same run may differ in: times, addresses, the process's memory readings.
VARYING = ("t_ns", "k_storage", "v_storage", "allocated_bytes", "reserved_bytes", "rss_bytes")


def _record(path, model, batch=1, user_cache=False, general=False, monkeypatch=None):
    kw = {}
    if user_cache:
        from transformers import StaticCache

        kw = cache_kwargs(model, StaticCache(config=model.config, max_cache_len=40))
    else:
        kw = {"cache_implementation": "static"}
    if general:
        monkeypatch.setattr(steps, "static_plan", lambda *a, **k: None)
    calls = []
    real = static_fast.read_step_static
    monkeypatch.setattr(steps, "read_step_static", lambda *a, **k: calls.append(1) or real(*a, **k))
    with kvtrace.record(model, path, structure_every=1):
        model.generate(tiny_prompt(7, batch=batch), max_new_tokens=9, min_new_tokens=9, do_sample=False,
                       disable_compile=True, **kw)
    monkeypatch.undo()
    with kvtrace.open(path) as t:
        return t.kv[:], t.steps[:], len(calls)


def _same(a, b):
    assert a.dtype == b.dtype and len(a) == len(b) > 0
    for name in a.dtype.names:
        if name not in VARYING:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    if "k_storage" in a.dtype.names:  # addresses: the same storage per layer for the whole request
        for rows in (a, b):
            for layer in np.unique(rows["layer"]):
                assert len(np.unique(rows["k_storage"][rows["layer"] == layer])) == 1


@pytest.mark.slow
@pytest.mark.parametrize("name,batch,user_cache", [("llama", 1, False), ("gemma3_text", 1, False),
                                                   ("llama", 2, False), ("gemma3_text", 1, True)])
def test_static_rows_equal_the_general_reader(tmp_path, monkeypatch, name, batch, user_cache):
    model = tiny_model(name)
    kv, st, used = _record(tmp_path / "fast.kvt.h5", model, batch, user_cache, monkeypatch=monkeypatch)
    kv0, st0, _ = _record(tmp_path / "general.kvt.h5", model, batch, user_cache, general=True,
                          monkeypatch=monkeypatch)
    assert used >= 8  # every decode step after the prefill's general read took the static reader
    _same(kv, kv0)
    _same(st, st0)
    assert (kv["tokens_kept"] < kv["tokens_seen"]).any() == (name == "gemma3_text")  # a window applied


@pytest.mark.parametrize("general", [False, True])
def test_static_reader_does_not_read_the_device_count(tmp_path, monkeypatch, general):
    """The general reader reads a full static layer's count (a device tensor, a sync on a GPU) at
    every structure step; the static reader only at the request's first read. general=True is the
    control that the count below sees those reads at all."""
    from kvtrace.recorder import layouts

    reads = []
    real = layouts._StaticSeen.get
    monkeypatch.setattr(layouts._StaticSeen, "get", lambda self, layer: reads.append(1) or real(self, layer))
    if general:
        monkeypatch.setattr(steps, "static_plan", lambda *a, **k: None)
    model = tiny_model("llama")
    with kvtrace.record(model, tmp_path / "r.kvt.h5", structure_every=1):
        model.generate(tiny_prompt(5), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                       cache_implementation="static", disable_compile=True)
    layers = model.config.num_hidden_layers
    assert len(reads) == (6 if general else 1) * layers


@pytest.mark.slow
def test_swapped_layers_fall_back_to_the_general_reader(tmp_path):
    """A cache whose layer objects change mid-request (a user's custom update) is not read from the
    stale plan: the rows follow the new tensors."""
    from transformers import StaticCache

    model = tiny_model("llama")
    cache = StaticCache(config=model.config, max_cache_len=40)
    path = tmp_path / "swap.kvt.h5"
    swapped = []

    def swap(module, args, kwargs, output):
        if len(swapped) == 3:
            layer = cache.layers[0]
            layer.keys = layer.keys.clone()  # a new storage: the plan's identity check must fail
        swapped.append(1)

    handle = model.register_forward_hook(swap, with_kwargs=True)
    try:
        with kvtrace.record(model, path, structure_every=1):
            model.generate(tiny_prompt(5), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                           disable_compile=True, **cache_kwargs(model, cache))
    finally:
        handle.remove()
    with kvtrace.open(path) as t:
        kv = t.kv[:]
    layer0 = kv[kv["layer"] == 0]
    assert len(set(layer0["k_storage"].tolist())) == 2  # the clone's storage is recorded after the swap
