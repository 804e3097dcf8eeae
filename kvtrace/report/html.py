"""HTML assembly: one self-contained page (inline CSS, figures as data: URIs, no scripts,
nothing fetched from the network).

Templates are Jinja2 with autoescape on: every value is escaped unless it is a fragment this
module (or a caller, through :func:`trusted`) already built as ``Markup``. So escaping is the
default, not a habit each f-string has to keep.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from jinja2 import Environment, StrictUndefined
from markupsafe import Markup

from kvtrace.errors import CannotWrite
from kvtrace.wholefile import write_text_whole

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
code{font-size:12px;background:#f3f3f3;padding:0 3px;border-radius:3px;-webkit-box-decoration-break:clone;box-decoration-break:clone}
pre.fix{min-width:30ch;margin:2px 0;padding:5px 8px;background:#f3f3f3;border:1px solid #e2e2e2;border-radius:3px;font-size:12px;line-height:1.45;white-space:pre-wrap;overflow-wrap:anywhere;overflow:visible}
pre.fix code{background:none;padding:0;font-size:inherit;line-height:inherit}
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
    body: list[str] = field(default_factory=list)  # HTML fragments (Markup, or trusted strings)
    lead: list[str] = field(default_factory=list)  # HTML fragments drawn before the figures


_ENV = Environment(autoescape=True, undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)


def trusted(fragment: str) -> Markup:
    """A fragment a caller built and escaped itself (build.py's severity spans, verdict lines)."""
    return Markup(fragment)


_ENV.filters["trusted"] = trusted
_ENV.filters["b64"] = lambda data: base64.b64encode(data).decode("ascii")


_ABSENT = _ENV.from_string('<p class="absent">Not shown: {{ reason }}</p>')
_PARA = _ENV.from_string("<p>{{ text }}</p>")
_TABLE = _ENV.from_string(
    "<table><thead><tr>{% for h in headers %}<th>{{ h }}</th>{% endfor %}</tr></thead><tbody>"
    "{% for row in rows %}<tr>{% for cell in row %}"
    '<td{% if loop.index0 in numeric %} class="num"{% endif %}>{{ cell }}</td>'
    "{% endfor %}</tr>{% endfor %}</tbody></table>"
)
_FIELDS = _ENV.from_string(
    "<table><tbody>{% for k, v in rows %}<tr><th>{{ k }}</th><td>{{ v }}</td></tr>{% endfor %}</tbody></table>"
)
_PAGE = _ENV.from_string("""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
{# No network: forbid every fetch except inline data the page carries. #}
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; img-src data:; style-src 'unsafe-inline'">
<title>{{ title }}</title><style>{{ css }}</style></head><body>
<header><h1>{{ title }}</h1>
{% for line in header_lines %}
<p>{{ line }}</p>
{% endfor %}
</header>
<nav>{% for s in sections %}<a href="#{{ s.id }}">{{ s.title }}</a>{% endfor %}</nav><main>
{% for s in sections %}
<section id="{{ s.id }}" data-section="{{ s.id }}"><h2>{{ s.title }}</h2>
{% for part in s.lead %}
{{ part | trusted }}
{% endfor %}
{% for fig in s.figures %}
<figure id="fig-{{ fig.name }}" data-figure="{{ fig.name }}">{#
#}<img alt="{{ fig.caption }}" src="data:image/svg+xml;base64,{{ fig.svg | b64 }}">{#
#}<figcaption>{{ fig.caption }}</figcaption></figure>
{% endfor %}
{% for part in s.body %}
{{ part | trusted }}
{% endfor %}
</section>
{% endfor %}
</main><footer>{{ footer }}</footer></body></html>""")


def absent(reason: str) -> Markup:
    return Markup(_ABSENT.render(reason=reason))


def para(text: str) -> Markup:
    return Markup(_PARA.render(text=text))


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], numeric: Sequence[int] = ()) -> Markup:
    return Markup(_TABLE.render(headers=headers, rows=rows, numeric=set(numeric)))


def fields(rows: Sequence[tuple[str, object]]) -> Markup:
    """A two-column name/value table without a header row."""
    return Markup(_FIELDS.render(rows=rows))


def raw_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> Markup:
    """Like table() but cells are trusted HTML fragments (callers escape what they insert)."""
    return table(headers, [[trusted(c) for c in row] for row in rows])


def render(title: str, header_lines: Sequence[str], sections: Sequence[Section], footer: str) -> str:
    return _PAGE.render(title=title, header_lines=header_lines, sections=sections, footer=footer,
                        css=trusted(CSS))


def write_page(out: Path, page: str) -> None:
    """Write a rendered page whole or not at all; a failure is CannotWrite (one line, exit 73), never a traceback."""
    try:
        write_text_whole(out, page)  # a full disk leaves no empty page (nor replaces an earlier one)
    except OSError as exc:
        raise CannotWrite(f"{out}: cannot write report ({exc.strerror})") from None
