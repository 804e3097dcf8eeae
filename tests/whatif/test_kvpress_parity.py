"""Our offline scorers against NVIDIA kvpress's own ``score`` methods on the same tensors.

kvpress 0.5.5 pins transformers < 5.3, so it is not a dependency: CI installs it best effort with
``pip install --no-deps --target /tmp/kvpress kvpress==0.5.5`` and this module imports only the
press modules (their package ``__init__`` pulls optional dependencies), from ``$KVPRESS_PATH`` or
/tmp/kvpress. Without it every test here skips and says why; the formulas are also checked without
kvpress on hand-built cases in test_policies.py / test_expected_attention.py.

What is compared: for each press and compression ratio, kvpress's scores [B, Hk, T] equal ours
(float64, rtol 1e-9) wherever both score a key, and the keep-set of kvpress's own
``topk(compute_n_kept(T, ratio))`` equals ours. kvpress scores keys in a prefill: queries at every
position, attention given as the eager attention matrix (the path kvpress takes with
``attn_implementation="eager"``).

The last tests read real captures back from a trace (kvtrace.record, every step sampled, the
replay's own source.units): a decode-heavy one (12 prompt tokens, 36 generated, llama GQA) and a
sliding-window one (mistral, window 8, the 7 held keys), against kvpress given the model's own
hidden states, RoPE and eager attention for the same tokens.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kvtrace.whatif import parse_policy
from kvtrace.whatif.policies import Observed, keep_top, n_kept

torch = pytest.importorskip("torch")

KVPRESS = Path(os.environ.get("KVPRESS_PATH", "/tmp/kvpress"))


def _press(module: str, cls: str):
    """A press class, imported without running kvpress/__init__.py (its optional imports)."""
    root = KVPRESS / "kvpress"
    if not (root / "presses" / f"{module}.py").is_file():
        pytest.skip(f"kvpress not installed at {KVPRESS} (pip install --no-deps --target {KVPRESS} kvpress==0.5.5)")
    if str(KVPRESS) not in sys.path:
        sys.path.insert(0, str(KVPRESS))
    for name, path in (("kvpress", root), ("kvpress.presses", root / "presses")):
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(path)]
            sys.modules[name] = pkg
    try:
        return getattr(importlib.import_module(f"kvpress.presses.{module}"), cls)
    except ImportError as exc:
        pytest.skip(f"kvpress press {module} does not import beside this transformers: {exc}")


B, HK, G, T, D = 2, 2, 2, 24, 8
HQ = HK * G
RATIOS = (0.25, 0.5, 0.75)


@pytest.fixture(scope="module")
def tensors():
    rng = np.random.default_rng(7)
    q = rng.normal(size=(B, HQ, T, D))
    k = rng.normal(size=(B, HK, T, D))
    v = rng.normal(size=(B, HK, T, D))
    k[0, 1, 9] *= 4  # a loud key and a heavy hitter so the policies disagree
    q[..., 0] += 2.0
    k[..., 5, 0] += 3.0
    return q, k, v


def _eager_attention(q, k):
    """Causal softmax(q k^T / sqrt(d)) [B, Hq, T, T], what an eager prefill hands kvpress."""
    kk = np.repeat(k, G, axis=1)
    logits = np.einsum("bhqd,bhkd->bhqk", q, kk) / math.sqrt(D)
    logits = np.where(np.tril(np.ones((T, T), bool)), logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def _module():
    return SimpleNamespace(head_dim=D, config=SimpleNamespace(num_attention_heads=HQ, num_key_value_heads=HK))


def _obs(q):
    return Observed(q, np.arange(T), np.arange(T), None, 1 / math.sqrt(D))


def _t(x):
    return torch.from_numpy(np.ascontiguousarray(x)).double()


def _kvpress_keep(scores, ratio):
    idx = scores.topk(n_kept(T, ratio), dim=-1).indices.numpy()
    keep = np.zeros(scores.shape, bool)
    np.put_along_axis(keep, idx, True, axis=-1)
    return keep


def _compare(theirs, ours, ratio, scored):
    np.testing.assert_allclose(ours[..., scored], theirs.numpy()[..., scored], rtol=1e-9, atol=1e-12)
    assert (keep_top(ours, ratio) == _kvpress_keep(theirs, ratio)).all()


CASES = [  # (our policy, kvpress module, class, kvpress kwargs, scored keys)
    ("knorm", "knorm_press", "KnormPress", {}, slice(None)),
    ("keydiff", "keydiff_press", "KeyDiffPress", {}, slice(None)),
    ("observed_attention", "observed_attention_press", "ObservedAttentionPress", {}, slice(None)),
    ("tova", "tova_press", "TOVAPress", {}, slice(0, T - 1)),  # both keep the last token
    ("snapkv:window_size=6,kernel_size=5", "snapkv_press", "SnapKVPress", {"window_size": 6, "kernel_size": 5},
     slice(0, T - 6)),
]


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("policy,module,cls,kw,scored", CASES, ids=[c[0].split(":")[0] for c in CASES])
def test_scorer_matches_kvpress(tensors, policy, module, cls, kw, scored, ratio):
    q, k, v = tensors
    press = _press(module, cls)(compression_ratio=ratio, **kw)
    theirs = press.score(_module(), _t(np.zeros((B, T, 1))), _t(k), _t(v), _t(_eager_attention(q, k)), {})
    ours = parse_policy(policy).score(k, _obs(q), v)
    _compare(theirs, ours, ratio, scored)


@pytest.mark.parametrize("ratio", RATIOS)
def test_streaming_llm_matches_kvpress(tensors, ratio):
    _, k, v = tensors
    press = _press("streaming_llm_press", "StreamingLLMPress")(compression_ratio=ratio, n_sink=3)
    theirs = press.score(_module(), None, _t(k), _t(v), None, {})
    ours = parse_policy("streaming_llm:n_sink=3").plan(k, ratio)
    assert (ours == (theirs.numpy() > 0)).all()  # kvpress scores 1 = kept, 0 = pruned: no ties to break
    assert (ours == _kvpress_keep(theirs, ratio)).all()


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("cov,vnorm", [(True, True), (False, True), (True, False)])
def test_expected_attention_formula_matches_kvpress(tensors, ratio, cov, vnorm):
    """The scoring formula only: kvpress's query statistics (pre-RoPE prefill queries rotated by
    the averaged future RoPE) are replaced by ours (the sampled post-RoPE queries at positions >=
    n_sink) on both sides -- that replacement is the documented stand-in, not a formula."""
    q, k, v = tensors
    press = _press("expected_attention_press", "ExpectedAttentionPress")(
        compression_ratio=ratio, n_sink=2, use_covariance=cov, use_vnorm=vnorm)
    qs = q[:, :, 2:]
    mu = qs.mean(axis=2)
    c = qs - mu[:, :, None]
    press.get_query_statistics = lambda module, h: (_t(mu), _t(np.einsum("bhsi,bhsj->bhij", c, c) / qs.shape[2]) if cov else None)
    theirs = press.score(_module(), None, _t(k), _t(v), None, {})
    ours = parse_policy(f"expected_attention:n_sink=2,use_covariance={cov},use_vnorm={vnorm}").score(k, _obs(q), v)
    _compare(theirs, ours, ratio, slice(2, None))
    assert np.isinf(ours[..., :2]).all()  # kvpress pads the sinks with max + 1: always kept


def test_n_kept_matches_kvpress_compute_n_kept():
    _press("knorm_press", "KnormPress")
    from kvpress.utils import compute_n_kept

    for t in (1, 2, 3, 7, 24, 100):
        for r in (0.0, 0.1, 0.5, 0.9, 0.99):
            assert n_kept(t, r) == compute_n_kept(t, r)


@pytest.fixture(scope="module")
def llama_prefill():
    """A tiny llama's layer-0 prefill: kvpress's inputs (module, hidden states, RoPE, K, V, eager
    attention) and what a kvtrace trace holds instead (post-RoPE queries via QueryCapture)."""
    pytest.importorskip("transformers")
    from transformers import DynamicCache

    from kvtrace.recorder.qcapture import QueryCapture
    from tests.helpers.models import tiny_model, tiny_prompt

    model = tiny_model("llama", attn_implementation="eager")
    attn = model.model.layers[0].self_attn
    got: dict[str, object] = {}

    def pre(module, args, kwargs):
        got["h"], got["pe"] = kwargs["hidden_states"], kwargs["position_embeddings"]

    handle = attn.register_forward_pre_hook(pre, with_kwargs=True)
    queries: dict[int, object] = {}
    cache = DynamicCache(config=model.config)
    try:
        with torch.no_grad(), QueryCapture(model, lambda layer, q: queries.setdefault(layer, q.clone())):
            out = model(tiny_prompt(20), past_key_values=cache, use_cache=True, output_attentions=True)
    finally:
        handle.remove()
    return {"module": attn, "h": got["h"], "pe": got["pe"], "k": cache.layers[0].keys, "v": cache.layers[0].values,
            "attn": out.attentions[0], "q": queries[0].double().numpy()}


@pytest.mark.parametrize("policy,module,cls,kw,attn", [
    ("snapkv:window_size=4,kernel_size=3", "snapkv_press", "SnapKVPress", {"window_size": 4, "kernel_size": 3}, False),
    ("tova", "tova_press", "TOVAPress", {}, False),
    ("observed_attention", "observed_attention_press", "ObservedAttentionPress", {}, True),
])
def test_kvpress_on_a_real_model_equals_ours_on_captured_post_rope_queries(llama_prefill, policy, module, cls, kw, attn):
    """kvpress computes its queries itself (q_proj + RoPE from the hidden states, or the eager
    attention matrix); ours scores with the post-RoPE queries a trace samples. Same keep-sets."""
    x = llama_prefill
    press = _press(module, cls)(compression_ratio=0.5, **kw)
    with torch.no_grad():
        theirs = press.score(x["module"], x["h"], x["k"], x["v"], x["attn"] if attn else None,
                             {"position_embeddings": x["pe"]}).double()
    k, v = x["k"].double().numpy(), x["v"].double().numpy()
    T = k.shape[2]
    obs = Observed(x["q"], np.arange(T), np.arange(T), None, float(x["module"].scaling))
    ours = parse_policy(policy).score(k, obs, v)
    scored = np.isfinite(ours[0, 0])
    np.testing.assert_allclose(ours[..., scored], theirs.numpy()[..., scored], rtol=1e-4, atol=1e-7)
    keep_theirs = np.zeros(theirs.shape, bool)
    np.put_along_axis(keep_theirs, theirs.topk(n_kept(T, 0.5), dim=-1).indices.numpy(), True, axis=-1)
    assert (keep_top(ours, 0.5) == keep_theirs).all()


# ---- decode-heavy and sliding-window captures, read back from a recorded trace ----------------


def _recorded(tmp_path_factory, name: str, prompt: int, gen: int, layer: int):
    """A capture through kvtrace.record (K/V and post-RoPE queries at every step) read back as the
    replay reads it (source.units, the last step), and kvpress's own inputs for the same tokens:
    the model's hidden states, RoPE and eager attention of ``layer`` over the whole sequence."""
    pytest.importorskip("transformers")
    import kvtrace
    from kvtrace.recorder.sampling import SamplingSettings
    from kvtrace.whatif import source
    from tests.helpers.models import tiny_model, tiny_prompt

    model = tiny_model(name, attn_implementation="eager")
    path = tmp_path_factory.mktemp("parity") / f"{name}.kvt.h5"
    with kvtrace.record(model, path, sampling=SamplingSettings(every_n_steps=1, queries=True)):
        out = model.generate(tiny_prompt(prompt), max_new_tokens=gen, min_new_tokens=gen, do_sample=False)
    from kvtrace.format.reader import Trace

    with Trace(path) as t:
        u = next(x for x in source.units(t, "last") if x.layer == layer)
    attn = model.model.layers[layer].self_attn
    got: dict[str, object] = {}

    def pre(module, args, kwargs):
        got["h"], got["pe"] = kwargs["hidden_states"], kwargs["position_embeddings"]

    handle = attn.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with torch.no_grad():
            full = model(out[:, :-1], output_attentions=True)  # the tokens the cache saw
    finally:
        handle.remove()
    q = np.concatenate([u.obs_q, u.eval_q], axis=2)  # every query: kvpress scores with all of them
    pos = np.concatenate([u.obs_pos, u.eval_pos])
    return {"module": attn, "h": got["h"], "pe": got["pe"], "attn": full.attentions[layer], "unit": u,
            "obs": Observed(q, pos, u.k_pos, u.window, u.scale), "T": int(out.shape[1]) - 1}


@pytest.fixture(scope="module")
def decode_heavy(tmp_path_factory):
    # 12 prompt tokens, 36 generated: three quarters of the cache written one token at a time
    return _recorded(tmp_path_factory, "llama", 12, 37, 1)


@pytest.fixture(scope="module")
def sliding(tmp_path_factory):
    # mistral, every layer sliding (window 8): the cache holds the last 7 positions
    return _recorded(tmp_path_factory, "mistral", 16, 9, 0)


def _theirs(x, module, cls, kw, ratio, attn):
    u = x["unit"]
    press = _press(module, cls)(compression_ratio=ratio, **kw)
    with torch.no_grad():
        s = press.score(x["module"], x["h"], torch.from_numpy(u.k), torch.from_numpy(u.v),  # fp32, as the model
                        x["attn"] if attn else None, {"position_embeddings": x["pe"]}).double()
    keep = np.zeros(s.shape, bool)
    np.put_along_axis(keep, s.topk(n_kept(u.k.shape[2], ratio), dim=-1).indices.numpy(), True, axis=-1)
    return s.numpy(), keep


DECODE_CASES = [
    ("knorm", "knorm_press", "KnormPress", {}, False),
    ("keydiff", "keydiff_press", "KeyDiffPress", {}, False),
    ("snapkv:window_size=8,kernel_size=5", "snapkv_press", "SnapKVPress", {"window_size": 8, "kernel_size": 5}, False),
    ("tova", "tova_press", "TOVAPress", {}, False),
    ("observed_attention", "observed_attention_press", "ObservedAttentionPress", {}, True),
]


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("policy,module,cls,kw,attn", DECODE_CASES, ids=[c[0].split(":")[0] for c in DECODE_CASES])
def test_decode_heavy_capture_keeps_what_kvpress_keeps(decode_heavy, policy, module, cls, kw, attn, ratio):
    """kvpress on the whole 48-token sequence (its inputs from the model) against ours on the
    trace's decode-time K/V and queries: the same scores where both score, the same keep-set."""
    x = decode_heavy
    u = x["unit"]
    assert u.k.shape[2] == x["T"] == 48 and len(x["obs"].q_pos) == 48  # every position's query sampled
    theirs, keep_theirs = _theirs(x, module, cls, kw, ratio, attn)
    pol = parse_policy(policy)
    ours = pol.score(u.k.astype(np.float64), x["obs"], u.v.astype(np.float64))
    scored = np.isfinite(ours[0, 0])
    np.testing.assert_allclose(ours[..., scored], theirs[..., scored], rtol=1e-4, atol=1e-7)
    keep, _ = pol.plan_info(u.k.astype(np.float64), ratio, x["obs"], u.v.astype(np.float64), k_pos=u.k_pos)
    assert (keep == keep_theirs).all()


@pytest.mark.parametrize("ratio", (0.25, 0.5))
@pytest.mark.parametrize("policy,module,cls,kw", [
    ("knorm", "knorm_press", "KnormPress", {}),
    ("snapkv:window_size=2,kernel_size=3", "snapkv_press", "SnapKVPress", {"window_size": 2, "kernel_size": 3}),
    ("tova", "tova_press", "TOVAPress", {}),
    ("streaming_llm:n_sink=2", "streaming_llm_press", "StreamingLLMPress", {"n_sink": 2}),
], ids=["knorm", "snapkv", "tova", "streaming_llm"])
def test_sliding_window_capture_keeps_what_kvpress_keeps(sliding, policy, module, cls, kw, ratio):
    """A sliding layer holds window - 1 = 7 keys; kvpress (which presses mistral's sliding layers)
    scores those held keys with the window queries computed from the hidden states; ours scores
    the trace's keys with its sampled queries, each seeing its own window. Same keep-set.
    (observed_attention is left out: kvpress hands its scorer the eager attention over the whole
    sequence, whose key axis does not match the 7 held keys.)"""
    x = sliding
    u = x["unit"]
    assert u.window == 8 and u.k.shape[2] == 7 and u.k_pos.tolist() == list(range(x["T"] - 7, x["T"]))
    theirs, keep_theirs = _theirs(x, module, cls, kw, ratio, False)
    pol = parse_policy(policy)
    keep, _ = pol.plan_info(u.k.astype(np.float64), ratio, x["obs"], u.v.astype(np.float64), k_pos=u.k_pos,
                            window=u.window)
    if policy == "knorm":  # a repeated token has the same key norm at both positions (RoPE keeps norms):
        s = theirs  # equal scores, ours keeps the older, torch's topk either -- the same kept scores
        assert (keep.sum(-1) == keep_theirs.sum(-1)).all()
        for h in range(keep.shape[1]):
            np.testing.assert_allclose(np.sort(s[0, h][keep[0, h]]), np.sort(s[0, h][keep_theirs[0, h]]), rtol=1e-6)
        return
    assert (keep == keep_theirs).all()
