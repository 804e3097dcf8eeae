"""Measured KV bytes against the analytical prediction, step by step.

For every kv row: the recorder's `bytes_unique` (storage bytes this layer adds to the cache,
each storage counted once) against kvtrace.geometry's allocated bytes for the same layer,
tokens seen, element size and batch (what `kvtrace calc` uses), with the MLA cache layout read
from the recorded key shapes as the analyser does (kvtrace.geometry.mla_cache_mode). A prefill step is predicted with
its whole prompt as the last forward, a decode step with one token. Static layers take their
preallocated length from the recorded shape (a run setting, not geometry); quantized layers are
not predicted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from kvtrace.analyzer.expect import STATIC_TYPES, recorded_k_heads
from kvtrace.analyzer.ranks import shard_config
from kvtrace.format import schema
from kvtrace.format.reader import Trace

# /kv rows read to tell the MLA cache layout (as many as the analyser's replay reads).
_MLA_SAMPLE_ROWS = 64


@dataclass
class StepCheck:
    request: int
    step: int
    tokens_seen: int
    measured: int
    predicted: int
    mismatches: list[tuple[int, int, int]] = field(default_factory=list)  # (layer, measured, predicted)

    @property
    def equal(self) -> bool:
        return self.measured == self.predicted and not self.mismatches


@dataclass
class KVCheck:
    steps: list[StepCheck]
    note: str = ""

    @property
    def checked(self) -> int:
        return len(self.steps)

    @property
    def equal(self) -> int:
        return sum(s.equal for s in self.steps)

    @property
    def first_mismatch(self) -> StepCheck | None:
        return next((s for s in self.steps if not s.equal), None)


class Unpredictable(Exception):
    """The trace holds something the geometry cannot size (reason in the message)."""


def predictor(trace: Trace) -> Callable[[np.void, int], tuple[int, int]]:
    """A function (kv row, tokens of the last forward) -> predicted (allocated, valid) bytes.
    Raises Unpredictable (here or when called) for what geometry cannot size."""
    from kvtrace import geometry
    from kvtrace.geometry.bounds import checked_config

    checked_config(trace, trace.layers[:])  # sizes within bounds before they size anything (exit 1)
    config = shard_config(trace.meta)  # a tensor-parallel rank holds its share of the KV heads
    if not config:
        raise Unpredictable("the trace stores no model config")
    sample = trace.kv[:_MLA_SAMPLE_ROWS] if trace.has("kv") and trace.nrows("kv") else None
    try:
        geo = geometry.model_geometry(config, mla_cache=geometry.mla_cache_mode(config, recorded_k_heads(sample)))
    except (ValueError, TypeError, KeyError) as exc:
        raise Unpredictable(f"model config not understood by kvtrace.geometry ({exc})") from None
    # The recorder numbers cache layers in cache order: decoder layers, then cross-attention ones
    # (geometry restarts its index for those), so the position in geo.layers is the trace's layer.
    layers = list(geo.layers)
    prompt_tokens = {int(r["request"]): int(r["prompt_tokens"]) for r in trace.requests[:]}
    memo: dict[tuple, tuple[int, int]] = {}

    def predict(row: np.void, last_step_tokens: int) -> tuple[int, int]:
        pos = int(row["layer"])
        if pos >= len(layers):
            raise Unpredictable(f"layer {pos} is not in the model config ({len(layers)} cache layers)")
        g = layers[pos]
        code = int(row["layer_type"])
        if (code == int(schema.LayerType.CROSS_ATTENTION)) != (g.kind == "cross_attention"):
            raise Unpredictable(f"layer {pos} is {schema.LayerType(code).name.lower()} in the trace "
                                f"but {g.kind} in the model config")
        if code in (int(schema.LayerType.QUANTIZED), int(schema.LayerType.UNKNOWN)):
            raise Unpredictable(f"layer {pos} is {schema.LayerType(code).name.lower()}: no exact prediction")
        try:
            itemsize = schema.DTYPE_ITEMSIZE[schema.CacheDType(int(row["k_dtype"]))]
        except (ValueError, KeyError):
            raise Unpredictable(f"layer {pos} has an unknown cache dtype") from None
        static = code in STATIC_TYPES
        batch = max(1, int(row["k_shape"][0]))
        cap = int(row["k_shape"][2]) if static else None
        # cross-attention holds the encoder output: as many tokens as the request's prompt
        enc = prompt_tokens.get(int(row["request"])) if g.kind == "cross_attention" else None
        key = (pos, int(row["tokens_seen"]), itemsize, batch, static, cap, enc, last_step_tokens)
        if key not in memo:
            try:
                memo[key] = geometry.layer_kv_bytes(
                    g, key[1], itemsize, batch, "static" if static else "dynamic", cap,
                    encoder_len=enc, last_step_tokens=last_step_tokens)
            except ValueError as exc:
                raise Unpredictable(f"geometry cannot size layer {pos}: {exc}") from None
        return memo[key]

    return predict


def check_kv(trace: Trace, which: Literal["all", "last"] = "all") -> KVCheck:
    """Compare every step (or only the last step of the longest request), reading /kv through the
    trace: the longest request's rows by its request index, or every row slice by slice."""
    steps = trace.steps[:]
    if not steps.size:
        return KVCheck([], "the trace has no step rows")
    phase = {(int(s["request"]), int(s["step"])): int(s["phase"]) for s in steps}
    try:
        predict = predictor(trace)
    except Unpredictable as exc:
        return KVCheck([], str(exc))
    if which == "last":
        longest = steps[np.argmax(steps["tokens_seen"])]
        chunks = [trace.kv.where(request=int(longest["request"]), step=int(longest["step"]))]
    else:
        chunks = trace.kv.slices()
    out: dict[tuple[int, int], StepCheck] = {}
    try:
        for rows in chunks:
            for row in rows:
                key = (int(row["request"]), int(row["step"]))
                prefill = phase.get(key) == int(schema.Phase.PREFILL)
                # a prefill forward brings all its tokens at once (fresh cache: all it has seen)
                predicted = predict(row, int(row["tokens_seen"]) if prefill else 1)[0]
                sc = out.setdefault(key, StepCheck(key[0], key[1], 0, 0, 0))
                measured = int(row["bytes_unique"])
                sc.tokens_seen = max(sc.tokens_seen, int(row["tokens_seen"]))
                sc.measured += measured
                sc.predicted += predicted
                if measured != predicted:
                    sc.mismatches.append((int(row["layer"]), measured, predicted))
    except Unpredictable as exc:
        return KVCheck([], str(exc))
    return KVCheck([out[k] for k in sorted(out)], "kvtrace.geometry allocated bytes vs recorded unique bytes")
