"""What an OpenAI-compatible completion answer looks like, checked line by line as it streams.

A load test must not take a web page, a proxy's error page or another API for a served request:
every answer is parsed as the OpenAI wire format (what vLLM, transformers serve, TGI and llama.cpp's
server speak), and what does not parse raises :class:`NotOpenAI`, which the client records as a
failed request, never as "ok" with 0 tokens.

A streamed answer is Server-Sent Events: ``data: {json}`` lines (``event:``, ``id:``, ``retry:``,
``:`` comments and blank lines allowed), ending with ``data: [DONE]`` (OpenAI, vLLM) or simply
the end of the body (transformers serve sends no ``[DONE]``). Each JSON chunk is an object with a
``choices`` list of objects (``text`` for /v1/completions, ``delta.content`` for chat), an
``error``, or a trailing ``usage`` with integer counts. A server that ignores ``"stream": true``
and answers one ``application/json`` completion object is accepted too (its text arrives at once).

Everything here is hostile-input safe: a JSON document nested too deep, a number that does not fit
(usage counts must lie in 0..2**40) or invalid UTF-8 is a NotOpenAI message, never an exception of
another class, and what a message quotes from the server is one printable line (:func:`one_line`).
"""

from __future__ import annotations

import json
import reprlib
from typing import Any

DONE = "[DONE]"
NOT_OPENAI = "not an OpenAI completion"
_SSE_FIELDS = ("event:", "id:", "retry:", ":")
_USAGE_KEYS = ("prompt_tokens", "completion_tokens")
MAX_COUNT = 2**40  # a usage count above this (a trillion tokens) is not a count
_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxother = 3, 120, 120


class NotOpenAI(ValueError):
    """The answer is not in the OpenAI completion format (the message says what was seen)."""


def one_line(text: str, n: int = 200) -> str:
    """``text`` as one printable line of at most about ``n`` characters: whitespace runs become one
    space, other characters that do not print (control characters, bidi overrides, lone surrogates)
    are written as escapes, so a server's text cannot move the cursor or split a message."""
    text = " ".join(text[: 4 * n].split())
    out = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text[:n])
    return out + ("..." if len(text) > n else "")


def brief(value: Any, n: int = 160) -> str:
    """A short printable rendering of a JSON value of any shape or depth (bounded work)."""
    if isinstance(value, str):
        return one_line(value, n)
    return one_line(_BRIEF.repr(value), n)


def parse_json(data: str | bytes) -> Any:
    """json.loads that raises only ValueError: invalid UTF-8 and nesting too deep for the parser
    (RecursionError) included."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deep") from None


def snippet(text: str | bytes, n: int = 60) -> str:
    """The start of a body, on one line, for a message."""
    if isinstance(text, bytes):
        text = text[: 8 * n].decode("utf-8", "replace")
    text = " ".join(text[: 8 * n].split())
    return repr(text[:n] + ("..." if len(text) > n else ""))


def _shown(value: Any) -> str:
    """snippet() of a parsed JSON value (its JSON text when it has one, else its brief form)."""
    try:
        return snippet(json.dumps(value))
    except (ValueError, RecursionError):
        return snippet(brief(value))


def sse_data(line: str) -> dict[str, Any] | str | None:
    """One line of an SSE body: its JSON chunk, :data:`DONE`, or None for a line that carries no
    data (blank, comment, other fields). Raises NotOpenAI for anything else."""
    line = line.strip("\r")
    if not line or line.startswith(_SSE_FIELDS):
        return None
    if not line.startswith("data:"):
        raise NotOpenAI(f"a line that is not Server-Sent Events: {snippet(line)}")
    data = line[5:].strip()
    if data == DONE:
        return DONE
    try:
        chunk = parse_json(data)
    except ValueError:
        raise NotOpenAI(f"a data line that is not JSON: {snippet(data)}") from None
    return check_chunk(chunk)


def check_chunk(chunk: Any) -> dict[str, Any]:
    """``chunk`` if it is an OpenAI completion (chunk) object or an error object; else NotOpenAI."""
    if not isinstance(chunk, dict):
        raise NotOpenAI(f"a JSON {type(chunk).__name__}, not a completion object: {_shown(chunk)}")
    if "error" in chunk:
        return chunk
    choices = chunk.get("choices")
    usage = chunk.get("usage")
    if choices is None and usage is None:
        raise NotOpenAI(f"a JSON object with neither choices nor usage: {_shown(chunk)}")
    if choices is not None and (not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices)):
        raise NotOpenAI(f"choices is not a list of objects: {_shown(choices)}")
    if usage is not None and not (isinstance(usage, dict) and all(_count(usage.get(k, 0)) for k in _USAGE_KEYS)):
        raise NotOpenAI(f"usage is not an object of integer counts: {_shown(usage)}")
    return chunk


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_COUNT


def chunk_text(chunk: dict[str, Any]) -> str:
    """The text a (checked) chunk carries: the first choice's ``text``, ``delta.content`` (chat
    stream) or ``message.content`` (chat, not streamed); "" when none."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    first = choices[0]
    for holder, key in ((first, "text"), (first.get("delta"), "content"), (first.get("message"), "content")):
        if isinstance(holder, dict) and isinstance(holder.get(key), str):
            return holder[key]
    return ""


def whole_completion(body: bytes) -> dict[str, Any]:
    """A non-streamed answer (``application/json``): one completion object."""
    try:
        return check_chunk(parse_json(body))
    except ValueError as exc:
        if isinstance(exc, NotOpenAI):
            raise
        raise NotOpenAI(f"application/json that does not parse: {snippet(body)}") from None


def error_detail(body: bytes) -> str:
    """': MESSAGE' from an error answer's JSON (OpenAI's error.message, FastAPI's detail), else ''."""
    try:
        doc = parse_json(body)
    except ValueError:
        return ""
    if not isinstance(doc, dict):
        return ""
    err = doc.get("error")
    msg = err.get("message") if isinstance(err, dict) else err
    msg = msg if msg is not None else doc.get("detail", doc.get("message"))
    if msg is None:
        return ""
    return ": " + brief(msg)
