"""`kvtrace presets [--json]`: the built-in architecture presets and their KV geometry."""

from __future__ import annotations

from typing import Any

import click

from kvtrace.commands.common import guarded
from kvtrace.commands.outputs import check_json_out, json_options, write_json
from kvtrace.units import format_bytes

DTYPE_BYTES = 2  # bf16, what these models are served in


def preset_rows() -> list[dict[str, Any]]:
    """One dict per preset: layer kinds, KV heads/dims, window, KV bytes per token (bf16). No torch."""
    from kvtrace import geometry, presets

    rows = []
    for name in presets.list_presets():
        p = presets.get_preset(name)
        geo = presets.preset_geometry(name)
        kv_layers = [g for g in geo.layers if g.stores_kv]
        shapes = sorted({(g.kind, g.num_kv_heads, g.k_head_dim, g.v_head_dim, g.window) for g in kv_layers},
                        key=lambda s: (s[0], s[1], s[2]))
        rows.append({
            "name": p.name,
            "aliases": list(p.aliases),
            "model_type": p.model_type,
            "description": p.description,
            "source": p.source,
            "layers": len(geo.layers),
            "layer_kinds": geo.kind_counts(),
            "kv_shapes": [{"kind": k, "kv_heads": h, "k_head_dim": kd, "v_head_dim": vd, "window": w}
                          for k, h, kd, vd, w in shapes],
            "kv_bytes_per_token_bf16": geometry.bytes_per_token(geo, DTYPE_BYTES)["total"],
            "mha_equivalent_bytes_per_token_bf16": geometry.mha_equivalent_bytes_per_token(geo, DTYPE_BYTES),
            "checkpoint_weight_dtypes": {"default": "bf16", **p.weight_dtypes},  # what `kvtrace calc` counts
        })
    return rows


@click.command("presets")
@json_options
@guarded
def presets(as_json: bool, json_out: str | None) -> None:
    """List the built-in architecture presets (real KV geometry, random weights).

    \b
    Use one with --model preset:NAME; --tiny (or --layers N --width F --vocab V) shrinks it:
      kvtrace record --model preset:gemma-3-4b --tiny --prompt hi --max-new-tokens 8 -o run.kvt.h5
    KV bytes per token are for bf16, summed over layers, before any sliding window saturates;
    binary units (KiB = 1024 B).
    """
    check_json_out(json_out, ())
    rows = preset_rows()
    write_json(rows, json_out, as_json=as_json)
    if as_json:
        return
    click.echo(f"{'preset':<18} {'type':<13} {'layers':>6}  {'KV/token':>10}  {'vs MHA':>6}  layer kinds (kv heads x head dim, window)")
    for r in rows:
        kinds = ", ".join(f"{n} {k}" for k, n in r["layer_kinds"].items())
        shapes = "; ".join(
            f"{s['kind']} {s['kv_heads']}x{s['k_head_dim']}" + (f"/{s['v_head_dim']}" if s['v_head_dim'] != s['k_head_dim'] else "")
            + (f" w{s['window']}" if s["window"] else "")
            for s in r["kv_shapes"]
        )
        ratio = r["kv_bytes_per_token_bf16"] / r["mha_equivalent_bytes_per_token_bf16"]
        click.echo(f"{r['name']:<18} {r['model_type']:<13} {r['layers']:>6}  "
                   f"{format_bytes(r['kv_bytes_per_token_bf16']):>10}  {ratio:>6.1%}  {kinds} ({shapes})")
    click.echo("(KV/token: bf16, all layers, binary units; 'vs MHA': share of the same model as plain "
               "multi-head attention)")
