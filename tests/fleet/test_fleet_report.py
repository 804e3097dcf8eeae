"""`kvtrace fleet report`: the page renders (sections, figures, regression table, worst traces with
links), hostile strings from traces stay text, and headless Chromium draws it without console errors."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile

import h5py
import pytest

from kvtrace import exitcodes
from tests.fleet.conftest import make_trace, write_synthetic_trace
from tests.helpers.cli_run import run_main

pytest.importorskip("matplotlib")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SECTIONS = ["summary", "distributions", "findings", "regressions", "worst"]
HOSTILE = "<script>alert(1)</script>"


def _report(capsys, *argv: str) -> tuple[int, dict, str]:
    code, out, err = run_main(["fleet", "report", *argv, "--json"], capsys)
    assert "Traceback" not in err
    return code, (json.loads(out) if out.strip() else {}), err


def test_report_sections_regressions_and_worst_traces(fleet_dir, tmp_path, capsys):
    page = tmp_path / "fleet.html"
    code, doc, _ = _report(capsys, str(fleet_dir), "-o", str(page), "--group-by", "transformers_version",
                           "--baseline", "transformers_version=5.17.0", "--candidate", "transformers_version=5.99.0")
    assert code == 0 and doc["traces"] == 9 and doc["groups"] == 3
    text = page.read_text()
    for s in SECTIONS:
        assert f'<section id="{s}"' in text, s
    assert doc["figures"] == ["fleet_peak", "fleet_retained", "fleet_kv_per_token", "fleet_findings"]
    assert text.count('src="data:image/svg+xml;base64,') == 4
    assert doc["regressed"] == ["retained_allocated_bytes per request"]
    row = re.search(r"<tr><td>retained_allocated_bytes per request</td>.*?</tr>", text, re.S)
    assert row and "<td>regressed</td>" in row.group(0)
    # the three traces that keep 1 MiB per request come first; no report exists yet: the command is shown
    assert [w["path"].rsplit("/", 1)[1][:6] for w in doc["worst"][:3]] == ["5.99.0"] * 3
    assert all(w["report_link"] is None and w["report_command"].startswith("kvtrace report ") for w in doc["worst"])
    # without a baseline there is no regression table; one of the two alone is a usage error
    code, doc, _ = _report(capsys, str(fleet_dir), "-o", str(tmp_path / "plain.html"))
    assert code == 0 and doc["regressed"] is None and 'id="regressions"' not in (tmp_path / "plain.html").read_text()
    code, _, err = _report(capsys, str(fleet_dir), "-o", str(tmp_path / "x.html"), "--baseline", "model_type=x")
    assert code == exitcodes.USAGE and "go together" in err
    code, _, _ = _report(capsys, str(fleet_dir), "-o", str(tmp_path / "no" / "dir" / "x.html"))
    assert code == exitcodes.CANNOT_WRITE


def test_links_to_existing_trace_reports_are_relative(tmp_path, capsys):
    runs = tmp_path / "runs"
    runs.mkdir()
    a = make_trace(runs / "a.kvt.h5", residual_bytes=1 << 20)
    make_trace(runs / "b.kvt.h5")
    (runs / "a.html").write_text("<html>a</html>")  # a's own report exists next to it, b's does not
    from kvtrace.fleet.export import export_parquet

    export_parquet([str(runs / "a.kvt.h5"), str(runs / "b.kvt.h5")], tmp_path / "f")
    out_dir = tmp_path / "site"
    out_dir.mkdir()
    code, doc, _ = _report(capsys, str(tmp_path / "f"), "-o", str(out_dir / "fleet.html"))
    assert code == 0
    links = {w["path"].rsplit("/", 1)[1]: w for w in doc["worst"]}
    assert links["a.kvt.h5"]["report_link"] == "../runs/a.html"
    assert links["b.kvt.h5"]["report_link"] is None
    assert links["b.kvt.h5"]["report_command"] == f"kvtrace report {runs / 'b.kvt.h5'} -o {runs / 'b.html'}"
    assert (out_dir / "../runs/a.html").resolve() == (runs / "a.html").resolve() and a.exists()
    assert 'href="../runs/a.html"' in (out_dir / "fleet.html").read_text()


def test_hostile_strings_are_escaped(tmp_path, capsys):
    """Model name, host label, version and file name from a stranger's trace are text on the page."""
    name = 'javascript:alert(1)"><b>x'
    p = write_synthetic_trace(tmp_path / f"{name}.kvt.h5", model_id=HOSTILE + " $\\frac{1$", residual_bytes=1 << 20)
    with h5py.File(p, "r+") as f:
        f["meta"].attrs["host_label"] = '<img src=x onerror="alert(2)">'
        f["meta"].attrs["transformers_version"] = "5.23.0</td><script>alert(3)</script>"
    (tmp_path / f"{name}.html").write_text("own report")
    from kvtrace.fleet.export import export_parquet

    export_parquet([str(p)], tmp_path / "f")
    page = tmp_path / "fleet.html"
    code, doc, _ = _report(capsys, str(tmp_path / "f"), "-o", str(page), "--group-by", "model_id,host")
    assert code == 0
    text = page.read_text()
    assert "<script" not in text and "<img src=x" not in text and "<b>x" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text and "onerror=&#34;alert(2)&#34;" in text.replace(
        "&quot;", "&#34;")
    # the link to the trace's own report stays a relative path, never a javascript: URL
    link = doc["worst"][0]["report_link"]
    assert doc["worst"][0]["report_command"].startswith("kvtrace report '")  # shell-quoted: the name has '"'

    assert link.startswith("./javascript%3Aalert") and 'href="javascript:' not in text
    # the figures' tick labels carry the group names as drawn paths, not as markup
    assert text.count('src="data:image/svg+xml;base64,') == 4


def _chromium(*args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync"]
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([CHROMIUM, *flags, f"--user-data-dir={profile}", *args], capture_output=True,
                              timeout=120, text=True)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install -y chromium)")
def test_renders_in_headless_chromium(fleet_dir, tmp_path, capsys):
    import numpy as np
    from PIL import Image

    page = tmp_path / "fleet.html"
    code, _, _ = _report(capsys, str(fleet_dir), "-o", str(page), "--group-by", "transformers_version",
                         "--baseline", "transformers_version=5.17.0", "--candidate", "transformers_version=5.99.0")
    assert code == 0
    url = page.resolve().as_uri()
    shot = tmp_path / "shot.png"
    proc = _chromium("--enable-logging=stderr", "--v=0", f"--screenshot={shot}", "--window-size=1280,1600", url)
    assert shot.exists(), proc.stderr[-2000:]
    assert [line for line in proc.stderr.splitlines() if ":CONSOLE" in line] == []  # no errors, nothing blocked
    pixels = np.asarray(Image.open(shot).convert("L"), dtype=np.float64)
    assert pixels.shape == (1600, 1280) and pixels[400:1400].std() > 20  # the figures are drawn, not blank
    dom = _chromium("--dump-dom", url).stdout
    for s in SECTIONS:
        assert f'id="{s}"' in dom, s
    assert dom.count("<img") == 4 and "retained_allocated_bytes per request" in dom


def test_report_refuses_outputs_inside_the_fleet_directory(fleet_dir, capsys):
    before = (fleet_dir / "traces.parquet").read_bytes()
    for target in ("traces.parquet", "fleet.html"):
        code, _, err = _report(capsys, str(fleet_dir), "-o", str(fleet_dir / target))
        assert code == exitcodes.USAGE and "inside the fleet directory" in err
    assert (fleet_dir / "traces.parquet").read_bytes() == before and not (fleet_dir / "fleet.html").exists()


def test_traces_without_analysis_are_named(fleet_dir, tmp_path, capsys):
    """A trace the detectors could not run on is named on the page, not counted as clean."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "f"
    d.mkdir()
    t = pq.read_table(fleet_dir / "traces.parquet")
    errors = ["detector crashed <b>" if i == 0 else "" for i in range(t.num_rows)]
    t = t.set_column(t.schema.get_field_index("analysis_error"), "analysis_error", pa.array(errors))
    pq.write_table(t, d / "traces.parquet")
    code, _, _ = _report(capsys, str(d), "-o", str(tmp_path / "r.html"))
    text = (tmp_path / "r.html").read_text()
    assert code == 0 and "1 trace(s) could not be analysed" in text and "detector crashed &lt;b&gt;" in text
    code, _, _ = _report(capsys, str(fleet_dir), "-o", str(tmp_path / "clean.html"))
    assert "could not be analysed" not in (tmp_path / "clean.html").read_text()
