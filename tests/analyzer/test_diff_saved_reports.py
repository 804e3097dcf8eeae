"""``kvtrace diff`` of saved analysis reports someone else wrote: a report is checked
like a trace before its fields are compared or printed. A finding whose score was a string ended
diff in exit 70; every damaged report below is exit 1 with one line, and strings that are merely
hostile (markup, escapes) are compared and printed as data."""

from __future__ import annotations

import copy
import json

import pytest

from kvtrace import exitcodes
from tests.helpers.cli_run import run_main
from tests.helpers.synth import write_synthetic_trace


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("saved")
    trace = write_synthetic_trace(d / "t.kvt.h5", residual_bytes=1 << 20)
    from kvtrace.analyzer import analyze, document

    return {"dir": d, "doc": document([analyze(trace)])}


def _set(doc: dict, path: str, value: object) -> dict:
    out = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node = out["reports"][0]
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return out


DAMAGED = {
    "score a string": ("findings.0.score", "x"),
    "score NaN": ("findings.0.score", float("nan")),
    "score 10**400": ("findings.0.score", 10**400),
    "message null": ("findings.0.message", None),
    "finding a list": ("findings.0", [1, 2]),
    "model id a list": ("model.id", ["a"]),
    "requests an object": ("requests", {"0": {}}),
    "request id a string": ("requests.0.request", "0"),
    "tokens a string": ("requests.0.prompt_tokens", "5"),
    "peak a string": ("requests.0.peak_kv_bytes", "big"),
    "layer sizes a string": ("requests.0.layers.0.bytes_valid", "1 KiB"),
    "memory device not a number": ("memory", {"gpu0": {}}),
    "detectors null": ("detectors", None),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_damaged_saved_report_is_invalid_not_70(case, saved, capsys):
    good = saved["dir"] / "good.json"
    good.write_text(json.dumps(saved["doc"]))
    bad = saved["dir"] / f"{case.replace(' ', '_')}.json"
    bad.write_text(json.dumps(_set(saved["doc"], *DAMAGED[case])))
    for argv in (["diff", str(good), str(bad)], ["diff", "--json", str(bad), str(good)]):
        code, out, err = run_main(argv, capsys)
        assert code == exitcodes.INVALID, (case, code, err)
        assert err.count("\n") == 1 and "a kvtrace analysis report whose first report" in err and "Traceback" not in err


def test_hostile_strings_in_a_saved_report_are_printed_as_data(saved, capsys):
    doc = _set(saved["doc"], "model.id", "[/bold]x\x1b[31mRED\u202e")
    doc = _set(doc, "findings.0.message", "[link=https://evil.example]x\x1b]8;;https://e\x1b\\")
    a, b = saved["dir"] / "a.json", saved["dir"] / "b.json"
    a.write_text(json.dumps(saved["doc"]))
    b.write_text(json.dumps(doc))
    code, out, err = run_main(["diff", str(a), str(b)], capsys)
    assert code == 0, err
    assert "\x1b" not in out and "\u202e" not in out and "[/bold]x\\x1b[31mRED\\u202e" in out
    code, out, _ = run_main(["diff", "--json", str(a), str(b)], capsys)
    assert code == 0 and json.loads(out)["b"]["model"]["id"] == "[/bold]x\x1b[31mRED\u202e"


@pytest.mark.parametrize("change", ["unknown measure", "layer 10**400"])
def test_a_damaged_saved_whatif_document_is_invalid_not_70(change, saved, capsys):
    trace = saved["dir"] / "t.kvt.h5"
    w = saved["dir"] / "w.json"
    code, out, err = run_main(["whatif", str(trace), "--policy", "knorm", "--ratio", "0.5", "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    w.write_text(out)
    r = doc["policies"][0]["results"][0]
    if change == "unknown measure":
        r["overall"] = {"zzz": {"mean": 1.0}}  # a KeyError-free name the table sorts by: was exit 70
    else:
        r["layers"] = [{"layer": 10**400}]
    bad = saved["dir"] / "w_bad.json"
    bad.write_text(json.dumps(doc))
    code, _, err = run_main(["diff", str(w), str(bad)], capsys)
    assert code == exitcodes.INVALID and "not a valid what-if document" in err and err.count("\n") == 1, err
