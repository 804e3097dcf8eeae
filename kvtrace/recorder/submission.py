"""Content sampling on the model's thread: which K/V/latent tensors of a sampled step go to the
:class:`~kvtrace.recorder.sampling.PayloadSampler` (whole, or only the tokens no earlier sample
holds), and the sampled queries from :class:`~kvtrace.recorder.qcapture.QueryCapture`.

Owns the sampler, the settings and the query capture (with the attention implementation it changed,
restored to the exact original value at close). Per request it keeps only what
:class:`~kvtrace.recorder.context.RequestState` holds (``sampled_until``, ``whole_samples``), so a
serving recorder submits per request exactly the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvtrace.format.schema import LayerType, PayloadKind
from kvtrace.recorder import hooks as _hooks
from kvtrace.recorder.context import RequestState, SessionContext
from kvtrace.recorder.layouts import LayerReading, cache_parts, is_offloading, valid_kv, wait_for_offload
from kvtrace.recorder.sampling import token_axis, unsampled_tokens


class SampleSubmission:
    def __init__(self, model: torch.nn.Module, ctx: SessionContext, settings: Any) -> None:
        self.model = model
        self.ctx = ctx
        self.settings = settings  # SamplingSettings, or None: no sampling
        self.sampler: Any = None  # PayloadSampler while open
        self.qcapture: Any = None  # QueryCapture while open (queries sampled)
        self._dropped_reported = 0
        self._attn_before = _attn_snapshot(model)
        # layer -> query heads per KV head, when the capture could not see the key (set by the steps part)
        self.group_of: Callable[[int], int | None] = lambda layer: None

    def start(self) -> None:
        """Start the sampler (and the query capture) on the session's writer."""
        if self.settings is None:
            return
        from kvtrace.recorder.sampling import PayloadSampler

        self.sampler = PayloadSampler(self.ctx.writer, self.settings)
        if self.settings.queries:
            from kvtrace.recorder.qcapture import QueryCapture

            self.qcapture = QueryCapture(self.model, self.on_query, modules=decoder_self_attention(self.model))
            self.qcapture.install()

    def restore_model(self) -> None:
        """Undo the query capture and any attention implementation change. Never raises."""
        if self.qcapture is not None:
            try:
                self.qcapture.restore()
            except Exception as exc:  # noqa: BLE001
                self.ctx.error("restore-attention", exc)
        for cfg, before in self._attn_before:
            try:
                if getattr(cfg, "_attn_implementation", None) != before:
                    cfg._attn_implementation = before
            except Exception as exc:  # noqa: BLE001
                self.ctx.error("restore-attention", exc)

    def close(self) -> None:
        if self.sampler is not None:
            try:
                self.sampler.close()
            except Exception as exc:  # noqa: BLE001
                self.ctx.error("sampler-close", exc)
            self.report_dropped()

    def wants(self, req: RequestState, step: int) -> bool:
        return self.sampler is not None and bool(
            self.sampler.wants(step, is_prefill=step == 0, is_last=step == req.expected_last))

    def report_dropped(self) -> None:
        """Samples dropped since the last report, to the observers."""
        sampler = self.sampler
        if sampler is None or not self.ctx.observers:
            return
        dropped = int(sampler.dropped)
        if dropped > self._dropped_reported:
            self.ctx.observers.notify("on_dropped_samples", dropped - self._dropped_reported)
            self._dropped_reported = dropped

    def sample(self, req: RequestState, step: int, cache: Any, readings: list[LayerReading]) -> None:
        offloaded = is_offloading(cache)
        if offloaded:
            wait_for_offload(cache)
        parts = dict(cache_parts(cache))
        with self.sampler.batch():  # one side-stream context and one event for the whole step
            self._submit_layers(req, step, cache, readings, parts, offloaded)

    def _submit_layers(self, req: RequestState, step: int, cache: Any, readings: list[LayerReading],
                       parts: dict, offloaded: bool) -> None:
        settings = self.settings
        for r in readings:
            if settings.layers is not None and r.layer not in settings.layers:
                continue
            if r.layer_type == LayerType.SHARED_CONSUMER:
                continue  # its producer's tensors are sampled under the producer's index
            k, v, start = valid_kv(cache, r)
            if k is None:
                continue
            # Dynamic layers replace their tensors (torch.cat) instead of writing into them, so the
            # copy may overlap later kernels; every other layout keeps the sampler's safe default
            # (the main stream waits for the copy): static, offloaded, quantized.
            mutable = False if not offloaded and _never_in_place(parts.get(r.part), r.cache_index) else None
            if r.layer_type == LayerType.LATENT:
                kinds = (PayloadKind.LATENT, PayloadKind.ROPE_KEY) if settings.latents else ()
            else:
                kinds = (PayloadKind.KEY, PayloadKind.VALUE)
            whole = settings.tokens == "all" or r.layer_type in _SAMPLED_WHOLE
            for kind, tensor in zip(kinds, (k, v), strict=False):
                self._submit_tokens(req, step, r.layer, kind, tensor, start, mutable, whole=whole)
            k = v = tensor = None  # no cache tensor outlives this call

    def _submit_tokens(self, req: RequestState, step: int, layer: int, kind: PayloadKind, tensor: torch.Tensor,
                       start: int, mutable: bool | None, *, whole: bool) -> None:
        """Submit one layer's K, V or latent: whole, or (incremental sampling) only the tokens no
        earlier sample of this (request, layer, kind) holds."""
        key = (layer, int(kind))
        axis = token_axis(tensor)
        end = start + tensor.shape[axis] if axis is not None else None
        until = req.sampled_until.get(key)
        if until is not None and end is not None and end < until:
            req.whole_samples = True  # the cache shrank (cropped): positions may be rewritten
        if not (whole or req.whole_samples):
            tensor, start = unsampled_tokens(tensor, start, until)
            if tensor is None:
                return  # nothing new since the last sample
        if self.sampler.submit(req.id, step, layer, kind, tensor, token_start=start, mutable=mutable) \
                and end is not None:
            req.sampled_until[key] = end  # a dropped sample is retried at the next sampling step

    def on_query(self, layer_idx: int, query: torch.Tensor) -> None:
        try:
            req = self.ctx.active
            if req is None or not req.sample_now or self.sampler is None:
                return
            if self.settings.layers is not None and layer_idx not in self.settings.layers:
                return
            group = self.qcapture.group_sizes.get(layer_idx) if self.qcapture is not None else None
            if group is None:  # the capture could not see the key: derive it from the geometry
                group = self.group_of(int(layer_idx))
            self.sampler.submit(req.id, req.step, int(layer_idx), PayloadKind.QUERY, query,
                                token_start=req.step_position, group_size=group)
        except Exception as exc:  # noqa: BLE001
            self.ctx.error("query-capture", exc)


def _dynamic_layer_types() -> tuple[type, ...]:
    try:
        from transformers import cache_utils
    except ImportError:  # pragma: no cover
        return ()
    return tuple(t for t in (getattr(cache_utils, n, None) for n in ("DynamicLayer", "DynamicSlidingWindowLayer"))
                 if isinstance(t, type))


_NEVER_IN_PLACE = _dynamic_layer_types()


def _never_in_place(sub: Any, index: int) -> bool:
    """The layer is exactly a DynamicLayer / DynamicSlidingWindowLayer (subclasses such as the
    quantized layers may keep buffers they write into)."""
    layers = getattr(sub, "layers", None)
    if layers is None or not 0 <= index < len(layers):
        return False
    return type(layers[index]) in _NEVER_IN_PLACE


# Layouts whose cached values change after they are written: never sampled incrementally.
_SAMPLED_WHOLE = frozenset({LayerType.QUANTIZED, LayerType.UNKNOWN})


def decoder_self_attention(model: torch.nn.Module) -> list[torch.nn.Module] | None:
    """For an encoder-decoder model, the decoder's self-attention modules (the ones whose queries
    pair with the self-attention cache); None (every ``layer_idx`` module) for decoder-only models.

    Encoder modules are excluded through ``get_encoder()``. Cross-attention attends to every
    encoder position, so it is never causal: decoder self-attention modules are the causal ones.
    Where modules do not say (no ``is_causal``), the first attention module of each layer is
    taken, the order every transformers decoder layer uses (self-attention, then cross)."""
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return None
    encoder_ids: set[int] = set()
    get_encoder = getattr(model, "get_encoder", None)
    if callable(get_encoder):
        try:
            encoder = get_encoder()
        except Exception:  # noqa: BLE001
            encoder = None
        if isinstance(encoder, torch.nn.Module):
            encoder_ids = {id(m) for m in encoder.modules()}
    named = [(n, m) for n, m in _hooks.layer_modules(model) if id(m) not in encoder_ids]
    # innermost layer_idx modules only: a decoder block may carry layer_idx too
    leaves = [m for n, m in named if not any(o.startswith(n + ".") for o, _ in named)]
    wanted = {m.layer_idx for m in leaves}
    causal = [m for m in leaves if getattr(m, "is_causal", None) is True]
    if causal and {m.layer_idx for m in causal} == wanted:
        return causal
    first: dict[int, torch.nn.Module] = {}
    for m in leaves:
        first.setdefault(m.layer_idx, m)
    return list(first.values())


def _attn_snapshot(model: torch.nn.Module) -> list[tuple[Any, Any]]:
    """(config, _attn_implementation) of every distinct config the model's modules carry."""
    out, seen = [], set()
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is None or id(cfg) in seen or not hasattr(cfg, "_attn_implementation"):
            continue
        seen.add(id(cfg))
        try:
            out.append((cfg, cfg._attn_implementation))
        except Exception:  # noqa: BLE001
            continue
    return out
