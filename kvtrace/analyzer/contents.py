"""Analyses of the sampled tensor contents of a trace (``kvtrace analyze --gpu`` / ``--contents``).

From the K, V, post-RoPE Q and MLA latent payloads: dead or near-dead KV heads, low-entropy
("streaming") versus high-entropy heads, eviction what-ifs (H2O budget, StreamingLLM sinks +
window) with the bytes each frees, and the MLA latent spectrum. Numerics come from
``kvtrace.kernels`` (Triton on CUDA, the torch references on CPU: same definitions).

This module never imports torch: it reaches torch and the kernels through one optional entry,
``kvtrace.kernels.compute.open_compute``, so importing it (and ``kvtrace.analyzer``) works without
torch. Without torch every analysis is skipped with the reason; thresholds and choices are
documented in docs/kernels.md.

Unit of analysis: one (request, layer). Dead heads and eviction use the request's last sampled
step that holds the layer's K and V, restricted to the tokens the cache held then. Entropy uses
every sampled query of the request at that layer, each against every key sampled up to its own
step (incremental samples joined, spec §6.1); H2O scores accumulate the received mass of all those
queries onto the last step's kept keys by absolute position. A query is used only when every key
it attends to is sampled; otherwise it is counted, not used (with whole samples a sliding cache
keeps ``window - 1`` tokens after a step, so its queries miss one key).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtrace.format import schema
from kvtrace.format.assemble import ContentsAssembler
from kvtrace.format.errors import InvalidTrace
from kvtrace.format.reader import Trace
from kvtrace.geometry.bounds import checked_config
from kvtrace.jsonable import plain
from kvtrace.kernels.compute import Compute, open_compute, select_device  # noqa: F401 - select_device: this API

__all__ = ["ContentsReport", "analyze_contents", "refuse_denied_payloads", "select_device"]

LT = schema.LayerType
PK = schema.PayloadKind
_WINDOWED = (LT.SLIDING, LT.STATIC_SLIDING)


@dataclass
class ContentsReport:
    """Result of :func:`analyze_contents`; ``to_dict()`` is the JSON ``contents`` section."""

    status: str  # "ran" | "skipped"
    reason: str = ""  # why skipped; "" when it ran
    backend: str | None = None  # "triton/cuda", "torch/cuda", "torch/cpu", "triton-interpreter/cpu"
    device_note: str = ""  # e.g. why --gpu ran on the CPU
    params: dict[str, Any] = field(default_factory=dict)
    payloads: int = 0
    dead_heads: list[dict[str, Any]] = field(default_factory=list)
    entropy: list[dict[str, Any]] = field(default_factory=list)
    eviction: list[dict[str, Any]] = field(default_factory=list)
    mla: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)  # {analysis, request, layer, reason}

    def to_dict(self) -> dict[str, Any]:
        return plain({
            "status": self.status, "reason": self.reason, "backend": self.backend,
            "device_note": self.device_note, "params": self.params, "payloads": self.payloads,
            "dead_heads": self.dead_heads, "entropy": self.entropy, "eviction": self.eviction,
            "mla": self.mla, "skipped": self.skipped,
        })


def analyze_contents(
    trace: Trace | str | os.PathLike[str], *, device: str = "auto", backend: str = "auto",
    heavy: int | float = 0.1, recent: int | float = 0.1, sinks: int = 4, window: int = 1020,
) -> ContentsReport:
    """Run the content analyses on a trace (path or open Trace).

    ``device``: auto (CUDA if present), cuda (falls back to the CPU with a note), cpu.
    ``backend``: kernels backend, auto | triton | torch. ``heavy``/``recent``: H2O budget (ints are
    tokens, floats fractions of the cached tokens; default 10% + 10%). ``sinks``/``window``:
    StreamingLLM what-if (default 4 sinks + 1020 recent = a 1024-token cache).
    """
    params = {"heavy": heavy, "recent": recent, "sinks": sinks, "window": window, "device": device}
    if isinstance(trace, Trace):
        return _run(trace, device, backend, params)
    with Trace(trace) as t:
        return _run(t, device, backend, params)


def refuse_denied_payloads(trace: Trace) -> None:
    """InvalidTrace (exit 1) when the trace holds sampled tensors its /meta flag says it does not
    (spec §3; ``kvtrace validate`` calls it invalid): ``analyze --contents``, ``whatif`` and
    ``diff --whatif`` call it before they read a payload, so they do not read what the file's own
    privacy flag denies. (The HTML report draws them and says the flag is wrong.)"""
    n = trace.nrows("payloads/index") if trace.has("payloads/index") else 0
    if n and not trace.meta.contains_tensor_payloads:
        raise InvalidTrace(f"{trace.path}: /meta contains_tensor_payloads is false but the trace holds {n:,} sampled "
                           "tensor(s): not read (the flag denies them; 'kvtrace validate' calls the trace invalid)")


def _run(trace: Trace, device: str, backend: str, params: dict[str, Any]) -> ContentsReport:
    index = trace.payload_index[:] if trace.has("payloads/index") else np.zeros(0, schema.PAYLOAD_INDEX)
    if index.size == 0:
        why = ("the trace holds no sampled tensors (record with sampling={'every_n_steps': N}"
               + (", queries=True for entropy/eviction)" if not trace.meta.contains_tensor_payloads else ")"))
        return ContentsReport("skipped", why, params=params)
    compute = open_compute(device, backend)
    if isinstance(compute, str):
        return ContentsReport("skipped", f"{compute}; the content analyses need torch (or a GPU with torch and triton)",
                              params=params, payloads=int(index.size))
    rep = ContentsReport("ran", backend=compute.label, device_note=compute.device_note,
                         params=params, payloads=int(index.size))
    _Analysis(trace, index, compute, rep).run()
    return rep


class _Analysis:
    def __init__(self, trace: Trace, index: np.ndarray, compute: Compute, rep: ContentsReport) -> None:
        self.trace, self.index, self.k, self.rep = trace, index, compute, rep
        self.backend = compute.backend
        self.p = rep.params
        self.layers = {int(r["layer"]): r for r in trace.layers[:]} if trace.has("layers") else {}
        self.kv, self.kv_request = np.zeros(0, schema.KV), -1  # /kv rows of the request being analysed
        cfg = checked_config(trace, trace.layers[:] if trace.has("layers") else None)  # bounded sizes (exit 1)
        self.cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
        self.contents = ContentsAssembler(trace, index)  # K/V/latents at a step, increments joined
        self.rows_by: dict[tuple[int, int, int, int], int] = {}
        for i, r in enumerate(index):
            self.rows_by[(int(r["request"]), int(r["step"]), int(r["layer"]), int(r["kind"]))] = i

    # -------------------------------------------------------------------------------- helpers

    def skip(self, analysis: str, request: int, layer: int, reason: str) -> None:
        self.rep.skipped.append({"analysis": analysis, "request": request, "layer": layer, "reason": reason})

    def tensor(self, row: int) -> tuple[Any, Any]:
        return self._on_device(self.trace.payload(int(row)))

    def at_step(self, request: int, step: int, layer: int, kind: PK, *, first: int | None = None) -> tuple[Any, Any]:
        """(payload, fp32 tensor) of the layer's sampled tokens at ``step`` (spec §6.1): every
        position sampled so far, or from ``first`` on (``_first_kept``: what the cache held then)."""
        p = self.contents.at(request, layer, int(kind), step, first=first)
        if p is None:  # callers ask only for steps listed in rows_by
            raise KeyError((request, step, layer, int(kind)))
        return self._on_device(p)

    def _on_device(self, p: Any) -> tuple[Any, Any]:
        return p, self.k.tensor(p.to_float32())

    def kv_row(self, request: int, step: int, layer: int) -> np.void | None:
        if request != self.kv_request:  # requests come in order: each one's rows are read once, by its runs
            self.kv, self.kv_request = self.trace.kv.where(request=request), request
        k = self.kv
        sel = k[(k["step"] == step) & (k["layer"] == layer)]
        return sel[0] if sel.size else None

    def layer_type(self, layer: int, kvrow: np.void | None) -> LT:
        code = int(kvrow["layer_type"]) if kvrow is not None else int(self.layers[layer]["layer_type"]) if layer in self.layers else 0
        try:
            return LT(code)
        except ValueError:
            return LT.UNKNOWN

    def run(self) -> None:
        req_layers = sorted({(int(r["request"]), int(r["layer"])) for r in self.index})
        for request, layer in req_layers:
            steps = sorted({s for (rq, s, ly, _k) in self.rows_by if rq == request and ly == layer})
            kv_steps = [s for s in steps if (request, s, layer, int(PK.KEY)) in self.rows_by
                        and (request, s, layer, int(PK.VALUE)) in self.rows_by]
            lat_steps = [s for s in steps if (request, s, layer, int(PK.LATENT)) in self.rows_by]
            lt = self.layer_type(layer, self.kv_row(request, steps[-1], layer))
            if lat_steps or lt == LT.LATENT:
                self.mla(request, layer, lat_steps or kv_steps)
                self.skip("dead_heads", request, layer, "MLA layer: the cache holds one latent shared by all heads")
                self.skip("entropy", request, layer,
                          "MLA layer: cached keys are latents; sampled queries are per-head and not comparable")
                self.skip("eviction", request, layer, "MLA layer: eviction what-ifs need per-head attention mass")
                continue
            if not kv_steps:
                self.skip("dead_heads", request, layer, "no step with both K and V sampled")
                continue
            last = kv_steps[-1]
            self.dead_heads(request, layer, last)
            self.attention(request, layer, last, steps)
            self.contents.clear()  # decoded payloads of this (request, layer) are not needed again

    # ------------------------------------------------------------------------------ dead heads

    def dead_heads(self, request: int, layer: int, step: int) -> None:
        kvrow = self.kv_row(request, step, layer)
        first = _first_kept(kvrow)
        kp, k = self.at_step(request, step, layer, PK.KEY, first=first)
        vp, v = self.at_step(request, step, layer, PK.VALUE, first=first)
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            self.skip("dead_heads", request, layer,
                      f"K/V payloads are not [B, H, T, D] with the same B, H, T (got {kp.shape}, {vp.shape})")
            return
        kb, vb = _dtype_bytes(kvrow, kp, vp)
        rep = self.k.kv_head_report(k, v, layer=layer, dtype_bytes=kb, backend=self.backend)
        heads = [kp.head_start + i * kp.head_stride for i in range(k.shape[1])]
        B, _, T, Dk = k.shape
        per_head = B * T * (Dk * kb + v.shape[3] * vb)
        total_heads = int(self.layers[layer]["num_kv_heads"]) if layer in self.layers else len(heads)
        self.rep.dead_heads.append({
            "request": request, "step": step, "layer": layer, "layer_type": self.layer_type(layer, kvrow).name.lower(),
            "heads": heads, "kv_heads": total_heads, "tokens": T, "batch": B, "token_start": kp.token_start,
            "basis": rep.basis, "threshold": rep.threshold,
            "key_ratio": list(rep.key_ratio or ()), "value_ratio": list(rep.value_ratio or ()),
            "key_mean_norm": [float(x) for x in _means(self, k)], "value_mean_norm": [float(x) for x in _means(self, v)],
            "dead": [heads[i] for i in rep.dead], "bytes_per_head": per_head, "bytes_dead": per_head * len(rep.dead),
        })

    # ------------------------------------------------------------------------ attention stats

    def attention(self, request: int, layer: int, last: int, steps: list[int]) -> None:

        kvrow = self.kv_row(request, last, layer)
        lt = self.layer_type(layer, kvrow)
        # Eviction plans act on what the cache held at the last step; each query's entropy uses
        # every key sampled up to its step (a sliding layer has dropped its oldest since).
        first = _first_kept(kvrow)
        kp_last, k_last = self.at_step(request, last, layer, PK.KEY, first=first)
        vp_last = self.contents.at(request, layer, int(PK.VALUE), last, first=first)
        if k_last.dim() != 4 or vp_last is None or len(vp_last.shape) != 4:  # a valid but other layout
            for name in ("entropy", "eviction_h2o"):
                self.skip(name, request, layer, f"K/V payloads are not [B, H, T, D] (got {kp_last.shape})")
            return
        B, hk, Tk, Dk = k_last.shape
        kb, vb = _dtype_bytes(kvrow, kp_last, vp_last)
        kv_heads = int(self.layers[layer]["num_kv_heads"]) if layer in self.layers else hk
        per_token = kv_heads * B * (Dk * kb + vp_last.shape[-1] * vb)
        window = None
        if lt in _WINDOWED and layer in self.layers and int(self.layers[layer]["window"]) > 0:
            window = int(self.layers[layer]["window"])
        if lt == LT.CHUNKED:
            self.skip("entropy", request, layer, "chunked attention: its mask is not a causal or sliding window")
        q_steps = [s for s in steps if (request, s, layer, int(PK.QUERY)) in self.rows_by
                   and (request, s, layer, int(PK.KEY)) in self.rows_by]
        mass = np.zeros((B, hk, Tk))
        ents: list[np.ndarray] = []
        nvis: list[np.ndarray] = []
        sampled = used = 0
        kv_abs = [kp_last.head_start + i * kp_last.head_stride for i in range(hk)]
        scale = _scale(self.cfg)
        for s in (q_steps if lt != LT.CHUNKED else []):
            if s > last:
                continue
            qp, q = self.tensor(self.rows_by[(request, s, layer, int(PK.QUERY))])
            kp, k = self.at_step(request, s, layer, PK.KEY)
            if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
                continue  # not [B, H, T, D] with K's batch and head_dim: nothing to pair
            sampled += q.shape[2] * q.shape[0]
            pick = _pair_heads(qp, q.shape[1], kp, k.shape[1], self.cfg, kv_heads)
            if pick is None or [kp.head_start + i * kp.head_stride for i in pick[1]] != kv_abs:
                continue
            qi, ki = pick
            pos = qp.token_start + np.arange(q.shape[2])
            lo = np.maximum(pos - window + 1, 0) if window else np.zeros_like(pos)
            ok = (lo >= kp.token_start) & (pos <= kp.token_start + k.shape[2] - 1)
            if not ok.any():
                continue
            used += int(ok.sum()) * q.shape[0]
            qs = q[:, qi][:, :, self.k.tensor(np.flatnonzero(ok))]
            st = self.k.attention_stats(qs, k[:, ki], q_positions=(pos[ok] - kp.token_start).tolist(),
                                 window=window, scale=scale, backend=self.backend)
            ents.append(st.norm_entropy.double().cpu().numpy())
            nvis.append(st.n_visible.cpu().numpy())
            # H2O accumulates received mass per token: add this step's onto the last step's keys.
            rec = st.received.double().cpu().numpy()
            a0 = max(kp.token_start, kp_last.token_start)
            a1 = min(kp.token_start + k.shape[2], kp_last.token_start + Tk)
            if a1 > a0:
                mass[:, :, a0 - kp_last.token_start:a1 - kp_last.token_start] += \
                    rec[:, :, a0 - kp.token_start:a1 - kp.token_start]
        base = {"request": request, "step": last, "layer": layer, "layer_type": lt.name.lower(),
                "kv_heads": kv_heads, "tokens": Tk, "token_start": kp_last.token_start, "batch": B,
                "bytes_per_token": per_token}
        have_mass = used > 0
        if not q_steps:
            self.skip("entropy", request, layer, "no sampled queries (record with sampling={..., 'queries': True})")
        elif not have_mass and lt != LT.CHUNKED:
            self.skip("entropy", request, layer,
                      f"none of the {sampled} sampled queries has all its visible keys in the sample"
                      + (" (a sliding cache keeps window - 1 tokens after the step)" if window else ""))
        if have_mass:
            e = self.k.classify_entropy(np.concatenate(ents, axis=2), n_visible=np.concatenate(nvis), kv_heads=hk)
            g = len(e.mean_norm_entropy) // hk
            self.rep.entropy.append({
                **{k: base[k] for k in ("request", "layer", "layer_type")}, "steps": q_steps,
                "window": window, "scale": scale if scale is not None else 1 / math.sqrt(Dk),
                "queries_sampled": sampled, "queries_used": used, "queries_multi_key": e.queries_used,
                "query_heads": _query_heads_abs(self, layer, hk, kv_abs),
                "kv_head_of_query_head": [kv_abs[i // g] for i in range(len(e.mean_norm_entropy))],
                "mean_norm_entropy": list(e.mean_norm_entropy),
                "low_threshold": e.low_threshold, "high_threshold": e.high_threshold,
                "low": e.low, "mixed": e.mixed, "high": e.high, "kv_low": [kv_abs[i] for i in e.kv_low],
            })
        plans = []
        if have_mass:
            plans.append(self.k.h2o_eviction(mass, head_dim=Dk, dtype_bytes=kb, heavy=self.p["heavy"], recent=self.p["recent"]))
        else:
            self.skip("eviction_h2o", request, layer, "needs received attention mass from usable sampled queries")
        plans.append(self.k.streaming_eviction(head_dim=Dk, dtype_bytes=kb, sinks=self.p["sinks"], recent=self.p["window"],
                                        received=mass if have_mass else None,
                                        tokens=None if have_mass else Tk, kv_heads=None if have_mass else hk,
                                        batch=B))
        for plan in plans:
            self.rep.eviction.append({
                **base, "policy": plan.policy, "kept": plan.kept, "evicted": plan.evicted,
                # as asked (ints tokens, floats fractions) and as applied to this layer's tokens
                "params": ({"heavy": self.p["heavy"], "recent": self.p["recent"]} if plan.policy == "h2o"
                           else {"sinks": self.p["sinks"], "window": self.p["window"]}),
                "applied": plan.params,
                "bytes_total": Tk * per_token, "bytes_freed": plan.evicted * per_token,
                "mass_retained_mean": plan.mass_retained_mean, "mass_retained_min": plan.mass_retained_min,
                "mass_heads": kv_abs if have_mass else [],
            })

    # ------------------------------------------------------------------------------------- MLA

    def mla(self, request: int, layer: int, steps: list[int]) -> None:

        if not steps:
            self.skip("mla", request, layer, "no latent (c_KV) sampled for this layer")
            return
        step = steps[-1]
        kind = PK.LATENT if (request, step, layer, int(PK.LATENT)) in self.rows_by else PK.KEY
        c = self.cfg
        need = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "num_attention_heads")
        missing = [n for n in need if not isinstance(c.get(n), int)]
        if missing:
            self.skip("mla", request, layer, f"model_config lacks {', '.join(missing)}")
            return
        lp, lat = self.at_step(request, step, layer, kind)
        r = int(c["kv_lora_rank"])
        if lat.shape[-1] != r:
            self.skip("mla", request, layer, f"latent width {lat.shape[-1]} is not kv_lora_rank {r} (expanded cache?)")
            return
        # K heads are nope + rope wide, V heads v_head_dim: their mean counts both (docs/kernels.md).
        head_dim = (c["qk_nope_head_dim"] + c["qk_rope_head_dim"] + c["v_head_dim"]) // 2
        sp = self.k.mla_spectrum(lat, num_heads=c["num_attention_heads"], head_dim=head_dim,
                          rope_dim=c["qk_rope_head_dim"], kv_lora_rank=r, backend=self.backend)
        d = sp.to_dict()
        eig = d.pop("eigenvalues")
        self.rep.mla.append({"request": request, "step": step, "layer": layer, "token_start": lp.token_start,
                             **d, "eigenvalues_top": list(eig[:8])})


def _first_kept(kvrow: np.void | None) -> int | None:
    """Position of the first token a layer's cache held at its /kv row's step (None: no row)."""
    return None if kvrow is None else int(kvrow["tokens_seen"]) - int(kvrow["tokens_kept"])


def _means(a: _Analysis, x: Any) -> np.ndarray:
    return a.k.head_norms(x, backend=a.backend).head_mean.double().mean(dim=0).cpu().numpy()


def _dtype_bytes(kvrow: np.void | None, kp: Any, vp: Any) -> tuple[int, int]:
    """Element bytes of the cached K and V, from /kv (the payload's own dtype as fallback)."""
    out = []
    for name, p in (("k_dtype", kp), ("v_dtype", vp)):
        size = 0
        if kvrow is not None:
            try:
                size = schema.DTYPE_ITEMSIZE.get(schema.CacheDType(int(kvrow[name])), 0)
            except ValueError:
                size = 0
        out.append(int(size) if size else int(schema.DTYPE_ITEMSIZE[p.dtype]))
    return out[0], out[1]


def _scale(cfg: dict[str, Any]) -> float | None:
    """Softmax scale the model uses where it is not 1/sqrt(head_dim) (gemma: query_pre_attn_scalar)."""
    v = cfg.get("query_pre_attn_scalar")
    return float(v) ** -0.5 if isinstance(v, (int, float)) and v > 0 else None


def _pair_heads(qp: Any, hq: int, kp: Any, hk: int, cfg: dict[str, Any], kv_total: int
                ) -> tuple[list[int], list[int]] | None:
    """Local (query heads, kv heads) indices so that query head i of the result reads KV head
    i // group (repeat_kv order), using absolute head numbers head_start + i * head_stride."""
    heads_total = cfg.get("num_attention_heads")
    if not isinstance(heads_total, int) or heads_total <= 0 or kv_total <= 0 or heads_total % kv_total:
        return None
    g = heads_total // kv_total
    q_abs = {qp.head_start + i * qp.head_stride: i for i in range(hq)}
    qi: list[int] = []
    ki: list[int] = []
    for j in range(hk):
        kv_head = kp.head_start + j * kp.head_stride
        want = [kv_head * g + t for t in range(g)]
        if all(w in q_abs for w in want):
            qi += [q_abs[w] for w in want]
            ki.append(j)
    return (qi, ki) if ki and len(ki) == hk else None


def _query_heads_abs(a: _Analysis, layer: int, hk: int, kv_abs: list[int]) -> list[int]:
    heads_total = a.cfg.get("num_attention_heads")
    kv_total = int(a.layers[layer]["num_kv_heads"]) if layer in a.layers else hk
    g = heads_total // kv_total if isinstance(heads_total, int) and kv_total else 1
    return [h * g + t for h in kv_abs for t in range(g)]

