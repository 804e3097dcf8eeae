"""What-if results of two traces side by side (``kvtrace diff A B --whatif ...``): per policy and
ratio, the bytes kept and saved and every offline measure, overall and per layer, as A, B and
B - A. Inputs are traces (replayed now with the given policies) or saved ``kvtrace whatif --json``
documents, in any mix. JSON contract: spec/whatif-json.md ("kvtrace diff --whatif").
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvtrace.format.errors import NotATrace
from kvtrace.jsonable import read_json_document, refuse_schema
from kvtrace.whatif.run import NEEDS, SCHEMA

__all__ = ["DIFF_SCHEMA", "diff_whatif", "is_whatif_json", "load_whatif", "render"]

DIFF_SCHEMA = 1
_BYTES = ("kept_peak", "kept_mean", "saved_peak", "saved_mean")


def is_whatif_json(path: str | os.PathLike[str]) -> bool:
    """A file that starts like a JSON object (a saved what-if document, checked when loaded)."""
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            return p.is_file() and fh.read(64).lstrip()[:1] == b"{"
    except OSError:
        return False


def load_whatif(path: str | os.PathLike[str], policies: Sequence[Any], ratios: Sequence[float]) -> dict[str, Any]:
    """The what-if document of ``path``: a saved one as it is, or a trace replayed now."""
    p = Path(path)
    if is_whatif_json(p):
        doc = read_json_document(p)
        if not isinstance(doc, dict) or "kvtrace_whatif" not in doc or not isinstance(doc.get("policies"), list):
            raise NotATrace(f"{p}: JSON but not a kvtrace whatif document (kvtrace whatif --json-out)")
        if doc["kvtrace_whatif"] != SCHEMA:
            refuse_schema(p, "what-if", doc["kvtrace_whatif"], str(SCHEMA))  # newer: exit 4, as a trace
        return doc
    from kvtrace.analyzer.contents import refuse_denied_payloads
    from kvtrace.format.reader import Trace
    from kvtrace.whatif.run import run_whatif

    with Trace(p) as t:
        refuse_denied_payloads(t)  # tensors the trace's privacy flag denies: exit 1, not read
        return {"trace": str(path), **run_whatif(t, list(policies), list(ratios))}


def _d(a: Any, b: Any) -> dict[str, Any]:
    ok = isinstance(a, (int, float)) and isinstance(b, (int, float))
    return {"a": a, "b": b, "delta": (b - a) if ok else None}


def _results(doc: dict[str, Any]) -> dict[tuple[str, float | None], dict[str, Any]]:
    return {(p["label"], r["ratio"]): {**r, "family": p["family"]} for p in doc["policies"] for r in p["results"]}


def _layer_means(r: dict[str, Any]) -> dict[int, dict[str, float]]:
    """Per layer: each measure's mean over KV heads and requests."""
    acc: dict[int, dict[str, list[float]]] = {}
    for row in r["layers"]:
        for m in NEEDS:
            vals = [v for v in row.get(m, []) if isinstance(v, (int, float)) and np.isfinite(v)]
            if vals:
                acc.setdefault(int(row["layer"]), {}).setdefault(m, []).extend(vals)
    return {layer: {m: float(np.mean(v)) for m, v in ms.items()} for layer, ms in acc.items()}


def diff_whatif(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """B - A of two what-if documents, matched by policy label and ratio."""
    ra, rb = _results(a), _results(b)
    out: dict[str, Any] = {
        "kvtrace_whatif_diff": DIFF_SCHEMA, "kind": "proxy",
        "a": {"trace": a.get("trace"), "sampled_units": a.get("sampled_units")},
        "b": {"trace": b.get("trace"), "sampled_units": b.get("sampled_units")},
        "baseline": {k: _d(a["baseline"][k], b["baseline"][k]) for k in ("bytes_peak", "bytes_mean")},
        "results": [], "only_a": [], "only_b": [], "notes": [],
    }
    if a.get("schema_minor", 0) != b.get("schema_minor", 0):
        out["notes"].append(f"schema minors differ ({a.get('schema_minor', 0)} vs {b.get('schema_minor', 0)}): "
                            "from minor 1 saved_* is against the policy-free layout (bytes_valid), before against "
                            "the trace's own allocated bytes; and rows a policy cannot support are no longer measured")
    if a.get("ratios") != b.get("ratios"):
        out["notes"].append(f"different ratios: {a.get('ratios')} vs {b.get('ratios')} (matched where equal)")
    out["only_a"] = [{"label": k[0], "ratio": k[1]} for k in ra if k not in rb]
    out["only_b"] = [{"label": k[0], "ratio": k[1]} for k in rb if k not in ra]
    for key in (k for k in ra if k in rb):
        x, y = ra[key], rb[key]
        la, lb = _layer_means(x), _layer_means(y)
        measures = sorted(set(x["overall"]) | set(y["overall"]), key=list(NEEDS).index)
        out["results"].append({
            "label": key[0], "ratio": key[1], "family": x["family"],
            "bytes": {k: _d(x["bytes"].get(k), y["bytes"].get(k)) for k in _BYTES},
            "overall": {m: _d(x["overall"].get(m, {}).get("mean"), y["overall"].get(m, {}).get("mean"))
                        for m in measures},
            "layers": [{"layer": layer, **{m: _d(la.get(layer, {}).get(m), lb.get(layer, {}).get(m))
                                           for m in sorted(set(la.get(layer, {})) | set(lb.get(layer, {})),
                                                           key=list(NEEDS).index)}}
                       for layer in sorted(set(la) | set(lb))],
            "skipped": {"a": len(x["skipped"]), "b": len(y["skipped"])},
        })
    return out


def render(d: dict[str, Any], console: Any) -> None:
    """The terminal table of a what-if diff (rich console)."""
    from rich.table import Table

    from kvtrace.textsafe import visible
    from kvtrace.units import format_bytes

    def num(v: Any, fmt: str) -> str:
        return "-" if v is None else fmt.format(v)

    def signed_bytes(v: Any) -> str:
        return "-" if v is None else ("+" if v > 0 else "-" if v < 0 else "") + format_bytes(abs(v))

    base = d["baseline"]["bytes_peak"]
    console.print(f"what-if (offline proxies): A {visible(d['a']['trace'])}, B {visible(d['b']['trace'])}; baseline peak "
                  f"{format_bytes(base['a'])} -> {format_bytes(base['b'])} ({signed_bytes(base['delta'])})")
    t = Table(title="What-if per policy (B - A)", title_justify="left", show_edge=False)
    for col in ("policy", "ratio", "saved peak A", "saved peak B", "delta", "output err A", "output err B", "delta",
                "mass recall A", "mass recall B"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for r in d["results"]:
        s, e = r["bytes"]["saved_peak"], r["overall"].get("attention_output_error", {"a": None, "b": None, "delta": None})
        m = r["overall"].get("attention_mass_recall", {"a": None, "b": None})
        t.add_row(visible(r["label"]), num(r["ratio"], "{:g}"), format_bytes(s["a"]), format_bytes(s["b"]), signed_bytes(s["delta"]),
                  num(e["a"], "{:.4f}"), num(e["b"], "{:.4f}"), num(e["delta"], "{:+.4f}"),
                  num(m["a"], "{:.3f}"), num(m["b"], "{:.3f}"))
    console.print(t)
    for side in ("a", "b"):
        for x in d[f"only_{side}"]:
            console.print(f"only in {side.upper()}: {visible(x['label'])}" + (f" at ratio {x['ratio']:g}" if x["ratio"] is not None else ""))
    for note in d["notes"]:
        console.print(f"note: {visible(note)}")
