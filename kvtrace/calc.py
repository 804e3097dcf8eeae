"""Capacity planning: will this model, at this context length, fit on these GPUs, and how many
requests at once? Pure python (no torch): the KV math comes from :mod:`kvtrace.geometry`.

The worksheet follows the usual serving breakdown (weights + fixed overhead + KV cache per request):

* KV per request is exact per layer kind: sliding/chunked layers saturate at their window, MLA layers
  cache the latent, KV-sharing consumers cost nothing, cross-attention holds the encoder tokens.
  Bytes are those of a transformers ``DynamicCache`` in steady decode (a saturated sliding layer's
  storage spans ``window`` tokens), or of a ``StaticCache`` sized to the context with
  ``cache_kind="static"``.
* Tensor parallelism splits KV heads across ranks; with fewer KV heads than ranks each rank keeps one
  head (heads replicated ``tp / kv_heads`` times); an MLA latent (a single head) is replicated on
  every rank. Weights are divided evenly by ``tp`` (replicated norms are ignored).
* ``reserve_fraction`` of each GPU is set aside for the CUDA context, allocator slack and activations.
* Weights are counted in the checkpoint's own dtypes by default (:func:`checkpoint_weight_dtypes`):
  gpt-oss stores its MoE experts in MXFP4 and the rest in bf16, DeepSeek-V3 its linear layers in fp8.

All sizes are bytes; :func:`format_plan` prints binary units (KiB, MiB, GiB).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtrace import geometry as G
from kvtrace import units as _units
from kvtrace.geometry.reviewed import is_reviewed

# Seed 001 alert thresholds: memory utilisation warning/critical, concurrency warning at 80% of max.
UTILIZATION_WARNING = 0.80
UTILIZATION_CRITICAL = 0.90
CONCURRENCY_WARNING = 0.80

# Element sizes the planner understands (bytes). mxfp4: 4-bit values plus one 8-bit scale per block
# of 32 (4.25 bits); int4/fp4 ignore their (group) scales.
KV_DTYPE_BYTES: dict[str, int] = {
    "fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2,
    "fp8": 1, "float8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1,
}
WEIGHT_DTYPE_BYTES: dict[str, float] = {**KV_DTYPE_BYTES, "int4": 0.5, "fp4": 0.5, "mxfp4": 0.53125}
# Parts of the parameter count a checkpoint may store in their own dtype; "default" is the rest
# (embeddings, lm_head, norms, sinks), which quantised checkpoints keep in bf16.
WEIGHT_PARTS = ("default", "attention", "mlp")


def checkpoint_weight_dtypes(config: Mapping[str, Any], preset: str | None = None) -> dict[str, str]:
    """The dtypes a checkpoint stores its weights in, by part (:data:`WEIGHT_PARTS`): the preset's
    when ``preset`` names one, else read from ``config`` (``quantization_config`` of mxfp4 / fp8 /
    4- or 8-bit methods, then ``dtype`` / ``torch_dtype``; bf16 when it says nothing)."""
    if preset is not None:
        from kvtrace import presets

        return {"default": "bf16", **presets.get_preset(preset).weight_dtypes}
    text = G.text_config(config)
    quant = config.get("quantization_config") or text.get("quantization_config") or {}
    if not isinstance(quant, Mapping):
        quant = {}
    method = str(quant.get("quant_method", "")).lower()
    if method == "mxfp4":  # gpt-oss: experts only; attention, router, embeddings stay bf16
        return {"default": "bf16", "mlp": "mxfp4"}
    if method == "fp8":  # DeepSeek-V3 style block fp8 of every linear layer
        return {"default": "bf16", "attention": "fp8", "mlp": "fp8"}
    bits = quant.get("bits")
    if bits in (4, 8):  # GPTQ / AWQ / bitsandbytes-style linear-layer quantisation
        name = "int4" if bits == 4 else "int8"
        return {"default": "bf16", "attention": name, "mlp": name}
    dtype = str(G._get(config, "dtype", "torch_dtype") or G._get(text, "dtype", "torch_dtype")
                or "bfloat16").removeprefix("torch.")
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)
    return {"default": short if short in WEIGHT_DTYPE_BYTES else "bf16"}


def describe_weight_dtypes(dtypes: Mapping[str, str]) -> str:
    """``{"default": "bf16", "mlp": "mxfp4"}`` -> ``"mxfp4 MLP/experts, bf16 rest"``."""
    default = dtypes.get("default", "bf16")
    parts = [f"{dtypes[p]} {'MLP/experts' if p == 'mlp' else p}" for p in ("mlp", "attention")
             if dtypes.get(p, default) != default]
    return ", ".join([*parts, f"{default} rest"]) if parts else default


def _weight_bytes(pc: G.ParamCount, dtypes: Mapping[str, str]) -> float:
    unknown = set(dtypes) - set(WEIGHT_PARTS)
    bad = [d for d in dtypes.values() if d not in WEIGHT_DTYPE_BYTES]
    if unknown or bad:
        raise ValueError(f"weight dtypes: unknown part(s) {sorted(unknown)} or dtype(s) {bad}")
    default = WEIGHT_DTYPE_BYTES[dtypes.get("default", "bf16")]
    size = {p: WEIGHT_DTYPE_BYTES[dtypes[p]] if p in dtypes else default for p in ("attention", "mlp")}
    rest = pc.total - pc.attention - pc.mlp
    return pc.attention * size["attention"] + pc.mlp * size["mlp"] + rest * default


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units (1 KiB = 1024 B), e.g. ``"1.50 GiB"``."""
    return _units.format_bytes(n, precision=2)


def load_config(source: Mapping[str, Any] | str | os.PathLike[str]) -> tuple[dict[str, Any], str]:
    """``(config dict, label)`` from a config dict, a preset name, or a ``config.json`` path (or a
    directory holding one)."""
    if isinstance(source, Mapping):
        d = dict(source)
        return d, str(d.get("_name_or_path") or d.get("model_type") or "config")
    s = os.fspath(source)
    if os.path.isdir(s):
        s = os.path.join(s, "config.json")
    if os.path.isfile(s):
        with open(s, encoding="utf-8") as f:
            d = json.load(f)
        if not isinstance(d, dict):
            raise ValueError(f"{s}: not a JSON object")
        return d, s
    from kvtrace import presets

    try:
        return presets.get_preset(s).config_dict(), presets.get_preset(s).name
    except KeyError:
        raise ValueError(f"{s!r} is neither a config.json path nor a preset "
                         f"({', '.join(presets.list_presets())})") from None


@dataclass(frozen=True)
class CapacityPlan:
    """Result of :func:`plan_capacity`. Byte fields are per GPU unless named ``*_total``."""

    model: str
    model_type: str
    num_layers: int
    layer_kinds: dict[str, int]
    context_len: int
    tp: int
    cache_kind: str
    kv_dtype_bytes: int
    weight_dtype_bytes: float  # average bytes per parameter
    gpu_memory_bytes: int
    reserve_fraction: float
    reserve_bytes: int
    param_count: int
    param_count_exact: bool
    weight_bytes_total: int
    weight_bytes: int
    # per token, one sequence, before any window saturates; by layer kind plus "total"
    kv_bytes_per_token_total: dict[str, int]
    kv_bytes_per_token: dict[str, int]
    mha_equivalent_bytes_per_token_total: int
    kv_heads_per_rank: dict[str, int]  # by layer kind
    kv_replication: int  # ranks holding a copy of each KV head (1 = cleanly split)
    # one request at context_len
    kv_bytes_per_request_total: int
    kv_bytes_per_request: int
    kv_bytes_per_request_by_kind: dict[str, int]
    available_kv_bytes: int  # gpu - reserve - weights (negative: weights alone do not fit)
    batch: int
    kv_bytes_needed: int
    fits: bool
    headroom_bytes: int
    max_concurrent_requests: int
    concurrency_warning_at: int
    memory_utilization: float
    notes: tuple[str, ...] = field(default_factory=tuple)
    weight_dtype: str = ""  # e.g. "mxfp4 MLP/experts, bf16 rest"
    # Hybrid models (kvtrace.geometry.hybrid): the conv / recurrent state every sequence holds,
    # constant in tokens; counted in kv_bytes_needed and max_concurrent_requests beside the KV.
    state_layers: int = 0
    state_bytes_per_sequence_total: int = 0
    state_bytes_per_sequence: int = 0  # per GPU
    state_bytes_by_kind: dict[str, int] = field(default_factory=dict)
    state_dtype_bytes: int = 0  # element size of conv / other states (recurrent states are float32)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["notes"] = list(self.notes)
        if not self.state_layers:  # documents of attention-only models keep their keys
            for key in [k for k in d if k.startswith("state_")]:
                del d[key]
        return d


def _rank_heads(g: G.LayerGeometry, tp: int) -> tuple[int, int]:
    """(KV heads held by one rank, replication factor) for one layer."""
    h = g.num_kv_heads
    if tp == 1 or h == 0:
        return h, 1
    if g.kind == "latent":
        return h, tp  # MLA latent: one shared head, every rank keeps all of it
    if h < tp:
        return 1, tp // h if tp % h == 0 else math.ceil(tp / h)
    return math.ceil(h / tp), 1


def plan_capacity(
    config_dict: Mapping[str, Any] | str | os.PathLike[str],
    *,
    context_len: int,
    gpu_memory_bytes: int,
    tp: int = 1,
    kv_dtype_bytes: int | None = None,
    weight_dtype_bytes: float | None = None,
    weight_dtypes: Mapping[str, str] | None = None,
    batch: int | None = None,
    reserve_fraction: float = 0.1,
    cache_kind: str = "dynamic",
    encoder_len: int | None = None,
    mla_cache: G.MlaCacheMode = "latent",
    state_dtype_bytes: int | None = None,
) -> CapacityPlan:
    """Plan KV/weight memory for ``context_len`` tokens per request on GPUs of ``gpu_memory_bytes``.

    ``config_dict``: a config dict (``config.to_dict()`` / ``config.json`` content), a preset name or a
    ``config.json`` path. ``kv_dtype_bytes``: cache element size (None: 2, bf16/fp16; 1 for fp8).
    ``weight_dtype_bytes``: one size for every weight, may be fractional (0.5 for 4-bit);
    ``weight_dtypes``: dtype names by part (:data:`WEIGHT_PARTS`); neither: the checkpoint's own
    (:func:`checkpoint_weight_dtypes`; a preset's when ``config_dict`` names one). ``batch``: concurrent requests to check
    (None: one; ``max_concurrent_requests`` is computed either way). ``cache_kind``: ``"dynamic"`` or
    ``"static"`` (preallocated to ``context_len``). ``encoder_len``: encoder tokens held by
    cross-attention layers of encoder-decoder models (None: ``context_len``). ``state_dtype_bytes``:
    element size of a hybrid model's conv states (None: the KV's, or 2 when the KV is 1-byte fp8,
    a quantised cache beside bf16 activations); recurrent states are float32.
    """
    cfg, label = load_config(config_dict)
    if context_len < 1:
        raise ValueError("context_len must be >= 1")
    if gpu_memory_bytes <= 0 or tp < 1:
        raise ValueError("gpu_memory_bytes must be > 0 and tp >= 1")
    if not 0 <= reserve_fraction < 1:
        raise ValueError("reserve_fraction must be in [0, 1)")
    if cache_kind not in ("dynamic", "static"):
        raise ValueError("cache_kind must be 'dynamic' or 'static'")
    kv_b = 2 if kv_dtype_bytes is None else int(kv_dtype_bytes)
    if kv_b <= 0 or (weight_dtype_bytes is not None and weight_dtype_bytes <= 0):
        raise ValueError("dtype sizes must be positive")
    n_req = 1 if batch is None else int(batch)
    if n_req < 1:
        raise ValueError("batch must be >= 1")

    geom = G.model_geometry(cfg, mla_cache=mla_cache)
    enc = context_len if encoder_len is None else int(encoder_len)
    notes: list[str] = []
    model_type = str(G.text_config(cfg).get("model_type") or "")
    if model_type and not is_reviewed(model_type):
        notes.append(f"model_type {model_type!r} is newer than the architectures kvtrace's layer rules were "
                     "checked against: the geometry follows the generic rules and is unverified.")

    # KV per token and per request, whole model and per rank
    bpt_total = G.bytes_per_token(geom, kv_b)
    bpt_rank: dict[str, int] = {}
    heads_rank: dict[str, int] = {}
    replication = 1
    req_total = req_rank = 0
    req_by_kind: dict[str, int] = {}
    static_len = context_len if cache_kind == "static" else None
    for g in geom.layers:
        alloc, _ = G.layer_kv_bytes(g, context_len, kv_b, 1, cache_kind, static_len, encoder_len=enc)
        h_rank, rep = _rank_heads(g, tp)
        frac = (h_rank / g.num_kv_heads) if g.num_kv_heads else 0.0
        per_rank = int(round(alloc * frac))
        req_total += alloc
        req_rank += per_rank
        req_by_kind[g.kind] = req_by_kind.get(g.kind, 0) + per_rank
        bpt_rank[g.kind] = bpt_rank.get(g.kind, 0) + int(round(g.elements_per_token * kv_b * frac))
        if g.stores_kv:
            heads_rank[g.kind] = max(heads_rank.get(g.kind, 0), h_rank)
            replication = max(replication, rep)
    bpt_rank["total"] = sum(bpt_rank.values())

    if tp > 1:
        if geom.mla_cache == "latent":
            notes.append(f"MLA latent cache is replicated on all {tp} ranks (one shared latent head).")
        elif replication > 1:
            notes.append(f"fewer KV heads than tp={tp}: each rank keeps 1 KV head, every head is "
                         f"replicated {replication}x across ranks.")
        uneven = {g.num_kv_heads for g in geom.layers if g.stores_kv and g.kind != "latent"
                  and g.num_kv_heads >= tp and g.num_kv_heads % tp}
        if uneven:
            notes.append(f"KV heads {sorted(uneven)} do not divide evenly by tp={tp}; counted as ceil().")
    windows = sorted({g.window for g in geom.layers if g.window and g.stores_kv})
    if windows and context_len > min(windows):
        notes.append(f"windowed layers saturate at {', '.join(map(str, windows))} tokens; "
                     "a prefill longer than the window briefly holds the whole prompt.")
    if any(g.kind == "shared_consumer" for g in geom.layers):
        notes.append("KV-sharing consumer layers reuse their producer's cache (0 bytes).")
    if geom.is_encoder_decoder:
        notes.append(f"cross-attention layers hold {enc} encoder tokens.")

    pc = G.param_count(cfg)
    counted = None if pc.exact else _preset_params(cfg, label)
    if counted is not None:  # a hybrid preset: transformers' own count (kvtrace.presets.Preset.params)
        pc = G.ParamCount(0, 0, 0, 0, 0, counted, True)
    if not pc.exact:
        notes.append("parameter count is a llama-like estimate for this model type.")
    if weight_dtype_bytes is not None:
        w_exact, w_label = pc.total * weight_dtype_bytes, f"{weight_dtype_bytes:g} B"
    else:
        if weight_dtypes is None:
            named = isinstance(config_dict, str) and not os.path.exists(config_dict)
            weight_dtypes = checkpoint_weight_dtypes(cfg, label if named else None)
        w_exact, w_label = _weight_bytes(pc, weight_dtypes), describe_weight_dtypes(weight_dtypes)
    w_total = int(math.ceil(w_exact))
    w_rank = int(math.ceil(w_total / tp))

    state = _state(cfg, kv_b if state_dtype_bytes is None else int(state_dtype_bytes), tp, notes)
    per_seq = req_rank + state["per_rank"]

    reserve = int(gpu_memory_bytes * reserve_fraction)
    available = gpu_memory_bytes - reserve - w_rank
    needed = n_req * per_seq
    fits = available >= needed
    max_conc = available // per_seq if (available > 0 and per_seq > 0) else 0
    if available <= 0:
        notes.append("weights and reserve alone exceed GPU memory.")
    util = (w_rank + reserve + needed) / gpu_memory_bytes
    if util > UTILIZATION_CRITICAL:
        notes.append(f"memory utilisation {util:.0%} is above the {UTILIZATION_CRITICAL:.0%} critical line.")
    elif util > UTILIZATION_WARNING:
        notes.append(f"memory utilisation {util:.0%} is above the {UTILIZATION_WARNING:.0%} warning line.")

    return CapacityPlan(
        model=label,
        model_type=geom.model_type,
        num_layers=geom.num_hidden_layers,
        layer_kinds=geom.kind_counts(),
        context_len=context_len,
        tp=tp,
        cache_kind=cache_kind,
        kv_dtype_bytes=kv_b,
        weight_dtype_bytes=w_exact / pc.total if pc.total else 0.0,
        gpu_memory_bytes=int(gpu_memory_bytes),
        reserve_fraction=reserve_fraction,
        reserve_bytes=reserve,
        param_count=pc.total,
        param_count_exact=pc.exact,
        weight_bytes_total=w_total,
        weight_bytes=w_rank,
        kv_bytes_per_token_total=bpt_total,
        kv_bytes_per_token=bpt_rank,
        mha_equivalent_bytes_per_token_total=G.mha_equivalent_bytes_per_token(geom, kv_b),
        kv_heads_per_rank=heads_rank,
        kv_replication=replication,
        kv_bytes_per_request_total=req_total,
        kv_bytes_per_request=req_rank,
        kv_bytes_per_request_by_kind=req_by_kind,
        available_kv_bytes=available,
        batch=n_req,
        kv_bytes_needed=needed,
        fits=fits,
        headroom_bytes=available - needed,
        max_concurrent_requests=int(max_conc),
        concurrency_warning_at=int(math.floor(max_conc * CONCURRENCY_WARNING)),
        memory_utilization=util,
        notes=tuple(notes),
        weight_dtype=w_label,
        state_layers=state["layers"],
        state_bytes_per_sequence_total=state["total"],
        state_bytes_per_sequence=state["per_rank"],
        state_bytes_by_kind=state["by_kind"],
        state_dtype_bytes=state["dtype_bytes"],
    )


def _preset_params(cfg: Mapping[str, Any], label: str) -> int | None:
    """The parameter count a preset states for itself (hybrid models, counted by transformers), when
    ``cfg`` is that preset's config (same model type, width and depth), else None."""
    from kvtrace import presets

    try:
        p = presets.get_preset(label)
    except KeyError:
        return None
    mine = p.config_dict()
    same = all(G.text_config(cfg).get(k) == mine.get(k) for k in ("model_type", "hidden_size", "num_hidden_layers"))
    return p.params if same else None


def _state(cfg: Mapping[str, Any], dtype_bytes: int, tp: int, notes: list[str]) -> dict[str, Any]:
    """The per-sequence state of a hybrid model (kvtrace.geometry.hybrid): layers, bytes for the
    whole model and per rank, bytes by kind; zeros for attention-only models. A state layout the
    geometry does not model is a note, not a guess."""
    from kvtrace.geometry.hybrid import state_geometry

    none = {"layers": 0, "total": 0, "per_rank": 0, "by_kind": {}, "dtype_bytes": 0}
    try:
        sg = state_geometry(cfg)
    except ValueError as exc:
        notes.append(f"recurrent/conv state not counted: {exc}.")
        return none
    if sg is None:
        return none
    size = dtype_bytes if dtype_bytes >= 2 else 2  # an fp8 KV cache does not make activations fp8
    total = sg.bytes_per_sequence(size)
    kinds = sg.by_kind(size)
    f32 = " (recurrent states in float32)" if "recurrent" in kinds else ""
    notes.append(f"{len(sg.layers)} {sg.mixer.replace('_', ' ')} layers hold {format_bytes(total)} of state per "
                 f"sequence, whatever its length{f32}; counted per concurrent sequence beside the KV.")
    if tp > 1:
        notes.append(f"state split evenly across the tp={tp} ranks (its heads shard like attention heads).")
    return {"layers": len(sg.layers), "total": total, "per_rank": int(math.ceil(total / tp)),
            "by_kind": kinds, "dtype_bytes": size}


def format_plan(plan: CapacityPlan) -> str:
    """A human-readable worksheet of ``plan`` in binary units."""
    fb = format_bytes
    kinds = ", ".join(f"{n} {k}" for k, n in plan.layer_kinds.items())
    per_gpu = " per GPU" if plan.tp > 1 else ""
    lines = [
        f"kvtrace capacity plan: {plan.model} ({plan.model_type}), sizes in binary units (1 GiB = 2^30 B)",
        f"  layers            {plan.num_layers} ({kinds})",
        f"  context           {plan.context_len:,} tokens/request, {plan.cache_kind} cache, "
        f"KV {plan.kv_dtype_bytes} B/element, tp={plan.tp}",
        f"  weights           {plan.param_count:,} params{'' if plan.param_count_exact else ' (estimate)'} in "
        f"{plan.weight_dtype} ({plan.weight_dtype_bytes:.3g} B/param) = {fb(plan.weight_bytes_total)}; "
        f"{fb(plan.weight_bytes)}{per_gpu}",
        "  KV per token      " + ", ".join(
            f"{k} {fb(v)}" for k, v in plan.kv_bytes_per_token_total.items() if k != "total")
        + f"; total {fb(plan.kv_bytes_per_token_total['total'])}"
        + (f" ({fb(plan.kv_bytes_per_token['total'])}{per_gpu})" if plan.tp > 1 else ""),
    ]
    mha = plan.mha_equivalent_bytes_per_token_total
    if mha and mha != plan.kv_bytes_per_token_total["total"]:
        lines.append(f"  vs plain MHA      {fb(mha)}/token: this layout stores "
                     f"{plan.kv_bytes_per_token_total['total'] / mha:.1%} of it")
    lines += [
        f"  KV per request    {fb(plan.kv_bytes_per_request_total)} at {plan.context_len:,} tokens"
        + (f"; {fb(plan.kv_bytes_per_request)}{per_gpu}" if plan.tp > 1 else "")
        + " (" + ", ".join(f"{k} {fb(v)}" for k, v in plan.kv_bytes_per_request_by_kind.items()) + ")",
    ]
    if plan.state_layers:
        lines.append(
            f"  state per request {fb(plan.state_bytes_per_sequence_total)} in {plan.state_layers} layers, constant in tokens"
            + (f"; {fb(plan.state_bytes_per_sequence)}{per_gpu}" if plan.tp > 1 else "")
            + " (" + ", ".join(f"{k} {fb(v)}" for k, v in plan.state_bytes_by_kind.items()) + ")")
    per_request = "KV + state each; " if plan.state_layers else ""
    lines += [
        f"  GPU memory        {fb(plan.gpu_memory_bytes)}{per_gpu}, reserve {plan.reserve_fraction:.0%} = "
        f"{fb(plan.reserve_bytes)}",
        f"  available for KV  {fb(plan.available_kv_bytes)}{per_gpu}",
        f"  {plan.batch:>3} request(s)    need {fb(plan.kv_bytes_needed)}{per_gpu}: "
        f"{'FITS' if plan.fits else 'DOES NOT FIT'}, headroom {fb(plan.headroom_bytes)}",
        f"  max concurrent    {plan.max_concurrent_requests:,} requests at {plan.context_len:,} tokens "
        f"({per_request}warn at {plan.concurrency_warning_at:,}); utilisation {plan.memory_utilization:.0%}",
    ]
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)
