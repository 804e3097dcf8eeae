"""`kvtrace whatif TRACE --policy NAME[:k=v,...] ... [--ratio 0.25,0.5,0.75] [--json | --json-out FILE]`."""

from __future__ import annotations

from typing import Any

import click

from kvtrace.commands.common import guarded, require_cuda
from kvtrace.commands.outputs import check_json_out, json_options, write_json
from kvtrace.params import split_list
from kvtrace.textsafe import visible
from kvtrace.units import format_bytes

DEFAULT_POLICIES = ("paging:page_size=16", "streaming_llm", "knorm", "snapkv", "kivi:nbits=4", "fp8")


def _ratios(text: str, option: str | None = None) -> list[float]:
    try:
        vals = [float(x) for x in split_list(text)]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {text!r}", param_hint=option) from None
    if not vals or any(not 0 <= v < 1 for v in vals):
        raise click.BadParameter(f"every ratio must be in [0, 1), got {text!r}", param_hint=option)
    return vals


def _check_unused(trace: str | None, rerun_model: str | None) -> None:
    """An option given on the command line for a part that does not run is a usage error (it was
    ignored without a word): the --rerun options without --rerun, the trace options without TRACE."""
    from click.core import ParameterSource

    ctx = click.get_current_context()
    given = [p for p in ctx.command.params if isinstance(p, click.Option) and p.name is not None
             and ctx.get_parameter_source(p.name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)]
    for part, missing, names in (("--rerun", rerun_model is None, ("max_tokens", "rerun_prefill", "rerun_device")),
                                 ("TRACE", trace is None, ("steps", "device"))):
        unused = [p.opts[0] for p in given if p.name in names]
        if missing and unused:
            raise click.UsageError(f"{'/'.join(unused)} only appl{'ies' if len(unused) == 1 else 'y'} with {part}")


def _check_rerun(model: str, device: str) -> str:
    """--rerun MODEL as `record --model` checks it (a missing directory: 64; a hub id not in the
    cache: 69; a checkpoint whose tokenizer builds empty: 64) and --rerun-device resolved (cuda
    without a GPU: 69), before the replay runs."""
    from kvtrace.errors import BadOption
    from kvtrace.loading import model_config_dict, resolve_device
    from kvtrace.whatif.rerun import check_tokenizer

    try:
        model_config_dict(model)
    except BadOption as exc:
        raise BadOption(str(exc), option="--rerun") from None
    device = resolve_device(device, option="--rerun-device")
    check_tokenizer(model)
    return device


@click.command("whatif")
@click.argument("trace", type=click.Path(), required=False)  # a directory is "not a trace" (exit 2)
@click.option("--policy", "policy_texts", multiple=True, metavar="NAME[:k=v,...]",
              help="Policy to replay (repeatable); default: " + " ".join(DEFAULT_POLICIES)
              + ". Names: paging, knorm, keydiff, random, streaming_llm, observed_attention, tova, snapkv, "
              "expected_attention, kivi, quanto, hqq, fp8.")
@click.option("--steps", type=click.Choice(["last", "all"]), default="last", show_default=True,
              help="Content measures at each (request, layer)'s last sampled step, or at up to 8 of its sampled "
              "steps (all; one layer row per step).")
@click.option("--ratio", "ratio_text", default="0.25,0.5,0.75", show_default=True, metavar="R[,R...]",
              help="Compression ratios (fraction of tokens evicted) for the eviction policies.")
@click.option("--rerun", "rerun_model", metavar="MODEL",
              help="Also measure quality: a teacher-forced pass of MODEL (local directory or preset:NAME) over "
              "--text with each policy applied to its KV cache; perplexity and KL against the unchanged cache.")
@click.option("--text", "text_file", type=click.Path(dir_okay=False), metavar="FILE",
              help="With --rerun: the text to score (UTF-8 text; a binary file is refused). Read only as far "
              "as --max-tokens needs, however large the file.")
@click.option("--max-tokens", type=click.IntRange(2, 1 << 20), default=256, show_default=True,
              help="With --rerun: score at most this many tokens of --text.")
@click.option("--rerun-prefill", type=click.IntRange(0, 1 << 20), default=0, show_default=True, metavar="N",
              help="With --rerun: feed the first N tokens in one forward and apply the policy after it (as kvpress "
              "presses a prefill); quality is measured on the tokens after it. 0: the policy acts from the first token.")
@click.option("--tiny", is_flag=True, help="With --rerun preset:NAME: shrink the preset as 'record --tiny'.")
@click.option("--rerun-device", default="cpu", show_default=True, metavar="DEVICE",
              help="With --rerun: where the model runs (cpu, cuda, cuda:N, auto).")
@click.option("--device", type=click.Choice(["cpu", "auto", "cuda"]), default="cpu", show_default=True,
              help="Where the attention and quantisation measures run: cpu = exact (float64 numpy); cuda = "
              "the Triton kernels (fp32, within ~1e-5; the first run compiles and autotunes them, about a "
              "minute; no CUDA device: exit 69); auto = cuda where a GPU is, else cpu. JSON 'numerics' says "
              "which ran.")
@click.option("--sliding", type=click.Choice(["auto", "press", "keep"]), default="auto", show_default=True,
              help="Whether eviction presses sliding-window layers, offline and in --rerun alike: auto = as kvpress "
              "0.5.5 does for the model (every layer, except Gemma3ForConditionalGeneration's sliding ones); "
              "press; keep (their window unpressed). The output says which.")
@click.option("--emit", type=click.Choice(["kvpress"]), default=None,
              help="Print the hand-off instead of replaying: for each --policy and --ratio, the NVIDIA kvpress "
              "0.5.5 press (class and arguments) that reproduces it, where it differs, or why kvpress cannot (a "
              "policy kvpress lacks; a transformers version kvpress does not support). TRACE optional (its model "
              "decides the sliding-window note).")
@click.option("--pool-sizes", "pool_sizes", default=None, metavar="N[,N...]|auto",
              help="On an engine trace (kvtrace attach): the prefix-cache hit rate its block-hash stream would "
              "get at each pool size in blocks (LRU in one pass, Belady's optimum as the ceiling); auto = powers "
              "of two and the recorded pool. Nothing else runs.")
@json_options
@guarded
def whatif(trace: str | None, policy_texts: tuple[str, ...], steps: str, ratio_text: str, rerun_model: str | None,
           text_file: str | None, max_tokens: int, rerun_prefill: int, tiny: bool, rerun_device: str, device: str,
           sliding: str, emit: str | None, pool_sizes: str | None, as_json: bool, json_out: str | None) -> None:
    """What paging, eviction or KV quantisation would save on TRACE and what it would cost in
    attention: bytes from the recorded sizes, attention mass recall and output error from sampled
    K/V/Q (offline proxies, not model quality). Without sampled tensors only bytes are reported.
    With --rerun MODEL --text FILE (TRACE optional) the same policies are also applied to the
    model's cache in a teacher-forced pass: perplexity and KL divergence (quality).

    \b
    Examples:
      kvtrace whatif run.kvt.h5
      kvtrace whatif run.kvt.h5 --policy snapkv:window_size=32 --policy kivi:nbits=2 --ratio 0.5
      kvtrace whatif run.kvt.h5 --json | jq '.policies[].results[].overall'
      kvtrace whatif --rerun ./my-model --text wiki.txt --policy knorm --policy kivi:nbits=4
      kvtrace whatif engine.kvt.h5 --pool-sizes 16,32,64,128     # an engine trace (kvtrace attach)
    """
    if pool_sizes is not None:  # an engine trace's pool-size what-if (kvtrace/commands/whatif_pools.py)
        if trace is None or rerun_model is not None or emit is not None or policy_texts:
            raise click.UsageError("--pool-sizes takes an engine TRACE and no --policy, --rerun or --emit")
        from kvtrace.commands.whatif_pools import run as run_pools

        run_pools(trace, pool_sizes, as_json, json_out)
        return
    from kvtrace.whatif import PolicyError, parse_policy

    ratios = _ratios(ratio_text, "--ratio")
    try:
        policies = [parse_policy(p) for p in (policy_texts or DEFAULT_POLICIES)]
    except PolicyError as exc:
        raise click.BadParameter(str(exc), param_hint="--policy") from None
    if emit is not None:
        if rerun_model is not None:
            raise click.UsageError("--emit prints the hand-off only: it does not run --rerun")
        check_json_out(json_out, [trace] if trace else [])
        _emit(trace, policies, ratios, sliding, as_json, json_out)
        return
    if trace is None and rerun_model is None:
        raise click.UsageError("give a TRACE, or --rerun MODEL --text FILE (or both)")
    if (rerun_model is None) != (text_file is None):
        raise click.UsageError("--rerun MODEL and --text FILE go together")
    if tiny and rerun_model is None:
        raise click.UsageError("--tiny only applies to --rerun preset:NAME")
    _check_unused(trace, rerun_model)
    check_json_out(json_out, [p for p in (trace, text_file) if p])
    rerun_dev = _check_rerun(rerun_model, rerun_device) if rerun_model is not None else rerun_device
    if trace is not None and device == "cuda":  # asked for the GPU: 69 without one (auto falls back)
        require_cuda("--device cuda", "--device cpu computes the same measures exactly (float64), --device auto "
                     "uses a GPU where there is one")
    doc: dict[str, Any] = {"trace": trace}
    if trace is not None:
        from kvtrace.analyzer.contents import refuse_denied_payloads
        from kvtrace.format.reader import Trace
        from kvtrace.whatif.run import run_whatif

        with Trace(trace) as t:
            refuse_denied_payloads(t)  # tensors the trace's privacy flag denies: exit 1, not read
            doc.update(run_whatif(t, policies, ratios, device, steps, sliding, progress=_bar("what-if", as_json)))
    else:
        from kvtrace.whatif.run import SCHEMA

        doc["kvtrace_whatif"] = SCHEMA
    if rerun_model is not None:
        from kvtrace.jsonable import plain
        from kvtrace.whatif.rerun import rerun_quality

        assert text_file is not None
        doc["rerun"] = plain(rerun_quality(rerun_model, text_file, policies, ratios, device=rerun_dev,
                                           max_tokens=max_tokens, tiny=tiny, prefill=rerun_prefill,
                                           sliding=sliding, progress=_bar("rerun", as_json)))
    write_json(doc, json_out, as_json=as_json)
    if not as_json:
        if trace is not None:
            _print(doc)
        if "rerun" in doc:
            _print_rerun(doc["rerun"])


def _emit(trace: str | None, policies: list[Any], ratios: list[float], sliding: str, as_json: bool,
          json_out: str | None) -> None:
    """--emit kvpress: the press of each policy and ratio (kvtrace.whatif.kvpress.press_for)."""
    from kvtrace.whatif.kvpress import KVPRESS_VERSION, press_for
    from kvtrace.whatif.policies import ScorerPolicy, StreamingLLM

    cfg: dict[str, Any] = {}
    if trace is not None:
        from kvtrace.format.reader import Trace

        with Trace(trace) as t:
            cfg = t.meta.model_config if isinstance(t.meta.model_config, dict) else {}
    rows = [press_for(p, r, cfg, sliding) for p in policies
            for r in (ratios if isinstance(p, ScorerPolicy) and not (isinstance(p, StreamingLLM) and p.window)
                      else [None])]
    doc = {"kvtrace_whatif_emit": 1, "target": f"kvpress {KVPRESS_VERSION}", "trace": trace, "presses": rows}
    write_json(doc, json_out, as_json=as_json)
    if as_json:
        return
    from kvtrace.analyzer.terminal import console_for

    c = console_for()
    first = rows[0] if rows else {}
    if first.get("runs_here") is False:
        c.print(visible(first["runs_here_reason"]), style="yellow")
    for r in rows:
        at = "" if r["ratio"] is None else f" at {r['ratio']:g}"
        if r.get("available"):
            args = ", ".join(f"{k}={v!r}" for k, v in r["kwargs"].items())
            c.print(f"{visible(r['label'])}{at}: {r['press']}({args})  [{r['module']}]", highlight=False)
        else:
            c.print(f"{visible(r['label'])}{at}: no kvpress press: {visible(r['reason'])}", highlight=False)
            if r.get("cache_config"):
                c.print(f"  cache_config={r['cache_config']}", highlight=False)
        for d in r.get("differs", []):
            c.print(f"  differs: {visible(d)}", style="dim", highlight=False)
        if r.get("sliding"):
            c.print(f"  sliding layers: {visible(r['sliding'])}", style="dim", highlight=False)


def _bar(title: str, as_json: bool) -> Any:
    """A progress bar on stderr (kvtrace.progress): drawn only on a terminal, never with --json."""
    from kvtrace.progress import progress_bar

    return lambda total: progress_bar(title, total, enabled=not as_json)


def _f(x: Any, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def _print(doc: dict[str, Any]) -> None:
    from rich.table import Table

    from kvtrace.analyzer.terminal import console_for

    c = console_for()
    b = doc["baseline"]
    c.print(f"kvtrace whatif {visible(doc['trace'])}: baseline (policy-free: the recorded tokens at their bytes per "
            f"token) peak {format_bytes(b['bytes_peak'])}, mean {format_bytes(b['bytes_mean'])}; "
            f"{doc['sampled_units']} sampled (request, layer) units")
    rec = b.get("recorded")
    if rec:
        c.print(f"layout effects (not a policy's): the trace's own layout allocates peak "
                f"{format_bytes(rec['allocated_peak'])}, {format_bytes(rec['layout_peak'])} above the baseline "
                "(views pinning larger storages, preallocation); saved = baseline - kept")
    st = b.get("state")
    if st:  # hybrid models (format 1.5 /state)
        c.print(f"state: {format_bytes(st['bytes_peak'])} of conv/recurrent state per step beside the KV, which no "
                f"token policy can evict: with it the baseline peaks at {format_bytes(st['with_state_peak'])}; "
                "every saving below is of the KV alone")
    if doc.get("sliding", {}).get("layers"):
        sl = doc["sliding"]
        c.print(f"sliding-window layers {sl['layers']}: {'pressed' if sl['pressed'] else 'not pressed'} "
                f"({visible(sl['reason'])})")
    c.print(visible(doc["note"]), style="dim")
    if doc.get("numerics", {}).get("note"):
        c.print(visible(doc["numerics"]["note"]), style="dim")
    t = Table(show_edge=False)
    for col, just in (("policy", "left"), ("ratio", "right"), ("kept peak", "right"), ("saved peak", "right"),
                      ("saved mean", "right"), ("mass recall", "right"), ("output err", "right"),
                      ("K cos", "right"), ("V cos", "right"), ("units", "right")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    skipped: dict[str, int] = {}
    unsupported: dict[str, int] = {}
    for p in doc["policies"]:
        for r in p["results"]:
            o, by = r["overall"], r["bytes"]
            u = r.get("units")
            units = f"{u['measured']}/{sum(u.values())}" if u and p["family"] == "eviction" else ""
            t.add_row(visible(p["label"]), _f(r["ratio"], "{:.2f}"), format_bytes(by["kept_peak"]),
                      format_bytes(by["saved_peak"]), format_bytes(by["saved_mean"]),
                      _f(o.get("attention_mass_recall", {}).get("mean")),
                      _f(o.get("attention_output_error", {}).get("mean")),
                      _f(o.get("key_cosine", {}).get("mean"), "{:.4f}"), _f(o.get("value_cosine", {}).get("mean"), "{:.4f}"),
                      units)
            for s in r["skipped"]:
                skipped[s["reason"]] = skipped.get(s["reason"], 0) + 1
            for x in r["layers"]:
                if x.get("status") in ("unsupported", "not_pressed"):
                    why = f"{x['status'].replace('_', ' ')}: {x['reason']}"
                    unsupported[why] = unsupported.get(why, 0) + 1
    c.print(t)
    c.print("mass recall: mean over KV heads of the full attention's mass on kept keys (needs Q and K); "
            "output err: ||o'-o||/||o|| (needs Q, K and V); cos: K/V reconstruction (needs K, V); units: "
            "(request, layer) units measured of those replayed (the others: unsupported or not pressed, below)")
    for p in doc["policies"]:
        if p.get("note"):
            c.print(f"note: {visible(p['policy'])}: {visible(p['note'])}")
    for reason, n in unsupported.items():
        c.print(f"{n}x {visible(reason)}", style="yellow")
    for reason, n in skipped.items():
        c.print(f"skipped {n}x: {visible(reason)}", style="dim")


def _print_rerun(r: dict[str, Any]) -> None:
    from rich.table import Table

    from kvtrace.analyzer.terminal import console_for

    c = console_for()
    pre = f", the first {r['prefill_tokens']} as a prefill" if r.get("prefill_tokens") else ""
    c.print(f"quality by rerun: {visible(r['model'])} over {visible(r['text'])} ({r['tokens']} tokens{pre}; {r['scored_positions']} "
            f"predictions scored); reference perplexity {r['reference']['perplexity']:.4g}")
    c.print(visible(r["note"]), style="dim")
    if r.get("warning"):
        c.print(visible(r["warning"]), style="yellow")
    t = Table(show_edge=False)
    for col in ("policy", "ratio", "perplexity", "change", "KL mean", "KL max", "top-1 same", "full-layer tokens"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for p in r["policies"]:
        if p.get("skipped"):
            t.add_row(p["label"], "-", "-", "-", "-", "-", "-", f"skipped: {p['skipped']}")
        for x in p["results"]:
            if x.get("skipped"):
                t.add_row(p["label"], _f(x["ratio"], "{:.2f}"), "-", "-", "-", "-", "-", f"skipped: {x['skipped']}")
                continue
            kept = (f"{x['full_layer_tokens_final']:.0f} of {x['tokens_seen']}"
                    if "full_layer_tokens_final" in x else
                    f"{x['sliding_layer_tokens_final']:.0f} (sliding)" if "sliding_layer_tokens_final" in x else "-")
            t.add_row(p["label"], _f(x["ratio"], "{:.2f}"), _f(x["perplexity"], "{:.4g}"),
                      _f(x["perplexity_change_pct"], "{:+.2f}%"), _f(x["kl_mean"], "{:.3g}"),
                      _f(x["kl_max"], "{:.3g}"), _f(x["top1_agreement"], "{:.1%}"), kept)
    c.print(t)
    sl = r.get("sliding") or {}
    if r.get("sliding_layers"):
        how = "are pressed like full ones (budget of their window - 1 tokens)" if sl.get("pressed") else \
            "keep their window unpressed (eviction applies to full-attention layers)"
        c.print(f"{r['sliding_layers']} sliding-window layers {how}; quantisation applies to all. "
                f"{visible(sl.get('reason', ''))}", style="dim")
    over = [(p["label"], x) for p in r["policies"] for x in p["results"] if x.get("steps_unscored") or x.get("steps_over_budget")]
    for label, x in over:
        c.print(f"{visible(label)} at {_f(x['ratio'], '{:.2f}')}: {x.get('steps_over_budget', 0)} steps ended over "
                f"budget, {x.get('steps_unscored', 0)} of them unscored (the policy could not score yet: all kept)",
                style="dim")
    # how each result was computed (one model pass, or the per-token loop and why) and where float
    # ties, not the policy, decided which token went: a table reader needs both, not only the JSON
    passes = sorted({(x.get("pass"), x.get("pass_note", "")) for p in r["policies"] for x in p["results"]
                     if x.get("pass")})
    for mode, note in passes:
        c.print(f"computed by {'one model pass per policy' if mode == 'one_pass' else 'the per-token loop'}"
                f"{': ' + visible(note) if note else ''}", style="dim")
    for p in r["policies"]:
        for x in p["results"]:
            if x.get("steps_near_tie"):
                c.print(f"{visible(p['label'])} at {_f(x['ratio'], '{:.2f}')}: {x['steps_near_tie']} steps evicted "
                        f"among scores equal to within float rounding (a near tie decided the token, not the policy)",
                        style="dim")
