"""The rerun in one model pass (kvtrace.whatif.rerun_pass) against its definition, the per-token
loop: the same keep-sets, unscored / over-budget / near-tie steps, and logits to float32 rounding,
policy by policy, on tiny random-weight models (CPU; under transformers 5.17 too with
PYTHONPATH=/tmp/tf517)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtrace.whatif import parse_policy

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtrace.whatif.rerun import _measures, teacher_forced_logprobs  # noqa: E402
from tests.helpers.models import tiny_model, tiny_prompt  # noqa: E402

POLICIES = [(None, None), ("knorm", 0.5), ("random", 0.5), ("streaming_llm", 0.75), ("streaming_llm:window=4", None),
            ("snapkv:window_size=4", 0.5), ("tova", 0.5), ("observed_attention", 0.5),
            ("expected_attention:n_sink=2", 0.5), ("kivi:nbits=2,residual_length=0", None), ("fp8", None)]


def _both(model, ids, name, ratio, prefill):
    pol = None if name is None else parse_policy(name)
    one, la = teacher_forced_logprobs(model, ids, pol, ratio, prefill, mode="one_pass")
    ref, lb = teacher_forced_logprobs(model, ids, pol, ratio, prefill, mode="per_token")
    assert all(x.mode == "one_pass" for x in la) and all(x.mode == "per_token" for x in lb)
    return one, la, ref, lb


def _same(la, lb, name):
    for x, y in zip(la, lb, strict=True):
        assert torch.equal(x.pos, y.pos), name
        assert x.kept_log == y.kept_log and x.unscored == y.unscored and x.over_budget == y.over_budget, name
        assert x.near_ties == y.near_ties, name


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama"), tiny_prompt(24)


@pytest.mark.parametrize("prefill", [0, 5])
@pytest.mark.parametrize("name,ratio", POLICIES)
def test_one_pass_is_the_per_token_loop(llama, name, ratio, prefill):
    model, ids = llama
    one, la, ref, lb = _both(model, ids, name, ratio, prefill)
    _same(la, lb, name)
    np.testing.assert_allclose(one, ref, rtol=0, atol=1e-5)
    if name is not None:  # the measures agree too (against each mode's own reference)
        base_one, _ = teacher_forced_logprobs(model, ids, prefill=prefill)
        base_ref, _ = teacher_forced_logprobs(model, ids, prefill=prefill, mode="per_token")
        flat = ids[0].numpy()
        a, b = _measures(base_one, one, flat, prefill), _measures(base_ref, ref, flat, prefill)
        assert a["kl_mean"] == pytest.approx(b["kl_mean"], rel=1e-4, abs=1e-9)
        assert a["perplexity"] == pytest.approx(b["perplexity"], rel=1e-6)


def test_keydiff_agrees_once_two_keys_no_longer_tie(llama):
    # keydiff at two keys is an exact tie by symmetry (cos(k0, mean) == cos(k1, mean)): float
    # rounding decides it, differently in the two passes; from three keys on it is decided
    model, ids = llama
    one, la, ref, lb = _both(model, ids, "keydiff", 0.5, 3)
    _same(la, lb, "keydiff")
    np.testing.assert_allclose(one, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name,ratio", [p for p in POLICIES if p[0] != "knorm"] + [("keydiff", 0.5)])
def test_one_pass_presses_sliding_layers_as_the_per_token_loop(name, ratio):
    model, ids = tiny_model("gemma3_text", attn_implementation="eager"), tiny_prompt(20)
    one, la, ref, lb = _both(model, ids, name, ratio, 4)
    _same(la, lb, name)
    np.testing.assert_allclose(one, ref, rtol=0, atol=1e-5)


def test_knorm_on_rms_normed_keys_is_a_near_tie_and_says_so():
    # gemma3 normalises keys (k_norm): every key norm is sqrt(head_dim) up to the norm's epsilon,
    # so knorm's keep-set is ordered by float rounding; the layers count those steps
    from kvtrace.whatif.rerun import _kept

    model, ids = tiny_model("gemma3_text", attn_implementation="eager"), tiny_prompt(20)
    _, layers = teacher_forced_logprobs(model, ids, parse_policy("knorm"), 0.5)
    assert _kept(layers)["steps_near_tie"] > 0
    _, layers = teacher_forced_logprobs(tiny_model("llama"), tiny_prompt(20), parse_policy("knorm"), 0.5)
    assert _kept(layers)["steps_near_tie"] == 0


def test_a_model_the_pass_cannot_drive_runs_per_token_and_says_why():
    from kvtrace.errors import Unavailable

    model, ids = tiny_model("deepseek_v3"), tiny_prompt(8)  # caches an MLA latent, up-projected after the cache
    _, layers = teacher_forced_logprobs(model, ids, parse_policy("knorm"), 0.5)
    assert layers[0].mode == "per_token" and "MLA latent" in layers[0].mode_note
    with pytest.raises(Unavailable, match="one model pass cannot drive"):
        teacher_forced_logprobs(model, ids, parse_policy("knorm"), 0.5, mode="one_pass")
    from transformers.modeling_utils import AttentionInterface

    assert not any(k.startswith("kvtrace_q") for k in AttentionInterface._global_mapping)  # wrappers removed
