"""The report's what-if section: memory saved against attention-output error per
policy (a Pareto plot), a per-layer heatmap of that error at one ratio, and a table.

It renders kvtrace.whatif.run's document (spec/whatif-json.md) for the report's open trace; every
number in it is an offline proxy, and the section says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtrace.params import split_key_value, split_list
from kvtrace.report import figures, html
from kvtrace.units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

    from kvtrace.format.reader import Trace

__all__ = ["DEFAULT_POLICIES", "DEFAULT_RATIOS", "WhatIfOptions", "add", "whatif_document", "pareto",
           "layer_heatmap", "table_rows"]

# What the report replays when asked for nothing in particular: one policy of each kind.
DEFAULT_POLICIES = ("paging:page_size=16", "streaming_llm", "knorm", "snapkv", "expected_attention",
                    "kivi:nbits=4", "kivi:nbits=2", "fp8")
DEFAULT_RATIOS = (0.25, 0.5, 0.75)
FAMILY_STYLE = {"paging": ("#7f7f7f", "s"), "eviction": ("#1f77b4", "o"), "quantization": ("#d62728", "^")}
ERR = "attention_output_error"


@dataclass(frozen=True)
class WhatIfOptions:
    """What the section replays: policy texts (NAME[:k=v,...]; None: DEFAULT_POLICIES), eviction
    ratios (None: DEFAULT_RATIOS) and the ratio of the per-layer heatmap (None: the middle one)."""

    policies: tuple[str, ...] | None = None
    ratios: tuple[float, ...] | None = None
    heatmap_ratio: float | None = None


def add(b: Any, spec: WhatIfOptions | bool | None) -> None:
    """The report's hook (``b``: report.build._Builder). ``spec`` False: no section; None: the
    defaults when the trace holds sampled contents, else no section; True: the defaults."""
    if spec is False or (spec is None and b.trace.nrows("payloads/index") == 0):
        return
    opts = spec if isinstance(spec, WhatIfOptions) else WhatIfOptions()
    doc = whatif_document(b.trace, opts.policies, opts.ratios)
    ratios = doc["ratios"]
    render_into(b, doc, opts.heatmap_ratio if opts.heatmap_ratio is not None else ratios[len(ratios) // 2])


def whatif_document(trace: Trace, policies: Sequence[str] | None, ratios: Sequence[float] | None) -> dict[str, Any]:
    """run_whatif on the open trace (PolicyError for a bad policy text)."""
    from kvtrace.whatif import parse_policy
    from kvtrace.whatif.run import run_whatif

    pols = [parse_policy(p) for p in (policies or DEFAULT_POLICIES)]
    return run_whatif(trace, pols, list(ratios or DEFAULT_RATIOS))


def _points(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One point per (policy, ratio): saved share of the baseline peak and mean output error;
    paging changes no value, so its error is 0 by construction."""
    base = doc["baseline"]["bytes_peak"] or 1.0
    out = []
    for p in doc["policies"]:
        for r in p["results"]:
            err = r["overall"].get(ERR, {}).get("mean")
            if p["family"] == "paging":
                err = 0.0
            if err is None:
                continue
            out.append({"label": p["label"], "policy": p["policy"], "family": p["family"], "ratio": r["ratio"],
                        "saved": 100.0 * r["bytes"]["saved_peak"] / base, "error": float(err)})
    return out


def pareto_front(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The points no other point beats on both axes (more saved, less error), by saved share."""
    front = [p for p in points if not any(q["saved"] >= p["saved"] and q["error"] <= p["error"]
                                          and (q["saved"], q["error"]) != (p["saved"], p["error"]) for q in points)]
    return sorted(front, key=lambda p: p["saved"])


def pareto(doc: dict[str, Any]) -> Figure | None:
    pts = _points(doc)
    if not pts:
        return None
    plt = figures._plt()
    fig, ax = plt.subplots(figsize=(8.5, 4.6))
    for label in dict.fromkeys(p["label"] for p in pts):
        mine = sorted((p for p in pts if p["label"] == label), key=lambda p: p["saved"])
        colour, marker = FAMILY_STYLE.get(mine[0]["family"], ("#444444", "x"))
        ax.plot([p["saved"] for p in mine], [p["error"] for p in mine], marker=marker, color=colour, lw=0.8,
                alpha=0.85)
        for p in mine:
            tag = label.split(":")[0] if p["ratio"] is None else f"{label.split(':')[0]} {p['ratio']:g}"
            if p["family"] == "quantization":
                tag = _short(label)
            ax.annotate(tag, (p["saved"], p["error"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    front = pareto_front(pts)
    ax.step([p["saved"] for p in front], [p["error"] for p in front], where="post", ls="--", color="#2ca02c",
            lw=1.0, label="Pareto front (more saved, less error)")
    for fam, (colour, marker) in FAMILY_STYLE.items():
        if any(p["family"] == fam for p in pts):
            ax.plot([], [], marker=marker, color=colour, ls="", label=fam)
    ax.axvline(0, color="#999999", lw=0.6)
    ax.set_xlabel("peak KV bytes saved (% of the trace's own layout)")
    ax.set_ylabel("attention output error ||o'-o||/||o|| (mean)")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _short(label: str) -> str:
    """kivi:nbits=4,group_size=32,... -> kivi 4b; fp8:fmt=e4m3 -> fp8 e4m3."""
    name, _, rest = label.partition(":")
    params = dict(kv for x in split_list(rest) if (kv := split_key_value(x)) is not None)
    if "nbits" in params:
        return f"{name} {params['nbits']}b"
    if "fmt" in params:
        return f"{name} {params['fmt']}"
    return name


def layer_errors(doc: dict[str, Any], ratio: float) -> tuple[list[str], list[int], np.ndarray]:
    """Rows (policy labels at ``ratio``, or their fixed setting), layers, mean output error per
    (row, layer) over KV heads and requests (NaN where not measured)."""
    rows: list[tuple[str, dict[int, list[float]]]] = []
    for p in doc["policies"]:
        for r in p["results"]:
            if r["ratio"] not in (None, ratio):
                continue
            per: dict[int, list[float]] = {}
            for x in r["layers"]:
                vals = [v for v in x.get(ERR, []) if isinstance(v, float) and np.isfinite(v)]
                if vals:
                    per.setdefault(int(x["layer"]), []).extend(vals)
            if per:
                rows.append((p["label"] if r["ratio"] is None else f"{p['label']} @ {ratio:g}", per))
    layers = sorted({layer for _, per in rows for layer in per})
    values = np.full((len(rows), len(layers)), np.nan)
    for i, (_, per) in enumerate(rows):
        for j, layer in enumerate(layers):
            if layer in per:
                values[i, j] = float(np.mean(per[layer]))
    return [label for label, _ in rows], layers, values


def layer_heatmap(doc: dict[str, Any], ratio: float) -> Figure | None:
    labels, layers, values = layer_errors(doc, ratio)
    if not labels:
        return None
    plt = figures._plt()
    fig, ax = plt.subplots(figsize=(max(4.5, min(11.0, 0.3 * len(layers) + 4)), max(2.2, 0.35 * len(labels) + 1.2)))
    im = ax.imshow(np.ma.masked_invalid(values), aspect="auto", cmap="magma_r", interpolation="nearest", vmin=0)
    shown = [_short(x.split(" @ ")[0]) + (f" @ {x.split(' @ ')[1]}" if " @ " in x else "") for x in labels]
    ax.set_yticks(range(len(labels)), shown, fontsize=6)
    ax.set_xticks(range(len(layers)), [str(v) for v in layers], fontsize=6)
    ax.set_xlabel("layer")
    fig.colorbar(im, ax=ax, label="||o'-o||/||o|| (mean over KV heads)")
    fig.tight_layout()
    return fig


def _units(r: dict[str, Any], family: str) -> str:
    """"measured/replayed" (request, layer) units of an eviction result ("" otherwise)."""
    u = r.get("units")
    return f"{u['measured']}/{sum(u.values())}" if u and family == "eviction" else ""


def table_rows(doc: dict[str, Any]) -> list[tuple[str, ...]]:
    base = doc["baseline"]["bytes_peak"] or 1.0

    def f(r: dict[str, Any], m: str, fmt: str) -> str:
        v = r["overall"].get(m, {}).get("mean")
        return "-" if v is None else fmt.format(v)

    out = []
    for p in doc["policies"]:
        for r in p["results"]:
            by = r["bytes"]
            out.append((p["label"], "-" if r["ratio"] is None else f"{r['ratio']:g}", format_bytes(by["kept_peak"]),
                        format_bytes(by["saved_peak"]), f"{100 * by['saved_peak'] / base:.1f}%",
                        f(r, "attention_mass_recall", "{:.3f}"), f(r, ERR, "{:.4f}"),
                        f(r, "key_cosine", "{:.4f}"), f(r, "value_cosine", "{:.4f}"), str(len(r["skipped"])),
                        _units(r, p["family"])))
    return out


def _layout(doc: dict[str, Any]) -> str:
    rec = doc["baseline"].get("recorded")
    if not rec or not rec.get("layout_peak"):
        return ""
    return (f" (the trace's own layout allocates {format_bytes(rec['allocated_peak'])} at peak: "
            f"{format_bytes(rec['layout_peak'])} of layout effects such as views pinning larger storages, "
            "credited to no policy)")


def render_into(b: Any, doc: dict[str, Any], ratio: float) -> None:
    """Fill the report builder's ``whatif`` section from ``doc`` (``b``: report.build._Builder)."""
    s = b.section("whatif", "What-if: memory saved vs attention error per KV policy")
    s.lead.append(html.para(
        f"Offline proxies, not model quality: {doc['note']}. Baseline (policy-free: the recorded tokens at their "
        f"bytes per token): peak {format_bytes(doc['baseline']['bytes_peak'])}{_layout(doc)}; "
        f"{doc['sampled_units']} sampled (request, layer) units. Quality by rerun: kvtrace whatif --rerun MODEL "
        "--text FILE."))
    fig = pareto(doc)
    if fig is None:
        s.body.append(html.absent("no policy has an attention output error here (it needs sampled Q, K and V); "
                                  "bytes are in the table"))
    else:
        b.add_figure(s, "whatif_pareto", fig, "Peak KV bytes saved against the mean attention output error, one "
                     "point per policy and ratio; paging changes no value (error 0 by construction); the dashed line "
                     "is the Pareto front.")
    hm = layer_heatmap(doc, ratio)
    if hm is not None:
        b.add_figure(s, "whatif_layer_error", hm, f"Attention output error per layer at ratio {ratio:g} (eviction) "
                     "and for each quantiser, mean over KV heads and sampled requests; blank: not measured.")
    s.body.append(html.table(["policy", "ratio", "kept peak", "saved peak", "saved", "mass recall", "output error",
                              "K cosine", "V cosine", "skipped", "units measured"], table_rows(doc),
                             (2, 3, 4, 5, 6, 7, 8, 9, 10)))
    reasons: dict[str, int] = {}
    for p in doc["policies"]:
        if p.get("note"):
            reasons[f"{p['policy']}: {p['note']}"] = 0
        for r in p["results"]:
            for x in r["skipped"]:
                reasons[x["reason"]] = reasons.get(x["reason"], 0) + 1
            for x in r["layers"]:
                if x.get("status") in ("unsupported", "not_pressed"):
                    why = f"{x['status'].replace('_', ' ')}: {x['reason']}"
                    reasons[why] = reasons.get(why, 0) + 1
    if reasons:
        s.body.append(html.table(["note, or why a measure was skipped", "times skipped"],
                                 [(reason, n or "-") for reason, n in reasons.items()], (1,)))
