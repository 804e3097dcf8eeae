"""Typed rows the recorder writes, one NamedTuple per table, fields in the schema's order.

These belong in :mod:`kvtrace.format.schema` (issue 15: the declarative schema derives typed row
constructors from its columns); they live here until it does, and should move there then. A
NamedTuple is a tuple, so the writer buffers and converts them exactly as it did positional tuples
(``numpy.array(rows, dtype=...)``); the names only stop rows being built by position.
"""

from __future__ import annotations

from typing import NamedTuple


class EventRow(NamedTuple):  # /events
    t_ns: int
    kind: int
    request: int
    step: int
    layer: int
    device: int
    value: int
    text_off: int
    text_len: int


class ReadingRow(NamedTuple):  # /readings; -1: not measured
    t_ns: int
    request: int
    label: int
    device: int
    allocated_bytes: int
    reserved_bytes: int
    active_bytes: int = -1
    inactive_split_bytes: int = -1
    nvml_used_bytes: int = -1
    nvml_process_used_bytes: int = -1
    rss_bytes: int = -1


class RequestRow(NamedTuple):  # /requests, as written at request start (outcome RUNNING)
    request: int
    outcome: int
    batch_size: int
    prompt_tokens: int
    new_tokens: int
    eos_step: int
    start_ns: int
    end_ns: int
    prompt_sha256: bytes
    prompt_text_off: int
    prompt_text_len: int
    gen_args_off: int
    gen_args_len: int
    error_off: int = 0
    error_len: int = 0


class KvRow(NamedTuple):  # /kv
    request: int
    step: int
    layer: int
    layer_type: int
    device: int
    k_dtype: int
    v_dtype: int
    k_shape: tuple
    v_shape: tuple
    tokens_seen: int
    tokens_kept: int
    bytes_allocated: int
    bytes_valid: int
    bytes_unique: int
    k_storage: int
    v_storage: int
    k_storage_bytes: int
    v_storage_bytes: int
    expanded_bytes: int
    t_ns: int


class StepRow(NamedTuple):  # /steps
    request: int
    step: int
    phase: int
    t_ns: int
    tokens_seen: int
    kv_bytes_naive: int
    kv_bytes_unique: int
    kv_bytes_valid: int
    allocated_bytes: int
    reserved_bytes: int
    rss_bytes: int


class LayerRow(NamedTuple):  # /layers
    layer: int
    layer_type: int
    num_kv_heads: int
    k_head_dim: int
    v_head_dim: int
    window: int
    shared_from: int
    module_off: int
    module_len: int


class RetentionRow(NamedTuple):  # /retention
    request: int
    layer: int
    device: int
    storage: int
    nbytes: int
    referrers_off: int
    referrers_len: int
