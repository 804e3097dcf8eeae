"""The trace layout in one place: table dtypes, enumerations, names.

Everything here mirrors spec/kvtrace-format.md. Changing a table's fields changes the
format: bump FORMAT_MINOR for added fields (readers ignore unknown fields), FORMAT_MAJOR for
anything a 1.x reader would misread.
"""

from __future__ import annotations

import enum

import numpy as np

FORMAT_NAME = "kvtrace"
FORMAT_MAJOR = 1
FORMAT_MINOR = 2
FORMAT_VERSION = f"{FORMAT_MAJOR}.{FORMAT_MINOR}"
# /meta payload_tokens (1.1): what one K/V/latent payload holds (spec §6.1)
PAYLOAD_TOKENS = ("all", "new")
# Token axis of a payload by its number of dimensions: [B, H, T, D] K/V/Q, [B, T, D] latents.
PAYLOAD_TOKEN_AXIS = {4: 2, 3: 1}

# HDF5 filter ids: shuffle is built in; zstd is the registered id used by hdf5plugin & co.
FILTER_SHUFFLE = 2
FILTER_ZSTD = 32015

# Payload carriers: one 1-D dataset per element size, chunk-aligned samples.
PAYLOAD_CHUNK_BYTES = 256 * 1024
PAYLOAD_ITEMSIZES = (1, 2, 4, 8)
PAYLOAD_MAX_NDIM = 6

# Sentinels for "no value": never a fabricated number.
NA_I64 = -1


class LayerType(enum.IntEnum):
    UNKNOWN = 0
    FULL = 1
    SLIDING = 2
    CHUNKED = 3
    SHARED_CONSUMER = 4
    LATENT = 5
    QUANTIZED = 6
    STATIC = 7
    CROSS_ATTENTION = 8
    STATIC_SLIDING = 9


class CacheDType(enum.IntEnum):
    """Element types of cached and sampled tensors (numpy lacks bf16 and fp8)."""

    UNKNOWN = 0
    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    FLOAT8_E4M3FN = 4
    FLOAT8_E5M2 = 5
    INT8 = 6
    UINT8 = 7
    FLOAT64 = 8
    INT32 = 9
    INT64 = 10
    INT4_PACKED = 11


DTYPE_ITEMSIZE = {
    CacheDType.FLOAT32: 4,
    CacheDType.FLOAT16: 2,
    CacheDType.BFLOAT16: 2,
    CacheDType.FLOAT8_E4M3FN: 1,
    CacheDType.FLOAT8_E5M2: 1,
    CacheDType.INT8: 1,
    CacheDType.UINT8: 1,
    CacheDType.FLOAT64: 8,
    CacheDType.INT32: 4,
    CacheDType.INT64: 8,
    CacheDType.INT4_PACKED: 1,
}

# torch dtype name (str(dtype) without "torch.") -> CacheDType
TORCH_DTYPE_NAMES = {
    "float32": CacheDType.FLOAT32,
    "float16": CacheDType.FLOAT16,
    "bfloat16": CacheDType.BFLOAT16,
    "float8_e4m3fn": CacheDType.FLOAT8_E4M3FN,
    "float8_e5m2": CacheDType.FLOAT8_E5M2,
    "int8": CacheDType.INT8,
    "uint8": CacheDType.UINT8,
    "float64": CacheDType.FLOAT64,
    "int32": CacheDType.INT32,
    "int64": CacheDType.INT64,
}


class Outcome(enum.IntEnum):
    RUNNING = 0  # row written at request start; still 0 after a crash
    OK = 1
    OOM = 2
    ERROR = 3
    INTERRUPTED = 4


class Phase(enum.IntEnum):
    PREFILL = 0
    DECODE = 1


class EventKind(enum.IntEnum):
    REQUEST_START = 1
    PREFILL_START = 2
    PREFILL_END = 3
    DECODE_STEP = 4
    EOS = 5
    GENERATE_RETURN = 6
    GC = 7
    EMPTY_CACHE = 8
    OOM = 9
    RECORDER_ERROR = 10
    DROPPED_SAMPLES = 11
    REQUEST_END = 12
    EXCEPTION = 13
    INTERRUPT = 14
    NOTE = 15


class ReadingLabel(enum.IntEnum):
    """Why a labelled memory reading was taken (table /readings)."""

    BASELINE = 1  # just before the request
    PEAK = 2  # allocator peak over the request
    AFTER_RETURN = 3  # generate returned, nothing released yet
    AFTER_GC = 4
    AFTER_EMPTY_CACHE = 5
    AT_OOM = 6
    RECORDER_OWN = 7  # the recorder's own device allocations (pinned/staging)


class PayloadKind(enum.IntEnum):
    KEY = 1
    VALUE = 2
    QUERY = 3
    LATENT = 4  # MLA c_KV
    ROPE_KEY = 5  # MLA decoupled rope key


# ---- table dtypes (little-endian, packed) -------------------------------------------------
# Strings live in the /text heap (uint8, append-only); rows hold (offset, length) pairs, so
# no table needs variable-length types (which SWMR does not support).

REQUESTS = np.dtype(
    [
        ("request", "<u4"),
        ("outcome", "u1"),
        ("batch_size", "<u4"),
        ("prompt_tokens", "<u4"),
        ("new_tokens", "<u4"),
        ("eos_step", "<i4"),
        ("start_ns", "<u8"),
        ("end_ns", "<u8"),
        ("prompt_sha256", "S64"),
        ("prompt_text_off", "<u8"),
        ("prompt_text_len", "<u4"),
        ("gen_args_off", "<u8"),
        ("gen_args_len", "<u4"),
        ("error_off", "<u8"),
        ("error_len", "<u4"),
    ]
)

LAYERS = np.dtype(
    [
        ("layer", "<u2"),
        ("layer_type", "u1"),
        ("num_kv_heads", "<u4"),
        ("k_head_dim", "<u4"),
        ("v_head_dim", "<u4"),
        ("window", "<i8"),
        ("shared_from", "<i4"),
        ("module_off", "<u8"),
        ("module_len", "<u4"),
    ]
)

KV = np.dtype(
    [
        ("request", "<u4"),
        ("step", "<u4"),
        ("layer", "<u2"),
        ("layer_type", "u1"),
        ("device", "<i2"),
        ("k_dtype", "u1"),
        ("v_dtype", "u1"),
        ("k_shape", "<i8", (4,)),
        ("v_shape", "<i8", (4,)),
        ("tokens_seen", "<u8"),
        ("tokens_kept", "<u8"),
        ("bytes_allocated", "<u8"),
        ("bytes_valid", "<u8"),
        ("bytes_unique", "<u8"),
        ("k_storage", "<u8"),
        ("v_storage", "<u8"),
        ("k_storage_bytes", "<u8"),
        ("v_storage_bytes", "<u8"),
        ("expanded_bytes", "<u8"),
        ("t_ns", "<u8"),
    ]
)

STEPS = np.dtype(
    [
        ("request", "<u4"),
        ("step", "<u4"),
        ("phase", "u1"),
        ("t_ns", "<u8"),
        ("tokens_seen", "<u8"),
        ("kv_bytes_naive", "<u8"),
        ("kv_bytes_unique", "<u8"),
        ("kv_bytes_valid", "<u8"),
        ("allocated_bytes", "<i8"),
        ("reserved_bytes", "<i8"),
        ("rss_bytes", "<i8"),
    ]
)

NVML = np.dtype(
    [
        ("t_ns", "<u8"),
        ("device", "<i2"),
        ("used_bytes", "<i8"),
        ("free_bytes", "<i8"),
        ("reserved_bytes", "<i8"),
        ("total_bytes", "<i8"),
        ("process_used_bytes", "<i8"),
    ]
)

ALLOCATOR = np.dtype(
    [
        ("t_ns", "<u8"),
        ("device", "<i2"),
        ("allocated_bytes", "<i8"),
        ("reserved_bytes", "<i8"),
        ("active_bytes", "<i8"),
        ("inactive_split_bytes", "<i8"),
        ("num_alloc_retries", "<i8"),
        ("num_ooms", "<i8"),
    ]
)

PROCESS = np.dtype([("t_ns", "<u8"), ("rss_bytes", "<i8")])

EVENTS = np.dtype(
    [
        ("t_ns", "<u8"),
        ("kind", "u1"),
        ("request", "<i4"),
        ("step", "<i4"),
        ("layer", "<i4"),
        ("device", "<i2"),
        ("value", "<i8"),
        ("text_off", "<u8"),
        ("text_len", "<u4"),
    ]
)

READINGS = np.dtype(
    [
        ("t_ns", "<u8"),
        ("request", "<i4"),
        ("label", "u1"),
        ("device", "<i2"),
        ("allocated_bytes", "<i8"),
        ("reserved_bytes", "<i8"),
        ("active_bytes", "<i8"),
        ("inactive_split_bytes", "<i8"),
        ("nvml_used_bytes", "<i8"),
        ("nvml_process_used_bytes", "<i8"),
        ("rss_bytes", "<i8"),
    ]
)

RETENTION = np.dtype(
    [
        ("request", "<u4"),
        ("layer", "<i4"),
        ("device", "<i2"),
        ("storage", "<u8"),
        ("nbytes", "<u8"),
        ("referrers_off", "<u8"),
        ("referrers_len", "<u4"),
    ]
)

PAYLOAD_INDEX = np.dtype(
    [
        ("request", "<u4"),
        ("step", "<u4"),
        ("layer", "<u2"),
        ("kind", "u1"),
        ("dtype", "u1"),
        ("ndim", "u1"),
        ("shape", "<i8", (PAYLOAD_MAX_NDIM,)),
        ("head_start", "<i4"),
        ("head_stride", "<i4"),
        ("token_start", "<i8"),
        ("itemsize", "u1"),
        ("first_chunk", "<u8"),
        ("n_chunks", "<u4"),
        ("n_elements", "<u8"),
        ("t_ns", "<u8"),
    ]
)

DEVICES = np.dtype(
    [
        ("device", "<i2"),
        ("name", "S64"),
        ("total_memory_bytes", "<i8"),
        ("uuid", "S64"),
    ]
)

STATUS = np.dtype([("closed_ns", "<u8"), ("last_flush_ns", "<u8"), ("flushes", "<u8")])
# /stop (1.2): why the writer stopped before closing, stamped in place after a storage failure.
STOP = np.dtype([("stopped_ns", "<u8"), ("errno", "<i8"), ("reason", "S128")])

# name -> (dtype, required). Required tables exist in every valid trace (maybe empty).
TABLES: dict[str, tuple[np.dtype, bool]] = {
    "requests": (REQUESTS, True),
    "layers": (LAYERS, True),
    "kv": (KV, True),
    "steps": (STEPS, True),
    "events": (EVENTS, True),
    "readings": (READINGS, True),
    "retention": (RETENTION, True),
    "telemetry/nvml": (NVML, True),
    "telemetry/allocator": (ALLOCATOR, True),
    "telemetry/process": (PROCESS, True),
    "payloads/index": (PAYLOAD_INDEX, True),
    "devices": (DEVICES, True),
}

# Attributes of /meta: (name, required). JSON-valued ones end in _json.
META_ATTRS: dict[str, bool] = {
    "kvtrace_version": True,
    "python_version": True,
    "torch_version": True,
    "transformers_version": True,
    "cuda_version": True,
    "driver_version": True,
    "hostname_sha256": False,
    "model_id": True,
    "model_type": True,
    "model_config_json": True,
    "generation_defaults_json": True,
    "recorder_settings_json": True,
    "sources_json": True,
    "clock_anchor_wall_ns": True,
    "clock_anchor_mono_ns": True,
    "prompt_hash_salt_sha256": False,
    "contains_prompt_text": True,
    "contains_tensor_payloads": True,
}


def payload_dataset_name(itemsize: int) -> str:
    return f"payloads/data_{itemsize}"


def payload_carrier(itemsize: int) -> np.dtype:
    return np.dtype({1: "u1", 2: "<u2", 4: "<u4", 8: "<u8"}[itemsize])


def payload_chunk_elements(itemsize: int) -> int:
    return PAYLOAD_CHUNK_BYTES // itemsize
