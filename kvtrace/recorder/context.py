"""What the recorder's parts share: the trace being written, the request in flight, the live
observers and the error count.

The recorder is a few parts, each owning its state (see :mod:`kvtrace.recorder.session` for the
wiring): :mod:`~kvtrace.recorder.requests` (the generate wrapper, request begin/finish/abort, the
retention verdict), :mod:`~kvtrace.recorder.steps` (hooks, fast path, structure reads),
:mod:`~kvtrace.recorder.submission` (content sampling and query capture),
:mod:`~kvtrace.recorder.readings` (telemetry and labelled memory readings) and
:mod:`~kvtrace.recorder.observers` (live listeners). They meet only here: a part never reaches into
another part's state except through the few methods the session hands it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvtrace.format.schema import EventKind
from kvtrace.format.writer import TraceWriter, monotonic_ns
from kvtrace.recorder.layouts import FastPlan
from kvtrace.recorder.observers import Observers
from kvtrace.recorder.options import RecordOptions
from kvtrace.recorder.rows import EventRow

MAX_ERROR_TEXT = 500


@dataclass
class RequestState:
    """One request (one generate call) while it runs: what the step hooks and the request end need."""

    id: int
    start_ns: int
    prompt_len: int
    decoder_start_len: int
    expected_last: int  # step index of the last forward if no EOS comes first (-1 unknown)
    step: int = 0
    tokens_seen: int = 0
    fed: int = 0  # tokens fed to the model so far (cache length before the request + inputs)
    step_position: int = 0  # position of the current forward's first token (for sampled queries)
    sample_now: bool = False
    step_t: list[int] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    last_cache: Any = None  # weakref.ref to the Cache of the last finished step
    plan: FastPlan | None = None  # the per-step fast path for that Cache, when it qualifies
    layer_refs: list | None = None  # weakref.ref to each of its layers (for the death read)
    recorded: int = -1  # last step whose structure was read (or tried: a failure is not retried)
    final: tuple | None = None  # structure of the last step, read as its Cache died
    # Incremental sampling (SamplingSettings.tokens == "new"): per (layer, payload kind) the end
    # position of what earlier samples hold. whole_samples: this request rewrites cached tokens
    # (beam search, assisted decoding, a cache that shrank), so every sample holds every kept token.
    sampled_until: dict[tuple[int, int], int] = field(default_factory=dict)
    whole_samples: bool = False


class SessionContext:
    """The shared state of one session. ``writer`` is set once the trace is open; ``active`` is the
    request in flight (set and cleared by the requests part only)."""

    def __init__(self, options: RecordOptions) -> None:
        self.options = options
        self.writer: TraceWriter | None = None
        self.active: RequestState | None = None
        self.errors: Counter = Counter()
        self.observers = Observers(self.error)

    def event(self, kind: EventKind, request: int = -1, *, step: int = -1, layer: int = -1,
              device: int = -1, value: int = 0, text: str = "", t: int | None = None) -> None:
        w = self.writer
        if w is None or w.closed:
            return
        off, length = w.add_text(text) if text else (0, 0)
        w.append("events", EventRow(monotonic_ns() if t is None else t, int(kind), request, step, layer,
                                    device, value, off, length))

    def error(self, site: str, exc: BaseException) -> None:
        """A recorder failure: counted, reported once per request as RECORDER_ERROR, swallowed."""
        summary = f"{site}: {type(exc).__name__}: {exc}"[:MAX_ERROR_TEXT]
        self.errors[summary] += 1
        req = self.active
        rid = req.id if req is not None else -1
        first = True
        if req is not None:
            req.errors[summary] += 1
            first = req.errors[summary] == 1
        if first:
            self.event(EventKind.RECORDER_ERROR, rid, step=req.step if req else -1, value=1, text=summary)
        self.observers.recorder_error()

    def report_request_errors(self, req: RequestState) -> None:
        for summary, n in req.errors.items():
            if n > 1:
                self.event(EventKind.RECORDER_ERROR, req.id, value=n, text=summary)

    def safe_update(self, rid: int, **fields: Any) -> None:
        try:
            assert self.writer is not None
            self.writer.update_request(rid, **fields)
        except Exception:  # noqa: BLE001
            pass
