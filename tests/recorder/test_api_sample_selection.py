"""The Python API refuses a content-sampling selection that matches nothing in the model, before
recording starts, with the rule the CLI applies (kvtrace.geometry.selection_problem): otherwise
the trace would claim tensor contents it does not hold. An in-range selection is the control."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import kvtrace  # noqa: E402
from kvtrace.format import Trace  # noqa: E402
from kvtrace.recorder.sampling import SamplingSettings  # noqa: E402
from tests.helpers.models import tiny_model, tiny_prompt  # noqa: E402


@pytest.mark.parametrize(("layers", "heads", "words"), [
    ([7], None, "out of range"),
    (None, [99], r"KV head\(s\) 99 out of range"),
])
def test_selection_matching_nothing_is_refused_before_recording(tmp_path, layers, heads, words):
    m = tiny_model("llama")
    path = tmp_path / "sel.kvt.h5"
    with pytest.raises(ValueError, match=words):
        kvtrace.record(m, path, sampling=SamplingSettings(every_n_steps=2, layers=layers, heads=heads))
    assert not path.exists()
    assert "generate" not in m.__dict__  # nothing was patched


def test_selection_in_range_stores_what_it_claims(tmp_path):
    m = tiny_model("llama")
    path = tmp_path / "ok.kvt.h5"
    with kvtrace.record(m, path, sampling=SamplingSettings(every_n_steps=2, layers=[1], heads=[0])):
        m.generate(tiny_prompt(6), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    with Trace(path) as t:
        assert t.meta.contains_tensor_payloads
        idx = t.payload_index[:]
        assert len(idx) > 0 and set(idx["layer"].tolist()) == {1}
