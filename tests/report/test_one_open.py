"""Each renderer command opens the trace once: the analyser reads the same open Trace as the page."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtrace.format import reader
from tests.helpers.open_count import count_kv_indexes, count_opens

DATA = Path(__file__).resolve().parents[1] / "data" / "gpu"


@pytest.fixture
def opens(monkeypatch):
    return count_opens(monkeypatch)


def test_html_report_opens_the_trace_once(tmp_path, opens):
    pytest.importorskip("matplotlib")
    from kvtrace.report import build_report

    result = build_report(DATA / "gpu_duplication.kvt.h5", tmp_path / "r.html")
    assert result.findings, "the analyser must have run on the open trace"
    assert len(opens) == 1, opens


def test_perfetto_opens_the_trace_once(tmp_path, opens):
    from kvtrace.export.perfetto import write_perfetto

    _, info = write_perfetto(DATA / "gpu_duplication.kvt.h5", tmp_path / "p.json")
    assert info["findings"], info
    assert len(opens) == 1, opens


def test_report_and_analyser_share_one_kv_index(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from kvtrace.report import build_report

    built = count_kv_indexes(monkeypatch)
    opened = count_opens(monkeypatch)
    result = build_report(DATA / "gpu_duplication.kvt.h5", tmp_path / "r.html")
    assert result.findings and "layer-footprint" not in result.absent
    # One open trace and one /kv index for the whole page: the footprint, the growth curves and
    # the analyser read their requests' rows through it.
    assert len(opened) == 1 and len(built) == 1


def test_renderers_take_one_trace_and_one_report(tmp_path, opens, monkeypatch):
    """render(trace, report, ...): the HTML page and Perfetto drawn from one open trace and one
    analysis, which neither renderer recomputes."""
    pytest.importorskip("matplotlib")
    import kvtrace.analyzer as analyzer_mod
    from kvtrace.analyzer import analyze
    from kvtrace.export import perfetto
    from kvtrace.report import build

    with reader.Trace(DATA / "gpu_duplication.kvt.h5") as t:
        report = analyze(t)
        monkeypatch.setattr(analyzer_mod, "analyze", lambda *a, **k: pytest.fail("analysed twice"))
        page = build.render(t, report, tmp_path / "r.html")
        _, info = perfetto.render(t, report, tmp_path / "p.json")
    assert page.findings == info["findings"] == len(report.findings) > 0
    assert len(opens) == 1
