"""aliasing: naive (sum over layers) vs unique (each storage once) KV bytes, and which layers
share storage. Identity comes from the recorded storage pointers, never from comparing values.
Sharing the config declares (KV-sharing layers, one K/V tensor) is reported as information;
layers sharing storage without the config saying so would overwrite each other and are flagged.
"""

from __future__ import annotations

import numpy as np

from kvtrace.analyzer.base import Detector, Finding, ev, register
from kvtrace.analyzer.detectors._common import layers_phrase
from kvtrace.analyzer.replay import ReplayContext, RequestTimeline
from kvtrace.units import format_bytes

UNEXPECTED_SCORE = 0.7


@register
class Aliasing(Detector):
    name = "aliasing"
    needs = ("kv",)
    summary = "naive vs unique KV bytes; which layers share storage, and whether the config says they should"

    def run(self, ctx: ReplayContext) -> list[Finding]:
        reqs = [r for r in ctx.requests if not r.kv.empty]
        if not reqs:
            return []
        out: list[Finding] = []
        declared = self._declared(ctx)
        unexpected: dict[tuple[int, ...], list[int]] = {}
        for req in reqs:
            for group in self._shared_groups(req):
                if not self._explained(group, declared):
                    unexpected.setdefault(tuple(group), []).append(req.request)
        for group, rids in unexpected.items():
            msg = (f"{layers_phrase(group).capitalize()} point at the same KV storage although the config "
                   f"declares no sharing between them (requests {', '.join(map(str, rids[:6]))}): "
                   f"they overwrite each other's cache.")
            out.append(self.finding("unexpected_sharing", UNEXPECTED_SCORE, msg,
                                    evidence={"layers_sharing": ev(len(group), "count")},
                                    requests=rids, layers=list(group)))
        req = max(reqs, key=lambda r: r.final_tokens)
        out.append(self._summary(ctx, req, declared))
        return out

    @staticmethod
    def _declared(ctx: ReplayContext) -> dict[int, int]:
        """consumer -> producer, from the config and the recorder's /layers table."""
        out = {g.index: g.shares_kv_with for g in ctx.expectation.layers.values() if g.shares_kv_with is not None}
        for r in ctx.layers_table:
            if int(r["shared_from"]) >= 0:
                out.setdefault(int(r["layer"]), int(r["shared_from"]))
        return out

    @staticmethod
    def _root(layer: int, declared: dict[int, int]) -> int:
        seen = set()
        while layer in declared and layer not in seen:
            seen.add(layer)
            layer = declared[layer]
        return layer

    def _explained(self, group: list[int], declared: dict[int, int]) -> bool:
        return len({self._root(x, declared) for x in group}) == 1

    @staticmethod
    def _shared_groups(req: RequestTimeline) -> list[list[int]]:
        """Groups of >1 layers whose K or V storage is the same object within one step."""
        g = req.kv
        si, li = np.nonzero(g.present)
        step = np.concatenate([si, si])
        dev = np.concatenate([g["device"][si, li]] * 2)
        ptr = np.concatenate([g["k_storage"][si, li], g["v_storage"][si, li]])
        layer = np.concatenate([g.layers[li]] * 2)
        keep = ptr > 0
        step, dev, ptr, layer = step[keep], dev[keep], ptr[keep], layer[keep]
        if ptr.size == 0:
            return []
        order = np.lexsort((layer, ptr, dev, step))
        step, dev, ptr, layer = step[order], dev[order], ptr[order], layer[order]
        new_key = np.ones(ptr.size, dtype=bool)
        new_key[1:] = (step[1:] != step[:-1]) | (dev[1:] != dev[:-1]) | (ptr[1:] != ptr[:-1])
        starts = np.flatnonzero(new_key)
        ends = np.append(starts[1:], ptr.size)
        groups: dict[tuple[int, ...], None] = {}
        for a, b in zip(starts[(ends - starts) > 1], ends[(ends - starts) > 1], strict=True):
            members = tuple(sorted({int(x) for x in layer[a:b]}))
            if len(members) > 1:
                groups[members] = None
        return [list(m) for m in groups]

    def _summary(self, ctx: ReplayContext, req: RequestTimeline, declared: dict[int, int]) -> Finding:
        g = req.kv
        row = g.last_row()
        same_kv = [int(layer) for li, layer in enumerate(g.layers)
                   if g.present[row, li] and g["k_storage"][row, li] > 0
                   and g["k_storage"][row, li] == g["v_storage"][row, li]]
        s = req.steps
        if s.size:
            naive, unique = int(s["kv_bytes_naive"][-1]), int(s["kv_bytes_unique"][-1])
        else:
            naive = int(g["bytes_allocated"][row][g.present[row]].sum())
            unique = int(g["bytes_unique"][row][g.present[row]].sum())
        consumers = sorted(declared)
        producers = sorted({self._root(c, declared) for c in consumers})
        parts = []
        if consumers:
            parts.append(f"{layers_phrase(consumers)} reuse the KV of {layers_phrase(producers)} (declared sharing)")
        if same_kv:
            parts.append(f"{layers_phrase(same_kv)} keep K and V in one storage")
        what = "; ".join(parts) if parts else "no layers share KV storage"
        msg = (f"Request {req.request}: {what}; naive sum {format_bytes(naive)}, unique "
               f"{format_bytes(unique)} (each storage counted once).")
        return self.finding(
            "sharing" if parts else "no_sharing", 0.0, msg,
            evidence={"naive_bytes": ev(naive, "bytes"), "unique_bytes": ev(unique, "bytes"),
                      "shared_bytes": ev(max(naive - unique, 0), "bytes"),
                      "consumer_layers": ev(len(consumers), "count"),
                      "k_equals_v_layers": ev(len(same_kv), "count")},
            requests=[req.request], layers=consumers + same_kv,
        )
