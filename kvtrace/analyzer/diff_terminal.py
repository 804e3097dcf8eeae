"""Terminal rendering of a ReportDiff (rich); sizes in binary units."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from kvtrace.analyzer.diff import ReportDiff
from kvtrace.labels import device_where
from kvtrace.textsafe import visible
from kvtrace.units import format_bytes, format_ns


def _fmt(d: dict[str, Any], unit: str = "bytes") -> tuple[str, str, str]:
    def one(v: Any) -> str:
        if v is None:
            return "-"
        if unit == "bytes":
            return format_bytes(v)
        if unit == "ns":
            return format_ns(v)
        return f"{v:,}"

    delta = d["delta"]
    sign = "+" if isinstance(delta, (int, float)) and delta > 0 else ""
    return one(d["a"]), one(d["b"]), ("-" if delta is None else sign + one(delta))


def render(d: ReportDiff, console: Console, *, all_layers: bool = False) -> None:
    a, b = d.a, d.b
    for name, side in (("A", a), ("B", b)):
        console.print(f"{name}  {visible(side['trace'])}: {visible(side['model']['id'])} ({visible(side['model']['type'])}), "
                      f"transformers {visible(side['software']['transformers'])}, torch {visible(side['software']['torch'])}")
    for note in d.notes:
        console.print(f"note: {visible(note)}")
    t = Table(title="Requests (B - A)", title_justify="left")
    for col in ("req", "metric", "A", "B", "delta"):
        t.add_column(col, justify="right" if col != "metric" else "left")
    for r in d.requests:
        for key, unit in (("final_tokens", "tokens"), ("peak_kv_bytes", "bytes"), ("final_kv_bytes", "bytes"),
                          ("peak_allocated_bytes", "bytes"), ("retained_allocated_bytes", "bytes"),
                          ("kv_alive_after_request_bytes", "bytes"), ("duration_ns", "ns")):
            if r[key]["a"] is None and r[key]["b"] is None:
                continue
            t.add_row(str(r["request"]), key.replace("_bytes", "").replace("_ns", ""), *_fmt(r[key], unit))
    console.print(t)
    lt = Table(title="Layers (final state of each request, B - A)", title_justify="left")
    for col in ("req", "layer", "kind", "valid A", "valid B", "delta", "allocated delta"):
        lt.add_column(col, justify="right" if col != "kind" else "left")
    shown = 0
    for row in d.layers:
        changed = row["bytes_valid"]["delta"] != 0 or row["bytes_allocated"]["delta"] != 0
        if not (changed or all_layers):
            continue
        kind = row["kind"]["b"] or row["kind"]["a"] or "?"
        if row["kind"]["a"] != row["kind"]["b"]:
            kind = f"{row['kind']['a'] or 'absent'} -> {row['kind']['b'] or 'absent'}"
        kind = visible(kind)
        va, vb, vd = _fmt(row["bytes_valid"])
        lt.add_row(str(row["request"]), str(row["layer"]), kind, va, vb, vd, _fmt(row["bytes_allocated"])[2])
        shown += 1
    if shown:
        console.print(lt)
    else:
        console.print("Layers: no per-layer change")
    if d.memory:
        mt = Table(title="Allocator (whole trace, B - A)", title_justify="left")
        for col in ("device", "metric", "A", "B", "delta"):
            mt.add_column(col, justify="right" if col != "metric" else "left")
        for m in d.memory:
            for key in ("max_allocated_bytes", "max_reserved_bytes", "max_gap_bytes", "max_inactive_split_bytes"):
                mt.add_row(visible(device_where(m["device"])), key.replace("_bytes", ""), *_fmt(m[key]))
        console.print(mt)
    for title, items in (("appeared in B", d.appeared), ("disappeared from B", d.disappeared)):
        for f in items:
            console.print(f"{title}: [{visible(f['severity'])}] {visible(f['detector'])}/{visible(f['kind'])} "
                          f"{f['score']:.2f}: {visible(f['message'])}")
    for c in d.changed:
        console.print(f"changed: {visible(c['detector'])}/{visible(c['kind'])} {visible(c['a']['severity'])} "
                      f"({c['a']['score']:.2f}) -> {visible(c['b']['severity'])} ({c['b']['score']:.2f}): "
                      f"{visible(c['message_b'])}")
    for n in d.not_compared:
        console.print(f"not compared: {visible(n['detector'])}/{visible(n['kind'])}: {visible(n['reason'])}")
    console.print(f"{len(d.appeared)} appeared, {len(d.disappeared)} disappeared, {len(d.changed)} changed "
                  f"severity, {d.unchanged} unchanged. Sizes in binary units (KiB = 1024 B).")
