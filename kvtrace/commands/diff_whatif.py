"""The what-if part of `kvtrace diff`: `--whatif NAME[:k=v,...]` (repeatable) and
`--whatif-ratio R[,R...]` replay the policies on both traces and add a "whatif" member to the
diff document; two saved `kvtrace whatif --json-out` documents are compared on their own.

The options store their values in the click context (expose_value=False), so the diff command's
signature stays as it is: its body asks :func:`whatif_part` for what to add.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])
_KEY = "kvtrace.whatif"


def _store(name: str) -> Callable[[click.Context, click.Parameter, Any], None]:
    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        ctx.meta.setdefault(_KEY, {})[name] = value

    return callback


def whatif_options(fn: F) -> F:
    fn = click.option("--whatif-ratio", "whatif_ratio", default=None, metavar="R[,R...]", expose_value=False,
                      callback=_store("ratio"),
                      help="Eviction ratios for --whatif (default 0.25,0.5,0.75).")(fn)
    return click.option("--whatif", "whatif_policies", multiple=True, metavar="NAME[:k=v,...]", expose_value=False,
                        callback=_store("policies"),
                        help="Also compare what-if results (see 'kvtrace whatif') of A and B for these policies; "
                        "A and B may also be saved 'kvtrace whatif --json-out' documents (a trace beside one is replayed "
                        "with its policies and ratios).")(fn)


def whatif_asked() -> bool:
    """Whether --whatif or --whatif-ratio is on the command line."""
    opts = click.get_current_context().meta.get(_KEY, {})
    return bool(opts.get("policies") or opts.get("ratio"))


@dataclass
class WhatIfPart:
    doc: dict[str, Any]
    only: bool  # both inputs are what-if documents: nothing else to diff

    def render(self) -> None:
        from kvtrace.analyzer.terminal import console_for
        from kvtrace.whatif.compare import render

        render(self.doc, console_for())


def whatif_part(a: str, b: str) -> WhatIfPart | None:
    """The what-if diff of A and B when --whatif was given or either is a what-if document. A
    saved document beside a trace: the trace is replayed with the document's policies and ratios
    (unless --whatif / --whatif-ratio say otherwise), and only the what-if parts are compared
    (a what-if document holds no analysis to diff)."""
    from kvtrace.whatif.compare import diff_whatif, load_whatif

    opts = click.get_current_context().meta.get(_KEY, {})
    texts, ratio_text = opts.get("policies") or (), opts.get("ratio")
    saved = {p: _checked(p, load_whatif(p, (), ())) for p in (a, b) if _is_whatif(p)}
    if not (texts or ratio_text or saved):
        return None
    # two saved documents are compared as they are; a trace is replayed (with a saved one's settings)
    policies, ratios = ([], []) if len(saved) == 2 else _replay_settings(texts, ratio_text, next(iter(saved.items()), None))
    docs = [saved[p] if p in saved else load_whatif(p, policies, ratios) for p in (a, b)]
    return WhatIfPart(diff_whatif(*docs), bool(saved))


def _replay_settings(texts: tuple[str, ...], ratio_text: str | None,
                     saved: tuple[str, dict[str, Any]] | None) -> tuple[list[Any], list[float]]:
    """Policies and ratios a trace is replayed with: --whatif / --whatif-ratio, else those of the
    saved document beside it, else the `kvtrace whatif` defaults."""
    from kvtrace.commands.whatif import DEFAULT_POLICIES, _ratios
    from kvtrace.errors import InvalidTrace
    from kvtrace.whatif import PolicyError, parse_policy

    if saved is not None and not texts:
        path, doc = saved
        try:
            policies = [parse_policy(p["label"]) for p in doc["policies"]]
        except PolicyError as exc:
            raise InvalidTrace(f"{path}: a policy of this what-if document cannot be replayed here ({exc})") from None
    else:
        try:
            policies = [parse_policy(p) for p in (texts or DEFAULT_POLICIES)]
        except PolicyError as exc:
            raise click.BadParameter(str(exc), param_hint="--whatif") from None
    if ratio_text:
        return policies, _ratios(ratio_text, "--whatif-ratio")
    return policies, (list(saved[1].get("ratios") or ()) if saved is not None else [0.25, 0.5, 0.75])


def _num(x: Any, none: bool = False) -> bool:
    """A number the diff can subtract and print (NaN and inf are JSON's too; 10**400 is not a float)."""
    if x is None:
        return none
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    return -2**63 < x < 2**63 if isinstance(x, int) else x == x


def _problem(doc: dict[str, Any]) -> str | None:
    """What makes a saved what-if document unusable by the diff (None: nothing), checked before
    any of it is read: every field the diff and its table read, with its type."""
    from kvtrace.whatif.run import NEEDS

    if type(doc.get("kvtrace_whatif")) is not int:
        return "kvtrace_whatif is not an integer"
    base = doc.get("baseline")
    if not isinstance(base, dict) or not (_num(base.get("bytes_peak")) and _num(base.get("bytes_mean"))):
        return "baseline.bytes_peak / bytes_mean are not numbers"
    for i, p in enumerate(doc["policies"]):
        if not (isinstance(p, dict) and isinstance(p.get("label"), str) and isinstance(p.get("family"), str)
                and isinstance(p.get("results"), list)):
            return f"policies[{i}] lacks a label, family or results list"
        for j, r in enumerate(p["results"]):
            where = f"policies[{i}].results[{j}]"
            if not isinstance(r, dict) or not _num(r.get("ratio"), none=True):
                return f"{where}: no ratio (a number or null)"
            by, overall, layers = r.get("bytes"), r.get("overall"), r.get("layers")
            if not isinstance(by, dict) or not all(_num(by.get(k)) for k in ("kept_peak", "kept_mean", "saved_peak",
                                                                              "saved_mean")):
                return f"{where}.bytes: kept_peak, kept_mean, saved_peak, saved_mean are not all numbers"
            if not isinstance(overall, dict) or not all(k in NEEDS and isinstance(v, dict) and _num(v.get("mean"), none=True)
                                                        for k, v in overall.items()):
                return f"{where}.overall: each measure ({', '.join(NEEDS)}) needs a mean (a number or null)"
            if not isinstance(layers, list) or not all(
                    isinstance(row, dict) and _num(row.get("layer")) and float(row["layer"]).is_integer()
                    and all(isinstance(row.get(m, []), list) for m in NEEDS) for row in layers):
                return f"{where}.layers: rows need an integer layer and lists of values"
            if not isinstance(r.get("skipped", []), list):
                return f"{where}.skipped is not a list"
    return None


def _checked(path: str, doc: dict[str, Any]) -> dict[str, Any]:
    from kvtrace.errors import InvalidTrace

    problem = _problem(doc)
    if problem is not None:
        raise InvalidTrace(f"{path}: not a valid what-if document ({problem})")
    return doc


def _is_whatif(path: str) -> bool:
    """A JSON file whose head names the what-if schema (an analysis report JSON is not one)."""
    from kvtrace.whatif.compare import is_whatif_json

    if not is_whatif_json(path):
        return False
    with open(path, "rb") as fh:
        return b'"kvtrace_whatif"' in fh.read(4096)
