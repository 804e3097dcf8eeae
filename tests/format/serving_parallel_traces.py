"""Traces of format 1.4 for the hostile-file tests (test_hostile_serving_parallel.py): a continuous-batching
(serving) trace and the two rank traces of a tensor-parallel run, written clean with the real
TraceWriter, then damaged in one place with h5py (the parts 1.4 added: ``/meta parallel_json``,
``/sched``, ``/sched_groups``, ``/blocks``, event kinds 16-22, the version attributes).

Every damage is a function ``(h5py.File) -> None``; :func:`damaged` copies a clean trace and applies
one. The clean builders are the controls: the same trace without the damage.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from kvtrace.format import DeviceInfo, TraceWriter, schema

K = schema.EventKind
LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "intermediate_size": 128}
HEADS, DIM, ITEM = 2, 16, 2  # KV heads, head dim, bf16
BLOCK_TOKENS = 16
BLOCK_BYTES = BLOCK_TOKENS * 2 * HEADS * DIM * ITEM * LLAMA["num_hidden_layers"]  # K and V of both layers
POOL_BLOCKS = 64
POOL = POOL_BLOCKS * BLOCK_BYTES
STEPS = 8
PROMPTS = (20, 12, 28)  # three requests, admitted at steps 0, 0 and 2
NEW = 4
Damage = Callable[[h5py.File], None]


def _kv_rows(rid: int, step: int, seen: int, t: int, heads: int = HEADS) -> list[tuple]:
    rows = []
    for layer in range(LLAMA["num_hidden_layers"]):
        nbytes = seen * 2 * heads * DIM * ITEM
        shape = [1, heads, seen, DIM]
        rows.append(schema.KvRow(rid, step, layer, int(schema.LayerType.FULL), -1,
                                 int(schema.CacheDType.BFLOAT16), int(schema.CacheDType.BFLOAT16), shape, shape,
                                 tokens_seen=seen, tokens_kept=seen, bytes_allocated=nbytes, bytes_valid=nbytes,
                                 bytes_unique=nbytes, k_storage=1000 + 10 * rid + 2 * layer,
                                 v_storage=1001 + 10 * rid + 2 * layer, k_storage_bytes=nbytes // 2,
                                 v_storage_bytes=nbytes // 2, expanded_bytes=0, t_ns=t))
    return rows


def _core(w: TraceWriter, requests: list[tuple[int, int]], t0: int, heads: int = HEADS,
          cb: bool = False) -> None:
    """/layers, and per request (prompt, first step): /requests, /kv, /steps, request events."""
    for layer in range(LLAMA["num_hidden_layers"]):
        w.append("layers", schema.LayerRow(layer, int(schema.LayerType.FULL), heads, DIM, DIM, window=-1))
    for rid, (prompt, first) in enumerate(requests):
        args = {"max_new_tokens": NEW} | ({"cb_request_id": f"req_{rid}", "manager": 0} if cb else {})
        off, n = w.add_text(json.dumps(args))
        start = t0 + 10 * first
        w.begin_request(schema.RequestRow(rid, int(schema.Outcome.RUNNING), batch_size=1, prompt_tokens=prompt,
                                          new_tokens=0, eos_step=-1, start_ns=start, end_ns=0,
                                          prompt_sha256=f"{rid:064x}".encode(), gen_args_off=off, gen_args_len=n))
        w.append("events", schema.EventRow(start, int(K.REQUEST_START), rid, -1, -1, -1, 0, 0, 0))
        for step in range(NEW):
            t = start + 1000 * (step + 1)
            seen = prompt + step
            w.append("kv", _kv_rows(rid, step, seen, t, heads))
            nbytes = LLAMA["num_hidden_layers"] * seen * 2 * heads * DIM * ITEM
            w.append("steps", schema.StepRow(rid, step, int(schema.Phase.PREFILL if step == 0 else schema.Phase.DECODE),
                                             t, tokens_seen=seen, kv_bytes_naive=nbytes, kv_bytes_unique=nbytes,
                                             kv_bytes_valid=nbytes, allocated_bytes=-1, reserved_bytes=-1,
                                             rss_bytes=-1))
        end = start + 1000 * (NEW + 1)
        w.append("events", schema.EventRow(end, int(K.EOS), rid, NEW - 1, -1, -1, 0, 0, 0))
        w.append("events", schema.EventRow(end + 1, int(K.REQUEST_END), rid, -1, -1, -1, 0, 0, 0))
        w.update_request(rid, outcome=int(schema.Outcome.OK), new_tokens=NEW, eos_step=NEW - 1, end_ns=end + 1)


def _meta(parallel: dict[str, Any] | None = None) -> dict[str, Any]:
    meta = {"model_id": "test/hostile14", "model_type": "llama", "model_config_json": LLAMA,
            "sources_json": {"cache_structure": {"available": True}, "nvml": {"available": False, "reason": "cpu"},
                             "allocator": {"available": False, "reason": "cpu"}}}
    if parallel is not None:
        meta["parallel_json"] = parallel
    return meta


def serving_trace(path: Path) -> Path:
    """A continuous-batching recording: three requests, eight scheduler steps of one manager with one
    full-attention cache group, every 1.4 event kind (16-22) once at least."""
    with TraceWriter(path, _meta(), [DeviceInfo(-1, "cpu", 16 << 30)]) as w:
        t0 = 1_000_000
        _core(w, [(p, first) for p, first in zip(PROMPTS, (0, 0, 2), strict=True)], t0, cb=True)

        def ev(t: int, kind: K, rid: int = -1, value: int = 0, text: str = "") -> None:
            off, n = w.add_text(text) if text else (0, 0)
            w.append("events", schema.EventRow(t, int(kind), rid, -1, -1, -1, value, off, n))

        ev(t0 - 5, K.PHASE, value=0, text="baseline")
        ev(t0 + 15, K.PHASE, value=1, text="concurrent")
        for rid, first in enumerate((0, 0, 2)):
            ev(t0 + 10 * first + 1, K.SCHEDULED, rid, 1)
            ev(t0 + 10 * first + 500, K.FIRST_TOKEN, rid)
        ev(t0 + 30, K.PREFIX_HIT, 2, 16)
        ev(t0 + 40, K.PREEMPTED, 1, 13, "soft reset")
        ev(t0 + 41, K.SCHEDULED, 1, 2)
        ev(t0 + 50, K.BLOCK_EVICTED, -1, 1)
        ev(t0 + 60, K.OFFLOADED, 1, BLOCK_BYTES)
        for step in range(STEPS):
            running = [rid for rid, first in enumerate((0, 0, 2)) if first <= step < first + NEW]
            tokens = {rid: PROMPTS[rid] + step - (0, 0, 2)[rid] for rid in running}
            blocks = {rid: -(-n // BLOCK_TOKENS) for rid, n in tokens.items()}
            shared = 1 if step >= 2 and 2 in running and 0 in running else 0
            in_use = sum(blocks.values()) - shared
            cached = 2 if step >= 4 else 0
            free = POOL_BLOCKS - in_use - cached
            valid = sum(tokens.values()) * BLOCK_BYTES // BLOCK_TOKENS
            prefill = sum(PROMPTS[r] for r in running if (0, 0, 2)[r] == step)
            w.append("sched", schema.SchedRow(
                t0 + 100 * step, 0, step, len(running), prefill, len(running) - (prefill > 0), len(running),
                (0, 0, 2)[2] > step and 1 or 0, 0, 256, POOL, free * BLOCK_BYTES, valid, in_use, cached,
                sum(tokens.values()), 16 if step == 2 else 0, 1 if step == 2 else 0, 1 if step == 5 else 0,
                1 if step == 3 else 0))
            w.append("sched_groups", schema.SchedGroupRow(
                0, step, 0, int(schema.LayerType.FULL), LLAMA["num_hidden_layers"], -1, BLOCK_TOKENS, BLOCK_BYTES,
                POOL_BLOCKS, in_use, cached, free, sum(tokens.values())))
            w.append("blocks", [schema.BlockRow(0, step, rid, 0, blocks[rid], shared if rid in (0, 2) else 0,
                                                tokens[rid]) for rid in running])
    return path


RUN_ID = "00000000-hostile-14"


def rank_parallel(rank: int, world: int = 2) -> dict[str, Any]:
    return {"mode": "tensor_parallel", "world_size": world, "rank": rank, "local_rank": rank, "backend": "gloo",
            "run_id": RUN_ID, "kv_heads_local": HEADS // world, "kv_heads_total": HEADS,
            "tp_plan": {"model.layers.*.self_attn.k_proj": "colwise"}}


def rank_trace(path: Path, rank: int, parallel: dict[str, Any] | None = None) -> Path:
    """One rank of a two-rank tensor-parallel run: one KV head of the model's two per layer."""
    with TraceWriter(path, _meta(parallel or rank_parallel(rank)), [DeviceInfo(-1, "cpu", 16 << 30)]) as w:
        _core(w, [(PROMPTS[0], 0), (PROMPTS[1], 1)], 1_000_000, heads=HEADS // 2)
    return path


def device_map_trace(path: Path) -> Path:
    """One process, layers on two devices (a device map)."""
    par = {"mode": "device_map", "device_map": {"model.embed_tokens": "cpu", "model.layers.0": "cpu",
                                                "model.layers.1": "disk", "lm_head": "cpu"}}
    with TraceWriter(path, _meta(par), [DeviceInfo(-1, "cpu", 16 << 30)]) as w:
        _core(w, [(PROMPTS[0], 0)], 1_000_000)
    return path


def damaged(clean: Path, out: Path, damage: Damage) -> Path:
    shutil.copyfile(clean, out)
    with h5py.File(out, "r+") as f:
        damage(f)  # may close f itself to change bytes afterwards (corrupt_chunk)
    return out


# ---- damages ---------------------------------------------------------------------------------------


def set_meta(name: str, value: Any) -> Damage:
    def apply(f: h5py.File) -> None:
        f["meta"].attrs[name] = value
    return apply


def set_parallel(value: Any) -> Damage:
    """parallel_json replaced by `value` (a str is stored as it is, anything else as JSON)."""
    return set_meta("parallel_json", value if isinstance(value, str) else json.dumps(value))


def patch_parallel(**fields: Any) -> Damage:
    def apply(f: h5py.File) -> None:
        par = json.loads(f["meta"].attrs["parallel_json"])
        par.update(fields)
        f["meta"].attrs["parallel_json"] = json.dumps(par)
    return apply


def set_rows(table: str, column: str, value: Any, rows: slice | list[int] = slice(None)) -> Damage:
    """Column values of some rows replaced (the stored type is kept)."""
    def apply(f: h5py.File) -> None:
        data = f[table][:]
        col = data[column]
        col[rows] = value
        data[column] = col
        f[table][:] = data
    return apply


def map_rows(table: str, fn: Callable[[np.ndarray], np.ndarray]) -> Damage:
    """The table's rows replaced by fn(rows) (same dtype, any length)."""
    def apply(f: h5py.File) -> None:
        data = fn(f[table][:])
        f[table].resize((len(data),))
        f[table][:] = data
    return apply


def grow(table: str, rows: int) -> Damage:
    """Extent grown to `rows` unwritten rows: zeros that occupy no space in the file."""
    def apply(f: h5py.File) -> None:
        f[table].resize((rows,))
    return apply


def retype(table: str, dtype: Callable[[np.dtype], np.dtype]) -> Damage:
    """The table rewritten with another compound type (values converted where they can be)."""
    def apply(f: h5py.File) -> None:
        old = f[table][:]
        new_dtype = dtype(old.dtype)
        new = np.zeros(len(old), dtype=new_dtype)
        for name in new_dtype.names:
            if name in old.dtype.names:
                new[name] = old[name]
        attrs = dict(f[table].attrs)
        del f[table]
        ds = f.create_dataset(table, data=new, maxshape=(None,), chunks=True)
        for k, v in attrs.items():
            ds.attrs[k] = v
    return apply


def float_column(column: str, value: float) -> Damage:
    """`column` stored as float64 holding `value` (NaN, inf) in its first row."""
    table = {"pool_bytes": "sched", "free_bytes": "sched", "tokens_per_block": "sched_groups",
             "blocks": "blocks"}[column]

    def apply(f: h5py.File) -> None:
        retype(table, lambda d: np.dtype([(n, "<f8" if n == column else d[n]) for n in d.names]))(f)
        data = f[table][:]
        data[column][0] = value
        f[table][:] = data
    return apply


def drop_column(table: str, column: str) -> Damage:
    return retype(table, lambda d: np.dtype([(n, d[n]) for n in d.names if n != column]))


def extra_column(table: str) -> Damage:
    """A field a newer minor might add: readers ignore it (spec §2)."""
    return retype(table, lambda d: np.dtype([*((n, d[n]) for n in d.names), ("future_field", "<i8")]))


def two_dimensional(table: str) -> Damage:
    """The table rewritten as a 2-D array of its rows (two columns of rows)."""
    def apply(f: h5py.File) -> None:
        rows = f[table][:]
        rows = rows[: rows.size // 2 * 2].reshape(-1, 2)
        del f[table]
        f.create_dataset(table, data=rows, maxshape=(None, 2), chunks=True)
    return apply


def corrupt_chunk(table: str) -> Damage:
    """The first stored chunk of `table` overwritten with garbage in place (its gzip stream no longer
    decodes). h5py writes nothing here: the bytes are changed after the file is closed."""
    def apply(f: h5py.File) -> None:
        info = f[table].id.get_chunk_info(0)
        path, offset, size = f.filename, info.byte_offset, info.size
        f.close()
        with open(path, "r+b") as fh:
            fh.seek(offset)
            fh.write(bytes(range(256)) * (size // 256) + bytes(size % 256))
    return apply


def not_a_table(table: str) -> Damage:
    def apply(f: h5py.File) -> None:
        del f[table]
        f.create_group(table)
    return apply


def event(kind: int, value: int, request: int = -1, text: str = "", text_ref: tuple[int, int] | None = None) -> Damage:
    """One more /events row (kind and value as given; `text_ref`: its (text_off, text_len) as given)."""
    def apply(f: h5py.File) -> None:
        ev = f["events"]
        row = np.zeros(1, dtype=ev.dtype)
        row["t_ns"], row["kind"], row["request"], row["step"], row["layer"], row["device"] = 1_000_070, kind, request, -1, -1, -1
        row["value"] = value
        if text:
            heap = f["text"]
            start = heap.shape[0]
            data = np.frombuffer(text.encode("utf-8", "surrogateescape"), dtype=np.uint8)  # \udcXX: a raw byte
            heap.resize((start + data.size,))
            heap[start:] = data
            row["text_off"], row["text_len"] = start, data.size
        if text_ref is not None:
            row["text_off"], row["text_len"] = text_ref
        n = ev.shape[0]
        ev.resize((n + 1,))
        ev[n:] = row
    return apply


def version(text: str) -> Damage:
    def apply(f: h5py.File) -> None:
        major, minor = text.split(".")
        f.attrs["format_version"] = text
        f.attrs["format_major"] = np.int64(major)
        f.attrs["format_minor"] = np.int64(minor)
    return apply


def nested(depth: int) -> str:
    return '{"mode": "device_map", "device_map": ' + "[" * depth + "]" * depth + "}"


def gen_args(request: int, text: str) -> Damage:
    """Request `request`'s generate() arguments (JSON in /text, spec §4.1) replaced by `text`."""
    def apply(f: h5py.File) -> None:
        heap = f["text"]
        start = heap.shape[0]
        data = np.frombuffer(text.encode("utf-8", "surrogateescape"), dtype=np.uint8)
        heap.resize((start + data.size,))
        heap[start:] = data
        rows = f["requests"][:]
        i = int(np.flatnonzero(rows["request"] == request)[0])
        rows["gen_args_off"][i], rows["gen_args_len"][i] = start, data.size
        f["requests"][:] = rows
    return apply
