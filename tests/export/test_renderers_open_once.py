"""The Prometheus replay, the Zenodo data card and ``calc --trace`` open each trace once and read
it through that one open Trace (one /kv request index), like the HTML report and Perfetto
(tests/report/test_one_open.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtrace.cli import cli
from kvtrace.format import reader
from tests.helpers.open_count import count_kv_indexes, count_opens

DATA = Path(__file__).resolve().parents[1] / "data" / "gpu"
TRACE = DATA / "gpu_duplication.kvt.h5"


@pytest.fixture
def opens(monkeypatch):
    return count_opens(monkeypatch)


@pytest.fixture
def indexes(monkeypatch):
    return count_kv_indexes(monkeypatch)


def test_prometheus_textfile_opens_the_trace_once(tmp_path, opens, indexes):
    pytest.importorskip("prometheus_client")
    out = tmp_path / "k.prom"
    result = CliRunner().invoke(cli, ["export", "prometheus-textfile", str(TRACE), "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["series"] > 0 and out.stat().st_size > 0
    assert opens == [str(TRACE)]
    assert len(indexes) <= 1  # the last request's rows come from the trace's one index


def test_prometheus_render_reads_kv_through_the_trace_index(tmp_path, opens, indexes):
    pytest.importorskip("prometheus_client")
    from kvtrace.export import prometheus

    with reader.Trace(TRACE) as t:
        exp = prometheus.render(t, None, tmp_path / "k.prom")
        # control: the no-analysis entry gives the same exposition
        assert prometheus.exporter_from_trace(t, tmp_path / "k2.prom").render() == exp.render()
    assert indexes == [id(t)]  # the second render reuses the open trace's index
    assert len(opens) == 1


def test_calc_trace_opens_the_trace_once(opens, indexes):
    result = CliRunner().invoke(cli, ["calc", "--trace", str(TRACE), "--context", "4k", "--gpu-memory", "80GiB", "--json"])
    assert result.exit_code == 0, result.output
    check = json.loads(result.output)["trace_check"]
    assert check["equal"] is not None and check["measured_bytes"] > 0, check
    assert opens == [str(TRACE)]
    assert len(indexes) == 1  # the last step's rows through the open trace's request index


def test_kvcheck_reads_through_the_trace_it_is_given(indexes):
    from kvtrace.report.kvcheck import check_kv

    with reader.Trace(TRACE) as t:
        last = check_kv(t, "last")
        assert indexes == [id(t)]
        # a second check of the same open trace reuses its index, with the same answer
        assert check_kv(t, "last") == last and indexes == [id(t)]


def test_zenodo_opens_each_trace_once(tmp_path, opens):
    traces = [TRACE, DATA / "gpu_clean.kvt.h5"]
    out = tmp_path / "bundle"
    result = CliRunner().invoke(cli, ["export", "zenodo", *map(str, traces), "-o", str(out),
                                      "--creator", "Doe, Jane", "--json"])
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.output)["traces"]) == 2
    # content, validity, summary, quality and the default title from one open of each trace
    assert sorted(opens) == sorted(map(str, traces)), opens
    assert "KV-cache traces of " in (out / ".zenodo.json").read_text()


def test_validate_open_matches_validate():
    from kvtrace.format.validate import validate, validate_open

    with reader.Trace(TRACE, check=False) as t:
        held = validate_open(t)
    fresh = validate(TRACE)
    assert (held.valid, held.problems, held.warnings, held.version) == (
        fresh.valid, fresh.problems, fresh.warnings, fresh.version)
