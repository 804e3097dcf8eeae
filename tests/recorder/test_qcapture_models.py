"""Query capture on tiny CPU models: right shape, truly post-RoPE (recomputed by hand), outputs
unchanged while installed, and the model exactly as before after restore()."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers.masking_utils import AttentionMaskInterface  # noqa: E402
from transformers.modeling_utils import AttentionInterface  # noqa: E402

from kvtrace.recorder.qcapture import QueryCapture  # noqa: E402
from tests.helpers.models import tiny_model, tiny_prompt  # noqa: E402

T = 7


def _rope_by_hand(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE written out here, independent of the model file: [B, H, T, D] with cos/sin [B, T, *]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = q.shape[-1] // 2
    x1, x2 = q[..., :half], q[..., half:]
    if cos.shape[-1] == q.shape[-1]:  # llama style: cos/sin repeated over both halves
        return q * cos + torch.cat((-x2, x1), dim=-1) * sin
    assert cos.shape[-1] == half  # gpt-oss style: one cos/sin per pair
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _attention_modules(model):
    return [m for m in model.modules() if hasattr(m, "q_proj") and isinstance(getattr(m, "layer_idx", None), int)]


def _attn_state(model):
    """Everything restore() must put back: each config's attn field (present or not) and the registries."""
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    fields = sorted(
        (type(c).__name__, "_attn_implementation_internal" in c.__dict__, c.__dict__.get("_attn_implementation_internal"))
        for c in configs.values()
    )
    return fields, sorted(AttentionInterface._global_mapping), sorted(AttentionMaskInterface._global_mapping)


@pytest.mark.parametrize("name", ["llama", "gpt_oss"])
def test_queries_are_post_rope_and_match_hand_computation(name: str) -> None:
    model = tiny_model(name)
    ids = tiny_prompt(T)
    inputs: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = {}

    def grab_inputs(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        inputs[module.layer_idx] = (hidden.detach().clone(), kwargs["position_embeddings"])

    handles = [m.register_forward_pre_hook(grab_inputs, with_kwargs=True) for m in _attention_modules(model)]
    captured: dict[int, torch.Tensor] = {}
    with torch.no_grad(), QueryCapture(model, lambda layer, q: captured.__setitem__(layer, q.clone())) as qc:
        model(ids)
    for h in handles:
        h.remove()

    cfg = model.config
    assert sorted(captured) == list(range(cfg.num_hidden_layers))
    for layer, q in captured.items():
        assert tuple(q.shape) == (1, cfg.num_attention_heads, T, cfg.head_dim)  # [B, Hq, T, D]
        attn = _attention_modules(model)[layer]
        hidden, (cos, sin) = inputs[layer]
        with torch.no_grad():
            pre = attn.q_proj(hidden).view(1, T, -1, cfg.head_dim).transpose(1, 2)
        post = _rope_by_hand(pre, cos, sin)
        torch.testing.assert_close(q, post, rtol=1e-5, atol=1e-6)
        # Position 0 is not rotated; every later position is: this is a post-RoPE query.
        torch.testing.assert_close(q[:, :, 0], pre[:, :, 0], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(q[:, :, 1:], pre[:, :, 1:])
    assert qc.group_sizes == dict.fromkeys(range(cfg.num_hidden_layers), cfg.num_attention_heads // cfg.num_key_value_heads)
    assert qc.errors == 0


@pytest.mark.parametrize("name", ["llama", "gpt_oss"])
def test_outputs_identical_during_and_after_and_restore_is_exact(name: str) -> None:
    model = tiny_model(name)
    ids = tiny_prompt(5)
    before_state = _attn_state(model)
    original = model.config._attn_implementation
    gen = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    with torch.no_grad():
        logits_before = model(ids).logits
        tokens_before = model.generate(ids, **gen)

    calls: list[tuple[int, tuple[int, ...]]] = []
    qc = QueryCapture(model, lambda layer, q: calls.append((layer, tuple(q.shape))))
    qc.install()
    assert model.config._attn_implementation == qc.name_for(original)
    assert model.config._attn_implementation != original
    with torch.no_grad():
        logits_during = model(ids).logits
        tokens_during = model.generate(ids, **gen)
    qc.restore()
    qc.restore()  # idempotent

    with torch.no_grad():
        logits_after = model(ids).logits
        tokens_after = model.generate(ids, **gen)
    assert torch.equal(logits_before, logits_during)
    assert torch.equal(logits_before, logits_after)
    assert torch.equal(tokens_before, tokens_during)
    assert torch.equal(tokens_before, tokens_after)
    assert model.config._attn_implementation == original
    assert _attn_state(model) == before_state
    n_layers = model.config.num_hidden_layers
    # forward (1 call per layer) + generate (prefill + 5 decode forwards; the 6th token needs none)
    assert len(calls) == n_layers * (1 + 6)
    assert {shape[2] for _, shape in calls} == {5, 1}  # prefill T=5 then decode T=1


def test_callback_errors_never_reach_the_model() -> None:
    model = tiny_model("llama")
    ids = tiny_prompt(4)
    with torch.no_grad():
        expected = model(ids).logits

    def broken(layer: int, q: torch.Tensor) -> None:
        raise ValueError("recorder bug")

    with torch.no_grad(), QueryCapture(model, broken) as qc:
        got = model(ids).logits
    assert torch.equal(expected, got)
    assert qc.errors == model.config.num_hidden_layers
    assert "recorder bug" in qc.last_error


def test_modules_filter_and_unset_config_field_restored_as_unset() -> None:
    model = tiny_model("llama")
    only = _attention_modules(model)[1]
    seen: list[int] = []
    with torch.no_grad(), QueryCapture(model, lambda layer, q: seen.append(layer), modules=[only]):
        model(tiny_prompt(3))
    assert seen == [1]

    # Two captures on one model nest and unwind exactly.
    before = _attn_state(model)
    outer = QueryCapture(model, lambda layer, q: None)
    inner = QueryCapture(model, lambda layer, q: None)
    outer.install()
    inner.install()
    assert model.config._attn_implementation == inner.name_for(outer.name_for("sdpa"))
    inner.restore()
    assert model.config._attn_implementation == outer.name_for("sdpa")
    outer.restore()
    assert _attn_state(model) == before
