"""The report's what-if section: Pareto plot, per-layer heatmap and table from the same document
`kvtrace whatif` writes; the CLI options; the section only when asked or when contents exist."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvtrace.format.reader import Trace
from kvtrace.report import build_report
from kvtrace.report.whatif_section import (
    WhatIfOptions,
    layer_errors,
    pareto_front,
    table_rows,
    whatif_document,
)
from tests.helpers.cli_run import run_main

pytest.importorskip("matplotlib")

DATA = Path(__file__).parents[1] / "data"
LLAMA = DATA / "gpu_contents" / "llama.kvt.h5"
NO_CONTENTS = DATA / "gpu" / "gpu_clean.kvt.h5"


def test_pareto_front_keeps_the_undominated_points():
    pts = [{"saved": 50, "error": 0.1}, {"saved": 75, "error": 0.3}, {"saved": 50, "error": 0.2},  # dominated
           {"saved": 25, "error": 0.05}, {"saved": 0, "error": 0.0}, {"saved": 20, "error": 0.06}]  # dominated
    assert [(p["saved"], p["error"]) for p in pareto_front(pts)] == [(0, 0.0), (25, 0.05), (50, 0.1), (75, 0.3)]


def test_heatmap_values_and_table_come_from_the_document():
    with Trace(LLAMA) as t:
        doc = whatif_document(t, ["knorm", "kivi:nbits=2,residual_length=0"], [0.25, 0.5])
    labels, layers, values = layer_errors(doc, 0.5)
    assert labels == ["knorm @ 0.5", "kivi:nbits=2,group_size=32,residual_length=0"] and layers == [0, 1]
    knorm = next(r for r in doc["policies"][0]["results"] if r["ratio"] == 0.5)
    for j, row in enumerate(knorm["layers"]):
        assert values[0, j] == pytest.approx(np.mean(row["attention_output_error"]))
    rows = table_rows(doc)
    assert [r[:2] for r in rows] == [("knorm", "0.25"), ("knorm", "0.5"), (labels[1], "-")]
    assert all("KiB" in r[2] or " B" in r[2] for r in rows)


@pytest.mark.slow
def test_report_has_the_section_by_default_on_sampled_traces(tmp_path):
    result = build_report(LLAMA, tmp_path / "r.html", tmp_path / "figs", run_analyzer=False)
    assert "whatif" in result.sections and "whatif" not in result.absent
    assert {"whatif_pareto", "whatif_layer_error"} <= {p.stem for p in result.figures}
    page = result.html.read_text()
    assert "Offline proxies, not model quality" in page and "expected_attention: stand-in" in page
    assert "kivi:nbits=2" in page and "Pareto front" in page
    none = build_report(NO_CONTENTS, tmp_path / "n.html", run_analyzer=False)
    assert "whatif" not in none.sections  # nothing sampled, nothing asked: no section
    asked = build_report(NO_CONTENTS, tmp_path / "a.html", run_analyzer=False,
                         whatif=WhatIfOptions(policies=("paging:page_size=64", "knorm")))
    assert "whatif" in asked.sections  # bytes only: paging (error 0 by construction) still plots
    assert "paging:page_size=64" in asked.html.read_text()


def test_report_cli_options(capsys, tmp_path):
    out = tmp_path / "r.json"
    code, _, _ = run_main(["report", str(LLAMA), "-o", str(tmp_path / "r.html"), "--no-analysis", "--whatif", "tova",
                           "--whatif", "fp8:fmt=e5m2", "--whatif-ratio", "0.5", "--json-out", str(out)], capsys)
    assert code == 0 and "whatif" in json.loads(out.read_text())["sections"]
    page = (tmp_path / "r.html").read_text()
    assert "fp8:fmt=e5m2" in page and "snapkv" not in page.split('id="whatif"')[1].split("</section>")[0]
    code, _, _ = run_main(["report", str(LLAMA), "-o", str(tmp_path / "n.html"), "--no-analysis", "--no-whatif",
                           "--json"], capsys)
    assert code == 0 and 'id="whatif"' not in (tmp_path / "n.html").read_text()
    assert run_main(["report", str(LLAMA), "-o", str(tmp_path / "x.html"), "--whatif", "nope"], capsys)[0] == 64
    assert run_main(["report", str(LLAMA), "-o", str(tmp_path / "x.html"), "--whatif-ratio", "2"], capsys)[0] == 64
    assert run_main(["report", str(LLAMA), "-o", str(tmp_path / "x.html"), "--no-whatif", "--whatif", "knorm"],
                    capsys)[0] == 64
