"""The HTML report: every section present, self-contained, rendered by headless Chromium."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import tempfile

import numpy as np
import pytest
from click.testing import CliRunner

from kvtrace import exitcodes
from kvtrace.analyzer import AnalysisReport, DetectorResult, Evidence, Finding
from kvtrace.cli import cli
from kvtrace.report import STAGES, build_report, write_report
from tests.helpers.synth_trace import write_synthetic_trace

pytest.importorskip("matplotlib")

SECTIONS = ["verdict", "overview", "memory-timeline", "layer-footprint", "growth-curves", "post-eos",
            "allocator-state", "findings", "heatmaps", "whatif", "data-quality"]
NO_CONTENTS = [s for s in SECTIONS if s != "whatif"]  # the what-if section needs sampled contents
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


# Scores inside each severity band of kvtrace.analyzer.base.severity_for.
SCORE_OF = {"info": 0.05, "low": 0.2, "medium": 0.4, "high": 0.6, "critical": 0.9}


def analysis_of(*findings: Finding) -> AnalysisReport:
    """The analyser's typed report holding these findings (the report reads nothing else)."""
    by_detector: dict[str, list[Finding]] = {}
    for f in findings:
        by_detector.setdefault(f.detector, []).append(f)
    return AnalysisReport(trace={}, model={}, devices=[], software={}, expectation={}, requests=[],
                          results=[DetectorResult(name, "ran", "", fs) for name, fs in by_detector.items()])


@pytest.fixture(scope="module")
def full_report(tmp_path_factory):
    d = tmp_path_factory.mktemp("report")
    trace = write_synthetic_trace(d / "t.kvt.h5", payloads=True, residual_bytes=3 * 1024**2,
                                  dropped_samples=2, recorder_error="sampler <b>stalled</b>",
                                  model_id="org/<script>alert(1)</script>")
    analysis = analysis_of(Finding("post_eos", "retention", 0.61, "request 1 keeps 3.0 MiB after empty_cache",
                                   requests=[1], evidence={"residual_bytes": Evidence(3 * 1024**2, "bytes")}))
    seen: list[str] = []
    result = build_report(trace, d / "report.html", d / "figs", analysis=analysis, progress=seen.append)
    return result, seen, d


def test_sections_figures_and_progress(full_report):
    result, seen, d = full_report
    assert seen == list(STAGES)
    assert result.sections == SECTIONS
    assert result.absent == {}
    page = result.html.read_text()
    for s in SECTIONS:
        assert f'<section id="{s}"' in page
    names = {p.stem for p in result.figures}
    # heatmaps for every sampled request (both requests of the synthetic trace), not only the last
    assert names == {"memory_timeline_device0", "layer_footprint", "growth_curves", "post_eos",
                     "allocator_end"} | {f"heatmap_{k}_r{r}" for k in ("key_norms", "value_norms",
                                                                      "attention_entropy") for r in (0, 1)} \
        | {"whatif_pareto", "whatif_layer_error"}
    for p in result.figures:
        blob = p.read_bytes()
        if p.suffix == ".png":
            assert blob.startswith(b"\x89PNG\r\n\x1a\n")
        else:
            assert b"<svg" in blob[:2000]
    # each figure is embedded once, as the same SVG that was written to disk
    embedded = re.findall(r'data-figure="([^"]+)"><img alt="[^"]*" src="data:image/svg\+xml;base64,([^"]+)"', page)
    assert {n for n, _ in embedded} == names
    for name, b64 in embedded:
        assert base64.b64decode(b64) == (d / "figs" / f"{name}.svg").read_bytes()


def test_self_contained_and_escaped(full_report):
    page = full_report[0].html.read_text()
    assert "<script" not in page.lower()
    assert not re.search(r'(src|href)="(https?:)?//', page)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "sampler &lt;b&gt;stalled&lt;/b&gt;" in page
    assert "request 1 keeps 3.0 MiB after empty_cache" in page
    assert "Measured valid KV bytes equal the expectation at 12 of 12 steps" in page


def test_absent_sections_say_why(tmp_path):
    trace = write_synthetic_trace(tmp_path / "t.kvt.h5")
    result = build_report(trace, tmp_path / "r.html", run_analyzer=False)
    assert set(result.absent) == {"findings", "heatmaps"}
    assert "no sampled tensor contents" in result.absent["heatmaps"]
    assert result.figures == []
    assert write_report(trace, tmp_path / "r2.html", run_analyzer=False) == tmp_path / "r2.html"


def _run_cli(args):
    return CliRunner().invoke(cli, args, catch_exceptions=False)


def test_cli_modes_and_errors(tmp_path):
    trace = write_synthetic_trace(tmp_path / "t.kvt.h5")
    res = _run_cli(["report", str(trace), "-o", str(tmp_path / "a.html"), "--no-analysis", "--json"])
    assert res.exit_code == 0
    doc = json.loads(res.output)  # nothing but JSON on stdout
    assert doc["report"] == str(tmp_path / "a.html") and doc["sections"] == NO_CONTENTS
    res = _run_cli(["report", str(trace), "-o", str(tmp_path / "b.html"), "--no-analysis", "-q"])
    assert res.exit_code == 0 and res.output == ""
    assert (tmp_path / "b.html").stat().st_size > 10_000
    res = _run_cli(["report", str(tmp_path / "missing.h5"), "-o", str(tmp_path / "c.html")])
    assert res.exit_code == exitcodes.UNREADABLE
    res = _run_cli(["report", str(trace), "-o", str(tmp_path / "no" / "dir" / "c.html")])
    assert res.exit_code == exitcodes.CANNOT_WRITE
    assert "Examples:" in _run_cli(["report", "--help"]).output


def _chromium(*args: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                              capture_output=True, timeout=120, text=True)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install -y chromium)")
def test_renders_in_headless_chromium(full_report, tmp_path):
    from PIL import Image

    result = full_report[0]
    url = result.html.resolve().as_uri()
    shot = tmp_path / "shot.png"
    proc = _chromium(f"--screenshot={shot}", "--window-size=1280,2000", url)
    assert shot.exists(), proc.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("L"), dtype=np.float64)
    assert pixels.shape == (2000, 1280)
    assert pixels.std() > 20, "screenshot is blank"
    # the figure area is drawn: the middle band is not one flat colour either
    assert pixels[600:1400].std() > 20
    dom = _chromium("--dump-dom", url).stdout
    for s in SECTIONS:
        assert f'id="{s}"' in dom, s
    assert dom.count("<img") == 13  # 11 + the what-if Pareto plot and layer heatmap
    assert "Measured valid KV bytes equal the expectation" in dom


def _verdict(page: str) -> str:
    m = re.search(r'<section id="verdict".*?</section>', page, re.S)
    assert m, "no verdict section"
    return m.group(0)


def test_verdict_first_with_fix(full_report):
    page = full_report[0].html.read_text()
    assert page.index('<section id="verdict"') < page.index('<section id="overview"')
    v = _verdict(page)
    assert 'data-verdict="attention"' in v and "Needs attention: 1 finding" in v
    assert "request 1 keeps 3.0 MiB after empty_cache" in v
    assert "<code>out = out.sequences; gc.collect()" in v  # the post_eos fix, copy-paste ready
    assert "findings of kvtrace.analyze" not in page  # the stray caption is gone


@pytest.mark.parametrize(("severities", "state"), [
    ([], "healthy"),  # clean control: no findings at all
    (["low", "info"], "healthy"),  # below medium is not a verdict
    (["medium"], "attention"),
    (["critical", "low"], "attention"),
])
def test_verdict_threshold_is_medium(tmp_path, severities, state):
    trace = write_synthetic_trace(tmp_path / "t.kvt.h5")
    analysis = analysis_of(*(Finding("fragmentation", "gap", SCORE_OF[sev], f"finding {i}")
                             for i, sev in enumerate(severities)))
    page = build_report(trace, tmp_path / "r.html", analysis=analysis).html.read_text()
    v = _verdict(page)
    assert f'data-verdict="{state}"' in v
    assert ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in v) == (state == "attention")


def test_no_verdict_without_analysis(tmp_path):
    trace = write_synthetic_trace(tmp_path / "t.kvt.h5")
    page = build_report(trace, tmp_path / "r.html", run_analyzer=False).html.read_text()
    assert 'data-verdict="none"' in _verdict(page) and "--no-analysis" in _verdict(page)


def test_fix_table_names_real_detectors_and_kinds():
    import inspect

    from kvtrace.analyzer.base import REGISTRY
    from kvtrace.analyzer.detectors import _common  # noqa: F401 - registers every detector
    from kvtrace.report.fixes import FIXES, fix_for

    assert FIXES
    for detector, kind in FIXES:
        assert detector in REGISTRY, detector
        if kind:  # the kind is one its detector emits (a renamed kind would silently lose its fix)
            assert f'"{kind}"' in inspect.getsource(inspect.getmodule(REGISTRY[detector])), (detector, kind)
    assert fix_for("post_eos", "released") is not None  # detector fallback
    assert fix_for("cache_density", "density") is None  # informational: nothing to fix


def test_cpu_trace_labels_rss_and_post_eos(tmp_path):
    """A CPU recording: device 'cpu' (not 'cpu cpu' / '-1: cpu'), RSS drawn, no all-n/a column,
    the post-EOS bars that cannot be drawn named with the sources' reasons."""
    from kvtrace.format import Trace
    from kvtrace.report import data

    trace = write_synthetic_trace(tmp_path / "t.kvt.h5", cpu=True, residual_bytes=2 * 1024**2)
    result = build_report(trace, tmp_path / "r.html", tmp_path / "figs", run_analyzer=False)
    page = result.html.read_text()
    assert "cpu cpu" not in page and "-1: cpu" not in page
    assert "<th>devices</th><td>cpu (16.0 GiB)</td>" in page
    with Trace(trace) as t:
        (tl,) = data.memory_timelines(t)
        mems = data.request_memory(t)
    assert tl.device == -1 and tl.label == "cpu"
    rss = {s.name: s for s in tl.series}["process_rss"]
    assert rss.values.min() >= 500 * 1024**2
    assert [m.residual_rss for m in mems] == [2 * 1024**2, 2 * 1024**2]
    post = re.search(r'<section id="post-eos".*?</section>', page, re.S).group(0)
    assert "n/a" not in post  # no column that is n/a everywhere
    assert "residual (RSS)" in post and "2.0 MiB" in post
    assert "Not shown: baseline (allocated)" in post and "nvml sampling disabled" in post
    assert "process RSS (host memory)" in page


def test_axes_start_at_zero_and_entropy_scale_fixed(tmp_path):
    from kvtrace.format import Trace
    from kvtrace.report import contents, data, figures

    trace = write_synthetic_trace(tmp_path / "t.kvt.h5", payloads=True)
    with Trace(trace) as t:
        (tl,) = data.memory_timelines(t)
        fig = figures.memory_timeline(tl, data.phase_markers(t), data.time_zero_ns(t))
        growth = figures.growth(data.growth_curves(t))
        ent = contents.entropy_heatmap(t, request=0)
        norms = [contents.head_norm_heatmaps(t, r) for r in contents.sampled_requests(t)]
    try:
        # the synthetic NVML series never drops below 300 MiB: an auto-ranged axis would not show 0
        assert all(ax.get_ylim()[0] == 0 for ax in fig.axes + growth.axes)
        hm = figures.heatmap(ent)
        assert hm.axes[0].images[0].get_clim() == (0.0, 1.0)
        figures.close(hm)
    finally:
        figures.close(fig)
        figures.close(growth)
    flat = [h for maps in norms for h in maps]
    contents.shared_scale(flat)
    keys = [h for h in flat if h.title.startswith("key")]
    assert len(keys) == 2 and keys[0].vmax == keys[1].vmax == max(float(np.nanmax(h.values)) for h in keys)
    assert all(h.vmin == 0.0 for h in flat)


def _console_lines(url: str) -> list[str]:
    """Console messages Chromium logs for a page: errors, CSP violations (blocked fetches)."""
    proc = _chromium("--enable-logging=stderr", "--v=0", "--dump-dom", url)
    return [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install -y chromium)")
def test_chromium_console_clean_and_verdict_on_top(full_report, tmp_path):
    page = full_report[0].html
    assert _console_lines(page.resolve().as_uri()) == []  # no console errors, nothing blocked or fetched
    # the control: the same CSP with one external image logs the blocked fetch, so silence means something
    bad = tmp_path / "bad.html"
    bad.write_text(page.read_text().replace("</main>", '<img src="http://192.0.2.1/x.png"></main>', 1))
    assert any("192.0.2.1" in line for line in _console_lines(bad.resolve().as_uri()))
    dom = _chromium("--dump-dom", page.resolve().as_uri()).stdout
    assert dom.index('id="verdict"') < dom.index('id="overview"')
    assert "Needs attention" in dom and "out = out.sequences" in dom
    assert dom.count('href="#fig-heatmap_') == 2  # the per-request selection: one link per sampled request
