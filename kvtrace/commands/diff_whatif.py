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
                        "A and B may also be saved 'kvtrace whatif --json-out' documents.")(fn)


@dataclass
class WhatIfPart:
    doc: dict[str, Any]
    only: bool  # both inputs are what-if documents: nothing else to diff

    def render(self) -> None:
        from kvtrace.analyzer.terminal import console_for
        from kvtrace.whatif.compare import render

        render(self.doc, console_for())


def whatif_part(a: str, b: str) -> WhatIfPart | None:
    """The what-if diff of A and B when --whatif was given or both are what-if documents."""
    from kvtrace.whatif.compare import diff_whatif, is_whatif_json, load_whatif

    opts = click.get_current_context().meta.get(_KEY, {})
    texts, ratio_text = opts.get("policies") or (), opts.get("ratio")
    both_docs = is_whatif_json(a) and is_whatif_json(b) and _is_whatif(a) and _is_whatif(b)
    if not (texts or ratio_text or both_docs):
        return None
    from kvtrace.commands.whatif import DEFAULT_POLICIES, _ratios
    from kvtrace.whatif import PolicyError, parse_policy

    try:
        policies = [parse_policy(p) for p in (texts or DEFAULT_POLICIES)]
    except PolicyError as exc:
        raise click.BadParameter(str(exc), param_hint="--whatif") from None
    ratios = _ratios(ratio_text) if ratio_text else [0.25, 0.5, 0.75]
    return WhatIfPart(diff_whatif(load_whatif(a, policies, ratios), load_whatif(b, policies, ratios)), both_docs)


def _is_whatif(path: str) -> bool:
    """A JSON file whose head names the what-if schema (an analysis report JSON is not one)."""
    with open(path, "rb") as fh:
        return b'"kvtrace_whatif"' in fh.read(4096)
