"""Matplotlib figures (Agg backend, no display needed) for the HTML report.

Each function takes extracted data (kvtrace.report.data / contents) and returns a Figure, or
None when there is nothing to draw. Byte axes are scaled to one binary unit chosen from the data
(KiB = 1024 B ...) and say which.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvtrace.errors import Unavailable
from kvtrace.report.contents import Heatmap
from kvtrace.report.data import (
    DeviceTimeline,
    GrowthCurves,
    LayerFootprint,
    Marker,
    RequestMemory,
    decimate,
    layer_type_name,
)

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")

SERIES_STYLE = {
    "nvml_used": ("NVML used", "#222222", "-"),
    "nvml_process_used": ("NVML used by this process", "#777777", ":"),
    "allocator_reserved": ("allocator reserved", "#1f77b4", "-"),
    "allocator_allocated": ("allocator allocated", "#2ca02c", "-"),
    "allocator_inactive_split": ("allocator inactive split", "#9467bd", ":"),
    "kv_bytes": ("KV cache alive (unique bytes)", "#d62728", "-"),
    "kv_retained": ("KV still alive after its request (retention proof)", "#7a0019", "--"),
    "process_rss": ("process RSS (host memory)", "#8c564b", "-"),
}
MARKER_STYLE = {
    "prefill_start": "#bcbd22",
    "prefill_end": "#17becf",
    "eos": "#ff7f0e",
    "gc": "#8c564b",
    "empty_cache": "#e377c2",
    "oom": "#d62728",
}
LAYER_COLOURS = {
    "full": "#1f77b4", "sliding": "#ff7f0e", "chunked": "#bcbd22", "shared_consumer": "#7f7f7f",
    "latent": "#9467bd", "quantized": "#8c564b", "static": "#2ca02c", "cross_attention": "#e377c2",
    "static_sliding": "#17becf", "unknown": "#444444",
}


def _plt():
    try:
        import matplotlib
    except ImportError:
        raise Unavailable("the HTML report needs matplotlib: pip install 'kvtrace[report]'") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "path", "figure.dpi": 100, "font.size": 9,
                         "svg.hashsalt": "kvtrace"})  # fixed salt: identical input, identical SVG
    return plt


def byte_unit(max_value: float) -> tuple[str, float]:
    """The binary unit an axis reaching `max_value` bytes reads best in."""
    k = 0
    v = abs(float(max_value))
    while v >= 1024 and k < len(_UNITS) - 1:
        v /= 1024
        k += 1
    return _UNITS[k], float(1024**k)


def to_png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


def to_svg(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    return buf.getvalue()


def close(fig: Figure) -> None:
    _plt().close(fig)


# Series drawn in the lower panel: small next to device totals, so they get their own scale.
DETAIL_SERIES = ("kv_bytes", "kv_retained", "allocator_inactive_split")


def memory_timeline(tl: DeviceTimeline, markers: Sequence[Marker], t0_ns: int) -> Figure | None:
    """Top panel: device-level memory (NVML, allocator); bottom: KV bytes and inactive split
    bytes on their own scale (a few MiB of KV vanish next to tens of GiB of weights)."""
    if not tl.series:
        return None
    plt = _plt()
    panels = [[s for s in tl.series if s.name not in DETAIL_SERIES],
              [s for s in tl.series if s.name in DETAIL_SERIES]]
    panels = [p for p in panels if p]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 2.6 + 2.2 * len(panels)), sharex=True,
                             squeeze=False)
    for ax, series in zip(axes[:, 0], panels, strict=True):
        unit, scale = byte_unit(max(int(s.values.max()) for s in series))
        for s in series:
            t, v = decimate(s.t_ns, s.values)
            label, colour, style = SERIES_STYLE.get(s.name, (s.name, None, "-"))
            drawstyle = "steps-post" if s.source in ("kv", "retention") else "default"
            ax.plot((t - t0_ns) / 1e9, v / scale, style, color=colour, label=label, lw=1.2,
                    drawstyle=drawstyle)
        seen: set[str] = set()
        for m in markers:
            if m.device not in (-1, tl.device):
                continue
            ax.axvline((m.t_ns - t0_ns) / 1e9, color=MARKER_STYLE.get(m.kind, "#000000"), lw=0.8,
                       alpha=0.7, ls="--", label=None if m.kind in seen else m.kind)
            seen.add(m.kind)
        ax.set_ylabel(f"memory ({unit})")
        ax.set_ylim(bottom=0)  # a zero-based axis: a 2% wiggle must not look like a doubling
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=7, ncol=3)  # the zero-based axis puts a flat line at the top
    axes[0, 0].set_title(f"Memory timeline: {tl.label}")
    axes[-1, 0].set_xlabel("time since trace start (s)")
    fig.tight_layout()
    return fig


STATE_COLOUR = "#2b8a3e"  # hybrid models' conv/recurrent state (format 1.5 /state)


def layer_footprint(fp: LayerFootprint) -> Figure:
    plt = _plt()
    kv_of = dict(zip(fp.layers.tolist(), fp.bytes_allocated.tolist(), strict=True))
    stacked = [kv_of.get(layer, 0) + b for layer, b in zip(fp.state_layers.tolist(), fp.state_bytes.tolist(), strict=True)]
    unit, scale = byte_unit(max(int(fp.bytes_allocated.max(initial=0)), *stacked, 1))
    fig, ax = plt.subplots(figsize=(11, 3.6))
    names = [layer_type_name(c) for c in fp.layer_types]
    colours = [LAYER_COLOURS.get(n, "#444444") for n in names]
    ax.bar(fp.layers, fp.bytes_allocated / scale, color=colours, width=0.8)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ax.scatter(fp.layers, fp.bytes_valid / scale, marker="_", color="black", s=60, zorder=3)
    handles = [Patch(color=LAYER_COLOURS.get(n, "#444444"), label=f"{n} (allocated)") for n in dict.fromkeys(names)]
    handles.append(Line2D([], [], color="black", marker="_", ls="", label="valid bytes (tokens held)"))
    if fp.state_layers.size:  # stacked on a layer's KV where it has both (parallel hybrids)
        bottoms = [kv_of.get(layer, 0) / scale for layer in fp.state_layers.tolist()]
        ax.bar(fp.state_layers, fp.state_bytes / scale, bottom=bottoms, color=STATE_COLOUR, width=0.8, hatch="//")
        handles.append(Patch(color=STATE_COLOUR, hatch="//", label="conv/recurrent state (constant in tokens)"))
    ticks = sorted(set(fp.layers.tolist()) | set(fp.state_layers.tolist()))
    if len(ticks) <= 64:
        ax.set_xticks(ticks, [str(v) for v in ticks], fontsize=6 if len(ticks) > 24 else 8)
    ax.set_xlabel("layer")
    what = "KV and state" if fp.state_layers.size else "KV"
    ax.set_ylabel(f"{what} bytes ({unit})")
    ax.set_title(f"Per-layer {what} footprint, request {fp.request} step {fp.step} "
                 f"({fp.tokens_seen} tokens seen)")
    ax.legend(handles=handles, fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def growth(gc: GrowthCurves) -> Figure:
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    peak = max(int(v.max(initial=0)) for v in gc.measured.values())
    unit, scale = byte_unit(max(peak, 1))
    for i, (name, values) in enumerate(sorted(gc.measured.items())):
        colour = "black" if name == "total" else LAYER_COLOURS.get(name, f"C{i}")
        ax1.plot(gc.tokens_seen, values / scale, "-", color=colour, lw=1.5, label=f"{name} measured")
        if gc.expected is not None and name in gc.expected:
            ax1.plot(gc.tokens_seen, gc.expected[name] / scale, "--", color=colour, lw=1,
                     alpha=0.8, label=f"{name} expected")
    ax1.set_xlabel("tokens seen")
    ax1.set_ylim(bottom=0)
    ax1.set_ylabel(f"valid KV bytes ({unit})")
    ax1.set_title(f"Growth by layer type, request {gc.request}")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    peak_all = max(int(v.max(initial=0)) for _, v in gc.all_requests.values())
    unit2, scale2 = byte_unit(max(peak_all, 1))
    for r, (tokens, valid) in sorted(gc.all_requests.items())[:20]:
        ax2.plot(tokens, valid / scale2, lw=1, label=f"request {r}")
    ax2.set_xlabel("tokens seen")
    ax2.set_ylim(bottom=0)
    ax2.set_ylabel(f"valid KV bytes ({unit2})")
    ax2.set_title("Total KV growth, every request")
    ax2.grid(alpha=0.3)
    if len(gc.all_requests) <= 10:
        ax2.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _grouped_bars(ax, labels: list[str], groups: dict[str, list[float | None]], scale: float) -> None:
    n = len(groups)
    width = 0.8 / max(1, n)
    x = np.arange(len(labels))
    for i, (name, values) in enumerate(groups.items()):
        heights = [np.nan if v is None else v / scale for v in values]
        ax.bar(x + (i - (n - 1) / 2) * width, heights, width, label=name)
    ax.set_xticks(x, labels, rotation=45 if len(labels) > 12 else 0, fontsize=7)
    ax.axhline(0, color="black", lw=0.6)


# The post-EOS bars, in drawing order: (legend, value of one request). A bar none of the requests
# has is not drawn and the report names it as absent.
POST_EOS_BARS: tuple[tuple[str, Callable[[RequestMemory], int | None]], ...] = (
    ("baseline (allocated)", lambda m: m.baseline_allocated),
    ("peak KV", lambda m: m.peak_kv),
    ("KV alive after the request (retention proof)", lambda m: m.kv_alive_after),
    ("residual after gc + empty_cache (allocated)", lambda m: m.residual_allocated),
    ("residual after gc + empty_cache (NVML)", lambda m: m.residual_nvml),
    ("residual process RSS (host)", lambda m: m.residual_rss),
)


def post_eos_bars(mems: Sequence[RequestMemory]) -> tuple[list[str], list[str]]:
    """(bars some request has, bars no request has)."""
    drawn = [name for name, get in POST_EOS_BARS if any(get(m) is not None for m in mems)]
    return drawn, [name for name, _ in POST_EOS_BARS if name not in drawn]


def post_eos(mems: Sequence[RequestMemory], max_requests: int = 40) -> Figure | None:
    mems = [m for m in mems if any(get(m) is not None for _, get in POST_EOS_BARS)][:max_requests]
    if not mems:
        return None
    plt = _plt()
    groups = {name: [get(m) for m in mems] for name, get in POST_EOS_BARS}
    groups = {k: v for k, v in groups.items() if any(x is not None for x in v)}
    peak = max(abs(x) for v in groups.values() for x in v if x is not None)
    unit, scale = byte_unit(max(peak, 1))
    fig, ax = plt.subplots(figsize=(11, 3.8))
    _grouped_bars(ax, [f"r{m.request}" + (f"/d{m.device}" if m.device >= 0 else "") for m in mems],
                  groups, scale)
    ax.set_ylabel(f"bytes ({unit})")
    ax.set_title("Post-EOS memory per request: " + ", ".join(groups), fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def allocator_end(mems: Sequence[RequestMemory], max_requests: int = 40) -> Figure | None:
    mems = [m for m in mems if m.end_gap is not None][:max_requests]
    if not mems:
        return None
    plt = _plt()
    groups = {
        "reserved - allocated": [m.end_gap for m in mems],
        "inactive split": [m.end_inactive_split for m in mems],
    }
    peak = max(abs(x) for v in groups.values() for x in v if x is not None)
    unit, scale = byte_unit(max(peak, 1))
    fig, ax = plt.subplots(figsize=(11, 3.4))
    _grouped_bars(ax, [f"r{m.request}" + (f"/d{m.device}" if m.device >= 0 else "") for m in mems],
                  groups, scale)
    ax.set_ylabel(f"bytes ({unit})")
    ax.set_title("Allocator state at end of generation")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def heatmap(hm: Heatmap) -> Figure:
    plt = _plt()
    h = max(2.5, min(10.0, 0.25 * len(hm.layers) + 1.5))
    w = max(4.0, min(11.0, 0.35 * len(hm.heads) + 3))
    fig, ax = plt.subplots(figsize=(w, h))
    im = ax.imshow(np.ma.masked_invalid(hm.values), aspect="auto", cmap="viridis", interpolation="nearest",
                   vmin=hm.vmin, vmax=hm.vmax)
    ax.set_yticks(range(len(hm.layers)), [str(v) for v in hm.layers], fontsize=6)
    ax.set_xticks(range(len(hm.heads)), [str(v) for v in hm.heads], fontsize=6)
    ax.set_ylabel("layer")
    ax.set_xlabel("head")
    ax.set_title(f"{hm.title}, request {hm.request}", fontsize=9)
    fig.colorbar(im, ax=ax, label=hm.unit)
    fig.tight_layout()
    return fig
