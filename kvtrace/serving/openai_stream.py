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
"""

from __future__ import annotations

import json
from typing import Any

DONE = "[DONE]"
NOT_OPENAI = "not an OpenAI completion"
_SSE_FIELDS = ("event:", "id:", "retry:", ":")
_USAGE_KEYS = ("prompt_tokens", "completion_tokens")


class NotOpenAI(ValueError):
    """The answer is not in the OpenAI completion format (the message says what was seen)."""


def snippet(text: str | bytes, n: int = 60) -> str:
    """The start of a body, on one line, for a message."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    text = " ".join(text.split())
    return repr(text[:n] + ("..." if len(text) > n else ""))


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
        chunk = json.loads(data)
    except ValueError:
        raise NotOpenAI(f"a data line that is not JSON: {snippet(data)}") from None
    return check_chunk(chunk)


def check_chunk(chunk: Any) -> dict[str, Any]:
    """``chunk`` if it is an OpenAI completion (chunk) object or an error object; else NotOpenAI."""
    if not isinstance(chunk, dict):
        raise NotOpenAI(f"a JSON {type(chunk).__name__}, not a completion object: {snippet(json.dumps(chunk))}")
    if "error" in chunk:
        return chunk
    choices = chunk.get("choices")
    usage = chunk.get("usage")
    if choices is None and usage is None:
        raise NotOpenAI(f"a JSON object with neither choices nor usage: {snippet(json.dumps(chunk))}")
    if choices is not None and (not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices)):
        raise NotOpenAI(f"choices is not a list of objects: {snippet(json.dumps(choices))}")
    if usage is not None and not (isinstance(usage, dict) and all(
            isinstance(usage.get(k, 0), int) and not isinstance(usage.get(k, 0), bool) for k in _USAGE_KEYS)):
        raise NotOpenAI(f"usage is not an object of integer counts: {snippet(json.dumps(usage))}")
    return chunk


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
        return check_chunk(json.loads(body))
    except ValueError as exc:
        if isinstance(exc, NotOpenAI):
            raise
        raise NotOpenAI(f"application/json that does not parse: {snippet(body)}") from None


def error_detail(body: bytes) -> str:
    """': MESSAGE' from an error answer's JSON (OpenAI's error.message, FastAPI's detail), else ''."""
    try:
        doc = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(doc, dict):
        return ""
    err = doc.get("error")
    msg = err.get("message") if isinstance(err, dict) else err
    msg = msg if msg is not None else doc.get("detail", doc.get("message"))
    if msg is None:
        return ""
    return ": " + " ".join(str(msg).split())[:160]
