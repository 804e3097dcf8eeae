"""`kvtrace info TRACE [--json] [--json-out FILE]`."""

from __future__ import annotations

import shutil
import textwrap
from typing import Any

import click

from kvtrace.commands.common import guarded
from kvtrace.commands.outputs import check_json_out, json_options, write_json
from kvtrace.labels import device_text
from kvtrace.textsafe import visible
from kvtrace.units import format_bytes

MAX_DEVICES_LISTED = 16


@click.command("info")
@click.argument("traces", nargs=-1, required=True, type=click.Path())  # a directory: "not a trace" (exit 2)
@json_options
@guarded
def info(traces: tuple[str, ...], as_json: bool, json_out: str | None) -> None:
    """Show what each of TRACES holds: requests, structure reads, layers, sources, sizes, and how
    the model was spread over devices or tensor-parallel ranks. The rank traces of one
    tensor-parallel run (run.rank*.kvt.h5) are also summarised as one run.

    \b
    Examples:
      kvtrace info run.kvt.h5
      kvtrace info run.kvt.h5 --json | jq .requests
      kvtrace info run.rank*.kvt.h5        # one block per rank, then the run
    --json with one trace prints its summary; with several, {"traces": [...], "rank_sets": [...]}.
    Rank traces that contradict each other (two files claiming one rank, world sizes that
    disagree) are summarised, then exit 1 naming the problem.
    """
    from kvtrace.analyzer.notes import trace_notes
    from kvtrace.analyzer.ranks import group, parallel_of, rank_trace
    from kvtrace.format.reader import Trace
    from kvtrace.format.summary import summarize

    check_json_out(json_out, traces)
    summaries, members = [], []
    for trace in traces:
        with Trace(trace) as t:
            summary = summarize(t)
            notes, unlisted = trace_notes(t)
            if notes or unlisted:  # only where the trace has notes: other documents unchanged
                summary["notes"] = notes
                if unlisted:
                    summary["notes_unlisted"] = unlisted
            par = parallel_of(t.meta)
            if par is not None:  # spec §3.1; absent: one process, the devices of the rows
                summary["parallel"] = par
                member = rank_trace(t)
                if member is not None:
                    members.append(member)
        summaries.append(summary)
    sets = [rs for rs in group(members) if len(traces) > 1]
    doc = summaries[0] if len(traces) == 1 else {"traces": summaries, "rank_sets": [rs.to_dict() for rs in sets]}
    write_json(doc, json_out, as_json=as_json)
    if not as_json:
        for i, summary in enumerate(summaries):
            if i:
                click.echo()
            _print(summary)
        for rs in sets:
            click.echo()
            _print_rank_set(rs.to_dict())
    from kvtrace.analyzer.rankset import refuse_broken

    refuse_broken(sets)  # two files claiming one rank...: exit 1 naming it, after the summaries


def _print_parallel(par: dict | None, echo: Any) -> None:
    """One line for /meta parallel_json: the rank of a tensor-parallel run, or the device map."""
    if not par:
        return
    if par.get("mode") == "tensor_parallel":
        heads = (f", {par['kv_heads_local']} of {par['kv_heads_total']} KV heads per layer"
                 if par.get("kv_heads_local") and par.get("kv_heads_total") else "")
        echo(f"parallel   tensor parallel: rank {par.get('rank')} of {par.get('world_size')} "
             f"({par.get('backend') or 'backend unknown'}), run {par.get('run_id') or 'unknown'}{heads}")
        return
    placed: dict[str, int] = {}
    for place in (par.get("device_map") or {}).values():
        placed[str(place)] = placed.get(str(place), 0) + 1
    shown = sorted(placed.items())[:MAX_DEVICES_LISTED]  # a hostile map may name 10^5 devices: one short line
    where = ", ".join(f"{d} {n} module{'s' if n != 1 else ''}" for d, n in shown)
    if len(placed) > len(shown):
        where += f", and {len(placed) - len(shown)} more devices"
    echo(f"parallel   {par.get('mode')}: {where or 'no map recorded'}")


def _print_rank_set(d: dict) -> None:
    from kvtrace.analyzer.ranks import ranks_text

    def echo(line: str) -> None:
        click.echo(visible(line))

    missing = f"; MISSING rank(s) {ranks_text(d['missing_ranks'])}" if d["missing_ranks"] else ""
    echo(f"run {d['run_id']}  tensor parallel, world size {d['world_size']}, ranks "
               f"{ranks_text(d['ranks_present'])}{missing}")
    for p in d["problems"]:
        echo(f"  problem: {p}")
    if d["model_kv_heads_per_layer"]:
        echo(f"  KV heads per layer: ranks hold {d['kv_heads_sum']} in all, the model has "
                   f"{d['model_kv_heads_per_layer']} ({d['expected_kv_heads_per_rank']} per rank expected)")
    for r in d["ranks"]:
        echo(f"  rank {r['rank']}  {r['path']}: {r['requests']} requests, peak KV {format_bytes(r['peak_kv_bytes'])}")


def _print(s: dict) -> None:
    width = shutil.get_terminal_size((80, 24)).columns  # COLUMNS first, then the terminal, else 80

    def echo(line: str = "") -> None:
        """Fold a long 'name  value' line under its value column so it reads at 80 columns. Text
        from the trace is data: control characters shown as escapes, cut past 4096 characters."""
        line = visible(line)
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
    _print_parallel(s.get("parallel"), echo)
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
               f"process {rows['telemetry/process']}"
               + "".join(f", {name} {rows[name]}" for name in ("sched", "sched_groups", "blocks") if name in rows)
               + (f", state {rows['state']}" if rows.get("state") else ""))
    _print_state(s.get("state"), echo)
    _print_serving(s.get("serving"), echo)
    kind = "incremental: new tokens per sample" if s["payloads"]["tokens"] == "new" else "whole samples"
    echo(f"payloads   {s['payloads']['count']} sampled tensors ({kind}), "
               f"{format_bytes(s['payloads']['stored_bytes'])} stored (compressed)")
    echo(f"privacy    prompt text {'STORED' if s['contains_prompt_text'] else 'not stored'}, "
               f"tensor contents {'STORED' if s['contains_tensor_payloads'] else 'not stored'}")
    for line in s.get("privacy_mismatches", ()):  # decided from the contents; the flag is wrong
        click.echo(f"warning: {visible(line)} (the trace is invalid: see 'kvtrace validate')", err=True)
    if "notes" in s:
        from kvtrace.analyzer.notes import note_lines

        for i, line in enumerate(note_lines(s["notes"], s.get("notes_unlisted", 0))):
            echo(f"{'notes:' if i == 0 else '':<11}{line}")
    echo("(sizes in binary units: KiB = 1024 B)")


def _print_state(st: dict | None, echo: Any) -> None:
    """Hybrid caches (format 1.5 /state): one line, or none for a trace without state."""
    if not st:
        return
    kinds = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(st["by_kind"].items()))
    per_seq = (f", {format_bytes(st['bytes_per_sequence'])} per sequence (batch {st['batch_size']})"
               if st["batch_size"] > 1 else "")
    kv = f" beside {format_bytes(st['kv_bytes'])} of KV" if st["kv_bytes"] >= 0 else ""
    echo(f"state      {st['layers']} layers hold {format_bytes(st['bytes'])} of state ({kinds}){per_seq}"
         f"{kv} (request {st['request']} step {st['step']}); constant in tokens")


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
