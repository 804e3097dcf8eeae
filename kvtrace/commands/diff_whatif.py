"""The what-if part of `kvtrace diff` (issue 17): `--whatif NAME[:k=v,...]` (repeatable) and
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
    saved = {p: load_whatif(p, (), ()) for p in (a, b) if _is_whatif(p)}
    if not (texts or ratio_text or saved):
        return None
    from kvtrace.commands.whatif import DEFAULT_POLICIES, _ratios
    from kvtrace.whatif import PolicyError, parse_policy

    first = next(iter(saved.values()), None)
    try:
        labels = texts or ([p["label"] for p in first["policies"]] if first else DEFAULT_POLICIES)
        policies = [parse_policy(p) for p in labels]
    except PolicyError as exc:
        raise click.BadParameter(str(exc), param_hint="--whatif") from None
    if ratio_text:
        ratios = _ratios(ratio_text, "--whatif-ratio")
    else:
        ratios = list(first.get("ratios") or ()) if first else [0.25, 0.5, 0.75]
    docs = [saved[p] if p in saved else load_whatif(p, policies, ratios) for p in (a, b)]
    return WhatIfPart(diff_whatif(*docs), bool(saved))


def _is_whatif(path: str) -> bool:
    """A JSON file whose head names the what-if schema (an analysis report JSON is not one)."""
    from kvtrace.whatif.compare import is_whatif_json

    if not is_whatif_json(path):
        return False
    with open(path, "rb") as fh:
        return b'"kvtrace_whatif"' in fh.read(4096)
