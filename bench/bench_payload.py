"""Payload path benchmark: throughput (MiB/s of raw input) and compression ratio of the codecs
a trace could use, on real K/V tensors from a forward pass, plus the lazy-open cost.

Run:  python bench/bench_payload.py [--tokens 1024] [--layers 4] [--repeat 3]

The K/V come from a forward pass of a random-weight model with Llama-3.1-8B attention geometry
(8 KV heads x 128, RoPE) in bf16 — real activations, not random bytes (random bytes do not
compress and say nothing). Weights are random, so treat the ratios as indicative for trained
models, not identical. Single-threaded; MB = 10^6 bytes of raw bf16 in (throughput convention).
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
import zlib

import numpy as np
import zstandard
from rich.console import Console
from rich.table import Table

from kvtrace.format import CacheDType, PayloadKind, Trace, TraceWriter, encode_payload
from kvtrace.format.codec import encode_chunks, shuffle_bytes
from kvtrace.format.schema import payload_chunk_elements
from kvtrace.units import format_bytes


def real_kv(tokens: int, layers: int) -> list[np.ndarray]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "llama", hidden_size=1024, intermediate_size=2048, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32000,
        max_position_embeddings=max(4096, tokens),
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, tokens))
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    out = []
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            out.append(t.contiguous().view(torch.int16).numpy().view(np.uint16))
    return out


def bench_codec(name: str, fn, arrays: list[np.ndarray], repeat: int) -> tuple[float, float]:
    raw = sum(a.nbytes for a in arrays)
    best = float("inf")
    stored = 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        stored = sum(fn(a) for a in arrays)
        best = min(best, time.perf_counter() - t0)
    return raw / best / 2**20, raw / stored  # MiB/s: binary units, like every size we print


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    arrays = real_kv(args.tokens, args.layers)
    raw = sum(a.nbytes for a in arrays)
    chunk = payload_chunk_elements(2)

    def chunks_of(a: np.ndarray):
        flat = a.reshape(-1)
        for i in range(0, flat.size, chunk):
            yield flat[i : i + chunk]

    def plain_zstd(level):
        c = zstandard.ZstdCompressor(level=level)
        return lambda a: sum(len(c.compress(p.tobytes())) for p in chunks_of(a))

    def gzip_(level, shuffle):
        def fn(a):
            return sum(len(zlib.compress(shuffle_bytes(p, 2) if shuffle else p.tobytes(), level))
                       for p in chunks_of(a))
        return fn

    rows = [
        ("shuffle + zstd -1 (kvtrace)", lambda a: sum(map(len, encode_chunks(a, chunk, level=1)))),
        ("shuffle + zstd -3 (kvtrace default)", lambda a: sum(map(len, encode_chunks(a, chunk, level=3)))),
        ("zstd -3, no shuffle", plain_zstd(3)),
        ("gzip -4, no shuffle", gzip_(4, False)),
        ("shuffle + gzip -4", gzip_(4, True)),
    ]
    print(f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, "
          f"python {platform.python_version()}, zstandard {zstandard.__version__}")
    print(f"input: {len(arrays)} K/V tensors [1, 8, {args.tokens}, 128] bf16 from a forward pass, "
          f"{format_bytes(raw)} raw; 256 KiB chunks; single thread; best of {args.repeat}")
    table = Table("codec", "MiB/s in", "ratio", box=None)
    for name, fn in rows:
        mibps, ratio = bench_codec(name, fn, arrays, args.repeat)
        table.add_row(name, f"{mibps:.0f}", f"{ratio:.3f}")
    for col in table.columns[1:]:
        col.justify = "right"
    Console().print(table)

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "b.kvt.h5")
        t0 = time.perf_counter()
        with TraceWriter(path) as w:
            for i, a in enumerate(arrays):
                w.write_payload(encode_payload(0, 0, i // 2, PayloadKind.KEY, CacheDType.BFLOAT16, a))
            for i in range(200_000):  # a long recording's worth of structure rows
                w.append("kv", (0, i // 36, i % 36, 1, 0, 3, 3, [1, 8, i, 128], [1, 8, i, 128],
                                i, i, 4096 * i, 4096 * i, 4096 * i, 1, 2, 0, 0, 0, i))
        write_s = time.perf_counter() - t0
        size = os.path.getsize(path)
        t0 = time.perf_counter()
        with Trace(path) as t:
            t.meta  # noqa: B018
            n_requests = len(t.requests)
        open_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        with Trace(path) as t:
            t.payload(len(arrays) - 1)
        one_payload_ms = (time.perf_counter() - t0) * 1e3
    print(f"\nwriter end to end: {format_bytes(raw)} payload + 200,000 /kv rows in {write_s:.2f} s "
          f"-> {format_bytes(size)} file")
    print(f"lazy open (root, /meta, /requests={n_requests} rows): {open_ms:.1f} ms; "
          f"one payload decoded: {one_payload_ms:.1f} ms")


if __name__ == "__main__":
    main()
