"""Failed requests are checked like any other, and owner readings land in the trace (CPU):
an exception still leaving the recording's with-block is not judged, a retry inside the except block
holds the failed request's cache (named, medium at most), the effective generate settings are
recorded, and every /owners reading is valid."""

from __future__ import annotations

import json
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvtrace  # noqa: E402
from kvtrace.analyzer.base import Severity  # noqa: E402
from kvtrace.format import Trace, schema  # noqa: E402
from kvtrace.format.validate import validate  # noqa: E402
from tests.helpers.models import tiny_model, tiny_prompt  # noqa: E402


def _raising(at: int, exc: BaseException):
    from transformers import StoppingCriteria

    class RaiseAt(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            if input_ids.shape[-1] >= at:
                raise exc
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    return RaiseAt()


def _gen(m, **kw):
    return m.generate(tiny_prompt(6), max_new_tokens=6, do_sample=False, **kw)


def _notes(t: Trace) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for e in t.events.where(kind=schema.EventKind.NOTE):
        out.setdefault(int(e["request"]), []).append(t.text(int(e["text_off"]), int(e["text_len"])))
    return out


def test_exception_leaving_the_with_block_is_not_judged(tmp_path):
    m = tiny_model("llama")
    path = tmp_path / "prop.kvt.h5"
    with pytest.raises(ValueError), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with kvtrace.record(m, path):
            _gen(m, stopping_criteria=[_raising(9, ValueError("boom"))])
    with Trace(path) as t:
        assert t.nrows("retention") == 0
        assert any("still propagating" in n for n in _notes(t)[0])
        (req,) = t.requests[:]
        assert int(req["outcome"]) == int(schema.Outcome.ERROR)
    assert not [f for f in kvtrace.analyze(path).findings if f.severity >= Severity.LOW]


def test_retry_inside_the_except_block_names_the_handled_exception(tmp_path):
    m = tiny_model("llama")
    path = tmp_path / "retry.kvt.h5"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with kvtrace.record(m, path):
            try:
                _gen(m, stopping_criteria=[_raising(9, RuntimeError("flaky"))])
            except RuntimeError:
                _gen(m)  # the retry: the failed request's traceback (and cache) is alive meanwhile
    r = kvtrace.analyze(path)
    (f,) = [f for f in r.result("post_eos").findings if f.requests == [0]]
    assert f.kind == "retained_after_request" and Severity.LOW <= f.severity <= Severity.MEDIUM, f.message
    assert "the exception being handled now (RuntimeError)" in f.message and "retry" in f.message


def test_effective_settings_and_owner_rows_are_recorded_and_valid(tmp_path):
    m = tiny_model("qwen3")
    path = tmp_path / "eff.kvt.h5"
    kept = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with kvtrace.record(m, path):
            kept.append(_gen(m, return_dict_in_generate=True, output_scores=True, num_beams=2))
            _gen(m)
    with Trace(path) as t:
        args = json.loads(t.text(int(t.requests[:][0]["gen_args_off"]), int(t.requests[:][0]["gen_args_len"])))
        eff = args["_effective"]
        assert eff["output_scores"] is True and eff["num_beams"] == 2 and eff["return_dict_in_generate"] is True
        assert not eff.get("output_logits") and eff.get("num_return_sequences", 1) == 1  # defaults
        rows = t["owners"][:]
        end = rows[(rows["request"] == 0) & (rows["moment"] == int(schema.OwnerMoment.REQUEST_END))]
        owners = {schema.Owner(int(o)) for o in end["owner"]}
        assert {schema.Owner.KV_REQUEST, schema.Owner.WEIGHTS, schema.Owner.GENERATE_OUTPUT} <= owners
        assert all(int(x["largest_bytes"]) <= int(x["bytes"]) for x in rows)
    report = validate(path)
    assert not report.problems, report.problems
    kept.clear()
