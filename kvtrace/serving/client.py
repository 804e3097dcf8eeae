"""The load-test client: streaming OpenAI-compatible requests with httpx's async client.

Times are measured from the moment the request is sent: TTFT to the first streamed chunk that
carries text, inter-token latency (ITL) between successive text chunks (one chunk per token on
transformers serve and vLLM; chunks that arrive in one network read have gaps near 0, which is what
a client sees), end-to-end to the end of the stream."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from kvtrace.serving.openai_stream import (
    DONE,
    NOT_OPENAI,
    NotOpenAI,
    chunk_text,
    error_detail,
    sse_data,
    whole_completion,
)

API_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class ServerUnreachable(Exception):
    """The endpoint does not answer at all (refused, unknown host, timed out)."""


@dataclass
class RequestResult:
    """One row of the latency table (seconds; -1 where not measured)."""

    phase: str
    index: int
    status: str  # "ok", "http NNN", "error: ...", "timeout"
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
                         phase: str, index: int, prompt_words: int, t0: float) -> RequestResult:
    """Send one streaming request; never raises for the server's failures (they are the status). An
    answer that is not an OpenAI completion (a web page, another API) is status "error: not an OpenAI
    completion: ..." (:mod:`kvtrace.serving.openai_stream`), a failed request like any other."""
    start = time.perf_counter()
    row = RequestResult(phase, index, "ok", prompt_words, -1, 0, start - t0)
    arrivals: list[float] = []
    usage: dict[str, Any] = {}
    try:
        async with client.stream("POST", base + API_PATHS[api], json=body) as resp:
            if resp.status_code != 200:
                row.status = f"http {resp.status_code}" + error_detail(await resp.aread())
                return row
            seen = False
            async for chunk in _chunks(resp):
                seen = True
                if "error" in chunk:
                    row.status = f"error: {str(chunk['error'])[:200]}"
                    break
                if chunk_text(chunk):
                    arrivals.append(time.perf_counter())
                if isinstance(chunk.get("usage"), dict):
                    usage = chunk["usage"]
            if not seen:
                raise NotOpenAI(f"HTTP 200 {resp.headers.get('content-type') or '(no content type)'} with no "
                                "completion chunk")
    except NotOpenAI as exc:
        row.status = f"error: {NOT_OPENAI}: {exc}"[:300]
        arrivals, usage = [], {}
    except httpx.TimeoutException:
        row.status = "timeout"
    except httpx.HTTPError as exc:
        row.status = f"error: {type(exc).__name__}: {exc}"[:200]
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


async def _chunks(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The checked completion chunks of a 200 answer: SSE lines up to [DONE] or the end, or the one
    object of a server that answered application/json (it ignored "stream")."""
    ctype = resp.headers.get("content-type") or ""
    if ctype.split(";")[0].strip().lower() == "application/json":
        yield whole_completion(await resp.aread())
        return
    async for line in resp.aiter_lines():
        try:
            item = sse_data(line)
        except NotOpenAI as exc:
            raise NotOpenAI(f"HTTP 200 {ctype or '(no content type)'}: {exc}") from None
        if item == DONE:
            return
        if isinstance(item, dict):
            yield item


async def get_json(client: httpx.AsyncClient, url: str) -> tuple[int, Any]:
    """(status, body or None); raises ServerUnreachable when nothing answers. One retry: a kept-alive
    connection the server closed just as it was reused fails once without the server being down."""
    for attempt in (1, 2):
        try:
            resp = await client.get(url)
            break
        except httpx.TimeoutException as exc:
            raise ServerUnreachable(f"{url}: timed out ({exc})") from None
        except httpx.TransportError as exc:
            if attempt == 2 or isinstance(exc, httpx.ConnectError):
                raise ServerUnreachable(f"{url}: {type(exc).__name__}: {exc}") from None
    try:
        return resp.status_code, resp.json()
    except ValueError:
        return resp.status_code, None


async def post_json(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    try:
        resp = await client.post(url, json=body)
    except httpx.TransportError as exc:
        raise ServerUnreachable(f"{url}: {type(exc).__name__}: {exc}") from None
    try:
        return resp.status_code, resp.json()
    except ValueError:
        return resp.status_code, None
