"""HTML assembly: one self-contained page (inline CSS, figures as data: URIs, no scripts,
nothing fetched from the network). Every string from the trace is escaped."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape

CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:0;background:#fafafa;color:#222}
header{background:#1d2b3a;color:#fff;padding:18px 28px}
header h1{margin:0 0 4px 0;font-size:22px}
header p{margin:2px 0;font-size:13px;opacity:.9}
nav{padding:8px 28px;background:#e9eef3;font-size:13px}
nav a{margin-right:14px;color:#1d4f80;text-decoration:none}
main{padding:8px 28px 40px 28px;max-width:1200px}
section{background:#fff;border:1px solid #ddd;border-radius:6px;margin:18px 0;padding:12px 18px}
section h2{font-size:17px;margin:4px 0 10px 0}
figure{margin:8px 0}
figure img{max-width:100%;height:auto;border:1px solid #eee}
figcaption{font-size:12px;color:#555}
table{border-collapse:collapse;font-size:12px;margin:8px 0}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f0f3f6}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.absent{color:#8a5a00;background:#fff6e0;border-left:3px solid #e0a000;padding:6px 10px;font-size:13px}
.sev-critical,.sev-error,.sev-high{color:#b00020;font-weight:600}
.sev-warning,.sev-medium{color:#b06000;font-weight:600}
.ok{color:#1b7f2a}
.verdict{font-size:15px;font-weight:600;padding:8px 12px;border-radius:4px}
p.verdict.ok{background:#e8f6ea}
p.verdict.sev-high{background:#fdecea}
code{font-size:12px;background:#f3f3f3;padding:1px 4px;border-radius:3px}
footer{font-size:12px;color:#666;padding:0 28px 20px 28px}
"""


@dataclass
class Figure:
    name: str  # file stem under --figures
    caption: str
    svg: bytes


@dataclass
class Section:
    id: str
    title: str
    figures: list[Figure] = field(default_factory=list)
    body: list[str] = field(default_factory=list)  # HTML fragments, already escaped
    lead: list[str] = field(default_factory=list)  # HTML fragments drawn before the figures


def absent(reason: str) -> str:
    return f'<p class="absent">Not shown: {escape(reason)}</p>'


def para(text: str) -> str:
    return f"<p>{escape(text)}</p>"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], numeric: Sequence[int] = ()) -> str:
    head = "".join(f"<th>{escape(str(h))}</th>" for h in headers)
    body = []
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            cls = ' class="num"' if i in numeric else ""
            cells.append(f"<td{cls}>{escape(str(cell))}</td>")
        body.append(f"<tr>{''.join(cells)}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def fields(rows: Sequence[tuple[str, object]]) -> str:
    """A two-column name/value table without a header row."""
    body = "".join(f"<tr><th>{escape(k)}</th><td>{escape(str(v))}</td></tr>" for k, v in rows)
    return f"<table><tbody>{body}</tbody></table>"


def raw_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Like table() but cells are trusted HTML fragments (callers escape what they insert)."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render(title: str, header_lines: Sequence[str], sections: Sequence[Section], footer: str) -> str:
    nav = "".join(f'<a href="#{s.id}">{escape(s.title)}</a>' for s in sections)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        # No network: forbid every fetch except inline data the page carries.
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
        "img-src data:; style-src 'unsafe-inline'\">",
        f"<title>{escape(title)}</title><style>{CSS}</style></head><body>",
        f"<header><h1>{escape(title)}</h1>",
        *(f"<p>{escape(line)}</p>" for line in header_lines),
        "</header>",
        f"<nav>{nav}</nav><main>",
    ]
    for s in sections:
        parts.append(f'<section id="{escape(s.id)}" data-section="{escape(s.id)}"><h2>{escape(s.title)}</h2>')
        parts.extend(s.lead)
        for fig in s.figures:
            data = base64.b64encode(fig.svg).decode("ascii")
            parts.append(
                f'<figure id="fig-{escape(fig.name)}" data-figure="{escape(fig.name)}"><img alt="{escape(fig.caption)}" '
                f'src="data:image/svg+xml;base64,{data}"><figcaption>{escape(fig.caption)}</figcaption></figure>'
            )
        parts.extend(s.body)
        parts.append("</section>")
    parts.append(f"</main><footer>{escape(footer)}</footer></body></html>")
    return "\n".join(parts)
