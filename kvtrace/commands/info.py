"""`kvtrace info TRACE [--json] [--json-out FILE]`."""

from __future__ import annotations

import shutil
import textwrap
from typing import Any

import click

from kvtrace.commands.common import guarded
from kvtrace.commands.outputs import check_json_out, json_options, write_json
from kvtrace.labels import device_text
from kvtrace.units import format_bytes


@click.command("info")
@click.argument("trace", type=click.Path())  # a directory is "not a trace" (exit 2), not a usage error
@json_options
@guarded
def info(trace: str, as_json: bool, json_out: str | None) -> None:
    """Show what TRACE holds: requests, structure reads, layers, sources, sizes.

    \b
    Examples:
      kvtrace info run.kvt.h5
      kvtrace info run.kvt.h5 --json | jq .requests
    """
    from kvtrace.format.reader import Trace
    from kvtrace.format.summary import summarize

    check_json_out(json_out, (trace,))
    with Trace(trace) as t:
        summary = summarize(t)
    write_json(summary, json_out, as_json=as_json)
    if as_json:
        return
    _print(summary)


def _print(s: dict) -> None:
    width = shutil.get_terminal_size((80, 24)).columns  # COLUMNS first, then the terminal, else 80

    def echo(line: str = "") -> None:
        """Fold a long 'name  value' line under its value column so it reads at 80 columns."""
        click.echo(textwrap.fill(line, width=max(width, 40), subsequent_indent=" " * 11,
                                 break_on_hyphens=False) if len(line) > width else line)

    state = "complete" if s["complete"] else "INCOMPLETE (writer did not close it)"
    if s.get("stopped"):
        state = f"INCOMPLETE (writer stopped early: {s['stopped']['reason']})"
    echo(f"{s['path']}  format {s['format_version']}  {state}  {format_bytes(s['file_bytes'])}")
    echo(f"model      {s['model']['id']} ({s['model']['type']})")
    sw = s["software"]
    echo(
        f"software   kvtrace {sw['kvtrace']}, torch {sw['torch']}, transformers {sw['transformers']}, "
        f"CUDA {sw['cuda']}, driver {sw['driver']}"
    )
    if s["devices"]:
        for d in s["devices"]:
            total = format_bytes(d["total_memory_bytes"]) if d["total_memory_bytes"] >= 0 else "unknown"
            echo(f"device     {device_text(d['index'], d['name'])} ({total})")
    sources = ", ".join(
        f"{k}={'yes' if (v.get('available') if isinstance(v, dict) else v) else 'no'}"
        for k, v in sorted(s["sources"].items())
    )
    echo(f"sources    {sources or 'none recorded'}")
    outcomes = ", ".join(f"{n} {k}" for k, n in sorted(s["requests"]["outcomes"].items()))
    echo(f"requests   {s['requests']['count']} ({outcomes or 'none'}), "
               f"{s['requests']['new_tokens']} new tokens")
    types = ", ".join(f"{n} {k}" for k, n in sorted(s["layers"]["types"].items()))
    echo(f"layers     {s['layers']['count']} ({types or 'none'})")
    rows = s["rows"]
    every = (s["sources"].get("cache_structure") or {}).get("structure_every")
    # /steps and /kv hold rows only for the steps whose cache structure was read (spec 4.3/4.4)
    echo(f"structure  read at {rows['steps']} steps" + (
        f" (structure_every {every}: the prefill, one decode step in {every}, sampled steps and the last)"
        if isinstance(every, int) and every > 1 else " (every step)" if every == 1 else ""))
    echo(f"rows       kv {rows['kv']}, steps {rows['steps']}, events {rows['events']}, "
               f"nvml {rows['telemetry/nvml']}, allocator {rows['telemetry/allocator']}, "
               f"process {rows['telemetry/process']}")
    _print_serving(s.get("serving"), echo)
    kind = "incremental: new tokens per sample" if s["payloads"]["tokens"] == "new" else "whole samples"
    echo(f"payloads   {s['payloads']['count']} sampled tensors ({kind}), "
               f"{format_bytes(s['payloads']['stored_bytes'])} stored (compressed)")
    echo(f"privacy    prompt text {'STORED' if s['contains_prompt_text'] else 'not stored'}, "
               f"tensor contents {'STORED' if s['contains_tensor_payloads'] else 'not stored'}")
    for line in s.get("privacy_mismatches", ()):  # decided from the contents; the flag is wrong
        click.echo(f"warning: {line} (the trace is invalid: see 'kvtrace validate')", err=True)
    echo("(sizes in binary units: KiB = 1024 B)")


def _print_serving(sv: dict | None, echo: Any) -> None:
    """Continuous batching (format 1.4 /sched): two lines, or none for a trace without it."""
    if not sv:
        return
    if sv["steps"]:
        usage = (f", peak use {sv['peak_block_usage']:.1%} of blocks" if sv["peak_block_usage"] is not None else "")
        if sv["peak_token_usage"] is not None:
            usage += f" ({sv['peak_token_usage']:.1%} of tokens)"
        pool = format_bytes(sv["pool_bytes"]) if sv["pool_bytes"] >= 0 else "unknown"
        echo(f"serving    {sv['steps']} scheduler steps ({sv['managers']} manager(s)), pool {pool}{usage}, "
             f"peak {sv['peak_running']} running / {sv['peak_waiting']} waiting; {sv['preemptions']} preemptions, "
             f"prefix hits {sv['prefix_hit_tokens']} tokens, {sv['evicted_blocks']} cached blocks evicted")
    if sv["phases"]:
        echo(f"phases     {', '.join(sv['phases'])}")
