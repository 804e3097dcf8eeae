"""The recorder's parts: typed rows match the schema, observers are handed in and see what
the trace holds, a failing observer is a recorder error, and the recorder imports no exporter."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from rec_helpers import generate, model

import kvtrace
from kvtrace.format import schema
from kvtrace.format.reader import Trace
from kvtrace.format.schema import EventKind
from kvtrace.recorder import rows
from kvtrace.recorder.observers import RecorderObserver
from kvtrace.recorder.options import RecordOptions
from kvtrace.recorder.session import Recorder

TABLES = {rows.EventRow: schema.EVENTS, rows.ReadingRow: schema.READINGS, rows.RequestRow: schema.REQUESTS,
          rows.KvRow: schema.KV, rows.StepRow: schema.STEPS, rows.LayerRow: schema.LAYERS,
          rows.RetentionRow: schema.RETENTION}


@pytest.mark.parametrize("row", list(TABLES), ids=lambda r: r.__name__)
def test_typed_rows_are_the_schema_columns_in_order(row):
    assert row._fields == TABLES[row].names


class Spy:
    """A live observer that keeps what it was told."""

    name = "spy"

    def __init__(self, fail_on: str | None = None) -> None:
        self.calls: list[tuple] = []
        self.fail_on = fail_on

    def _note(self, *call: object) -> None:
        self.calls.append(call)
        if call[0] == self.fail_on:
            raise RuntimeError(f"{self.fail_on} broke")

    def start(self) -> Spy:
        self._note("start")
        return self

    def close(self) -> None:
        self._note("close")

    def on_session_start(self, model, model_type, rss=None):
        self._note("session", model_type)

    def on_request_start(self, request=None):
        self._note("request_start", request)

    def on_step(self, phase="decode", tokens_seen=None):
        self._note("step", phase, tokens_seen)

    def on_kv(self, layer, layer_type, nbytes):
        self._note("kv", layer, layer_type, nbytes)

    def on_memory(self, device, used_bytes=None, **values):
        self._note("memory", device)

    def on_request_end(self, outcome="ok", new_tokens=0):
        self._note("request_end", outcome, new_tokens)

    def on_dropped_samples(self, n=1):
        self._note("dropped", n)

    def on_recorder_error(self):
        self._note("recorder_error")


def test_an_observer_sees_what_the_trace_holds(tmp_path):
    spy = Spy()
    assert isinstance(spy, RecorderObserver)
    m = model("llama")
    path = tmp_path / "obs.kvt.h5"
    with Recorder(m, path, observers=[spy]) as rec:
        generate(m, new=4)
    assert rec.exporter is None  # no live metrics asked for in the options
    names = [c[0] for c in spy.calls]
    assert names[:2] == ["start", "session"] and names[-1] == "close"
    assert ("request_start", 0) in spy.calls and ("request_end", "ok", 4) in spy.calls
    assert names.count("step") == 4  # every forward, structure read or not
    with Trace(path) as t:
        kv = t.kv[:]
        last = kv[kv["step"] == kv["step"].max()]
        want = {(int(r["layer"]), int(r["bytes_unique"])) for r in last}
        recorded = sorted(set(t.steps[:]["step"].tolist()))
    kv_calls = [c for c in spy.calls if c[0] == "kv"]
    assert len(kv_calls) == len(recorded) * len(want)  # one per layer per structure read
    assert {(c[1], c[3]) for c in kv_calls[-len(want):]} == want


def test_a_failing_observer_is_a_recorder_error_not_the_models(tmp_path):
    m = model("llama")
    ref = generate(m, new=3)
    spy = Spy(fail_on="step")
    path = tmp_path / "bad.kvt.h5"
    with Recorder(m, path, observers=[spy]) as rec:
        out = generate(m, new=3)
    assert out.equal(ref)
    assert rec.recorder_errors == 3
    assert ("recorder_error",) in spy.calls
    with Trace(path) as t:
        ev = t.events.where(kind=EventKind.RECORDER_ERROR)
        assert "spy: RuntimeError: step broke" in t.text(int(ev[0]["text_off"]), int(ev[0]["text_len"]))


def test_prometheus_options_without_a_factory_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="kvtrace.record"):
        Recorder(model("llama"), tmp_path / "p.kvt.h5", RecordOptions(prometheus="127.0.0.1:0"))


def test_the_recorder_imports_no_exporter_or_report():
    root = Path(kvtrace.__file__).parent / "recorder"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert not name.startswith(("kvtrace.export", "kvtrace.report", "kvtrace.commands")), (path, name)
