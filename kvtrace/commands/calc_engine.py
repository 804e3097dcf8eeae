"""`kvtrace calc --engine vllm`: vLLM's "KV cache size" line predicted from a model config and a KV
memory budget (kvtrace.engines.vllm_calc), and with an engine trace checked against what the engine
reported (its cache_config_info, recorded by kvtrace attach)."""

from __future__ import annotations

import json
from typing import Any

import click

from kvtrace.commands.outputs import check_json_out, write_json
from kvtrace.errors import BadOption, InvalidTrace
from kvtrace.units import format_bytes

DEFAULT_BLOCK = 16  # vLLM's block size on GPUs when --block-size is not given (the CPU backend's is 128)


def run(preset: str | None, config_path: str | None, trace_paths: tuple[str, ...], context: int, budget: int,
        kv_dtype: str | None, as_json: bool, json_out: str | None) -> None:
    from kvtrace.calc import load_config
    from kvtrace.engines.vllm_calc import check, predict

    sources = [s for s in (preset, config_path, *trace_paths) if s is not None]
    if len(sources) != 1:
        raise click.UsageError("--engine vllm takes exactly one of --preset, --config, --trace (an engine trace)")
    check_json_out(json_out, sources)
    engine_config: dict[str, Any] | None = None
    if trace_paths:
        from kvtrace.format.reader import Trace

        with Trace(trace_paths[0]) as t:
            settings = t.meta.recorder_settings if isinstance(t.meta.recorder_settings, dict) else {}
            config = t.meta.model_config if isinstance(t.meta.model_config, dict) else {}
        if settings.get("recorder") != "attach" or not isinstance(settings.get("engine_config"), dict):
            raise InvalidTrace(f"{trace_paths[0]}: --engine vllm --trace reads an engine trace (kvtrace attach); this "
                               f"one was recorded by {json.dumps(settings.get('recorder', 'kvtrace record'))}")
        engine_config = settings["engine_config"]
        if not config:
            raise click.UsageError(f"{trace_paths[0]}: the engine's model config was not readable when it was "
                                   "recorded; use --config with the model's config.json")
        label = trace_paths[0]
    else:
        try:
            config, label = load_config(preset or config_path or "")
        except (OSError, ValueError) as exc:
            raise BadOption(str(exc), "--config" if config_path else "--preset") from None
    block = engine_config.get("block_size", -1) if engine_config else -1
    block = block if isinstance(block, int) and block > 0 else DEFAULT_BLOCK
    device = "cpu" if engine_config and "GPU" not in json.dumps(engine_config.get("cache_config_info", {})) else "gpu"
    pool = predict(config, budget, context, block, kv_dtype, device="cpu" if engine_config else device)
    doc: dict[str, Any] = {"engine": "vllm", "model": label, "kv_budget_bytes": budget, "context": context,
                           "block_size": pool.block_size, "kv_dtype": pool.kv_dtype, "kv_dtype_note": pool.dtype_note,
                           "page_bytes_per_layer": pool.page_bytes_per_layer, "layers": pool.layers,
                           "num_blocks": pool.num_blocks, "kv_cache_tokens": pool.tokens,
                           "max_concurrency": round(pool.max_concurrency, 4), "line": pool.line(context)}
    if engine_config is not None:
        doc["check"] = check(pool, engine_config)
    write_json(doc, json_out, as_json=as_json)
    if as_json:
        return
    click.echo(f"vLLM pool for {label}: {format_bytes(budget)} KV budget, {pool.layers} layers x "
               f"{format_bytes(pool.page_bytes_per_layer)} per block of {pool.block_size} tokens "
               f"(KV {pool.kv_dtype}: {pool.dtype_note})")
    click.echo(f"predicted: {pool.num_blocks:,} blocks; {pool.line(context)}")
    if "check" in doc:
        c = doc["check"]
        ok = c["blocks_match"] and c["tokens_match"]
        click.echo(f"recorded:  {c['recorded_blocks']:,} blocks, {c['recorded_tokens']:,} tokens "
                   f"(cache_config_info): {'MATCH' if ok else 'DIFFERS'}")
