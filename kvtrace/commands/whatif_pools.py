"""`kvtrace whatif ENGINE_TRACE --pool-sizes [N,N,...|auto]`: the prefix-cache hit rate an engine's
recorded block-hash stream would get at every pool size (kvtrace.engines.poolsim, spec §10)."""

from __future__ import annotations

import json
from typing import Any

import click

from kvtrace.commands.outputs import check_json_out, write_json
from kvtrace.errors import InvalidTrace
from kvtrace.params import split_list

SCHEMA = "kvtrace-whatif-pools/1"
MAX_SIZES = 64


def parse_sizes(text: str) -> list[int] | None:
    """`auto` -> None (powers of two and the recorded pool); else distinct block counts >= 1."""
    if text.strip() == "auto":
        return None
    try:
        sizes = sorted({int(x) for x in split_list(text)})
    except ValueError:
        raise click.BadParameter(f"expected 'auto' or comma-separated block counts, got {text!r}",
                                 param_hint="--pool-sizes") from None
    if not sizes or sizes[0] < 1 or sizes[-1] > 1 << 40 or len(sizes) > MAX_SIZES:
        raise click.BadParameter(f"1-{MAX_SIZES} block counts, each >= 1, got {text!r}", param_hint="--pool-sizes")
    return sizes


def run(trace: str, sizes_text: str, as_json: bool, json_out: str | None) -> None:
    from kvtrace.engines import poolsim
    from kvtrace.format.reader import Trace

    sizes = parse_sizes(sizes_text)
    check_json_out(json_out, [trace])
    with Trace(trace) as t:
        settings = t.meta.recorder_settings if isinstance(t.meta.recorder_settings, dict) else {}
        if settings.get("recorder") != "attach":
            raise InvalidTrace(f"{trace}: --pool-sizes reads an engine trace (kvtrace attach); this one was "
                               f"recorded by {json.dumps(settings.get('recorder', 'kvtrace record'))}: it has no "
                               "block-hash stream")
        try:
            stream = poolsim.read_stream(t)
        except ValueError as exc:
            raise InvalidTrace(f"{trace}: {exc}") from None
    cfg = settings.get("engine_config") if isinstance(settings.get("engine_config"), dict) else {}
    recorded = cfg.get("pool_blocks", -1) if isinstance(cfg.get("pool_blocks", -1), int) else -1
    distinct = len(set(stream.keys.tolist()))
    if sizes is None:
        sizes = poolsim.default_sizes(distinct, recorded)
    rows = poolsim.table(stream, sizes)
    n = int(stream.keys.size)
    recorded_hits = int(stream.hit.sum())
    doc: dict[str, Any] = {
        "schema": SCHEMA, "trace": trace, "block_size": stream.block_size, "recorded_pool_blocks": recorded,
        "accesses": n, "distinct_blocks": distinct, "recorded_hits": recorded_hits,
        "reuse_reports": stream.reuse_reports, "unreadable_hashes": stream.bad_texts, "sizes": rows,
        "block_times": poolsim.block_times(stream), "computed_again_blocks": poolsim.computed_again(stream),
        "model": "LRU stack distances (one pass) and Belady's optimum per size, over the recorded block "
                 "accesses; pinned blocks and the prefix-chain rule are outside the model",
    }
    write_json(doc, json_out, as_json=as_json)
    if as_json:
        return
    click.echo(f"{trace}: {n:,} block accesses ({distinct:,} distinct blocks of {stream.block_size} tokens); "
               f"recorded: {recorded_hits:,} hits at the engine's {recorded} blocks"
               + ("" if stream.reuse_reports else " (no reuse reports in the trace: vLLM publishes hits only for "
                  "requests sent with kv_cache_report_mode=\"full\", so every access here is a miss it computed)"))
    again = doc["computed_again_blocks"]
    if again:
        click.echo(f"computed again after an eviction: {again:,} blocks ({again * stream.block_size:,} tokens of "
                   "prefill that a pool keeping them would have served from cache)")
    bt = doc["block_times"]
    for name, what in (("lifetime", "block lifetimes (stored -> evicted)"),
                       ("idle_before_removal", "idle before eviction"), ("reuse_gap", "reuse gaps")):
        st = bt[name]
        if st["count"]:
            click.echo(f"{what}: {st['count']:,} from every event; median {st['p50_s']:.3f} s, p90 {st['p90_s']:.3f} s, "
                       f"max {st['max_s']:.3f} s")
    click.echo(f"{'pool blocks':>12} {'tokens':>9} {'LRU hits':>10} {'LRU rate':>9} {'Belady':>10} {'ceiling':>8}")
    for r in rows:
        mark = "  <- recorded pool" if r["pool_blocks"] == recorded else ""
        click.echo(f"{r['pool_blocks']:>12,} {r['pool_tokens']:>9,} {r['lru_hits']:>10,} {r['lru_hit_rate']:>8.1%} "
                   f"{r['belady_hits']:>10,} {r['belady_hit_rate']:>7.1%}{mark}")
