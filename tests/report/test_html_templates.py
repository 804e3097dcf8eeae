"""report/html renders through Jinja2 with autoescape: values are escaped unless trusted."""

from __future__ import annotations

from kvtrace.report import html

EVIL = '<script>alert("x")</script>'


def test_values_are_escaped_by_default():
    page = html.render(EVIL, [EVIL], [html.Section("s", EVIL, body=[html.para(EVIL), html.table([EVIL], [[EVIL]])],
                                                   figures=[html.Figure("f", EVIL, b"<svg/>")])], EVIL)
    assert "<script>" not in page
    # <title>, <h1>, header line, nav link, <h2>, img alt, figcaption, para, th, td, footer
    assert page.count("&lt;script&gt;") == 11
    assert 'alt="&lt;script&gt;' in page and "data:image/svg+xml;base64,PHN2Zy8+" in page


def test_trusted_fragments_pass_and_plain_cells_do_not():
    t = html.raw_table(["h"], [['<span class="sev-high">high</span>']])
    assert '<td><span class="sev-high">high</span></td>' in t  # control: a trusted fragment is kept
    assert "<td>&lt;span" in html.table(["h"], [['<span class="sev-high">high</span>']])
