"""The load-test client: streaming OpenAI-compatible requests with httpx's async client.

Times are measured from the moment the request is sent: TTFT to the first streamed chunk that
carries text, inter-token latency (ITL) between successive text chunks (one chunk per token on
transformers serve and vLLM; chunks that arrive in one network read have gaps near 0, which is what
a client sees), end-to-end to the end of the stream."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from kvtrace.errors import Unavailable
from kvtrace.serving.openai_stream import (
    DONE,
    NOT_OPENAI,
    NotOpenAI,
    brief,
    chunk_text,
    error_detail,
    one_line,
    parse_json,
    sse_data,
    whole_completion,
)

API_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class ServerUnreachable(Unavailable):
    """The endpoint does not answer at all (refused, unknown host, timed out): exit 69."""


class BoundBroken(Exception):
    """The server broke one of the client's bounds (:class:`Bounds`); the message says which."""


MiB = 1 << 20


@dataclass(frozen=True)
class Bounds:
    """What kvtrace loadtest follows a server into, at most (spec/cli.md, "kvtrace loadtest"). A
    server that breaks a bound is not followed further: the request fails, its status says which
    bound, and the phase verdict counts it."""

    request_s: float = 1800.0  # --request-timeout: a completion request from send to its last byte
    gap_s: float = 600.0  # --timeout: between two reads (10 s at most to connect)
    line_bytes: int = MiB  # --max-line-bytes: one SSE line, or one JSON answer read whole
    answer_bytes: int = 8 * MiB  # --max-answer-bytes: one answer (a whole stream included)
    in_flight: int = 256  # --max-in-flight: requests sent and not yet answered, at once

    @property
    def whole(self) -> tuple[int, str]:
        """(bytes, option) for an answer read whole and parsed as one JSON document (/health,
        /kvtrace/status, an error body, a non-streamed completion): held in memory like one line."""
        if self.line_bytes <= self.answer_bytes:
            return self.line_bytes, "--max-line-bytes"
        return self.answer_bytes, "--max-answer-bytes"

    @property
    def control_s(self) -> float:
        """/health, /kvtrace/status and /kvtrace/phase: answered in full within --timeout (and
        --request-timeout, when shorter)."""
        return min(self.gap_s, self.request_s)


@dataclass
class RequestResult:
    """One row of the latency table (seconds; -1 where not measured)."""

    phase: str
    index: int
    status: str  # "ok", "http NNN", "error: ...", "timeout" (a gap), "timeout: ..." (--request-timeout)
    prompt_words: int
    prompt_tokens: int  # the server's usage.prompt_tokens, -1 if it reported none
    output_tokens: int  # usage.completion_tokens, else text chunks received
    start_s: float  # since the load test began
    ttft_s: float = -1.0
    itl_mean_s: float = -1.0
    itl_p50_s: float = -1.0
    itl_p95_s: float = -1.0
    e2e_s: float = -1.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def context_tokens(self) -> int:
        """Prompt plus output tokens (the server's count when it gave one, else the words sent)."""
        prompt = self.prompt_tokens if self.prompt_tokens >= 0 else self.prompt_words
        return prompt + max(self.output_tokens, 0)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), -1 for no values."""
    if not values:
        return -1.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def request_body(api: str, text: str, max_tokens: int, model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"stream": True, "max_tokens": max_tokens, "temperature": 0.0}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if model is not None:
        body["model"] = model
    return body


async def stream_request(client: httpx.AsyncClient, base: str, api: str, body: dict[str, Any], *,
                         phase: str, index: int, prompt_words: int, t0: float,
                         bounds: Bounds = Bounds()) -> RequestResult:
    """Send one streaming request; never raises for the server's failures (they are the status). An
    answer that is not an OpenAI completion (a web page, another API) is status "error: not an OpenAI
    completion: ..." (:mod:`kvtrace.serving.openai_stream`), a failed request like any other; one
    that breaks a bound (:class:`Bounds`: its whole time, a line's or the answer's bytes) is status
    "timeout: ..." or "error: ...", naming the option that sets the bound."""
    start = time.perf_counter()
    row = RequestResult(phase, index, "ok", prompt_words, -1, 0, start - t0)
    arrivals: list[float] = []
    usage: dict[str, Any] = {}
    try:
        await asyncio.wait_for(_exchange(client, base + API_PATHS[api], body, row, arrivals, usage, bounds),
                               timeout=bounds.request_s)
    except NotOpenAI as exc:
        row.status = one_line(f"error: {NOT_OPENAI}: {exc}", 300)
        arrivals, usage = [], {}
    except BoundBroken as exc:
        row.status = one_line(f"error: {exc}", 300)
    except asyncio.TimeoutError:
        row.status = (f"timeout: the answer did not end within {bounds.request_s:g} s (--request-timeout)"
                      f"{'' if arrivals else ', no text received'}")
    except httpx.TimeoutException:
        row.status = "timeout"
    except httpx.HTTPError as exc:
        row.status = one_line(f"error: {type(exc).__name__}: {exc}", 200)
    end = time.perf_counter()
    if row.ok:
        row.e2e_s = end - start
    if arrivals:
        row.ttft_s = arrivals[0] - start
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
        if gaps:
            row.itl_mean_s = sum(gaps) / len(gaps)
            row.itl_p50_s = percentile(gaps, 50)
            row.itl_p95_s = percentile(gaps, 95)
    row.prompt_tokens = int(usage.get("prompt_tokens", -1))
    row.output_tokens = int(usage.get("completion_tokens", len(arrivals)))
    return row


async def _exchange(client: httpx.AsyncClient, url: str, body: dict[str, Any], row: RequestResult,
                    arrivals: list[float], usage: dict[str, Any], bounds: Bounds) -> None:
    """One request and its answer, filling ``row`` (status), ``arrivals`` and ``usage`` in place, so
    that what arrived before a bound was broken is kept."""
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            try:
                detail = error_detail(await read_bounded(resp, *bounds.whole))
            except BoundBroken as exc:
                detail = f" ({exc})"
            row.status = one_line(f"http {resp.status_code}{detail}", 300)
            return
        seen = False
        async for chunk in _chunks(resp, bounds):
            seen = True
            if "error" in chunk:
                err = chunk["error"]
                msg = err.get("message") if isinstance(err, dict) and isinstance(err.get("message"), str) else err
                row.status = f"error: {brief(msg, 200)}"
                break
            if chunk_text(chunk):
                arrivals.append(time.perf_counter())
            if isinstance(chunk.get("usage"), dict):
                usage.clear()
                usage.update(chunk["usage"])
        if not seen:
            raise NotOpenAI(f"HTTP 200 {one_line(resp.headers.get('content-type') or '(no content type)', 80)} with "
                            "no completion chunk")


def _check_encoding(resp: httpx.Response) -> None:
    """The client asks for ``Accept-Encoding: identity``: a compressed answer is not read (its
    decoded size is not bounded by the bytes that arrive)."""
    coding = (resp.headers.get("content-encoding") or "identity").strip().lower()
    if coding != "identity":
        raise BoundBroken(f"an answer with Content-Encoding {one_line(coding, 40)} though identity was asked "
                          f"(not read: its decoded size is unbounded)")


async def read_bounded(resp: httpx.Response, limit: int, option: str) -> bytes:
    """The whole body, or BoundBroken once it passes ``limit`` bytes (a Content-Length above it is
    refused before reading); ``option`` names what set the limit."""
    _check_encoding(resp)
    declared = (resp.headers.get("content-length") or "").strip()
    if declared.isdigit() and len(declared) < 20 and int(declared) > limit:
        raise BoundBroken(f"an answer of {int(declared)} bytes, over {limit} ({option})")
    buf = bytearray()
    async for piece in resp.aiter_raw():
        buf += piece
        if len(buf) > limit:
            raise BoundBroken(f"an answer over {limit} bytes ({option})")
    return bytes(buf)


_EOL = re.compile(rb"\r\n|\r|\n")


async def sse_lines(resp: httpx.Response, bounds: Bounds) -> AsyncIterator[str]:
    """The lines of a streamed answer (CR, LF or CRLF ends, as SSE allows), decoded as UTF-8 with
    replacement (as SSE decodes); BoundBroken for a line over ``bounds.line_bytes`` (found before it
    is held whole) or an answer over ``bounds.answer_bytes``."""
    _check_encoding(resp)
    buf = bytearray()
    total = 0
    async for piece in resp.aiter_raw():
        total += len(piece)
        if total > bounds.answer_bytes:
            raise BoundBroken(f"a streamed answer over {bounds.answer_bytes} bytes (--max-answer-bytes)")
        buf += piece
        pos = 0
        while (m := _EOL.search(buf, pos)) is not None:
            if m.group() == b"\r" and m.end() == len(buf):
                break  # a CR at the end: its LF may be in the next piece
            if m.start() - pos > bounds.line_bytes:
                break
            yield buf[pos:m.start()].decode("utf-8", "replace")
            pos = m.end()
        del buf[:pos]
        if len(buf) > bounds.line_bytes:
            raise BoundBroken(f"an SSE line over {bounds.line_bytes} bytes (--max-line-bytes)")
    if buf:
        yield buf.rstrip(b"\r").decode("utf-8", "replace")


async def _chunks(resp: httpx.Response, bounds: Bounds) -> AsyncIterator[dict[str, Any]]:
    """The checked completion chunks of a 200 answer: SSE lines up to [DONE] or the end, or the one
    object of a server that answered application/json (it ignored "stream")."""
    ctype = one_line(resp.headers.get("content-type") or "", 80)
    if ctype.split(";")[0].strip().lower() == "application/json":
        yield whole_completion(await read_bounded(resp, *bounds.whole))
        return
    async for line in sse_lines(resp, bounds):
        try:
            item = sse_data(line)
        except NotOpenAI as exc:
            raise NotOpenAI(f"HTTP 200 {ctype or '(no content type)'}: {exc}") from None
        if item == DONE:
            return
        if isinstance(item, dict):
            yield item


async def get_json(client: httpx.AsyncClient, url: str, bounds: Bounds = Bounds()) -> tuple[int, Any]:
    """(status, body or None); raises ServerUnreachable when nothing answers, BoundBroken when the
    answer is not complete within ``bounds.control_s`` or passes ``bounds.whole``. One retry: a
    kept-alive connection the server closed just as it was reused fails once without the server
    being down."""
    for attempt in (1, 2):
        try:
            return await _bounded_call(client, "GET", url, None, bounds)
        except httpx.TimeoutException as exc:
            raise ServerUnreachable(f"{url}: timed out ({exc})") from None
        except httpx.TransportError as exc:
            if attempt == 2 or isinstance(exc, httpx.ConnectError):
                raise ServerUnreachable(f"{url}: {type(exc).__name__}: {one_line(str(exc))}") from None
    raise AssertionError("unreachable")  # pragma: no cover


async def post_json(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                    bounds: Bounds = Bounds()) -> tuple[int, Any]:
    try:
        return await _bounded_call(client, "POST", url, body, bounds)
    except httpx.TimeoutException as exc:
        raise ServerUnreachable(f"{url}: timed out ({exc})") from None
    except httpx.TransportError as exc:
        raise ServerUnreachable(f"{url}: {type(exc).__name__}: {one_line(str(exc))}") from None


async def _bounded_call(client: httpx.AsyncClient, method: str, url: str, body: dict[str, Any] | None,
                        bounds: Bounds) -> tuple[int, Any]:
    async def call() -> tuple[int, bytes]:
        async with client.stream(method, url, json=body) as resp:
            return resp.status_code, await read_bounded(resp, *bounds.whole)

    try:
        code, data = await asyncio.wait_for(call(), timeout=bounds.control_s)
    except asyncio.TimeoutError:
        raise BoundBroken(f"{url}: no complete answer within {bounds.control_s:g} s (--timeout)") from None
    try:
        return code, parse_json(data)
    except ValueError:
        return code, None
