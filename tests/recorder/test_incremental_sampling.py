"""Incremental sampling (SamplingSettings.tokens == "new"): only tokens no earlier sample holds."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvtrace  # noqa: E402
from kvtrace.format import PayloadKind  # noqa: E402
from kvtrace.recorder.sampling import SamplingSettings, unsampled_tokens  # noqa: E402
from tests.helpers.models import tiny_model, tiny_prompt  # noqa: E402


def test_unsampled_tokens_cuts_on_the_token_axis():
    x = torch.arange(2 * 3 * 10 * 4).reshape(2, 3, 10, 4)  # tokens 5..14
    view, start = unsampled_tokens(x, 5, None)
    assert view is x and start == 5
    view, start = unsampled_tokens(x, 5, 12)
    assert start == 12 and view.shape == (2, 3, 3, 4) and torch.equal(view, x[:, :, 7:])
    assert view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()  # a view, no copy
    assert unsampled_tokens(x, 5, 15) == (None, 15)
    assert unsampled_tokens(x, 5, 3)[1] == 5  # everything is newer than what was sampled
    latent = torch.zeros(1, 6, 8)  # [B, T, D]: tokens on axis 1
    assert unsampled_tokens(latent, 0, 4)[0].shape == (1, 2, 8)


def test_tokens_setting_is_checked():
    with pytest.raises(ValueError, match="tokens must be one of"):
        SamplingSettings(every_n_steps=2, tokens="some")


def test_a_dropped_sample_is_retried_at_the_next_sampling_step(tmp_path):
    """A sample the queue refused leaves no hole: the next one starts where the last stored one ended."""
    model = tiny_model("llama")
    path = tmp_path / "drop.kvt.h5"
    refused = []
    with kvtrace.record(model, str(path), sampling={"every_n_steps": 2}) as rec, torch.no_grad():
        submit = rec.sampler.submit

        def flaky(request, step, layer, kind, tensor, **kw):
            if step == 2 and layer == 0 and kind == PayloadKind.KEY:
                refused.append(kw["token_start"])
                return False  # as when the queue is full
            return submit(request, step, layer, kind, tensor, **kw)

        rec.sampler.submit = flaky
        model.generate(tiny_prompt(6), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    with kvtrace.open(str(path)) as trace:
        index = trace.payload_index[:]
        keys0 = sorted((trace.payload(i) for i in range(len(index))
                        if int(index[i]["layer"]) == 0 and int(index[i]["kind"]) == int(PayloadKind.KEY)),
                       key=lambda p: p.step)
    assert refused == [6]  # step 2 would have held positions 6..7; step 4 holds 6..9
    assert [(p.step, p.token_start, p.shape[2]) for p in keys0] == [(0, 0, 6), (4, 6, 4), (5, 10, 1)]
