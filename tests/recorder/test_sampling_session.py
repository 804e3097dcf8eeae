"""Sampling through a whole recording session: the right steps, the real cache contents, queries
from the attention wrapper, and the model's attention implementation back as it was."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvtrace  # noqa: E402
from kvtrace.format import PayloadKind  # noqa: E402
from kvtrace.recorder.sampling import SamplingSettings  # noqa: E402
from tests.helpers.hfcache import output_cache  # noqa: E402
from tests.helpers.models import tiny_model, tiny_prompt  # noqa: E402

PROMPT, NEW = 6, 7


def test_session_samples_cache_and_queries(tmp_path) -> None:
    model = tiny_model("llama")
    attn_before = model.config._attn_implementation
    path = tmp_path / "s.kvt.h5"
    settings = SamplingSettings(every_n_steps=3, heads=[1], max_tokens=4, queries=True, tokens="all")
    with kvtrace.record(model, str(path), sampling=settings), torch.no_grad():
        out = model.generate(tiny_prompt(PROMPT), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             return_dict_in_generate=True)
    assert model.config._attn_implementation == attn_before

    last = NEW - 1  # step 0 is the prefill, step k the k-th decode forward
    with kvtrace.open(str(path)) as trace:
        assert trace.meta.contains_tensor_payloads and trace.meta.payload_tokens == "all"
        index = trace.payload_index[:]
        assert sorted(set(index["step"].tolist())) == [0, 3, last]
        payloads = [trace.payload(i) for i in range(len(index))]
    n_layers = model.config.num_hidden_layers
    for step in (0, 3, last):
        kinds = sorted((p.layer, int(p.kind)) for p in payloads if p.step == step)
        assert kinds == sorted((layer, int(k)) for layer in range(n_layers)
                               for k in (PayloadKind.KEY, PayloadKind.VALUE, PayloadKind.QUERY))

    # The last step's samples are the cache generate() handed back: head 1, last 4 tokens.
    cache = output_cache(out)
    total = PROMPT + NEW - 1
    for p in payloads:
        if p.step != last or p.kind == PayloadKind.QUERY:
            continue
        layer = cache.layers[p.layer]
        src = layer.keys if p.kind == PayloadKind.KEY else layer.values
        assert (p.head_start, p.token_start, p.shape) == (1, total - 4, (1, 1, 4, src.shape[-1]))
        np.testing.assert_array_equal(p.to_float32(), src[:, 1:2, -4:].numpy())
    decode_queries = [p for p in payloads if p.kind == PayloadKind.QUERY and p.step == last]
    for p in decode_queries:  # one new token per decode step, every query head of its group
        assert p.shape[2] == 1 and p.shape[-1] == model.config.head_dim
        assert p.token_start == total - 1


def test_query_positions_exact_when_structure_is_read_sparsely(tmp_path) -> None:
    """Sampled queries carry their absolute position even when the structure was last read several
    steps earlier (structure_every > 1): positions come from the inputs, not from that read."""
    model = tiny_model("llama")
    path = tmp_path / "q.kvt.h5"
    settings = SamplingSettings(every_n_steps=5, queries=True, at_last_step=False)
    with kvtrace.record(model, str(path), sampling=settings, structure_every=4), torch.no_grad():
        model.generate(tiny_prompt(PROMPT), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    with kvtrace.open(str(path)) as trace:
        index = trace.payload_index[:]
        queries = [trace.payload(i) for i in range(len(index)) if int(index[i]["kind"]) == int(PayloadKind.QUERY)]
    by_step = {p.step: p.token_start for p in queries}
    # step 0 (prefill) feeds positions 0..PROMPT-1; decode step s feeds position PROMPT + s - 1
    assert by_step == {0: 0, 5: PROMPT + 4}


def _kv_payloads(path):
    with kvtrace.open(str(path)) as trace:
        index = trace.payload_index[:]
        meta = trace.meta
        payloads = [trace.payload(i) for i in range(len(index)) if int(index[i]["kind"]) != int(PayloadKind.QUERY)]
    return meta, payloads


@pytest.mark.parametrize("name", ["llama", "gpt_oss"])
def test_incremental_samples_chain_into_the_final_cache(tmp_path, name) -> None:
    """The default sample holds only new tokens: per (layer, kind) the samples tile the positions
    without gap or overlap, and joined they are the cache generate() returned, bit for bit."""
    from kvtrace.format.assemble import ContentsAssembler

    model = tiny_model(name)
    path = tmp_path / "inc.kvt.h5"
    with kvtrace.record(model, str(path), sampling={"every_n_steps": 2}), torch.no_grad():
        out = model.generate(tiny_prompt(PROMPT), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             return_dict_in_generate=True)
    meta, payloads = _kv_payloads(path)
    assert meta.payload_tokens == "new"
    total = PROMPT + NEW - 1  # tokens in the cache after the last forward
    cache = output_cache(out)
    with kvtrace.open(str(path)) as trace:
        joined = ContentsAssembler(trace)
        for layer_idx, layer in enumerate(cache.layers):
            for kind, src in ((PayloadKind.KEY, layer.keys), (PayloadKind.VALUE, layer.values)):
                mine = sorted((p for p in payloads if p.layer == layer_idx and p.kind == kind), key=lambda p: p.step)
                ends = [p.token_start + p.shape[2] for p in mine]
                starts = [p.token_start for p in mine]
                assert starts[1:] == ends[:-1] and ends[-1] == total  # contiguous, never twice
                kept = src.shape[2]
                got = joined.at(0, layer_idx, int(kind), NEW - 1, first=total - kept)
                assert got.token_start == total - kept
                np.testing.assert_array_equal(got.to_float32(), src.float().numpy())


def test_beam_search_samples_whole(tmp_path) -> None:
    """Beam search reorders cached rows: every sample then holds every kept token."""
    model = tiny_model("llama")
    path = tmp_path / "beam.kvt.h5"
    with kvtrace.record(model, str(path), sampling={"every_n_steps": 2}), torch.no_grad():
        model.generate(tiny_prompt(PROMPT), max_new_tokens=4, min_new_tokens=4, do_sample=False, num_beams=2)
    _meta, payloads = _kv_payloads(path)
    assert payloads and all(p.token_start == 0 for p in payloads)
    steps = sorted({p.step for p in payloads})
    assert len(steps) > 1
    assert [max(p.shape[2] for p in payloads if p.step == s) for s in steps] == \
        sorted(max(p.shape[2] for p in payloads if p.step == s) for s in steps)
