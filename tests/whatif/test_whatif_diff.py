"""What-if in `kvtrace diff`: two traces replayed with the same policies, or two saved what-if
documents; B - A per policy, ratio, measure and layer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtrace.whatif import parse_policy
from kvtrace.whatif.compare import diff_whatif, load_whatif
from kvtrace.whatif.run import run_whatif
from tests.helpers.cli_run import run_main

DATA = Path(__file__).parents[1] / "data" / "gpu_contents"
LLAMA, GEMMA = DATA / "llama.kvt.h5", DATA / "gemma3_text.kvt.h5"
POLS = ["knorm", "kivi:nbits=2,residual_length=0", "paging:page_size=32"]


def _doc(path, names=POLS, ratios=(0.25, 0.5)):
    return {"trace": str(path), **run_whatif(path, [parse_policy(n) for n in names], list(ratios))}


def test_same_trace_diffs_to_zero_and_two_traces_to_b_minus_a():
    a = _doc(LLAMA)
    d = diff_whatif(a, a)
    assert [(r["label"], r["ratio"]) for r in d["results"]] == [
        ("knorm", 0.25), ("knorm", 0.5), ("kivi:nbits=2,group_size=32,residual_length=0", None),
        ("paging:page_size=32", None)]
    for r in d["results"]:
        assert all(v["delta"] == 0 for v in r["bytes"].values())
        assert all(v["delta"] == 0 for v in r["overall"].values())
    b = _doc(GEMMA, ratios=(0.5, 0.75))
    d = diff_whatif(a, b)
    assert d["only_a"] == [{"label": "knorm", "ratio": 0.25}] and d["only_b"] == [{"label": "knorm", "ratio": 0.75}]
    assert "different ratios" in d["notes"][0]
    ka = next(r for r in a["policies"][0]["results"] if r["ratio"] == 0.5)
    kb = next(r for r in b["policies"][0]["results"] if r["ratio"] == 0.5)
    got = next(r for r in d["results"] if r["label"] == "knorm")
    assert got["bytes"]["saved_peak"]["delta"] == kb["bytes"]["saved_peak"] - ka["bytes"]["saved_peak"]
    err = got["overall"]["attention_output_error"]
    assert err["delta"] == pytest.approx(kb["overall"]["attention_output_error"]["mean"]
                                         - ka["overall"]["attention_output_error"]["mean"])
    layers = {x["layer"]: x for x in got["layers"]}
    assert set(layers) == {0, 1, 2} and layers[2]["attention_output_error"]["a"] is None  # llama has 2 layers
    assert d["baseline"]["bytes_peak"]["delta"] == b["baseline"]["bytes_peak"] - a["baseline"]["bytes_peak"]


def test_saved_documents_load_and_bad_json_is_refused(tmp_path):
    p = tmp_path / "w.json"
    p.write_text(json.dumps(_doc(LLAMA)))
    assert load_whatif(p, [], [])["kvtrace_whatif"] == 1
    q = tmp_path / "other.json"
    q.write_text('{"schema": "kvtrace-analysis"}')
    from kvtrace.format.errors import NotATrace

    with pytest.raises(NotATrace):
        load_whatif(q, [], [])


def test_cli(capsys, tmp_path):
    out = tmp_path / "d.json"
    code, text, _ = run_main(["diff", str(LLAMA), str(GEMMA), "--whatif", "knorm", "--whatif", "fp8",
                              "--whatif-ratio", "0.5", "--json-out", str(out)], capsys)
    assert code == 0 and "What-if per policy" in text
    doc = json.loads(out.read_text())
    assert doc["schema"] == "kvtrace-analysis-diff" and doc["whatif"]["kvtrace_whatif_diff"] == 1
    assert [(r["label"], r["ratio"]) for r in doc["whatif"]["results"]] == [("knorm", 0.5), ("fp8:fmt=e4m3", None)]
    code, text, _ = run_main(["diff", str(LLAMA), str(GEMMA), "--json"], capsys)
    assert code == 0 and "whatif" not in json.loads(text)  # not asked: the plain diff
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert run_main(["whatif", str(LLAMA), "--policy", "knorm", "--ratio", "0.5", "--json-out", str(a)], capsys)[0] == 0
    assert run_main(["whatif", str(GEMMA), "--policy", "knorm", "--ratio", "0.5", "--json-out", str(b)], capsys)[0] == 0
    code, text, _ = run_main(["diff", str(a), str(b), "--json"], capsys)
    only = json.loads(text)
    assert code == 0 and only["kvtrace_whatif_diff"] == 1 and only["results"][0]["label"] == "knorm"
    assert run_main(["diff", str(LLAMA), str(GEMMA), "--whatif", "nope"], capsys)[0] == 64


def test_diff_keys_are_in_the_spec():
    import re

    spec = (Path(__file__).parents[2] / "spec" / "whatif-json.md").read_text()
    block = spec.split("what-if diff, schema 1")[1].split("```")[1]
    allowed = set(re.findall(r'"([a-z_0-9]+)"', block))
    a = _doc(LLAMA)
    d = diff_whatif(a, _doc(GEMMA))
    seen: set[str] = set()

    def walk(x, measures=False):
        if isinstance(x, dict):
            for k, v in x.items():
                if not (measures and k in a["needs"]):
                    seen.add(k)
                walk(v, measures=k in ("overall", "layers"))
        elif isinstance(x, list):
            for v in x:
                walk(v, measures)

    walk(d)
    assert seen - allowed == set(), sorted(seen - allowed)
