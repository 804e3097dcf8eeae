"""Text that kvtrace did not write (model ids, layer types, paths, messages read from a trace, a
fleet or a server) is data: printed, it must neither drive the terminal nor be read as markup.

- :func:`visible`: control characters (C0, DEL, C1: ESC starts terminal escape sequences, CR and
  BS overwrite what was printed, a newline forges a line), Unicode bidi controls (U+202A-U+202E,
  U+2066-U+2069, U+200E/U+200F/U+061C: they reorder what the reader sees), line and paragraph
  separators and lone surrogates become visible escapes (``\\x1b``, ``\\u202e``); text longer
  than ``limit`` characters is cut with a count of what was left out (a 1 MB model id is a
  diagnosis, not something to print). JSON output needs none of this: ``json.dumps`` escapes
  every control character, and the reader turns lone surrogates into U+FFFD.
- :func:`markup`: :func:`visible` and then escaped for rich markup (``[/bold]``, ``[link=...]``
  are printed as written), for text interpolated into a string rich renders with markup.
- :class:`SafeConsoleMixin`: the last line of defence of kvtrace's rich consoles
  (kvtrace.analyzer.terminal.console_for): every string rich renders and every segment it writes
  passes :func:`visible` (newlines and tabs kept), emoji codes (``:smile:``) are not replaced.

Every printing path (the commands' ``click.echo`` lines, the rich renderers) uses these.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

__all__ = ["MAX_CHARS", "SafeConsoleMixin", "markup", "visible", "visible_lines"]

MAX_CHARS = 4096  # one field printed to a terminal; longer text is cut (its length is said)

_BIDI = "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
_OTHER = "\x7f-\x9f\u2028\u2029\ud800-\udfff"
_UNSAFE_LINE = re.compile(f"[\x00-\x1f{_OTHER}{_BIDI}]")  # one line: newlines and tabs too
_UNSAFE_TEXT = re.compile(f"[\x00-\x08\x0b-\x1f{_OTHER}{_BIDI}]")  # several lines: \t and \n kept


def _escape(m: re.Match[str]) -> str:
    o = ord(m.group())
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}"


def visible(text: Any, *, multiline: bool = False, limit: int | None = MAX_CHARS) -> str:
    """``text`` (``str()`` of anything else) with every character that acts on a terminal shown
    as an escape, cut to ``limit`` characters (None: whole). ``multiline`` keeps ``\\n`` and
    ``\\t`` (a block kvtrace laid out), else they are shown too (one field, one line)."""
    s = text if isinstance(text, str) else str(text)
    more = 0
    if limit is not None and len(s) > limit:
        more, s = len(s) - limit, s[:limit]
    s = (_UNSAFE_TEXT if multiline else _UNSAFE_LINE).sub(_escape, s)
    return f"{s}... [{more:,} more characters]" if more else s


def visible_lines(text: str, *, limit: int | None = MAX_CHARS) -> str:
    """A block of lines kvtrace laid out, each line :func:`visible` and cut to ``limit``."""
    return "\n".join(visible(line, limit=limit) for line in text.split("\n"))


def markup(text: Any, *, limit: int | None = MAX_CHARS) -> str:
    """:func:`visible` (one line), escaped for rich markup: printed exactly as written."""
    from rich.markup import escape

    return escape(visible(text, limit=limit))


class SafeConsoleMixin:
    """Mix into a ``rich.console.Console``: strings are made visible before rich parses and lays
    them out (so tables measure what is printed), and every segment once more on its way out
    (Text objects built elsewhere). Control segments (rich's own cursor moves) pass as they are."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("emoji", False)  # ":smile:" in a model id stays ":smile:"
        super().__init__(*args, **kwargs)

    def render_str(self, text: str, **kwargs: Any) -> Any:
        return super().render_str(visible(text, multiline=True, limit=None), **kwargs)  # type: ignore[misc]

    def render(self, renderable: Any, options: Any = None) -> Iterable[Any]:
        from rich.segment import Segment

        for seg in super().render(renderable, options):  # type: ignore[misc]
            if seg.control or not _UNSAFE_TEXT.search(seg.text):
                yield seg
            else:
                yield Segment(visible(seg.text, multiline=True, limit=None), seg.style, seg.control)
