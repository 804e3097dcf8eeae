"""The report of a trace with real retention shows what its verdict says: the KV each
request left alive is drawn after the request on the memory timeline (the series no longer falls to
0) and in the post-EOS chart (not host RSS only), with what holds it; and the fix renders whole, as a
code block (an inline code background wrapped over two lines hid underscores and a letter).

The trace is recorded here by scripts/readme_figure.py's recorder (the README's picture): three
requests of kvtrace's gpt-oss-20b preset, shrunk, whose outputs the caller keeps."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_report_html import CHROMIUM, CHROMIUM_FLAGS  # noqa: E402

import kvtrace  # noqa: E402
from kvtrace.report import build_report, data, figures, fixes  # noqa: E402
from kvtrace.units import format_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FIX = fixes.FIXES[("post_eos", "retained_after_request")]


def _script():
    spec = importlib.util.spec_from_file_location("readme_figure", ROOT / "scripts" / "readme_figure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def retention(tmp_path_factory):
    d = tmp_path_factory.mktemp("retention")
    trace = d / "retention.kvt.h5"
    kept = _script().record_retention(trace)
    del kept
    with kvtrace.open(trace) as t:
        rows = t.retention[:]
        ends = [int(e) for e in t.requests[:]["end_ns"]]
    per_request = {}
    for r in sorted({int(x) for x in rows["request"]}):
        mine = rows[rows["request"] == r]
        _, first = np.unique(mine["storage"], return_index=True)
        per_request[r] = int(mine["nbytes"][first].sum())
    assert len(per_request) == len(ends) == 3 and all(v > 0 for v in per_request.values())  # real retention
    return d, trace, ends, per_request


def test_the_timeline_keeps_the_retained_kv_after_each_request(retention):
    _, trace, ends, per_request = retention
    with kvtrace.open(trace) as t:
        (ts, values), = data.kv_totals_by_device(t).values()
        timelines = data.memory_timelines(t)
    kept = 0
    for r, end in enumerate(ends):
        kept += per_request[r]
        at_end = values[ts == end]
        assert at_end.size and int(at_end[-1]) == kept, (r, at_end, kept)  # not 0: what is still alive
    assert int(values[-1]) == sum(per_request.values())
    (retained,) = [s for tl in timelines for s in tl.series if s.name == "kv_retained"]
    assert retained.source == "retention" and int(retained.values[-1]) == sum(per_request.values())
    assert list(retained.values[:3]) == list(np.cumsum([per_request[r] for r in sorted(per_request)]))


def test_the_post_eos_chart_draws_the_retained_kv_and_names_its_holder(retention):
    _, trace, _, per_request = retention
    with kvtrace.open(trace) as t:
        mems = data.request_memory(t)
    assert {m.request: m.kv_alive_after for m in mems} == per_request
    assert all("DynamicCache" in m.holders for m in mems)
    drawn, _ = figures.post_eos_bars(mems)
    assert "KV alive after the request (retention proof)" in drawn
    assert drawn != ["peak KV", "residual process RSS (host)"]  # the old chart: RSS only


def test_a_clean_trace_still_falls_to_zero_and_alive_after_is_zero(tmp_path):
    import torch

    from kvtrace.presets import preset_model

    model = preset_model("llama-3.1-8b")
    path = tmp_path / "clean.kvt.h5"
    with kvtrace.record(model, path):
        for _ in range(2):
            model.generate(torch.ones(1, 8, dtype=torch.long), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    with kvtrace.open(path) as t:
        (ts, values), = data.kv_totals_by_device(t).values()
        ends = [int(e) for e in t.requests[:]["end_ns"]]
        mems = data.request_memory(t)
        assert not [s for tl in data.memory_timelines(t) for s in tl.series if s.name == "kv_retained"]
    assert [int(values[ts == e][-1]) for e in ends] == [0, 0]
    assert [m.kv_alive_after for m in mems] == [0, 0] and not any(m.holders for m in mems)


# ---- headless Chromium ----------------------------------------------------------------------------

# Measures every fix in the verdict and findings tables after layout: its text, its line boxes and
# whether anything is clipped; and whether every figure decoded. Written into the DOM as JSON.
MEASURE = """<script>
const out = {fixes: [], images: []};
for (const el of document.querySelectorAll('#verdict td code, #findings td code')) {
  const box = el.closest('pre') || el;
  const rects = Array.from(el.getClientRects()).map(r => [r.top, r.bottom, r.left, r.right]);
  const cs = getComputedStyle(box);
  out.fixes.push({text: el.textContent, rects: rects, scrollW: box.scrollWidth, clientW: box.clientWidth,
                  scrollH: box.scrollHeight, clientH: box.clientHeight, overflowX: cs.overflowX,
                  overflowY: cs.overflowY, lineHeight: cs.lineHeight, fontSize: cs.fontSize,
                  height: box.getBoundingClientRect().height});
}
for (const img of document.images) out.images.push([img.alt, img.naturalWidth, img.naturalHeight]);
const pre = document.createElement('pre'); pre.id = 'kvtrace-measure'; pre.textContent = JSON.stringify(out);
document.body.appendChild(pre);
</script>"""


def _measure(page: Path, tmp: Path, width: int) -> tuple[dict, str]:
    """Lay the page out in headless Chromium at ``width`` CSS pixels: (measurements, the DOM)."""
    html = page.read_text()
    html = re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", html)  # let the probe run
    probe = tmp / f"probe{width}.html"
    probe.write_text(html.replace("</body>", MEASURE + "</body>", 1))
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={width},2000",
                               "--virtual-time-budget=5000", "--dump-dom", probe.resolve().as_uri()],
                              capture_output=True, timeout=180, text=True)
    found = re.search(r'<pre id="kvtrace-measure">(.*?)</pre>', proc.stdout, re.S)
    assert found, proc.stderr[-2000:]
    text = found.group(1).replace("&quot;", '"').replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
    return json.loads(text), proc.stdout


@pytest.fixture(scope="module")
def page(retention):
    d, trace, _, _ = retention
    result = build_report(trace, d / "report.html", d / "figs")
    return result


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install -y chromium)")
@pytest.mark.parametrize("width", [1280, 700])
def test_chromium_shows_the_fix_whole_and_the_retained_bytes(page, retention, tmp_path, width):
    _, _, _, per_request = retention
    m, dom = _measure(page.html, tmp_path, width)
    assert m["fixes"] and all(f["text"] == FIX for f in m["fixes"])  # every finding of the trace: the same fix
    for f in m["fixes"]:
        lines = sorted({(top, bottom) for top, bottom, _, _ in f["rects"]})  # fragments of a line share it
        for (_, bottom_a), (top_b, _) in zip(lines, lines[1:], strict=False):
            # a line box that starts above the previous one's bottom paints over its descenders
            assert top_b >= bottom_a - 0.5, f"line boxes overlap by {bottom_a - top_b:.1f}px: {f}"
        assert f["scrollW"] <= f["clientW"] + 1 and f["scrollH"] <= f["clientH"] + 1, f"clipped: {f}"
        line = float(f["lineHeight"].removesuffix("px"))
        assert line >= 1.3 * float(f["fontSize"].removesuffix("px")), f  # room for underscores between lines
    assert m["images"] and all(w > 0 and h > 0 for _, w, h in m["images"])  # every figure decoded
    # the retained KV is in the page's figures' tables: each request's, and the timeline's total
    for r, nbytes in per_request.items():
        assert f"<td class=\"num\">{format_bytes(nbytes)}</td>" in dom, (r, format_bytes(nbytes))
    assert "KV still alive after its request (retention proof)" in dom
    assert "KV alive after the request (retention proof)" in dom
    assert "DynamicCache" in dom
