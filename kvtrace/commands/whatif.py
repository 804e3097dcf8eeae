"""`kvtrace whatif TRACE --policy NAME[:k=v,...] ... [--ratio 0.25,0.5,0.75] [--json | --json-out FILE]`."""

from __future__ import annotations

from typing import Any

import click

from kvtrace.commands.common import guarded
from kvtrace.commands.outputs import check_json_out, json_options, write_json
from kvtrace.units import format_bytes

DEFAULT_POLICIES = ("paging:page_size=16", "streaming_llm", "knorm", "snapkv", "kivi:nbits=4", "fp8")


def _ratios(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {text!r}") from None
    if not vals or any(not 0 <= v < 1 for v in vals):
        raise click.BadParameter(f"every ratio must be in [0, 1), got {text!r}")
    return vals


@click.command("whatif")
@click.argument("trace", type=click.Path())  # a directory is "not a trace" (exit 2), not a usage error
@click.option("--policy", "policy_texts", multiple=True, metavar="NAME[:k=v,...]",
              help="Policy to replay (repeatable); default: " + " ".join(DEFAULT_POLICIES)
              + ". Names: paging, knorm, keydiff, random, streaming_llm, observed_attention, tova, snapkv, "
              "expected_attention, kivi, quanto, hqq, fp8.")
@click.option("--ratio", "ratio_text", default="0.25,0.5,0.75", show_default=True, metavar="R[,R...]",
              help="Compression ratios (fraction of tokens evicted) for the eviction policies.")
@json_options
@guarded
def whatif(trace: str, policy_texts: tuple[str, ...], ratio_text: str, as_json: bool, json_out: str | None) -> None:
    """What paging, eviction or KV quantisation would save on TRACE and what it would cost in
    attention: bytes from the recorded sizes, attention mass recall and output error from sampled
    K/V/Q (offline proxies, not model quality). Without sampled tensors only bytes are reported.

    \b
    Examples:
      kvtrace whatif run.kvt.h5
      kvtrace whatif run.kvt.h5 --policy snapkv:window_size=32 --policy kivi:nbits=2 --ratio 0.5
      kvtrace whatif run.kvt.h5 --json | jq '.policies[].results[].overall'
    """
    from kvtrace.format.reader import Trace
    from kvtrace.whatif import PolicyError, parse_policy
    from kvtrace.whatif.run import run_whatif

    ratios = _ratios(ratio_text)
    try:
        policies = [parse_policy(p) for p in (policy_texts or DEFAULT_POLICIES)]
    except PolicyError as exc:
        raise click.BadParameter(str(exc), param_hint="--policy") from None
    check_json_out(json_out, (trace,))
    with Trace(trace) as t:
        doc = run_whatif(t, policies, ratios)
    doc = {"trace": trace, **doc}
    write_json(doc, json_out, as_json=as_json)
    if not as_json:
        _print(doc)


def _f(x: Any, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def _print(doc: dict[str, Any]) -> None:
    from rich.table import Table

    from kvtrace.analyzer.terminal import console_for

    c = console_for()
    b = doc["baseline"]
    c.print(f"kvtrace whatif {doc['trace']}: baseline (the trace's own layout) peak {format_bytes(b['bytes_peak'])}, "
            f"mean {format_bytes(b['bytes_mean'])}; {doc['sampled_units']} sampled (request, layer) units")
    c.print(f"[dim]{doc['note']}[/dim]")
    t = Table(show_edge=False)
    for col, just in (("policy", "left"), ("ratio", "right"), ("kept peak", "right"), ("saved peak", "right"),
                      ("saved mean", "right"), ("mass recall", "right"), ("output err", "right"),
                      ("K cos", "right"), ("V cos", "right")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    skipped: dict[str, int] = {}
    for p in doc["policies"]:
        for r in p["results"]:
            o, by = r["overall"], r["bytes"]
            t.add_row(p["label"], _f(r["ratio"], "{:.2f}"), format_bytes(by["kept_peak"]),
                      format_bytes(by["saved_peak"]), format_bytes(by["saved_mean"]),
                      _f(o.get("attention_mass_recall", {}).get("mean")),
                      _f(o.get("attention_output_error", {}).get("mean")),
                      _f(o.get("key_cosine", {}).get("mean"), "{:.4f}"), _f(o.get("value_cosine", {}).get("mean"), "{:.4f}"))
            for s in r["skipped"]:
                skipped[s["reason"]] = skipped.get(s["reason"], 0) + 1
    c.print(t)
    c.print("mass recall: mean over KV heads of the full attention's mass on kept keys (needs Q and K); "
            "output err: ||o'-o||/||o|| (needs Q, K and V); cos: K/V reconstruction (needs K, V)")
    for reason, n in skipped.items():
        c.print(f"[dim]skipped {n}x: {reason}[/dim]")
