"""Quality by rerun (kvtrace.whatif.rerun) on tiny random-weight models, CPU. Random weights make
the numbers prove the mechanics only (no policy is "good" here): the no-op is exact, a harsher
setting moves the distribution more, the cache holds what the policy says."""

from __future__ import annotations

import json
import os
import re
import threading

import numpy as np
import pytest

from kvtrace.whatif import parse_policy
from kvtrace.whatif.policies import n_kept
from tests.helpers.cli_run import run_main

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtrace.whatif.rerun import _measures, teacher_forced_logprobs  # noqa: E402
from tests.helpers.hfcache import cache_kwargs  # noqa: E402
from tests.helpers.models import TINY_WINDOW, tiny_model, tiny_prompt  # noqa: E402

N = 24


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama"), tiny_prompt(N)


def _plain(model, ids):
    from transformers import DynamicCache

    cache, rows = DynamicCache(config=model.config), []
    with torch.no_grad():
        for t in range(ids.shape[1]):
            out = model(input_ids=ids[:, t:t + 1], use_cache=True, **cache_kwargs(model, cache))
            rows.append(torch.log_softmax(out.logits[0, -1].double(), dim=-1).cpu().numpy())
    return np.stack(rows)


def test_reference_is_the_plain_cache_and_ratio_zero_is_exact(llama):
    model, ids = llama
    ref, layers = teacher_forced_logprobs(model, ids, mode="per_token")
    np.testing.assert_array_equal(ref, _plain(model, ids))  # the wrapper itself changes nothing
    ref, layers = teacher_forced_logprobs(model, ids)  # one pass: float rounding of batched matmuls only
    assert layers[0].mode == "one_pass"
    np.testing.assert_allclose(ref, _plain(model, ids), rtol=0, atol=1e-5)
    flat = ids[0].numpy()
    for name in ("knorm", "snapkv:window_size=4"):
        got, _ = teacher_forced_logprobs(model, ids, parse_policy(name), 0.0)
        m = _measures(ref, got, flat)
        assert m["kl_mean"] == 0.0 and m["kl_max"] == 0.0 and m["perplexity_change_pct"] == 0.0
    got, _ = teacher_forced_logprobs(model, ids, parse_policy("kivi:residual_length=128"))  # all residual: no-op
    assert _measures(ref, got, flat)["kl_max"] == 0.0


def test_harsher_settings_cost_more_and_the_cache_holds_the_budget(llama):
    model, ids = llama
    ref, _ = teacher_forced_logprobs(model, ids)
    flat = ids[0].numpy()
    kl = {}
    for r in (0.25, 0.75):
        got, layers = teacher_forced_logprobs(model, ids, parse_policy("knorm"), r)
        kl[r] = _measures(ref, got, flat)["kl_mean"]
        assert [x.kept_log[-1] for x in layers] == [n_kept(N, r)] * 2
        assert all(b <= n_kept(t + 1, r) for x in layers for t, b in enumerate(x.kept_log))
    assert 0 < kl[0.25] < kl[0.75]
    q = {b: _measures(ref, teacher_forced_logprobs(model, ids, parse_policy(f"kivi:nbits={b},residual_length=0"))[0],
                      flat)["kl_mean"] for b in (2, 8)}
    assert 0 < q[8] < q[2] / 100


def test_query_policies_use_captured_queries(llama):
    model, ids = llama
    ref, _ = teacher_forced_logprobs(model, ids)
    keeps = {}
    for name in ("observed_attention", "tova", "snapkv:window_size=4", "expected_attention:n_sink=2"):
        got, layers = teacher_forced_logprobs(model, ids, parse_policy(name), 0.5)
        assert _measures(ref, got, ids[0].numpy())["kl_mean"] > 0
        assert [x.kept_log[-1] for x in layers] == [n_kept(N, 0.5)] * 2
        assert all(x.queries.shape[2] == N for x in layers)  # one post-RoPE query per step and layer
        keeps[name] = tuple(layers[0].pos[0, 0].tolist())
    assert len(set(keeps.values())) > 1  # the policies disagree on what to keep
    from transformers.modeling_utils import AttentionInterface

    assert not any(k.startswith("kvtrace_q") for k in AttentionInterface._global_mapping)  # capture removed


def test_sliding_hybrid_presses_windows_as_kvpress_would():
    # gemma3_text (Gemma3ForCausalLM): kvpress hooks every layer, so its sliding layers are pressed to
    # n_kept of the window - 1 tokens they hold, keys that left the window gone first
    model, ids = tiny_model("gemma3_text", attn_implementation="eager"), tiny_prompt(20)
    ref, layers = teacher_forced_logprobs(model, ids, mode="per_token")
    np.testing.assert_array_equal(ref, _plain(model, ids))
    ref, layers = teacher_forced_logprobs(model, ids)
    np.testing.assert_allclose(ref, _plain(model, ids), rtol=0, atol=1e-5)
    got, layers = teacher_forced_logprobs(model, ids, parse_policy("knorm"), 0.5)
    assert [x.kept_log[-1] for x in layers] == [n_kept(TINY_WINDOW - 1, 0.5)] * 2 + [n_kept(20, 0.5)]
    for x in layers[:2]:
        assert x.pressed and (x.pos > 20 - TINY_WINDOW).all()  # inside the window
        assert all(b <= n_kept(min(t + 1, TINY_WINDOW - 1), 0.5) for t, b in enumerate(x.kept_log))
    assert _measures(ref, got, ids[0].numpy())["kl_mean"] > 0
    kept, layers = teacher_forced_logprobs(model, ids, parse_policy("knorm"), 0.5, press_sliding=False)
    assert [x.kept_log[-1] for x in layers] == [TINY_WINDOW - 1, TINY_WINDOW - 1, n_kept(20, 0.5)]
    assert not layers[0].pressed and (kept != got).any()
    for name in ("snapkv:window_size=2", "tova", "streaming_llm:n_sink=2"):  # query and position policies too
        _, layers = teacher_forced_logprobs(model, ids, parse_policy(name), 0.25)
        assert [x.kept_log[-1] for x in layers[:2]] == [n_kept(TINY_WINDOW - 1, 0.25)] * 2, name
        assert all((x.pos > 20 - TINY_WINDOW).all() for x in layers[:2])


@pytest.mark.parametrize("ratio,unscored,over,final", [
    (0.75, 3, 14, [0, 1, 2, 3, 22, 23]),  # budget max(1, seen // 4): below the 4 sinks until seen = 16
    (0.25, 3, 4, [0, 1, 2, 3] + list(range(10, 24))),
])
def test_streaming_llm_keeps_its_sinks_from_the_first_token(llama, ratio, unscored, over, final):
    model, ids = llama
    _, layers = teacher_forced_logprobs(model, ids, parse_policy("streaming_llm"), ratio)
    for x in layers:
        assert (x.pos == torch.tensor(final)).all()  # every head, every layer: the true sinks 0..3
        # seen 2..4: over budget and at most n_sink keys (kvpress needs more): kept whole, unscored
        assert sorted(x.unscored) == [2, 3, 4][:unscored] and len(x.over_budget) == over
        assert all(b >= min(t + 1, 4) for t, b in enumerate(x.kept_log))  # the sinks never leave
    from kvtrace.whatif.rerun import _kept

    k = _kept(layers)
    assert (k["steps_unscored"], k["steps_over_budget"]) == (unscored, over)  # steps, not layer-steps


def test_a_checkpoint_whose_tokenizer_builds_empty_is_refused_up_front(capsys, tmp_path, llama):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model, _ = llama
    model.save_pretrained(tmp_path / "m")
    empty = Tokenizer(models.BPE(vocab={}, merges=[]))
    empty.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=empty).save_pretrained(tmp_path / "m")
    (tmp_path / "t.txt").write_text("a text the empty tokenizer turns into nothing")
    capsys.readouterr()  # save_pretrained's progress
    code, _, err = run_main(["whatif", "--rerun", str(tmp_path / "m"), "--text", str(tmp_path / "t.txt"),
                             "--policy", "knorm"], capsys)
    assert code == 64 and "tokenizer has 0 tokens" in err and "--rerun" in err and err.count("\n") == 1


def test_cli_rerun_json(capsys, tmp_path, llama):
    model, _ = llama
    model.save_pretrained(tmp_path / "m")
    text = tmp_path / "t.txt"
    text.write_text("a short text to score, token by token")
    out = tmp_path / "r.json"
    code, printed, _ = run_main(["whatif", "--rerun", str(tmp_path / "m"), "--text", str(text), "--policy", "knorm",
                                 "--policy", "paging", "--ratio", "0,0.5", "--max-tokens", "16",
                                 "--json-out", str(out)], capsys)
    assert code == 0 and "quality by rerun" in printed
    assert "computed by one model pass per policy" in printed and "near tie" not in printed
    doc = json.loads(out.read_text())
    r = doc["rerun"]
    assert doc["trace"] is None and r["kind"] == "quality" and r["tokens"] == 16
    knorm = r["policies"][0]["results"]
    assert [x["ratio"] for x in knorm] == [0.0, 0.5] and knorm[0]["kl_mean"] == 0 and knorm[1]["kl_mean"] > 0
    assert "unchanged by construction" in r["policies"][1]["skipped"]
    assert r["reference"]["pass"] == "one_pass" and all(x["pass"] == "one_pass" and "pass_note" not in x for x in knorm)
    assert knorm[1]["steps_near_tie"] == 0  # llama's key norms are far apart
    code, printed, _ = run_main(["whatif", "--rerun", str(tmp_path / "m"), "--text", str(text), "--policy", "tova",
                                 "--ratio", "0.5", "--max-tokens", "16", "--rerun-prefill", "8", "--json"], capsys)
    r = json.loads(printed)["rerun"]
    assert code == 0 and (r["prefill_tokens"], r["scored_positions"]) == (8, 7)
    assert r["policies"][0]["results"][0]["full_layer_tokens_final"] == n_kept(16, 0.5)
    assert run_main(["whatif", "--rerun", str(tmp_path / "m"), "--text", str(text), "--max-tokens", "16",
                     "--rerun-prefill", "15"], capsys)[0] == 64  # nothing left to score
    assert run_main(["whatif", "--rerun", str(tmp_path / "m")], capsys)[0] == 64  # no --text
    assert run_main(["whatif"], capsys)[0] == 64
    assert run_main(["whatif", "--rerun", str(tmp_path / "m"), "--text", str(tmp_path / "none.txt")], capsys)[0] == 64
    code, _, err = run_main(["whatif", "--rerun", str(tmp_path / "nope"), "--text", str(text)], capsys)
    assert code != 0 and err.count("\n") == 1


def test_mla_latent_is_pressed_by_key_only_policies_and_query_policies_refuse():
    from kvtrace.whatif.policies import PolicyError

    model, ids = tiny_model("deepseek_v3"), tiny_prompt(12)
    ref, layers = teacher_forced_logprobs(model, ids)
    assert layers[0].keys.shape[1] == 1  # the cached latent: one "head" shared by all
    assert layers[0].mode == "per_token" and "MLA latent" in layers[0].mode_note  # up-projected after the cache
    got, layers = teacher_forced_logprobs(model, ids, parse_policy("knorm"), 0.5)
    assert [x.kept_log[-1] for x in layers] == [6, 6] and _measures(ref, got, ids[0].numpy())["kl_mean"] > 0
    with pytest.raises(PolicyError, match="MLA latent"):
        teacher_forced_logprobs(model, ids, parse_policy("tova"), 0.5)
    assert not any(m._forward_hooks for m in model.modules())  # every step hook removed, refusal included


def test_all_sliding_model_says_eviction_has_nothing_to_press(tmp_path):
    from kvtrace.whatif.rerun import rerun_quality

    tiny_model("mistral").save_pretrained(tmp_path / "m")  # every layer slides (window 8)
    (tmp_path / "t.txt").write_text("twelve bytes")
    pols = [parse_policy("knorm"), parse_policy("fp8")]
    doc = rerun_quality(str(tmp_path / "m"), tmp_path / "t.txt", pols, [0.5], sliding="keep")
    assert doc["sliding_layers"] == 2 and "no layer to press" in doc["policies"][0]["skipped"]
    assert doc["sliding"]["pressed"] is False and "--sliding keep" in doc["sliding"]["reason"]
    assert doc["policies"][1]["results"][0]["kl_mean"] > 0  # quantisation still applies to sliding layers
    from contextlib import contextmanager

    seen: list = []

    @contextmanager
    def bar(total):
        seen.append(total)
        yield seen.append

    doc = rerun_quality(str(tmp_path / "m"), tmp_path / "t.txt", pols, [0.5], progress=bar)  # auto: kvpress presses mistral's
    assert seen == [3, "reference (the cache unchanged)", "knorm at 0.5", "fp8:fmt=e4m3"]  # one line per pass
    assert doc["sliding"]["pressed"] and "mistral" in doc["sliding"]["reason"]
    r = doc["policies"][0]["results"][0]
    assert r["kl_mean"] > 0 and r["sliding_layer_tokens_final"] == n_kept(TINY_WINDOW - 1, 0.5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rerun_on_cuda_matches_the_plain_cache_and_orders_policies():
    model = tiny_model("gemma3_text", dtype=torch.float32).to("cuda")
    ids = tiny_prompt(32).to("cuda")
    ref, _ = teacher_forced_logprobs(model, ids)  # one model pass: batched matmuls round differently
    np.testing.assert_allclose(ref, _plain(model, ids), rtol=0, atol=1e-5)
    flat = ids[0].cpu().numpy()
    kl = [_measures(ref, teacher_forced_logprobs(model, ids, parse_policy(p), r)[0], flat)["kl_mean"]
          for p, r in (("knorm", 0.0), ("knorm", 0.25), ("knorm", 0.75))]
    assert kl[0] == 0.0 and 0 < kl[1] < kl[2]
    for p in ("snapkv:window_size=4", "kivi:nbits=2,residual_length=0", "fp8"):
        got, layers = teacher_forced_logprobs(model, ids, parse_policy(p), 0.5)
        assert _measures(ref, got, flat)["kl_mean"] > 0 and layers[0].keys.device.type == "cuda"
    for p in ("snapkv:window_size=2", "tova", "observed_attention", "expected_attention:n_sink=2", "streaming_llm"):
        one, la = teacher_forced_logprobs(model, ids, parse_policy(p), 0.5)  # scorers on the cache's device
        per, lb = teacher_forced_logprobs(model, ids, parse_policy(p), 0.5, mode="per_token")
        assert la[0].mode == "one_pass" and la[0].keys.device.type == "cuda"
        np.testing.assert_allclose(one, per, rtol=0, atol=1e-4)
        for x, y in zip(la, lb, strict=True):
            assert torch.equal(x.pos, y.pos) and x.kept_log == y.kept_log, p


def test_prefill_is_pressed_once_after_its_attention(llama):
    model, ids = llama
    ref, _ = teacher_forced_logprobs(model, ids, prefill=16)
    assert ref.shape[0] == N  # one batched prefill forward vs token by token: float32 rounding only
    np.testing.assert_allclose(ref, _plain(model, ids), rtol=0, atol=1e-5)
    for name in ("snapkv:window_size=4", "knorm"):
        got, layers = teacher_forced_logprobs(model, ids, parse_policy(name), 0.5, prefill=16)
        np.testing.assert_array_equal(got[:16], ref[:16])  # the prefill's own predictions use the full cache
        assert (got[16:] != ref[16:]).any()
        assert layers[0].kept_log[0] == n_kept(16, 0.5)  # pressed right after the prefill
        assert [x.kept_log[-1] for x in layers] == [n_kept(N, 0.5)] * 2
        if name.startswith("snapkv"):
            assert layers[0].queries.shape[2] == N  # the prefill's own queries, then one per step
    m = _measures(ref, got, ids[0].numpy(), 16)
    assert m["kl_mean"] > 0 and m["perplexity"] > 0


def test_encoder_decoder_models_are_refused_with_the_reason():
    from kvtrace.errors import Unavailable

    with pytest.raises(Unavailable, match="encoder-decoder"):
        teacher_forced_logprobs(tiny_model("t5"), tiny_prompt(4))


# ---- --text read only as far as the token budget needs ------------------------------------------

def _byte_encode(text: str) -> torch.Tensor:  # one token per UTF-8 byte (as the presets' ByteTokenizer)
    return torch.tensor([list(text.encode("utf-8"))], dtype=torch.long)


def test_text_is_read_only_as_far_as_the_budget_needs(tmp_path):
    from kvtrace.whatif.rerun import BYTES_PER_TOKEN, TextSource

    big = tmp_path / "big.txt"
    with open(big, "wb") as fh:  # 4 KiB of text, then 1 GiB of NUL bytes (sparse): never reached
        fh.write(b"a few words of text. " * 200)
        fh.truncate(1 << 30)
    with TextSource(big, 16) as src:
        ids = src.tokens(_byte_encode)
        assert ids.shape == (1, 16) and src.bytes_read == 16 * BYTES_PER_TOKEN
    # a tokenizer that needs more bytes per token than the first read gave: further reads, doubling
    with TextSource(big, 16) as src:
        ids = src.tokens(lambda t: _byte_encode(t)[:, ::40])  # one token per 40 bytes
        assert ids.shape == (1, 16) and src.bytes_read == 16 * BYTES_PER_TOKEN * 8  # 128, 256, 512, 1024
    # the whole file when it is shorter than the budget needs
    small = tmp_path / "small.txt"
    small.write_text("héllo wörld")
    with TextSource(small, 256) as src:
        assert src.tokens(_byte_encode).shape == (1, len("héllo wörld".encode())) and src.eof


@pytest.mark.parametrize(("body", "phrase"), [
    (b"\xff\xfe\x00\x01 not UTF-8", "NUL byte at offset 2"),
    (b"text, then \xff\xfe bytes that are not UTF-8", "not UTF-8 text (invalid start byte at byte 11)"),
    (b"\x7fELF\x02\x01\x01\x00" + b"\x00" * 64, "NUL byte at offset 7"),  # valid UTF-8, still a binary
    (b"ends in half a character \xc3", "not UTF-8 text"),
])
def test_text_that_is_not_text_is_refused(tmp_path, body, phrase):
    from kvtrace.errors import BadOption
    from kvtrace.whatif.rerun import TextSource

    (tmp_path / "x.bin").write_bytes(body)
    with pytest.raises(BadOption, match=re.escape(phrase)) as err:
        TextSource(tmp_path / "x.bin", 256).tokens(_byte_encode)
    assert err.value.option == "--text"


def test_text_from_a_pipe_is_read_to_the_budget(tmp_path):
    """A pipe answers short reads before its end: they are not taken for the end of the text."""
    from kvtrace.whatif.rerun import TextSource

    r, w = os.pipe()
    body = ("word " * 400).encode()

    def feed() -> None:
        with os.fdopen(w, "wb", buffering=0) as fh:
            for i in range(0, len(body), 7):  # 7 bytes at a time
                fh.write(body[i:i + 7])

    t = threading.Thread(target=feed)
    t.start()
    try:
        with TextSource(f"/dev/fd/{r}", 100) as src:
            assert src.tokens(_byte_encode).shape == (1, 100) and not src.eof
    finally:
        t.join()
        os.close(r)


def test_rerun_over_a_huge_text_scores_the_budget(tmp_path, capsys):
    """The CLI over a 1 GiB text file (sparse past its first 4 KiB): --max-tokens 8 reads what 8
    tokens need (the whole file was read, and its NUL bytes tokenised, before)."""
    big = tmp_path / "big.txt"
    with open(big, "wb") as fh:
        fh.write(b"a few words of text. " * 200)
        fh.truncate(1 << 30)
    code, out, err = run_main(["whatif", "--rerun", "preset:llama-3.1-8b", "--tiny", "--text", str(big),
                               "--policy", "knorm", "--ratio", "0.5", "--max-tokens", "8", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["rerun"]["tokens"] == 8


@pytest.mark.parametrize("name", ["knorm", "snapkv:window_size=4", "tova", "expected_attention:n_sink=2"])
def test_torch_scoring_keeps_what_the_numpy_scorers_keep(llama, monkeypatch, name):
    from kvtrace.whatif import rerun

    model, ids = llama
    fast, fast_layers = teacher_forced_logprobs(model, ids, parse_policy(name), 0.5)
    monkeypatch.setattr(rerun, "TORCH_SCORING", False)  # policies.py's numpy scorers, head by head
    slow, slow_layers = teacher_forced_logprobs(model, ids, parse_policy(name), 0.5)
    for a, b in zip(fast_layers, slow_layers, strict=True):
        assert torch.equal(a.pos, b.pos) and a.kept_log == b.kept_log and a.unscored == b.unscored
    np.testing.assert_allclose(fast, slow, rtol=0, atol=1e-12)


def test_observed_attention_is_h2o_summed_step_by_step_and_kvpress_on_a_prefill(llama):
    from kvtrace.recorder.qcapture import QueryCapture
    from kvtrace.whatif.policies import Observed, keep_top

    model, ids = llama
    _, ref_layers = teacher_forced_logprobs(model, ids, prefill=N)  # one forward: every key, no press
    queries: dict[int, torch.Tensor] = {}
    with torch.no_grad(), QueryCapture(model, lambda layer, q: queries.setdefault(layer, q.clone())):
        model(ids)
    _, layers = teacher_forced_logprobs(model, ids, parse_policy("observed_attention"), 0.5, prefill=N)
    for i, x in enumerate(layers):  # pressed once, right after the prefill: kvpress's definition
        k = ref_layers[i].keys.double().numpy()
        obs = Observed(queries[i].double().numpy(), np.arange(N), np.arange(N), None, x.scale)
        want = keep_top(parse_policy("observed_attention").score(k, obs), 0.5)
        assert (x.pos.numpy() == np.stack([np.flatnonzero(w) for w in want[0]])[None]).all()
    _, layers = teacher_forced_logprobs(model, ids, parse_policy("observed_attention"), 0.5)
    for x in layers:  # token by token: each held key counted once by every query since it arrived
        acc, cnt = x.h2o
        assert torch.equal(cnt[0], (N - x.pos[0]).double())
        assert (acc > 0).all() and x.kept_log[-1] == n_kept(N, 0.5)


def test_rerun_table_says_how_each_pass_ran_and_where_ties_decided(capsys):
    """The printed table carries what the JSON says beside the numbers: the per-token loop and its
    reason where a model fell back to it, and results where a near tie decided the evicted token."""
    from kvtrace.commands.whatif import _print_rerun

    def result(**extra):
        return {"ratio": 0.5, "perplexity": 10.0, "perplexity_change_pct": 1.0, "kl_mean": 0.1, "kl_max": 0.2,
                "top1_agreement": 0.9, "full_layer_tokens_final": 8, "tokens_seen": 16, **extra}

    doc = {"model": "m", "text": "t.txt", "tokens": 16, "scored_positions": 15, "note": "n",
           "reference": {"perplexity": 9.0},
           "policies": [{"label": "knorm", "results": [result(**{"pass": "per_token", "pass_note": "MLA latent cache",
                                                                  "steps_near_tie": 3})]},
                        {"label": "tova", "results": [result(**{"pass": "per_token",
                                                                 "pass_note": "MLA latent cache"})]}]}
    _print_rerun(doc)
    out = capsys.readouterr().out
    assert out.count("computed by the per-token loop: MLA latent cache") == 1
    assert "knorm at 0.50: 3 steps evicted among scores equal to within float rounding" in " ".join(out.split())
    assert "tova at 0.50: " not in out
