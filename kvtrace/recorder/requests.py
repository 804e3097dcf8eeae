"""The request part of the recorder: the ``model.generate`` wrapper (one request per call), and
each request's begin (its /requests row, BASELINE reading, prompt hash), finish (the last step's
structure, AFTER_RETURN/PEAK/RECORDER_OWN readings, EOS, outcome) and abort (OOM with its
allocator state, interrupt, exception). The retention verdict it defers is
:class:`~kvtrace.recorder.verdict.RetentionVerdict`.

Owns the request counter, the prompt-hash salt and the generate patch. What a serving recorder
(continuous batching) reuses: :meth:`Requests.begin`-style rows keyed by request id
(``RequestRow``, ``ctx.event``), the abort classification (:data:`OOM_ERRORS`, outcome and events),
the verdict per finished request, and :class:`~kvtrace.recorder.context.RequestState` per request;
it replaces only the entry point (``patch_generate``) with the scheduler's add/finish calls and
keeps several RequestStates in flight instead of ``ctx.active``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from kvtrace.format.schema import EventKind, Outcome, ReadingLabel
from kvtrace.format.writer import monotonic_ns
from kvtrace.memory_errors import is_host_oom, named_gpu, requested_bytes
from kvtrace.recorder.context import MAX_ERROR_TEXT, RequestState, SessionContext
from kvtrace.recorder.readings import MemoryReadings
from kvtrace.recorder.rows import RequestRow
from kvtrace.recorder.steps import StepRecorder
from kvtrace.recorder.submission import SampleSubmission
from kvtrace.recorder.verdict import RetentionVerdict

OOM_ERRORS: tuple[type[BaseException], ...] = tuple(
    {getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)} - {None}
)


class Requests:
    def __init__(self, model: torch.nn.Module, ctx: SessionContext, salt: bytes, readings: MemoryReadings,
                 steps: StepRecorder, submission: SampleSubmission, verdict: RetentionVerdict) -> None:
        self.model = model
        self.ctx = ctx
        self.salt = salt
        self.readings = readings
        self.steps = steps
        self.submission = submission
        self.verdict = verdict
        self.count = 0  # requests begun so far (the next request's id)
        self.owners: Any = None  # kvtrace.recorder.owners.OwnerRecorder, set by the session
        self.closed = False  # set by the session as it closes: later generate calls pass through
        self._generate_patch: tuple[bool, Any] | None = None

    def patch_generate(self) -> None:
        model = self.model
        had_own = "generate" in model.__dict__
        original = model.generate
        self._generate_patch = (had_own, model.__dict__.get("generate"))
        requests, ctx = self, self.ctx

        def generate(*args: Any, **kwargs: Any) -> Any:
            if ctx.active is not None or requests.closed or kwargs.get("cache_implementation") == "paged":
                # re-entrant call, closed session, or transformers' switch to continuous batching
                # (recorded request by request by recorder.serving): pass through
                return original(*args, **kwargs)
            req = requests.begin(args, kwargs)
            if req is None:
                return original(*args, **kwargs)
            try:
                out = original(*args, **kwargs)
            except BaseException as exc:
                requests.abort(req, exc)
                raise
            requests.finish(req, out, args, kwargs)
            return out

        generate.__wrapped__ = original  # type: ignore[attr-defined]
        generate.__doc__ = getattr(original, "__doc__", None)
        model.__dict__["generate"] = generate

    def unpatch_generate(self) -> None:
        if self._generate_patch is None:
            return
        had_own, previous = self._generate_patch
        if had_own:
            self.model.__dict__["generate"] = previous
        else:
            self.model.__dict__.pop("generate", None)
        self._generate_patch = None

    # ---- one request ----------------------------------------------------------------------------

    def begin(self, args: tuple, kwargs: dict) -> RequestState | None:
        self.verdict.check("next request")
        try:
            return self._begin_unguarded(args, kwargs)
        except Exception as exc:  # noqa: BLE001 - the user's generate runs regardless
            self.ctx.error("request-start", exc)
            return None

    def _begin_unguarded(self, args: tuple, kwargs: dict) -> RequestState:
        w = self.ctx.writer
        assert w is not None
        rid = self.count
        ids, embeds = _prompt_inputs(args, kwargs)
        batch, prompt_len, digest = 0, 0, b""
        if ids is not None:
            batch, prompt_len = int(ids.shape[0]), int(ids.shape[-1])
            raw = ids.detach().to("cpu", torch.int64).contiguous().numpy().astype("<i8").tobytes()
            digest = hashlib.sha256(self.salt + raw).hexdigest().encode()
        elif embeds is not None:
            batch, prompt_len = int(embeds.shape[0]), int(embeds.shape[1])
        text_ref = (0, 0)
        if self.ctx.options.store_prompts and ids is not None:
            text_ref = w.add_text(self._prompt_text(ids))
        gen_args = _jsonable_kwargs(kwargs)
        effective = effective_settings(self.model, kwargs)
        gen_args["_effective"] = effective  # format 1.5: what makes generate keep per-step tensors
        gen_ref = w.add_text(json.dumps(gen_args, sort_keys=True, default=str))
        self.readings.write(rid, ReadingLabel.BASELINE)
        if self.ctx.options.reset_peak:
            self.readings.reset_peak()
        start = monotonic_ns()
        w.begin_request(RequestRow(rid, int(Outcome.RUNNING), batch, prompt_len, 0, -1, start, 0, digest,
                                   *text_ref, *gen_ref))
        self.ctx.event(EventKind.REQUEST_START, rid, t=start)
        self.count += 1
        is_encdec = bool(getattr(getattr(self.model, "config", None), "is_encoder_decoder", False))
        dec = kwargs.get("decoder_input_ids")
        dec_len = int(dec.shape[-1]) if isinstance(dec, torch.Tensor) else (1 if is_encdec else 0)
        max_new = _max_new_tokens(self.model, kwargs, prompt_len if not is_encdec else dec_len)
        req = RequestState(rid, start, 0 if is_encdec or ids is None else prompt_len, dec_len,
                           (max_new - 1) if max_new else -1)
        req.whole_samples = _rewrites_cache(self.model, kwargs)
        if self.ctx.options.retention:
            self.verdict.tracker.begin()
        if self.owners is not None:
            self.owners.begin(rid, effective, prompt_len)
        self.ctx.observers.notify("on_request_start", rid)
        self.ctx.active = req
        return req

    def finish(self, req: RequestState, out: Any, args: tuple, kwargs: dict) -> None:
        self.ctx.active = None
        new_tokens = req.step
        try:
            new_tokens = self._finish_unguarded(req, out, kwargs)
        except Exception as exc:  # noqa: BLE001
            self.ctx.error("request-end", exc)
            self.ctx.safe_update(req.id, outcome=int(Outcome.OK), end_ns=monotonic_ns())
        self.ctx.observers.notify("on_request_end", "ok", new_tokens=new_tokens)

    def _finish_unguarded(self, req: RequestState, out: Any, kwargs: dict) -> int:
        w = self.ctx.writer
        assert w is not None
        rid = req.id
        self.steps.final_structure(req)
        if self.submission.sampler is not None:
            # Its staged copies must not be what keeps device memory busy below; their encoding and
            # writing finish in the background (close() joins them), off the caller's path.
            self.submission.sampler.wait_copies()
        self.ctx.event(EventKind.GENERATE_RETURN, rid, step=req.step)
        self.readings.write(rid, ReadingLabel.AFTER_RETURN)
        if self.ctx.options.reset_peak and self.readings.devices:
            self.readings.write_peak(rid)
        if self.ctx.options.empty_cache:  # the full measurement, asked for
            self.verdict.collect(rid)
            self.verdict.empty_cache(rid)
        if self.owners is not None:  # the output's tensors, by identity, for the owner readings
            self.owners.finish(req, out)
        if self.ctx.options.retention:  # the verdict waits until the caller could drop the output
            self.verdict.observe_output(out)
            self.verdict.defer(rid, req.last_cache)
        if self.submission.sampler is not None:
            self.readings.write_recorder_own(rid, self.submission.sampler.own_device_bytes_on)
            self.submission.report_dropped()
        new_tokens, eos_step = _generated(out, req, kwargs, self.model)
        if eos_step >= 0:
            t_eos = req.step_t[eos_step] if eos_step < len(req.step_t) else monotonic_ns()
            self.ctx.event(EventKind.EOS, rid, step=eos_step, t=t_eos)
        self.ctx.report_request_errors(req)
        end = monotonic_ns()
        w.update_request(rid, outcome=int(Outcome.OK), end_ns=end, new_tokens=new_tokens, eos_step=eos_step)
        self.ctx.event(EventKind.REQUEST_END, rid, value=int(Outcome.OK), t=end)
        w.flush_soon()  # the flusher writes it within milliseconds, off the caller's thread
        return new_tokens

    def abort(self, req: RequestState, exc: BaseException) -> None:
        """generate raised: record why, with the allocator state for an OOM; never raises."""
        self.ctx.active = None
        outcome = Outcome.ERROR
        try:
            w = self.ctx.writer
            assert w is not None
            rid = req.id
            summary = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_TEXT]
            try:  # the failing step's structure: what the traceback holds, and what retention tracks
                self.steps.final_structure(req)
            except Exception as inner:  # noqa: BLE001
                self.ctx.error("request-abort-structure", inner)
            if isinstance(exc, OOM_ERRORS) or is_host_oom(exc):  # host OOMs too (one rule, memory_errors)
                outcome = Outcome.OOM
                device, note = oom_device(exc, self.readings.devices)
                want = requested_bytes(str(exc))
                self.ctx.event(EventKind.OOM, rid, step=req.step, device=device,
                               value=-1 if want is None else want, text=summary)
                if note:
                    self.ctx.event(EventKind.NOTE, rid, step=req.step, device=device, text=note)
                self.readings.write(rid, ReadingLabel.AT_OOM)
                if self.owners is not None:  # who filled the device, while the failing frames hold it
                    self.owners.at_oom(req)
            elif isinstance(exc, KeyboardInterrupt):
                outcome = Outcome.INTERRUPTED
                self.ctx.event(EventKind.INTERRUPT, rid, step=req.step)
            else:
                outcome = Outcome.ERROR
                self.ctx.event(EventKind.EXCEPTION, rid, step=req.step, text=summary)
            if self.ctx.options.retention:
                # Checked like any request: the exception's traceback holds the cache while it
                # propagates; whether the caller keeps it is known when it could have dropped it.
                self.verdict.defer(rid, req.last_cache, outcome=int(outcome), exc_id=id(exc))
            self.ctx.report_request_errors(req)
            err = w.add_text(summary)
            end = monotonic_ns()
            w.update_request(rid, outcome=int(outcome), end_ns=end, new_tokens=req.step,
                             error_off=err[0], error_len=err[1])
            self.ctx.event(EventKind.REQUEST_END, rid, value=int(outcome), t=end)
            w.flush()
        except Exception as inner:  # noqa: BLE001 - never mask the user's exception
            self.ctx.error("request-abort", inner)
        self.ctx.observers.notify("on_request_end", outcome.name.lower(), new_tokens=req.step)

    def _prompt_text(self, ids: torch.Tensor) -> str:
        tok = self.ctx.options.tokenizer
        rows = ids.detach().cpu().tolist()
        if tok is not None:
            try:
                return "\n".join(tok.decode(r, skip_special_tokens=False) for r in rows)
            except Exception as exc:  # noqa: BLE001
                self.ctx.error("prompt-decode", exc)
        return "\n".join("token ids: " + " ".join(map(str, r)) for r in rows)


def oom_device(exc: BaseException, devices: list[int]) -> tuple[int, str]:
    """(device, note) of an OOM event: -1 for a host allocation failure; else the device torch's
    message names (a model spread over GPUs runs out on any of them); else the model's first
    device, with a note saying the error named none ("" when nothing needs saying)."""
    if not isinstance(exc, OOM_ERRORS) and is_host_oom(exc):
        return -1, ""
    named = named_gpu(str(exc))
    if named is not None:
        return named, ""
    if not devices:
        return -1, ""
    return devices[0], (f"oom: the error names no device; stamped on device {devices[0]}, the model's first "
                        f"(the model is on {', '.join(map(str, devices))})")


def _rewrites_cache(model: Any, kwargs: dict) -> bool:
    """Does this generate call rewrite cached tokens (beams reorder the cache; assisted and
    prompt-lookup decoding crop rejected tokens)? Then samples hold every kept token."""
    if kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens"):
        return True
    beams = _gen_setting(model, kwargs, "num_beams")
    return isinstance(beams, int) and beams > 1


def _prompt_inputs(args: tuple, kwargs: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    ids = kwargs.get("input_ids")
    if ids is None:
        ids = kwargs.get("inputs")
    if ids is None and args and isinstance(args[0], torch.Tensor):
        ids = args[0]
    if isinstance(ids, torch.Tensor) and ids.dim() == 1:
        ids = ids.unsqueeze(0)
    embeds = kwargs.get("inputs_embeds")
    return (ids if isinstance(ids, torch.Tensor) and not ids.is_floating_point() else None,
            embeds if isinstance(embeds, torch.Tensor) else None)


_JSON_SCALARS = (bool, int, float, str, type(None))


def _jsonable(value: Any) -> bool:
    if isinstance(value, _JSON_SCALARS):
        return True
    if isinstance(value, (list, tuple)):
        return all(_jsonable(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _jsonable(v) for k, v in value.items())
    return False


def _jsonable_kwargs(kwargs: dict) -> dict[str, Any]:
    """generate() kwargs that are plain JSON values; a GenerationConfig as its diff dict; the names
    of everything else (tensors, streamers, callables) under "_omitted"."""
    out: dict[str, Any] = {}
    omitted = []
    for k, v in kwargs.items():
        if _jsonable(v):
            out[k] = v
        elif k == "generation_config" and hasattr(v, "to_diff_dict"):
            try:
                out[k] = json.loads(json.dumps(v.to_diff_dict(), default=str))
            except Exception:  # noqa: BLE001
                omitted.append(k)
        else:
            omitted.append(k)
    if omitted:
        out["_omitted"] = sorted(omitted)
    return out


# generate settings that keep per-step tensors or widen the batch (by-design growth, spec §4.1)
EFFECTIVE = ("return_dict_in_generate", "output_scores", "output_logits", "output_hidden_states",
             "output_attentions", "num_beams", "num_return_sequences")


def effective_settings(model: Any, kwargs: dict) -> dict[str, Any]:
    """The EFFECTIVE settings as generate resolves them (call keyword, its generation_config, the
    model's defaults), as JSON values; a setting none of them names is left out."""
    out: dict[str, Any] = {}
    for name in EFFECTIVE:
        try:
            v = _gen_setting(model, kwargs, name)
        except Exception:  # noqa: BLE001, S112 - a config that cannot say is left out
            continue
        if isinstance(v, bool) or (isinstance(v, int) and not isinstance(v, bool)):
            out[name] = v
    return out


def _gen_setting(model: Any, kwargs: dict, name: str) -> Any:
    if kwargs.get(name) is not None:
        return kwargs[name]
    for cfg in (kwargs.get("generation_config"), getattr(model, "generation_config", None)):
        v = getattr(cfg, name, None)
        if v is not None:
            return v
    return None


def _max_new_tokens(model: Any, kwargs: dict, start_len: int) -> int | None:
    n = _gen_setting(model, kwargs, "max_new_tokens")
    if n is not None:
        return int(n)
    max_len = _gen_setting(model, kwargs, "max_length")
    if max_len is not None:
        return max(int(max_len) - start_len, 0)
    return None


def _eos_ids(model: Any, kwargs: dict) -> set[int]:
    eos = _gen_setting(model, kwargs, "eos_token_id")
    if eos is None:
        return set()
    if isinstance(eos, torch.Tensor):
        eos = eos.flatten().tolist()
    if isinstance(eos, int):
        eos = [eos]
    return {int(e) for e in eos}


def _generated(out: Any, req: RequestState, kwargs: dict, model: Any) -> tuple[int, int]:
    """(new tokens, step that produced the first EOS in any sequence or -1) from generate's output."""
    seqs = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
    if not isinstance(seqs, torch.Tensor) or seqs.dim() != 2:
        return req.step, -1
    start = req.decoder_start_len if req.decoder_start_len else req.prompt_len
    new = seqs[:, start:]
    eos = _eos_ids(model, kwargs)
    eos_step = -1
    if eos and new.numel():
        hits = torch.isin(new, torch.tensor(sorted(eos), device=new.device)).any(dim=0).nonzero()
        if hits.numel():
            eos_step = int(hits[0, 0])
    return int(new.shape[1]), eos_step
