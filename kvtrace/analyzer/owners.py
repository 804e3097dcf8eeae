"""Who owned the memory: the /owners readings of a trace (format 1.5, spec §4.19) and the generate
settings that make growth by design, for the detectors that decide from them (post_eos,
growth_curve, oom).

A reading is one moment on one device (or the CPU census): bytes, blocks and the largest block per
owner class, with a JSON detail. :func:`readings` reads them once per analysis;
:func:`describe` writes the share phrase an engineer paged for an OOM wants ("KV of request 3 61%,
weights 22%, copies of KV 9%, unknown 4%"); :func:`effective` and :func:`by_design_bytes` say what
the user asked generate to keep (output_scores, output_logits, hidden states, attentions, beams).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvtrace.analyzer.replay import ReplayContext, RequestTimeline
from kvtrace.format import schema
from kvtrace.format.owner_rules import checked_owners
from kvtrace.units import format_bytes

OW = schema.Owner
M = schema.OwnerMoment
NAMES = {
    OW.KV_REQUEST: "KV of the request", OW.KV_EARLIER: "KV of earlier requests", OW.WEIGHTS: "weights",
    OW.GENERATE_OUTPUT: "generate outputs", OW.WORKSPACE: "library workspaces", OW.KV_COPIES: "copies of KV",
    OW.UNKNOWN: "unknown", OW.INACTIVE: "free in reserved segments",
}
ALLOCATED = tuple(o for o in OW if o != OW.INACTIVE)
_GEN_KEYS = ("return_dict_in_generate", "output_scores", "output_logits", "output_hidden_states",
             "output_attentions", "num_beams", "num_return_sequences")


@dataclass
class OwnerClass:
    bytes: int
    blocks: int
    largest: int
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Reading:
    request: int
    step: int
    moment: schema.OwnerMoment
    device: int
    t_ns: int
    classes: dict[schema.Owner, OwnerClass] = field(default_factory=dict)

    def bytes(self, *owners: schema.Owner) -> int:
        return sum(self.classes[o].bytes for o in owners if o in self.classes)

    @property
    def allocated(self) -> int:
        return self.bytes(*ALLOCATED)

    def largest_sites(self, owner: schema.Owner, n: int = 3) -> list[str]:
        """The class's largest blocks as "size at file:line" (allocation sites, recorded with memory
        history) or, for a CPU census, "size dtype [shape]"; [] when the detail names neither."""
        c = self.classes.get(owner)
        items = c.detail.get("largest", []) if c is not None else []
        out = []
        for it in items if isinstance(items, list) else []:
            if not isinstance(it, dict) or not isinstance(it.get("bytes"), int):
                continue
            if isinstance(it.get("at"), str):
                out.append(f"{format_bytes(it['bytes'])} at {it['at'][:160]}")
            elif isinstance(it.get("shape"), list) and all(isinstance(x, int) for x in it["shape"][:6]):
                dtype = str(it.get("dtype", ""))[:16]
                out.append(f"{format_bytes(it['bytes'])} {dtype} {list(it['shape'][:6])}".replace("  ", " "))
            if len(out) >= n:
                break
        return out


def readings(ctx: ReplayContext) -> list[Reading]:
    """Every /owners reading of the trace, in time order (empty before format 1.5). Cached on the
    context."""
    cached = ctx.__dict__.get("_owner_readings")
    if cached is not None:
        return cached
    rows = checked_owners(ctx.trace)
    by: dict[tuple[int, int, int, int, int], Reading] = {}
    for r in rows:
        try:
            moment, owner = schema.OwnerMoment(int(r["moment"])), schema.Owner(int(r["owner"]))
        except ValueError:  # a newer minor's code: skipped like any unknown row
            continue
        key = (int(r["t_ns"]), int(r["device"]), int(r["request"]), int(r["step"]), int(moment))
        rd = by.get(key)
        if rd is None:
            rd = by[key] = Reading(int(r["request"]), int(r["step"]), moment, int(r["device"]), int(r["t_ns"]))
        detail: Any = {}
        if int(r["detail_len"]):
            try:
                detail = json.loads(ctx.trace.text(int(r["detail_off"]), int(r["detail_len"])))
            except (ValueError, RecursionError):
                detail = {}
        rd.classes[owner] = OwnerClass(int(r["bytes"]), int(r["blocks"]), int(r["largest_bytes"]),
                                       detail if isinstance(detail, dict) else {})
    out = sorted(by.values(), key=lambda x: (x.t_ns, x.device))
    ctx.__dict__["_owner_readings"] = out
    return out


def of_request(ctx: ReplayContext, request: int, moment: schema.OwnerMoment) -> list[Reading]:
    return [r for r in readings(ctx) if r.request == request and r.moment == moment]


def latest(ctx: ReplayContext, request: int, moment: schema.OwnerMoment) -> list[Reading]:
    """The last reading of that moment for the request, one per device."""
    found: dict[int, Reading] = {}
    for r in of_request(ctx, request, moment):
        found[r.device] = r
    return [found[d] for d in sorted(found)]


def merged(rds: list[Reading]) -> Reading | None:
    """One reading summing several devices' (the same moment)."""
    if not rds:
        return None
    out = Reading(rds[0].request, rds[0].step, rds[0].moment, rds[0].device if len(rds) == 1 else -2, rds[0].t_ns)
    for rd in rds:
        for o, c in rd.classes.items():
            have = out.classes.get(o)
            if have is None:
                out.classes[o] = OwnerClass(c.bytes, c.blocks, c.largest, dict(c.detail))
            else:
                have.bytes += c.bytes
                have.blocks += c.blocks
                have.largest = max(have.largest, c.largest)
    return out


def class_name(owner: schema.Owner, c: OwnerClass | None = None, request: int | None = None) -> str:
    if owner == OW.KV_REQUEST and c is not None and c.detail.get("pool") == "paged":
        return pool_name(c)
    if owner == OW.KV_REQUEST and request is not None:
        return f"KV of request {request}"
    if owner == OW.KV_EARLIER and c is not None:
        reqs = [x for x in c.detail.get("requests", []) if isinstance(x, int)]
        if reqs:
            return f"KV of earlier request{'s' if len(reqs) > 1 else ''} {', '.join(map(str, reqs[:6]))}"
    if owner == OW.GENERATE_OUTPUT and c is not None:
        fields = [str(x)[:40] for x in c.detail.get("fields", []) if isinstance(x, str)]
        if fields:
            return f"generate outputs ({', '.join(fields[:4])})"
    if owner == OW.WORKSPACE and c is not None:
        names = [str(x)[:40] for x in c.detail.get("names", []) if isinstance(x, str)]
        if names:
            return ", ".join(names[:3])
    return NAMES[owner]


def pool_name(c: OwnerClass) -> str:
    """A continuous-batching manager's paged KV pool, named by the requests running on it: it belongs to
    them together (blocks are handed out and reused by request, the pool's bytes never change)."""
    n = c.detail.get("running")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        reqs = c.detail.get("requests")
        n = len(reqs) if isinstance(reqs, list) else -1
    who = f"{n} running request{'' if n == 1 else 's'}" if n >= 0 else "its running requests"
    return f"paged KV pool ({who})"


def describe(rd: Reading, *, of: int | None = None, include_free: bool = False, top: int = 6) -> str:
    """Owner shares of a reading, largest first: "KV of request 3 61%, weights 22%, ..." of ``of``
    bytes (default: the reading's allocated bytes; with ``include_free`` its reserved bytes)."""
    owners = [o for o in rd.classes if include_free or o != OW.INACTIVE]
    total = of if of is not None else sum(rd.classes[o].bytes for o in owners)
    if total <= 0:
        return "nothing allocated"
    parts = []
    for o in sorted(owners, key=lambda k: -rd.classes[k].bytes)[:top]:
        c = rd.classes[o]
        if c.bytes <= 0:
            continue
        share = c.bytes / total
        pct = f"{share:.0%}" if share >= 0.01 else "<1%"
        parts.append(f"{class_name(o, c, rd.request if rd.request >= 0 else None)} {pct} ({format_bytes(c.bytes)})")
    return ", ".join(parts)


# ---- what the user asked generate to keep ------------------------------------------------------

def gen_args(ctx: ReplayContext, request: int) -> dict[str, Any]:
    """The request's recorded generate() arguments (a JSON object; {} when absent or not an object)."""
    cache = ctx.__dict__.setdefault("_gen_args", {})
    if request in cache:
        return cache[request]
    value: Any = {}
    for r in ctx.trace.requests[:]:
        if int(r["request"]) == request:
            try:
                value = json.loads(ctx.trace.text(int(r["gen_args_off"]), int(r["gen_args_len"])) or "{}")
            except (ValueError, RecursionError):
                value = {}
            break
    cache[request] = value if isinstance(value, dict) else {}
    return cache[request]


def effective(ctx: ReplayContext, request: int) -> dict[str, Any]:
    """The settings that keep per-step tensors or widen the batch, as generate resolved them: the
    recorded ``_effective`` (1.5), else the call's arguments, its generation_config and the model's
    generation defaults in that order. Only bool/int values are kept."""
    args = gen_args(ctx, request)
    eff = args.get("_effective")
    out: dict[str, Any] = {}
    sources: list[Any] = [eff] if isinstance(eff, dict) else []
    sources += [args, args.get("generation_config"), ctx.meta.generation_defaults]
    for key in _GEN_KEYS:
        for src in sources:
            v = src.get(key) if isinstance(src, dict) else None
            if isinstance(v, (bool, int)):
                out[key] = v
                break
    return out


def asked_outputs(ctx: ReplayContext, request: int) -> list[str]:
    """The per-step output fields the call asked generate to return ([] when it returns none)."""
    eff = effective(ctx, request)
    if not eff.get("return_dict_in_generate"):
        return []
    return [k.removeprefix("output_") for k in ("output_scores", "output_logits", "output_hidden_states",
                                                 "output_attentions") if eff.get(k)]


def _text_config(ctx: ReplayContext) -> dict[str, Any]:
    cfg = ctx.meta.model_config if isinstance(ctx.meta.model_config, dict) else {}
    text = cfg.get("text_config")
    return text if isinstance(text, dict) and text.get("vocab_size") else cfg


def by_design_bytes(ctx: ReplayContext, req: RequestTimeline, steps: int | None = None) -> tuple[int, list[str]]:
    """(bytes, phrases) the call's requested outputs hold after ``steps`` generated tokens (default:
    all of them): float32 score/logit rows of batch x vocabulary per token each, hidden states of
    (layers + 1) x batch x hidden per token (the prompt's at the first), attentions of layers x batch
    x heads x token length. Batch counts beams and returned sequences (the cache's batch)."""
    asked = asked_outputs(ctx, req.request)
    if not asked:
        return 0, []
    cfg = _text_config(ctx)
    n = req.new_tokens if steps is None else steps
    n = max(int(n), 0)
    eff = effective(ctx, req.request)
    batch = _cache_batch(req) or max(req.batch_size, 1) * max(int(eff.get("num_beams") or 1), 1)
    vocab = _int(cfg.get("vocab_size"))
    hidden = _int(cfg.get("hidden_size"))
    layers = _int(cfg.get("num_hidden_layers"))
    heads = _int(cfg.get("num_attention_heads"))
    item = 2 if str(cfg.get("torch_dtype") or cfg.get("dtype") or "") in ("bfloat16", "float16") else 4
    total, phrases = 0, []
    rows = sum(1 for k in ("scores", "logits") if k in asked)
    if rows and vocab:
        b = rows * batch * vocab * 4 * n
        total += b
        names = " and ".join(f"output_{k}" for k in ("scores", "logits") if k in asked)
        phrases.append(f"{names}: {rows} x {batch} x {vocab:,} float32 per token ({format_bytes(b)})")
    if "hidden_states" in asked and hidden and layers:
        b = (layers + 1) * batch * hidden * item * (n + max(req.prompt_tokens - 1, 0))
        total += b
        phrases.append(f"output_hidden_states: {layers + 1} x {batch} x {hidden:,} per token ({format_bytes(b)})")
    if "attentions" in asked and heads and layers:
        p = max(req.prompt_tokens, 1)
        b = layers * batch * heads * item * (p * p + sum(p + i for i in range(1, n)))
        total += b
        phrases.append(f"output_attentions: {layers} x {batch} x {heads} x tokens per token ({format_bytes(b)})")
    return total, phrases


def _int(v: Any) -> int:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and 0 < v < (1 << 40) else 0


def _cache_batch(req: RequestTimeline) -> int:
    g = req.kv
    if g.empty:
        return 0
    b = g["batch"][g.present]
    return int(b.max()) if b.size else 0
