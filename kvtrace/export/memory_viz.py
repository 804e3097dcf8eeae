"""``kvtrace export memory-viz``: one /owners reading of a trace (format 1.5) as a memory snapshot that
https://pytorch.org/memory_viz opens (and torch's own ``torch.cuda._memory_viz`` reads): the pickle
format of ``torch.cuda.memory._dump_snapshot`` (``segments`` of ``blocks``, ``device_traces``).

The trace keeps a summary, not every block: each owner class becomes one segment whose blocks are
the class's largest blocks as recorded (with their allocation site as a frame when memory history
was on) plus one block for the rest of the class; free reserved memory is one inactive segment. The
flame graph's root frame names the owner ("owner: copies of KV"), so memory_viz's "Allocator State
History" and the segment flame graph show who held what at that moment. No torch needed: plain
dicts, lists, ints and strings, pickled.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

from kvtrace.analyzer import owners as own
from kvtrace.analyzer.replay import ReplayContext
from kvtrace.errors import BadOption
from kvtrace.format import open_trace, schema

MOMENTS = {m.name.lower(): m for m in schema.OwnerMoment}
_BASE = 0x7F0000000000  # synthetic addresses: one segment per class, 1 GiB aligned gaps
_ALIGN = 1 << 30


class NoOwnerReading(BadOption):
    """The trace holds no /owners reading matching the selection (exit 64 through the CLI)."""


def pick_reading(readings: list[own.Reading], *, request: int | None = None, moment: str | None = None,
                 device: int | None = None) -> own.Reading:
    """The reading to export: the one matching ``request``/``moment``/``device``; among several, the
    OOM reading if any, else the one with the most allocated bytes (the last of equals)."""
    rds = [r for r in readings if (request is None or r.request == request)
           and (moment is None or r.moment == MOMENTS[moment]) and (device is None or r.device == device)]
    if not rds:
        raise NoOwnerReading("no owner reading matches" + (
            "" if readings else " (the trace holds none: recorded before format 1.5 or with owners off)"))
    ooms = [r for r in rds if r.moment == schema.OwnerMoment.OOM]
    pool = ooms or rds
    return max(enumerate(pool), key=lambda ir: (ir[1].allocated, ir[0]))[1]


def _frame(site: str) -> dict[str, Any] | None:
    """A memory_viz frame from an ``at`` text "dir/file.py:LINE (function)"."""
    try:
        where, _, func = site.partition(" (")
        filename, _, line = where.rpartition(":")
        return {"filename": filename, "line": int(line), "name": func.rstrip(")") or "?"}
    except (ValueError, AttributeError):
        return None


def snapshot(rd: own.Reading) -> dict[str, Any]:
    """The memory snapshot dict of one reading (torch's _snapshot() layout)."""
    segments = []
    address = _BASE
    dev = max(rd.device, 0)
    for owner in sorted(rd.classes):
        c = rd.classes[owner]
        if c.bytes <= 0:
            continue
        name = own.class_name(owner, c, rd.request if rd.request >= 0 else None)
        root = {"filename": "kvtrace", "line": 0, "name": f"owner: {name}"}
        state = "inactive" if owner == schema.Owner.INACTIVE else "active_allocated"
        blocks = []
        left, count = c.bytes, c.blocks
        for item in c.detail.get("largest", []) if isinstance(c.detail.get("largest"), list) else []:
            if not isinstance(item, dict) or not isinstance(item.get("bytes"), int):
                continue
            size = min(int(item["bytes"]), left)
            if size <= 0 or count <= 1:
                break
            req = item.get("requested_bytes")
            req = int(req) if isinstance(req, int) and 0 < req <= size else size
            site = _frame(item["at"]) if isinstance(item.get("at"), str) else None
            blocks.append({"address": address + (c.bytes - left), "size": size, "requested_size": req,
                           "state": state, "frames": [f for f in (site, root) if f is not None]})
            left -= size
            count -= 1
        if left > 0:
            rest = f" ({count:,} blocks)" if count > 1 else ""
            blocks.append({"address": address + (c.bytes - left), "size": left, "requested_size": left,
                           "state": state, "frames": [{**root, "name": root["name"] + rest}]})
        active = sum(b["size"] for b in blocks if b["state"] != "inactive")
        segments.append({"device": dev, "address": address, "total_size": c.bytes, "stream": 0,
                         "segment_type": "large", "segment_pool_id": (0, 0), "allocated_size": active,
                         "active_size": active, "requested_size": sum(b["requested_size"] for b in blocks
                                                                      if b["state"] != "inactive"),
                         "blocks": blocks})
        address += (c.bytes // _ALIGN + 1) * _ALIGN
    return {"segments": segments, "device_traces": [[] for _ in range(dev + 1)]}


def write_memory_viz(trace: str | os.PathLike[str], output: str | os.PathLike[str], *, request: int | None = None,
                     moment: str | None = None, device: int | None = None) -> tuple[Path, dict[str, Any]]:
    """Write the chosen reading of ``trace`` as a snapshot pickle; (path, what was written)."""
    with open_trace(trace) as tr:
        ctx = ReplayContext(tr)
        rd = pick_reading(own.readings(ctx), request=request, moment=moment, device=device)
        snap = snapshot(rd)
    out = Path(output)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as fh:
        pickle.dump(snap, fh, protocol=4)
    os.replace(tmp, out)
    info = {"request": rd.request, "moment": rd.moment.name.lower(), "device": rd.device, "step": rd.step,
            "allocated_bytes": rd.allocated, "segments": len(snap["segments"]),
            "owners": own.describe(rd, include_free=True)}
    return out, info
