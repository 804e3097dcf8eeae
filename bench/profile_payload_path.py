"""Throughput of the sampled-payload path, stage by stage (sampling at b16 writes ~3 GiB).

    python bench/profile_payload_path.py [--mib 256] [--threads 1,2,4,8] [--json out.json]

What a sampling step's bytes go through after the device->host copy, each stage timed alone on
the same data (bf16-like: normal values rounded to bf16 bits, what random-weight K/V look like),
in GiB/s of raw input:

* **shuffle**: ``codec.shuffle_chunks`` (one numpy copy per payload, GIL-free);
* **compress**: ``codec.compress_shuffled_many`` at zstd levels 1 and -1 (faster, slightly
  larger), with 1..N zstd threads inside the one GIL-free call;
* **write**: ``TraceWriter.write_payload`` of pre-encoded frames through the writer's
  ``GuardedFile`` (h5py's fileobj driver: one Python call per HDF5 I/O) against the same HDF5
  calls on a plain h5py file (sec2 driver): what the storage-fault guard costs;
* **end to end**: ``PayloadSampler`` (CPU tensors) from submit to ``close()``, with its default
  and with more workers: what ``record()``'s close waits for.

Nothing here asserts a time; it prints a table (and JSON with --json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def bf16_like(n_bytes: int, seed: int = 0) -> np.ndarray:
    """uint16 bf16 bit patterns of N(0, 1) values (K/V of random-weight models look like this)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n_bytes // 2, dtype=np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def _best(fn: Any, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=256, help="raw MiB per stage (split in 16 MiB payloads)")
    p.add_argument("--threads", default="1,2,4,8")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--dir", default=None, help="where to write the test files (default: a temp dir)")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)

    import h5py

    from kvtrace.format import schema
    from kvtrace.format.codec import compress_shuffled_many, shuffle_chunks
    from kvtrace.format.writer import EncodedPayload, TraceWriter

    payload_bytes = 16 << 20
    n_payloads = max(1, (args.mib << 20) // payload_bytes)
    arrays = [bf16_like(payload_bytes, seed=i) for i in range(n_payloads)]
    raw = sum(a.nbytes for a in arrays)
    gib = raw / 2**30
    chunk = schema.payload_chunk_elements(2)
    out: dict[str, Any] = {"raw_bytes": raw, "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
                           "python": platform.python_version(), "h5py": h5py.__version__, "stages": {}}
    rows = out["stages"]

    shuffled: list[np.ndarray] = []
    rows["shuffle"] = gib / _best(lambda: shuffled.__setitem__(slice(None), [shuffle_chunks(a, chunk) for a in arrays]),
                                  args.repeat)
    frames: list[list[bytes]] = []
    for level in (1, -1):
        for threads in [int(t) for t in args.threads.split(",")]:
            def comp(level: int = level, threads: int = threads) -> None:
                frames[:] = compress_shuffled_many(shuffled, level, threads=threads)
            rows[f"compress_l{level}_t{threads}"] = gib / _best(comp, args.repeat)
        stored = sum(len(f) for fs in frames for f in fs)
        rows[f"ratio_l{level}"] = raw / stored
    frames[:] = compress_shuffled_many(shuffled, 1, threads=max(int(t) for t in args.threads.split(",")))
    payloads = [EncodedPayload(0, i, 0, schema.PayloadKind.KEY, schema.CacheDType.BFLOAT16, (a.size,), 2, a.size, f)
                for i, (a, f) in enumerate(zip(arrays, frames, strict=True))]
    stored_gib = sum(len(f) for fs in frames for f in fs) / 2**30

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        def guarded() -> None:
            path = Path(tmp) / "g.kvt.h5"
            with TraceWriter(path, flush_interval_s=60) as w:
                for pl in payloads:
                    w.write_payload(pl)
            path.unlink()

        def plain() -> None:  # the same chunk writes, HDF5's own sec2 driver, no Python per I/O
            path = Path(tmp) / "p.h5"
            with h5py.File(path, "w", libver=("v110", "v110")) as f:
                n_chunks = sum(len(pl.frames) for pl in payloads)
                ds = f.create_dataset("x", shape=(n_chunks * chunk,), maxshape=(None,), dtype="<u2",
                                      chunks=(chunk,), shuffle=True, compression=schema.FILTER_ZSTD,
                                      compression_opts=(1,), allow_unknown_filter=True)
                i = 0
                for pl in payloads:
                    for frame in pl.frames:
                        ds.id.write_direct_chunk((i * chunk,), frame, filter_mask=0)
                        i += 1
            path.unlink()

        rows["write_guarded"] = gib / _best(guarded, args.repeat)
        rows["write_plain_sec2"] = gib / _best(plain, args.repeat)
        rows["write_guarded_stored_gib_s"] = rows["write_guarded"] * stored_gib / gib
        e2e = end_to_end(arrays, Path(tmp), args.repeat)
        rows.update(e2e)

    width = max(len(k) for k in rows)
    print(f"payload path, {gib:.2f} GiB raw in {n_payloads} payloads of 16 MiB, {os.cpu_count()} CPUs, "
          f"{platform.platform()}")
    for k, v in rows.items():
        unit = "x" if k.startswith("ratio") else "GiB/s"
        print(f"  {k:<{width}}  {v:8.2f} {unit}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(out, indent=1), encoding="utf-8")
    return 0


def end_to_end(arrays: list[np.ndarray], tmp: Path, repeat: int) -> dict[str, float]:
    """PayloadSampler from submit to close(), CPU tensors (no device copy), per worker count."""
    import torch

    from kvtrace.format.schema import PayloadKind
    from kvtrace.format.writer import TraceWriter
    from kvtrace.recorder.sampling import PayloadSampler, SamplingSettings, default_workers

    tensors = [torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).reshape(1, 8, -1, 128) for a in arrays]
    gib = sum(a.nbytes for a in arrays) / 2**30
    res: dict[str, float] = {}
    for workers in sorted({2, default_workers()}):
        def run(workers: int = workers) -> None:
            path = tmp / "e.kvt.h5"
            with TraceWriter(path, flush_interval_s=60) as w:
                s = PayloadSampler(w, SamplingSettings(every_n_steps=1, queue_size=len(tensors) + 1), workers=workers)
                for i, t in enumerate(tensors):
                    s.submit(0, 0, i, PayloadKind.KEY, t)
                s.close()
            path.unlink()
        res[f"end_to_end_workers{workers}"] = gib / _best(run, repeat)
    return res


if __name__ == "__main__":
    sys.exit(main())
