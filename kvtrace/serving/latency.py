"""The per-request latency table of ``kvtrace loadtest`` (CSV, one row per request) and its
per-phase summary. Columns (seconds; -1 where not measured):

``phase, index, status, start_s, ttft_s, itl_mean_s, itl_p50_s, itl_p95_s, e2e_s, prompt_words,
prompt_tokens, output_tokens``

``prompt_tokens`` and ``output_tokens`` are the server's usage counts when it reports them
(``prompt_tokens`` -1 otherwise; ``output_tokens`` then counts streamed text chunks)."""

from __future__ import annotations

import csv
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from kvtrace.serving.client import RequestResult, percentile

COLUMNS = ("phase", "index", "status", "start_s", "ttft_s", "itl_mean_s", "itl_p50_s", "itl_p95_s", "e2e_s",
           "prompt_words", "prompt_tokens", "output_tokens")
assert set(COLUMNS) == {f.name for f in fields(RequestResult)}


def write_csv(rows: list[RequestResult], path: str | Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        out = csv.DictWriter(fh, fieldnames=COLUMNS)
        out.writeheader()
        for r in rows:
            d = asdict(r)
            out.writerow({k: (f"{d[k]:.6f}" if isinstance(d[k], float) else d[k]) for k in COLUMNS})


def read_csv(path: str | Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def summary(rows: list[RequestResult], wall_s: float) -> dict[str, Any]:
    """Per-phase latency figures (seconds) and output tokens per second over the phase's wall time."""
    ok = [r for r in rows if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s >= 0]
    itl = [r.itl_p50_s for r in ok if r.itl_p50_s >= 0]
    e2e = [r.e2e_s for r in ok if r.e2e_s >= 0]
    out_tokens = sum(r.output_tokens for r in ok)
    return {"requests": len(rows), "ok": len(ok), "ttft_p50_s": percentile(ttft, 50),
            "ttft_p95_s": percentile(ttft, 95), "itl_p50_s": percentile(itl, 50), "e2e_p50_s": percentile(e2e, 50),
            "e2e_p95_s": percentile(e2e, 95), "output_tokens": out_tokens,
            "output_tokens_per_s": out_tokens / wall_s if wall_s > 0 and ok else -1.0}
