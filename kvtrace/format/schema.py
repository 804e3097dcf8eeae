"""The trace layout in one place, declared once: tables, columns, enumerations, /meta.

Each column declares its numpy type, its enumeration, the /text length column it points with,
its "not recorded" sentinel, its units and a one-line description; each /meta attribute its
kind, whether it is required and its default. Everything else derives from these declarations:
the numpy dtypes (REQUESTS, KV, ...), the HDF5 types with enum members and the self-describing
attributes (format 1.3), a NamedTuple row type per table (RequestRow, KvRow, ...), the reader's
and validator's enum and text maps, and /meta encoding and decoding.

Everything here mirrors spec/kvtrace-format.md (tests/format/test_spec_sync.py checks it).
Why one module over 600 lines: about 300 of them are the column declarations themselves (one line
per field, units and description included), kept in one place so the layout is read in one file.
Changing a table's fields changes the format: bump FORMAT_MINOR for added fields (readers
ignore unknown fields), FORMAT_MAJOR for anything a 1.x reader would misread.
"""

from __future__ import annotations

import enum
import json
from collections import namedtuple
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

FORMAT_NAME = "kvtrace"
FORMAT_MAJOR = 1
FORMAT_MINOR = 5
# The minor whose table fields and /meta attributes this reader knows exactly: files of this minor
# or newer must have every field with its type (1.3 changed only HDF5 types and attributes).
FIELDS_MINOR = 2
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
    # continuous batching (1.4): the request's step is its manager's scheduler step (/sched)
    SCHEDULED = 16  # admitted by the scheduler (again after a preemption); value: admissions so far
    FIRST_TOKEN = 17  # the batch update that produced its first token returned; t_ns - start_ns = TTFT
    PREEMPTED = 18  # its KV left the GPU to make room (soft reset or CPU offload); value: tokens it held
    PREFIX_HIT = 19  # prompt tokens served from cached blocks at admission; value: tokens
    BLOCK_EVICTED = 20  # cached (unreferenced, reusable) blocks returned to the pool; value: blocks
    OFFLOADED = 21  # a preempted request's blocks copied to the CPU swap pool; value: bytes
    PHASE = 22  # a load-test phase begins (kvtrace loadtest, Recorder.mark_phase); value: index, text: name


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


class StateKind(enum.IntEnum):
    """What a constant-size cache state tensor is (table /state, 1.5)."""

    CONV = 1  # short-convolution window: conv_states of linear-attention / Mamba / LFM2 conv layers
    RECURRENT = 2  # recurrent or SSM state: recurrent_states
    OTHER = 3  # any other tensor the cache object holds outside its layers' K/V (MiniMax's linear_cache)


class Owner(enum.IntEnum):
    """Who holds a byte of an /owners reading (1.5)."""

    KV_REQUEST = 1  # a storage of this request's cache (KV and state)
    KV_EARLIER = 2  # a KV storage of an earlier request, still alive
    WEIGHTS = 3  # model parameters and buffers
    GENERATE_OUTPUT = 4  # the generate output's tensors (sequences, scores, logits, hidden states, attentions)
    WORKSPACE = 5  # a library workspace of known size (cuBLAS, cuBLASLt), counted once per device
    KV_COPIES = 6  # tensors or blocks sized like the cache's own K/V tensors, not the cache's
    UNKNOWN = 7
    INACTIVE = 8  # allocator blocks reserved but free


class OwnerMoment(enum.IntEnum):
    """When an /owners reading was taken (1.5)."""

    REQUEST_END = 1  # the request's retention verdict, after its collection
    OOM = 2  # as generate raised an out-of-memory error
    GROWTH_PEAK = 3  # during decode: memory grown past the live KV
    TICK = 4  # a periodic reading


# ---- tables, declared ---------------------------------------------------------------------
# Strings live in the /text heap (uint8, append-only); rows hold (offset, length) pairs, so
# no table needs variable-length types (which SWMR does not support).


@dataclass(frozen=True)
class Column:
    """One field of a table: how it is stored and what it means."""

    name: str
    dtype: str  # numpy type string, little-endian
    shape: tuple[int, ...] = ()
    enum: type[enum.IntEnum] | None = None  # codes of this IntEnum (an HDF5 enum type since 1.3)
    text: str | None = None  # on an offset column: the column holding the /text length
    na: int | None = None  # the "not recorded" sentinel (spec §1 Units), never a fabricated value
    units: str = ""  # "bytes", "ns", "tokens", ... ("" for enums and free text)
    doc: str = ""  # one line, as in the spec's table

    @property
    def numpy_type(self) -> np.dtype:
        return np.dtype((self.dtype, self.shape)) if self.shape else np.dtype(self.dtype)

    @property
    def hdf5_type(self) -> np.dtype:
        """The stored type: enum columns carry their names (h5dump prints them)."""
        if self.enum is None:
            return self.numpy_type
        import h5py  # the format layer needs h5py anyway; kept local so importing schema stays light

        return h5py.enum_dtype({m.name.lower(): int(m) for m in self.enum}, basetype=self.dtype)

    @property
    def unit_label(self) -> str:
        """Units as the spec's table and the file's attributes give them."""
        return self.enum.__name__ if self.enum is not None else self.units

    @property
    def description(self) -> str:
        """The one line written into the file: the spec's meaning, else what the name means
        wherever it appears (the spec leaves those cells empty)."""
        if self.doc:
            return self.doc
        if self.enum is not None:
            return f"{self.enum.__name__} code"
        if self.name.endswith("_len"):
            return "byte length of the string at the matching _off column"
        return _COMMON_DOCS.get(self.name, "")


@dataclass(frozen=True)
class Table:
    """A table (1-D compound dataset): its path, one-line title and columns in compound order."""

    name: str
    title: str
    columns: tuple[Column, ...]
    required: bool = True

    @cached_property
    def dtype(self) -> np.dtype:
        return np.dtype([(c.name, c.numpy_type) for c in self.columns])

    @cached_property
    def hdf5_dtype(self) -> np.dtype:
        """Same layout as :attr:`dtype` (numpy compares them equal); enum members named for HDF5."""
        return np.dtype([(c.name, c.hdf5_type) for c in self.columns])

    @cached_property
    def enum_columns(self) -> tuple[tuple[str, type[enum.IntEnum]], ...]:
        return tuple((c.name, c.enum) for c in self.columns if c.enum is not None)

    @cached_property
    def text_refs(self) -> tuple[tuple[str, str], ...]:
        """(offset column, length column) pairs pointing into /text."""
        return tuple((c.name, c.text) for c in self.columns if c.text is not None)

    @cached_property
    def row(self) -> type:
        """A NamedTuple of the columns: rows built by name, buffered and converted like tuples.
        Trailing columns with a sentinel (or a text reference, 0 = no text) may be omitted."""
        text_cols = {n for pair in self.text_refs for n in pair}
        defaults: list[Any] = []
        for c in reversed(self.columns):
            if c.na is not None:
                defaults.insert(0, c.na)
            elif c.name in text_cols:
                defaults.insert(0, 0)
            else:
                break
        cls = namedtuple(_row_name(self.name), [c.name for c in self.columns], defaults=defaults)  # noqa: PYI024
        cls.__doc__ = f"A /{self.name} row ({self.title})."
        return cls

    def attributes(self) -> dict[str, Any]:
        """Self-description written on the dataset (1.3): title and, per column in compound order,
        units, description and "not recorded" sentinel ("" where none)."""
        return {
            "description": self.title,
            "column_names": [c.name for c in self.columns],
            "column_units": [c.unit_label for c in self.columns],
            "column_descriptions": [c.description for c in self.columns],
            "column_not_recorded": ["" if c.na is None else str(c.na) for c in self.columns],
        }


_COMMON_DOCS = {
    "request": "request id (/requests)",
    "step": "step: 0 after the prefill forward, k after the k-th decode forward",
    "layer": "decoder layer index",
    "t_ns": "monotonic time of the reading",
    "device": "CUDA ordinal; -1 the CPU",
    "v_storage_bytes": "size of the values' storage",
}


def _row_name(table: str) -> str:
    base = {"telemetry/nvml": "Nvml", "telemetry/allocator": "Allocator", "telemetry/process": "Process",
            "payloads/index": "PayloadIndex", "kv": "Kv", "status": "Status",
            "sched_groups": "SchedGroup"}.get(table, table.capitalize().rstrip("s"))
    return f"{base}Row"


REQUESTS_TABLE = Table(
    'requests',
    'one row per `generate` call',
    (
        Column('request', '<u4', units='id', doc='request id, 0, 1, 2… within the session; unique'),
        Column('outcome', 'u1', enum=Outcome, doc='how the request ended'),
        Column('batch_size', '<u4', units='sequences', doc='batch size of the call'),
        Column('prompt_tokens', '<u4', units='tokens', doc='prompt length (longest row of the batch)'),
        Column('new_tokens', '<u4', units='tokens', doc='tokens generated'),
        Column('eos_step', '<i4', na=-1, units='step', doc='decode step at which EOS was produced; -1 if none'),
        Column('start_ns', '<u8', units='ns', doc='monotonic time the request started'),
        Column('end_ns', '<u8', units='ns', doc='monotonic time it ended; 0 while running'),
        Column('prompt_sha256', 'S64', units='hex', doc='sha256 (hex) of salt ‖ prompt token ids; never reversible'),
        Column('prompt_text_off', '<u8', text='prompt_text_len', units='text ref', doc='prompt text, **only when the user opted in**; else length 0'),
        Column('prompt_text_len', '<u4', units='bytes', doc=''),
        Column('gen_args_off', '<u8', text='gen_args_len', units='text ref', doc='JSON of the JSON-able generate() arguments'),
        Column('gen_args_len', '<u4', units='bytes', doc=''),
        Column('error_off', '<u8', text='error_len', units='text ref', doc='one-line error for outcomes oom/error/interrupted'),
        Column('error_len', '<u4', units='bytes', doc=''),
    ),
)
LAYERS_TABLE = Table(
    'layers',
    'one row per attention layer (static geometry)',
    (
        Column('layer', '<u2', units='index', doc='decoder layer index (`layer_idx`)'),
        Column('layer_type', 'u1', enum=LayerType, doc=''),
        Column('num_kv_heads', '<u4', units='heads', doc='KV heads cached by this layer'),
        Column('k_head_dim', '<u4', units='elements', doc='last dim of cached keys (latent rank for MLA)'),
        Column('v_head_dim', '<u4', units='elements', doc='last dim of cached values (RoPE dim for MLA)'),
        Column('window', '<i8', na=-1, units='tokens', doc='attention window; -1 if none'),
        Column('shared_from', '<i4', na=-1, units='index', doc='producer layer of a KV-shared consumer; -1 otherwise'),
        Column('module_off', '<u8', text='module_len', units='text ref', doc='module path in the model (e.g. `model.layers.3.self_attn`)'),
        Column('module_len', '<u4', units='bytes', doc=''),
    ),
)
KV_TABLE = Table(
    'kv',
    'one row per (request, step, layer): the cache structure',
    (
        Column('request', '<u4', units='id', doc=''),
        Column('step', '<u4', units='step', doc=''),
        Column('layer', '<u2', units='index', doc=''),
        Column('layer_type', 'u1', enum=LayerType, doc=''),
        Column('device', '<i2', na=-1, units='ordinal', doc='CUDA ordinal holding the tensors; -1 CPU'),
        Column('k_dtype', 'u1', enum=CacheDType, doc=''),
        Column('v_dtype', 'u1', enum=CacheDType, doc=''),
        Column('k_shape', '<i8', shape=(4,), units='elements', doc='key tensor shape `[B, kv_heads, T, D]` (zeros if absent)'),
        Column('v_shape', '<i8', shape=(4,), units='elements', doc='value tensor shape'),
        Column('tokens_seen', '<u8', units='tokens', doc='tokens this layer has processed in the request'),
        Column('tokens_kept', '<u8', units='tokens', doc='tokens it holds now (≤ seen: windows keep `window − 1`; static caches their valid length)'),
        Column('bytes_allocated', '<u8', units='bytes', doc="bytes of the storages behind this layer's K and V (static caches: the whole preallocation; K and V sharing one storage counted once)"),
        Column('bytes_valid', '<u8', units='bytes', doc='bytes holding valid tokens'),
        Column('bytes_unique', '<u8', units='bytes', doc='bytes this layer adds to the de-duplicated total: 0 when all its storages were already counted for an earlier layer (aliasing, KV sharing)'),
        Column('k_storage', '<u8', units='id', doc='storage identity of the keys (data pointer of the untyped storage); 0 if none'),
        Column('v_storage', '<u8', units='id', doc='same for values'),
        Column('k_storage_bytes', '<u8', units='bytes', doc='size of that storage'),
        Column('v_storage_bytes', '<u8', units='bytes', doc=''),
        Column('expanded_bytes', '<u8', units='bytes', doc='MLA: bytes the multi-head expanded K and V would take for the kept tokens; 0 otherwise'),
        Column('t_ns', '<u8', units='ns', doc='when read'),
    ),
)
STEPS_TABLE = Table(
    'steps',
    'one row per (request, step) whose cache structure was read',
    (
        Column('request', '<u4', units='id', doc=''),
        Column('step', '<u4', units='step', doc=''),
        Column('phase', 'u1', enum=Phase, doc=''),
        Column('t_ns', '<u8', units='ns', doc='end of that forward'),
        Column('tokens_seen', '<u8', units='tokens', doc='sequence length after the forward'),
        Column('kv_bytes_naive', '<u8', units='bytes', doc='Σ `bytes_allocated` over layers'),
        Column('kv_bytes_unique', '<u8', units='bytes', doc='Σ `bytes_unique` over layers'),
        Column('kv_bytes_valid', '<u8', units='bytes', doc='Σ `bytes_valid` over layers'),
        Column('allocated_bytes', '<i8', na=-1, units='bytes', doc="step-synchronous allocator reading (`memory_allocated`), summed over the model's devices; -1 without CUDA"),
        Column('reserved_bytes', '<i8', na=-1, units='bytes', doc='same, `memory_reserved`; -1 without CUDA'),
        Column('rss_bytes', '<i8', na=-1, units='bytes', doc="process resident set size: the background sampler's latest reading, at most 1/rate old (no `/proc` read inside the step); -1 if unavailable or none yet"),
    ),
)
EVENTS_TABLE = Table(
    'events',
    '',
    (
        Column('t_ns', '<u8', units='ns', doc=''),
        Column('kind', 'u1', enum=EventKind, doc=''),
        Column('request', '<i4', na=-1, units='id', doc='-1 if not tied to a request'),
        Column('step', '<i4', na=-1, units='step', doc='-1 if not tied to a step'),
        Column('layer', '<i4', na=-1, units='index', doc='-1 if not tied to a layer'),
        Column('device', '<i2', na=-1, units='ordinal', doc='-1 CPU / not tied'),
        Column('value', '<i8', units='kind-specific', doc="decode_step: the step; dropped_samples: count dropped; recorder_error: 1 at the first occurrence of each distinct error in a request, then one more event at request end with the request's total when above 1; note: kind-specific count (e.g. retention rows written); gc: objects collected; oom: bytes requested if known, else -1; scheduled: admissions so far; preempted: tokens whose KV it held; prefix_hit: tokens matched; block_evicted: blocks; offloaded: bytes; phase: phase index"),
        Column('text_off', '<u8', text='text_len', units='text ref', doc='optional detail (e.g. an exception summary)'),
        Column('text_len', '<u4', units='bytes', doc=''),
    ),
)
READINGS_TABLE = Table(
    'readings',
    'labelled memory readings around each request',
    (
        Column('t_ns', '<u8', units='ns', doc=''),
        Column('request', '<i4', units='id', doc=''),
        Column('label', 'u1', enum=ReadingLabel, doc='why it was taken'),
        Column('device', '<i2', na=-1, units='ordinal', doc='-1 for a CPU-only reading'),
        Column('allocated_bytes', '<i8', na=-1, units='bytes', doc='allocator `allocated_bytes.all.current`; -1 if unavailable'),
        Column('reserved_bytes', '<i8', na=-1, units='bytes', doc='`reserved_bytes.all.current`'),
        Column('active_bytes', '<i8', na=-1, units='bytes', doc='`active_bytes.all.current`'),
        Column('inactive_split_bytes', '<i8', na=-1, units='bytes', doc='`inactive_split_bytes.all.current`'),
        Column('nvml_used_bytes', '<i8', na=-1, units='bytes', doc='NVML v2 `used`'),
        Column('nvml_process_used_bytes', '<i8', na=-1, units='bytes', doc="this process's usage from NVML"),
        Column('rss_bytes', '<i8', na=-1, units='bytes', doc='process RSS'),
    ),
)
RETENTION_TABLE = Table(
    'retention',
    'KV storages of a request still alive once its caller had the chance to drop them',
    (
        Column('request', '<u4', units='id', doc=''),
        Column('layer', '<i4', units='index', doc='layer the storage belonged to'),
        Column('device', '<i2', units='ordinal', doc=''),
        Column('storage', '<u8', units='id', doc='storage identity'),
        Column('nbytes', '<u8', units='bytes', doc='storage size'),
        Column('referrers_off', '<u8', text='referrers_len', units='text ref', doc='comma-separated type names of the objects still referring to it'),
        Column('referrers_len', '<u4', units='bytes', doc=''),
    ),
)
NVML_TABLE = Table(
    'telemetry/nvml',
    'NVML timeseries (background sampler)',
    (
        Column('t_ns', '<u8', units='ns', doc=''),
        Column('device', '<i2', units='ordinal', doc='CUDA ordinal'),
        Column('used_bytes', '<i8', units='bytes', doc='`nvmlDeviceGetMemoryInfo` v2 `used` (excludes driver-reserved)'),
        Column('free_bytes', '<i8', units='bytes', doc='v2 `free`'),
        Column('reserved_bytes', '<i8', units='bytes', doc='v2 `reserved` (driver/firmware)'),
        Column('total_bytes', '<i8', units='bytes', doc='v2 `total`'),
        Column('process_used_bytes', '<i8', na=-1, units='bytes', doc="this process's `usedGpuMemory`; -1 if NVML does not report it"),
    ),
)
ALLOCATOR_TABLE = Table(
    'telemetry/allocator',
    'PyTorch caching-allocator timeseries',
    (
        Column('t_ns', '<u8', units='ns', doc=''),
        Column('device', '<i2', units='ordinal', doc=''),
        Column('allocated_bytes', '<i8', units='bytes', doc='`allocated_bytes.all.current`'),
        Column('reserved_bytes', '<i8', units='bytes', doc='`reserved_bytes.all.current`'),
        Column('active_bytes', '<i8', units='bytes', doc='`active_bytes.all.current`'),
        Column('inactive_split_bytes', '<i8', units='bytes', doc='`inactive_split_bytes.all.current`'),
        Column('num_alloc_retries', '<i8', units='count', doc='`num_alloc_retries` (cumulative)'),
        Column('num_ooms', '<i8', units='count', doc='`num_ooms` (cumulative)'),
    ),
)
PROCESS_TABLE = Table(
    'telemetry/process',
    '',
    (
        Column('t_ns', '<u8', units='ns', doc=''),
        Column('rss_bytes', '<i8', units='bytes', doc='resident set size of the recording process'),
    ),
)
PAYLOAD_INDEX_TABLE = Table(
    'payloads/index',
    'sampled tensor contents (§6)',
    (
        Column('request', '<u4', units='id', doc=''),
        Column('step', '<u4', units='step', doc=''),
        Column('layer', '<u2', units='index', doc=''),
        Column('kind', 'u1', enum=PayloadKind, doc=''),
        Column('dtype', 'u1', enum=CacheDType, doc='element type of the stored bits'),
        Column('ndim', 'u1', doc='number of used entries of `shape` (≤ 6)'),
        Column('shape', '<i8', shape=(6,), units='elements', doc='tensor shape, row-major; unused entries 0'),
        Column('head_start', '<i4', units='index', doc='first head kept (head selection)'),
        Column('head_stride', '<i4', units='heads', doc='stride between kept heads (1 = contiguous)'),
        Column('token_start', '<i8', units='tokens', doc='position of the first stored token in the sequence'),
        Column('itemsize', 'u1', units='bytes', doc='element size; selects the carrier dataset'),
        Column('first_chunk', '<u8', units='chunk', doc='first chunk index in `/payloads/data_{itemsize}`'),
        Column('n_chunks', '<u4', units='chunks', doc='chunks used'),
        Column('n_elements', '<u8', units='elements', doc='elements stored (= product of shape)'),
        Column('t_ns', '<u8', units='ns', doc='when sampled'),
    ),
)
DEVICES_TABLE = Table(
    'devices',
    '',
    (
        Column('device', '<i2', na=-1, units='ordinal', doc='CUDA ordinal; -1 the CPU'),
        Column('name', 'S64', doc='device name, e.g. `NVIDIA H100 80GB HBM3`'),
        Column('total_memory_bytes', '<i8', na=-1, units='bytes', doc='total memory; -1 unknown'),
        Column('uuid', 'S64', doc='NVML UUID if known'),
    ),
)
STATUS_TABLE = Table(
    'status',
    'one row, not a table',
    (
        Column('closed_ns', '<u8', units='ns', doc='0 until the writer closed the file cleanly'),
        Column('last_flush_ns', '<u8', units='ns', doc='monotonic time of the last flush'),
        Column('flushes', '<u8', units='count', doc='flushes so far'),
    ),
)
STOP_TABLE = Table(
    'stop',
    'one row: why the writer stopped early (1.2)',
    (
        Column('stopped_ns', '<u8', units='ns', doc='monotonic time the writer stopped writing; 0: it never stopped early'),
        Column('errno', '<i8', units='code', doc="the failure's POSIX errno (28 ENOSPC, 27 EFBIG, 5 EIO, 2 ENOENT for a deleted file); 0 when it had none"),
        Column('reason', 'S128', doc='one line, e.g. `ENOSPC (No space left on device) on write at offset 2175984`'),
    ),
)

SCHED_TABLE = Table(
    'sched',
    'one row per continuous-batching scheduler step (1.4)',
    (
        Column('t_ns', '<u8', units='ns', doc="the step's batch was scheduled (its forward follows)"),
        Column('manager', '<u2', units='index', doc='continuous-batching manager of the session, 0, 1, … in order of creation'),
        Column('step', '<u4', units='step', doc="that manager's scheduler step, 0, 1, 2…"),
        Column('batch_requests', '<u4', units='requests', doc="requests in this step's batch"),
        Column('prefill_tokens', '<u4', units='tokens', doc='query tokens at prompt positions (recomputed ones after a soft reset included)'),
        Column('decode_tokens', '<u4', units='tokens', doc='query tokens at generated positions'),
        Column('running', '<u4', units='requests', doc='requests admitted and not finished (they hold cache)'),
        Column('waiting', '<u4', units='requests', doc='requests queued, not admitted (preempted ones included)'),
        Column('starved', '<i4', na=-1, units='requests', doc='running requests the scheduler could not give the blocks they needed; -1 if unknown'),
        Column('max_batch_tokens', '<i8', na=-1, units='tokens', doc="the scheduler's token budget per step; -1 if unknown"),
        Column('pool_bytes', '<i8', na=-1, units='bytes', doc='the paged KV pool allocated up front (its padding/trash sectors excluded); -1 if unknown'),
        Column('free_bytes', '<i8', na=-1, units='bytes', doc='free capacity as the cache itself reports it; -1 if unknown'),
        Column('valid_bytes', '<i8', na=-1, units='bytes', doc="KV bytes holding valid tokens: Σ over groups of `tokens_valid` × the group's bytes per token; -1 if unknown"),
        Column('blocks_in_use', '<i8', na=-1, units='blocks', doc="distinct blocks in the running requests' block tables, all groups; -1 if unknown"),
        Column('blocks_cached', '<i8', na=-1, units='blocks', doc='unreferenced blocks kept for prefix reuse (evictable), all groups; -1 if unknown'),
        Column('tokens_cached', '<i8', na=-1, units='tokens', doc="Σ sequence positions of the running requests once this step's forward has run; -1 if unknown"),
        Column('prefix_hit_tokens', '<i8', units='tokens', doc="prompt tokens served from cached blocks by this step's admissions"),
        Column('prefix_hit_blocks', '<i8', units='blocks', doc='blocks those hits shared, all groups'),
        Column('evicted_blocks', '<i8', units='blocks', doc='cached blocks evicted while scheduling this step'),
        Column('preempted', '<u4', units='requests', doc='requests preempted (soft reset or offloaded) while scheduling this step'),
    ),
    required=False,
)
SCHED_GROUPS_TABLE = Table(
    'sched_groups',
    'one row per (scheduler step, cache group): one attention type\'s share of the paged cache (1.4)',
    (
        Column('manager', '<u2', units='index', doc='as in /sched'),
        Column('step', '<u4', units='step', doc='as in /sched'),
        Column('group', 'u1', units='index', doc='cache group: one per attention type (transformers 5.23: allocator index; 5.17: group index)'),
        Column('layer_type', 'u1', enum=LayerType, doc='attention type of its layers (full, sliding)'),
        Column('layers', '<u2', units='layers', doc='decoder layers whose KV the group holds'),
        Column('window', '<i8', na=-1, units='tokens', doc='sliding window; -1 if none'),
        Column('tokens_per_block', '<i8', units='tokens', doc='sequence positions one block holds for one request (the page size)'),
        Column('bytes_per_block', '<i8', units='bytes', doc="one block: those positions' K and V in every layer of the group"),
        Column('blocks_total', '<i8', na=-1, units='blocks', doc='blocks of this size the pool holds; -1 if unknown'),
        Column('blocks_in_use', '<i8', units='blocks', doc="distinct blocks in the running requests' block tables"),
        Column('blocks_cached', '<i8', na=-1, units='blocks', doc='unreferenced blocks kept for prefix reuse; -1 if the version has none'),
        Column('blocks_free', '<i8', na=-1, units='blocks', doc='free blocks the group holds (5.23: in its sectors; 5.17: its free list); -1 if unknown'),
        Column('tokens_valid', '<i8', units='tokens', doc='Σ over running requests of `/blocks.tokens_valid`'),
    ),
    required=False,
)
BLOCKS_TABLE = Table(
    'blocks',
    "one row per (scheduler step, running request, cache group): the request's blocks (1.4)",
    (
        Column('manager', '<u2', units='index', doc='as in /sched'),
        Column('step', '<u4', units='step', doc='as in /sched'),
        Column('request', '<u4', units='id', doc='request id (/requests)'),
        Column('group', 'u1', units='index', doc='as in /sched_groups'),
        Column('blocks', '<u4', units='blocks', doc='blocks in its block table'),
        Column('blocks_shared', '<u4', units='blocks', doc='of those, blocks another running request also references (prefix sharing, forks)'),
        Column('tokens_valid', '<u8', units='tokens', doc='positions whose KV the group holds for it once the forward has run (sliding: at most the window)'),
    ),
    required=False,
)

STATE_TABLE = Table(
    'state',
    'one row per (request, step, state tensor): constant-size cache state beside the KV (1.5)',
    (
        Column('request', '<u4', units='id', doc=''),
        Column('step', '<u4', units='step', doc=''),
        Column('layer', '<i4', na=-1, units='index', doc='decoder layer the state belongs to; -1 if the cache does not tie it to one'),
        Column('kind', 'u1', enum=StateKind, doc=''),
        Column('state_index', '<u2', units='index', doc="which of the layer's states (transformers `state_idx`), or the position in the cache attribute holding it"),
        Column('device', '<i2', na=-1, units='ordinal', doc='CUDA ordinal holding the tensor; -1 CPU'),
        Column('dtype', 'u1', enum=CacheDType, doc=''),
        Column('ndim', 'u1', doc='number of used entries of `shape` (≤ 6)'),
        Column('shape', '<i8', shape=(6,), units='elements', doc='tensor shape, row-major; unused entries 0'),
        Column('bytes_allocated', '<u8', units='bytes', doc="size of the tensor's storage"),
        Column('bytes_valid', '<u8', units='bytes', doc='bytes of the tensor itself (elements × item size)'),
        Column('bytes_unique', '<u8', units='bytes', doc="bytes this row adds to the step's de-duplicated cache total: 0 when its storage was already counted (a /kv storage of the step or an earlier /state row)"),
        Column('storage', '<u8', units='id', doc='storage identity (data pointer of the untyped storage)'),
        Column('source_off', '<u8', text='source_len', units='text ref', doc='where the cache holds it, e.g. `layers[3].recurrent_states[0]`, `linear_cache[2]`'),
        Column('source_len', '<u4', units='bytes', doc=''),
        Column('t_ns', '<u8', units='ns', doc='when read'),
    ),
    required=False,
)
OWNERS_TABLE = Table(
    'owners',
    'who owns the memory at a moment: bytes and blocks per owner class (1.5)',
    (
        Column('request', '<i4', na=-1, units='id', doc='request the reading belongs to; -1 if none (a tick between requests)'),
        Column('step', '<i4', na=-1, units='step', doc='decode step of a growth_peak or oom reading; -1 otherwise'),
        Column('moment', 'u1', enum=OwnerMoment, doc=''),
        Column('device', '<i2', na=-1, units='ordinal', doc='CUDA ordinal whose allocator was read; -1 for the CPU census'),
        Column('owner', 'u1', enum=Owner, doc=''),
        Column('bytes', '<u8', units='bytes', doc='bytes of this class: allocator block sizes on a GPU, storage sizes on the CPU'),
        Column('blocks', '<u8', units='count', doc='allocator blocks (GPU) or storages (CPU) of this class'),
        Column('largest_bytes', '<u8', units='bytes', doc='size of its largest block or storage'),
        Column('detail_off', '<u8', text='detail_len', units='text ref', doc='JSON object saying what the class holds (below); length 0 if nothing more'),
        Column('detail_len', '<u4', units='bytes', doc=''),
        Column('t_ns', '<u8', units='ns', doc='when read'),
    ),
    required=False,
)
# Shape entries a /state row holds (a tensor of more dimensions folds its leading ones into the first).
STATE_MAX_NDIM = 6

# ---- derived: numpy dtypes and row types (the names the rest of kvtrace uses) ---------------

REQUESTS = REQUESTS_TABLE.dtype
LAYERS = LAYERS_TABLE.dtype
KV = KV_TABLE.dtype
STEPS = STEPS_TABLE.dtype
NVML = NVML_TABLE.dtype
ALLOCATOR = ALLOCATOR_TABLE.dtype
PROCESS = PROCESS_TABLE.dtype
EVENTS = EVENTS_TABLE.dtype
READINGS = READINGS_TABLE.dtype
RETENTION = RETENTION_TABLE.dtype
PAYLOAD_INDEX = PAYLOAD_INDEX_TABLE.dtype
DEVICES = DEVICES_TABLE.dtype
STATUS = STATUS_TABLE.dtype
# /stop (1.2): why the writer stopped before closing, stamped in place after a storage failure.
STOP = STOP_TABLE.dtype
# continuous batching (1.4): optional tables, absent from older traces
SCHED = SCHED_TABLE.dtype
SCHED_GROUPS = SCHED_GROUPS_TABLE.dtype
BLOCKS = BLOCKS_TABLE.dtype
# hybrid caches (1.5): optional, absent from older traces
STATE = STATE_TABLE.dtype
OWNERS = OWNERS_TABLE.dtype  # memory owners (1.5): optional

RequestRow = REQUESTS_TABLE.row
LayerRow = LAYERS_TABLE.row
KvRow = KV_TABLE.row
StepRow = STEPS_TABLE.row
NvmlRow = NVML_TABLE.row
AllocatorRow = ALLOCATOR_TABLE.row
ProcessRow = PROCESS_TABLE.row
EventRow = EVENTS_TABLE.row
ReadingRow = READINGS_TABLE.row
RetentionRow = RETENTION_TABLE.row
PayloadIndexRow = PAYLOAD_INDEX_TABLE.row
DeviceRow = DEVICES_TABLE.row
StatusRow = STATUS_TABLE.row
StopRow = STOP_TABLE.row
SchedRow = SCHED_TABLE.row
SchedGroupRow = SCHED_GROUPS_TABLE.row
BlockRow = BLOCKS_TABLE.row
StateRow = STATE_TABLE.row
OwnerRow = OWNERS_TABLE.row

# A payload's description: the /payloads/index columns that say what a sampled tensor is (the
# rest say where its chunks are). reader.Payload and writer.EncodedPayload carry these fields.
PAYLOAD_DESCRIPTION = ("request", "step", "layer", "kind", "dtype", "shape", "head_start", "head_stride",
                       "token_start", "t_ns")


def payload_index_row(payload: Any, *, first_chunk: int, n_chunks: int) -> Any:
    """The /payloads/index row of a payload (any object with the PAYLOAD_DESCRIPTION fields plus
    itemsize and n_elements) whose chunks start at ``first_chunk``."""
    fields = {name: getattr(payload, name) for name in PAYLOAD_DESCRIPTION}
    shape = tuple(int(s) for s in payload.shape)
    fields.update(kind=int(payload.kind), dtype=int(payload.dtype),
                  shape=list(shape) + [0] * (PAYLOAD_MAX_NDIM - len(shape)))
    return PayloadIndexRow(**fields, ndim=len(shape), itemsize=payload.itemsize, first_chunk=first_chunk,
                           n_chunks=n_chunks, n_elements=payload.n_elements)


def payload_description(row: Any) -> dict[str, Any]:
    """The PAYLOAD_DESCRIPTION fields of an index row as Python values (enums, shape tuple)."""
    out = {name: int(row[name]) for name in PAYLOAD_DESCRIPTION if name not in ("kind", "dtype", "shape")}
    out["kind"] = PayloadKind(int(row["kind"]))
    out["dtype"] = CacheDType(int(row["dtype"]))
    out["shape"] = tuple(int(s) for s in row["shape"][: int(row["ndim"])])
    return out


# Every table, by path. Required tables exist in every valid trace (maybe empty).
TABLE_DECLS: dict[str, Table] = {t.name: t for t in (
    REQUESTS_TABLE, LAYERS_TABLE, KV_TABLE, STEPS_TABLE, EVENTS_TABLE, READINGS_TABLE, RETENTION_TABLE,
    NVML_TABLE, ALLOCATOR_TABLE, PROCESS_TABLE, PAYLOAD_INDEX_TABLE, DEVICES_TABLE,
    SCHED_TABLE, SCHED_GROUPS_TABLE, BLOCKS_TABLE, STATE_TABLE, OWNERS_TABLE,
)}
# name -> (dtype, required), the form readers and the writer iterate.
TABLES: dict[str, tuple[np.dtype, bool]] = {name: (t.dtype, t.required) for name, t in TABLE_DECLS.items()}
# Enumerated columns per table: the reader refuses rows with codes it does not know (spec §2).
ENUM_COLUMNS: dict[str, tuple[tuple[str, type[enum.IntEnum]], ...]] = {
    name: t.enum_columns for name, t in TABLE_DECLS.items() if t.enum_columns}
# Columns pointing into /text, per table: (offset, length) pairs.
TEXT_REFS: dict[str, tuple[tuple[str, str], ...]] = {
    name: t.text_refs for name, t in TABLE_DECLS.items() if t.text_refs}

# Self-description of the other objects (1.3): (description, units) written as attributes.
GROUP_DESCRIPTIONS = {
    "meta": "run metadata, one attribute each (spec §3)",
    "telemetry": "background telemetry timeseries (spec §4.8-4.10)",
    "payloads": "sampled K/V/Q/latent contents: an index and one carrier per element size (spec §6)",
}
TEXT_ATTRS = {"description": "UTF-8 string heap; rows point into it with (_off, _len) pairs (spec §5)",
              "units": "bytes"}
PAYLOAD_CARRIER_ATTRS = {
    "description": "raw element bits of sampled tensors in shuffle + zstd (filter 32015) chunks: HDF5 tools "
                   "need the zstd filter plugin (HDF5_PLUGIN_PATH, e.g. from hdf5plugin) to print them; "
                   "/payloads/index says what they are (spec §6)",
    "units": "element bits"}


# ---- /meta, declared ------------------------------------------------------------------------


@dataclass(frozen=True)
class MetaAttr:
    """One /meta attribute. ``kind``: "str", "int", "bool" or "json" (a JSON object stored as a
    UTF-8 string; the name ends in _json and the reader's field drops that suffix)."""

    name: str
    kind: str
    required: bool
    default: Any = None  # written when the recorder gives none; None: the writer supplies it
    since: str = "1.0"

    @property
    def field(self) -> str:
        return self.name[: -len("_json")] if self.kind == "json" else self.name


META: tuple[MetaAttr, ...] = (
    MetaAttr("kvtrace_version", "str", True),
    MetaAttr("python_version", "str", True),
    MetaAttr("torch_version", "str", True),
    MetaAttr("transformers_version", "str", True),
    MetaAttr("cuda_version", "str", True, "unavailable"),
    MetaAttr("driver_version", "str", True, "unavailable"),
    MetaAttr("hostname_sha256", "str", False),
    MetaAttr("model_id", "str", True, "unknown"),
    MetaAttr("model_type", "str", True, "unknown"),
    MetaAttr("model_config_json", "json", True, {}),
    MetaAttr("generation_defaults_json", "json", True, {}),
    MetaAttr("recorder_settings_json", "json", True, {}),
    MetaAttr("sources_json", "json", True, {}),
    MetaAttr("clock_anchor_wall_ns", "int", True),
    MetaAttr("clock_anchor_mono_ns", "int", True),
    MetaAttr("prompt_hash_salt_sha256", "str", False),
    MetaAttr("contains_prompt_text", "bool", True, False),
    MetaAttr("contains_tensor_payloads", "bool", True, False),
    MetaAttr("payload_tokens", "str", False, since="1.1"),  # absent: "all" (spec §6.1)
    # 1.4: how the model is spread over devices and processes (spec §3.1); absent: one process
    MetaAttr("parallel_json", "json", False, since="1.4"),
)
META_BY_NAME: dict[str, MetaAttr] = {a.name: a for a in META}
# Attributes of /meta: (name, required). JSON-valued ones end in _json.
META_ATTRS: dict[str, bool] = {a.name: a.required for a in META}


def meta_attr_value(key: str, value: Any) -> Any:
    """The HDF5 attribute value for a /meta entry (declared or not: a recorder may add extras)."""
    attr = META_BY_NAME.get(key)
    kind = attr.kind if attr is not None else ("json" if key.endswith("_json") else None)
    if kind == "json":
        return json.dumps(value, sort_keys=True, default=str)
    if isinstance(value, bool):
        return np.bool_(value)
    if isinstance(value, (int, np.integer)):
        return np.int64(value)
    if isinstance(value, (float, np.floating)):
        return np.float64(value)
    return str(value)


def payload_dataset_name(itemsize: int) -> str:
    return f"payloads/data_{itemsize}"


def payload_carrier(itemsize: int) -> np.dtype:
    return np.dtype({1: "u1", 2: "<u2", 4: "<u4", 8: "<u8"}[itemsize])


def payload_chunk_elements(itemsize: int) -> int:
    return PAYLOAD_CHUNK_BYTES // itemsize
