"""The recorder's NOTE events in `kvtrace info` (a "notes:" block, bounded) and `kvtrace analyze`
(terminal, and a "notes" list in the JSON): a real continuous-batching recording (the manager's
note: no per-layer rows, CUDA-graph / async settings), and a recording given many notes (grouping,
the 8-line bound, the data notes left out). Traces without notes keep their documents unchanged
(tests/golden)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers.cli_run import run_main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving_detectors"))

from kvtrace.analyzer.notes import MAX_REQUESTS, SHOWN  # noqa: E402
from kvtrace.format.schema import EventKind  # noqa: E402


def _info(path: Path, capsys, *extra: str) -> tuple[int, str]:
    code, out, err = run_main(["info", str(path), *extra], capsys)
    assert err == "", err
    return code, out


def _analyze(path: Path, capsys, *extra: str) -> tuple[int, str]:
    code, out, _ = run_main(["analyze", str(path), *extra], capsys)
    return code, out


def test_the_managers_note_of_a_continuous_batching_recording(tmp_path, capsys):
    pytest.importorskip("transformers.generation.continuous_batching")
    import serving_scenarios as S

    # a small pool: a default one is sized from free memory (18 s of allocation on a CPU host)
    trace = S.batch(tmp_path / "cb.kvt.h5", [20, 30, 40], 4, page_size=16, num_blocks=32, max_batch_tokens=128)
    code, out = _info(trace, capsys, "--json")
    doc = json.loads(out)
    (note,) = doc["notes"]
    assert note["text"].startswith("continuous-batching manager 0: no per-layer rows") and note["count"] == 1
    assert "CUDA graphs (varlen, decode)" in note["text"] and note["requests"] == []
    code, out = _info(trace, capsys)
    assert code == 0 and "\nnotes:     continuous-batching manager 0: no per-layer rows" in out
    code, out = _analyze(trace, capsys, "--json")
    report = json.loads(out)["reports"][0]
    assert report["notes"] == doc["notes"]
    code, out = _analyze(trace, capsys)
    assert "\nnotes   continuous-batching manager 0: no per-layer rows" in out


def _plain_recording(path: Path, notes: list[tuple[int, str]]) -> Path:
    """A generate() recording of the tiny llama, with ``notes`` (request, text) written as NOTE events
    through the recording's session (as kvtrace serve's phase fallback writes its NOTE)."""
    import torch

    import kvtrace
    from tests.helpers.models import tiny_model

    model = tiny_model("llama")
    with kvtrace.record(model, path) as rec:
        model.generate(torch.tensor([[1, 5, 6, 7]]), max_new_tokens=2, min_new_tokens=2, do_sample=False)
        for rid, text in notes:
            rec._ctx.event(EventKind.NOTE, rid, text=text)
    return path


def test_notes_are_grouped_bounded_and_data_notes_left_out(tmp_path, capsys):
    notes = [(-1, f"distinct note {i}") for i in range(12)]
    notes += [(r, "the same note on many requests") for r in range(20)]
    notes += [(-1, "phase: single"), (-1, 'paged cache occupancy {"pool_bytes": 1}'), (0, "x" * 5000)]
    trace = _plain_recording(tmp_path / "notes.kvt.h5", notes)
    from kvtrace.format.reader import Trace

    with Trace(trace) as t:  # the recorder's own bookkeeping note is there, and left out below
        written = [t.text(int(e["text_off"]), int(e["text_len"])) for e in t.events.where(kind=EventKind.NOTE)]
    assert any(w.startswith("retention checked at ") for w in written), written
    code, out = _info(trace, capsys, "--json")
    listed = json.loads(out)["notes"]
    texts = [n["text"] for n in listed]
    # the retention check's own "retention checked at ..." note and the data notes are not listed
    assert texts[:12] == [f"distinct note {i}" for i in range(12)]
    assert not any(t.startswith(("phase: ", "paged cache occupancy ", "retention checked at ")) for t in texts)
    same = listed[12]
    assert same["text"] == "the same note on many requests" and same["count"] == 20
    assert same["requests"] == list(range(MAX_REQUESTS))
    assert listed[13]["text"].endswith("[... 3,000 characters more]") and len(listed) == 14
    code, out = _info(trace, capsys)
    block = out[out.index("\nnotes:"):].splitlines()[1:]
    assert block[0].startswith("notes:     distinct note 0")
    assert sum(line.startswith("           distinct note") for line in block) == SHOWN - 1
    assert "... and 6 more distinct note(s) (--json lists them)" in out  # 14 entries, 8 shown
    code, out = _analyze(trace, capsys, "--json")
    assert json.loads(out)["reports"][0]["notes"] == listed


def test_a_trace_without_notes_has_no_notes_key(tmp_path, capsys):
    trace = _plain_recording(tmp_path / "plain.kvt.h5", [])
    code, out = _info(trace, capsys, "--json")
    assert "notes" not in json.loads(out)
    code, out = _analyze(trace, capsys, "--json")
    assert "notes" not in json.loads(out)["reports"][0]
    code, out = _info(trace, capsys)
    assert "notes:" not in out


def test_distinct_texts_past_the_json_bound_are_counted():
    import numpy as np

    from kvtrace.analyzer.notes import MAX_LISTED, note_lines, trace_notes
    from kvtrace.format import schema
    from kvtrace.format.tables import Table

    class Reader:
        texts = [f"note {i}" for i in range(MAX_LISTED + 44)] + ["note 0"]
        events = property(lambda self: Table(self, "events"))

        def has(self, name):
            return True

        def table(self, name, rows=None):
            ev = np.zeros(len(self.texts), schema.EVENTS)
            ev["kind"], ev["t_ns"], ev["request"] = int(schema.EventKind.NOTE), np.arange(len(self.texts)), -1
            ev["text_off"] = np.arange(len(self.texts))
            return ev if rows is None else ev[rows]

        def text(self, off, length):
            return self.texts[off]

    notes, unlisted = trace_notes(Reader())
    assert len(notes) == MAX_LISTED and unlisted == 44 and notes[0]["count"] == 2
    lines = note_lines(notes, unlisted)
    assert lines[0] == "note 0 (x2)" and len(lines) == SHOWN + 2
    assert lines[-2] == f"... and {MAX_LISTED - SHOWN:,} more distinct note(s) (--json lists them)"
    assert lines[-1].startswith("... and 44 note event(s) not listed anywhere")
