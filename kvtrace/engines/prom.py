"""A bounded reader of the Prometheus text exposition format (what an engine's /metrics answers).

Only what ``kvtrace attach`` needs: samples ``name{labels} value`` (comments, timestamps and exemplars
ignored). The page comes from a server kvtrace does not trust: its size, line count and label count
are bounded, a line that does not parse is skipped and counted, never raised.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

MAX_PAGE_BYTES = 16 << 20
MAX_LABELS = 64
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_ESC = re.compile(r"\\(.)")


@dataclass
class Page:
    """One /metrics page: samples by name, each a list of (labels, value)."""

    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)
    skipped_lines: int = 0

    def value(self, name: str, **labels: str) -> float | None:
        """The sum over the samples of `name` whose labels include `labels` (None: no such sample)."""
        found = [v for lab, v in self.samples.get(name, ()) if all(lab.get(k) == x for k, x in labels.items())]
        return math.fsum(found) if found else None

    def labels(self, name: str) -> dict[str, str] | None:
        """The labels of the first sample of `name` (an info metric), None without one."""
        rows = self.samples.get(name)
        return dict(rows[0][0]) if rows else None


def _unescape(s: str) -> str:
    return _ESC.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), s)


def parse(text: str) -> Page:
    """The samples of a /metrics page (see the module docstring for the bounds)."""
    page = Page()
    for line in text[:MAX_PAGE_BYTES].splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _NAME.match(line)
        if not m:
            page.skipped_lines += 1
            continue
        name, rest = m.group(0), line[m.end():]
        labels: dict[str, str] = {}
        if rest.startswith("{"):
            end = rest.find("}")
            body, rest = (rest[1:end], rest[end + 1:]) if end >= 0 else ("", "")
            pos = 0
            while pos < len(body) and len(labels) < MAX_LABELS:
                lm = _LABEL.match(body, pos)
                if not lm:
                    break
                labels[lm.group(1)] = _unescape(lm.group(2))
                pos = lm.end()
            if end < 0 or pos < len(body.rstrip(", ")):
                page.skipped_lines += 1
                continue
        parts = rest.split()
        try:
            value = float(parts[0])
        except (IndexError, ValueError):
            page.skipped_lines += 1
            continue
        page.samples.setdefault(name, []).append((labels, value))
    return page
