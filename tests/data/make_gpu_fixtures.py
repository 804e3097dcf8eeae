#!/usr/bin/env python
"""Record the GPU-only cases of the analyser's planted-pathology suite (run on a CUDA machine).

    python tests/data/make_gpu_fixtures.py tests/data/gpu

writes one small trace per case (each < 2 MiB, the set < 12 MiB), `manifest.json` (which
detector must fire, how the trace was made) and `README.md` (the same in words, with the
device and versions). The CPU test suite (tests/analyzer/test_gpu_fixtures.py) loads them;
without them it skips. Every case uses a tiny random-weight model (tests.helpers.models), so
nothing is downloaded. Runtime is well under 4 minutes on one H100.

Cases (planted / clean):
  gpu_clean            clean control: every detector <= 0.1 (post_eos near zero with the recorder on)
  gpu_kept_cache       user code keeps the generate output's cache: post_eos on allocator bytes
  gpu_duplication      a cache layer keeps its old tensors in a list: growth_curve (allocator growth)
  gpu_fragmentation    interleaved odd-sized allocations during decoding: fragmentation
  gpu_prefill_eager    eager attention over a 4,096-token prompt: prefill_spike
  gpu_prefill_sdpa     its clean twin (SDPA): prefill_spike <= 0.1
  gpu_oom              a prompt whose eager attention cannot fit: oom
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, when not installed

import kvtrace  # noqa: E402
from tests.helpers.hfcache import output_cache  # noqa: E402
from tests.helpers.models import tiny_model, tiny_prompt  # noqa: E402

DEV = "cuda"
MiB = 1 << 20
HZ = 100  # telemetry rate: tiny models decode in milliseconds per step
# KV big enough (2 KiB per token) that allocator block rounding (512 B) is noise against it.
KV4x64 = dict(num_key_value_heads=4, num_attention_heads=4, head_dim=64)

# A small but not trivial model for the prefill cases: weights (~1.3 GiB fp16) dominate what is
# resident, as in real serving, so a transient spike is measured against something realistic.
PREFILL_MODEL = dict(hidden_size=2048, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=64, intermediate_size=8192, vocab_size=32000, max_position_embeddings=70000)


def model(name: str = "llama", dtype: torch.dtype = torch.float16, **extra: Any) -> Any:
    m = tiny_model(name, dtype=dtype, **extra).to(DEV)
    # Warm up once without the recorder: cuBLAS workspaces and kernels are allocated by the
    # first forward and would otherwise count as "retained" by the first recorded request.
    with torch.no_grad():
        m.generate(tiny_prompt(8).to(DEV), max_new_tokens=2, min_new_tokens=2, do_sample=False)
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    return m


def gen(m: Any, prompt: int, new: int, **kw: Any) -> Any:
    kw.setdefault("do_sample", False)
    return m.generate(tiny_prompt(prompt).to(DEV), max_new_tokens=new, min_new_tokens=new, **kw)


def case_clean(path: Path) -> dict:
    m = model("llama", **KV4x64)
    with kvtrace.record(m, path, telemetry_hz=HZ, structure_every=1):
        gen(m, 32, 64)
        gen(m, 48, 32)
    return {"detector": None, "note": "tiny llama (fp16, 4 KV heads x 64), two requests of 32+64 and 48+32 tokens, nothing planted"}


def case_kept_cache(path: Path) -> dict:
    m = model("llama", **KV4x64)
    kept = []
    with kvtrace.record(m, path, telemetry_hz=HZ, structure_every=1):
        out = gen(m, 32, 64, return_dict_in_generate=True)
        kept.append(output_cache(out))  # user code holding on to the cache after generate
        del out
    kept.clear()
    return {"detector": "post_eos", "kind": "retained_after_request",
            "note": "tiny llama (fp16, 4 KV heads x 64), generate(return_dict_in_generate=True) and the caller keeps "
                    "the generate output's cache; retained bytes measured on the allocator"}


def case_duplication(path: Path) -> dict:
    from transformers.cache_utils import DynamicLayer

    original = DynamicLayer.update

    def keeping_update(self: Any, k: Any, v: Any, *a: Any, **kw: Any) -> Any:
        if self.is_initialized:
            self.__dict__.setdefault("_old_copies", []).append((self.keys, self.values))
        return original(self, k, v, *a, **kw)

    m = model("llama", **KV4x64)
    DynamicLayer.update = keeping_update
    try:
        with kvtrace.record(m, path, telemetry_hz=HZ, structure_every=1):
            gen(m, 32, 64)
    finally:
        DynamicLayer.update = original
    return {"detector": "growth_curve", "kind": "unexplained_memory_growth",
            "note": "tiny llama (fp16, 4 KV heads x 64), DynamicLayer.update patched to keep every old K/V "
                    "tensor in a list on the layer; the cache structure looks normal, the allocator grows"}


class OddSizedAllocations:
    """A logits processor (runs once per decode step) that interleaves odd-sized allocations with
    the cache's: each step a large block is allocated and freed, then a smaller one is carved out
    of it and kept, leaving the rest of the segment as an inactive split block."""

    def __init__(self) -> None:
        self.kept: list[torch.Tensor] = []
        self.i = 0

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        big = (64 + 6 * self.i) * MiB + 4096 * (2 * self.i + 1)  # grows: never fits an earlier hole
        block = torch.empty(big, dtype=torch.uint8, device=scores.device)
        del block
        self.kept.append(torch.empty(int(big * 0.55) + 1536, dtype=torch.uint8, device=scores.device))
        self.i += 1
        time.sleep(0.02)  # let the telemetry thread see the split grow
        return scores


def case_fragmentation(path: Path) -> dict:
    from transformers import LogitsProcessorList

    m = model("llama")
    proc = OddSizedAllocations()
    with kvtrace.record(m, path, telemetry_hz=HZ, structure_every=1):
        gen(m, 32, 24, logits_processor=LogitsProcessorList([proc]))
        proc.kept.clear()
    return {"detector": "fragmentation", "kind": "split_fragmentation",
            "note": "tiny llama (fp16), 32+24 tokens; a logits processor allocates and frees a growing "
                    "64+6i MiB block each step and keeps a 55% block carved from it (held until after "
                    "the request), so inactive split blocks accumulate"}


def case_prefill(path: Path, attn: str) -> dict:
    m = model("llama", **PREFILL_MODEL)
    m.config._attn_implementation = attn
    if hasattr(m, "set_attn_implementation"):
        with contextlib.suppress(Exception):
            m.set_attn_implementation(attn)
    with kvtrace.record(m, path, telemetry_hz=HZ, structure_every=1):
        gen(m, 4096, 4)
    planted = attn == "eager"
    return {"detector": "prefill_spike" if planted else None, "kind": "eager_attention_spike" if planted else None,
            "twin_of": None if planted else "gpu_prefill_eager", "only": None if planted else "prefill_spike",
            "note": f"llama-like 8 layers, hidden 2048, 32 heads x 64 (8 KV heads), fp16, attn_implementation="
                    f"{attn!r}, 4,096-token prompt + 4 new tokens"}


def case_oom(path: Path) -> dict:
    m = model("llama", **PREFILL_MODEL)
    m.config._attn_implementation = "eager"
    if hasattr(m, "set_attn_implementation"):
        with contextlib.suppress(Exception):
            m.set_attn_implementation("eager")
    with kvtrace.record(m, path, telemetry_hz=HZ, structure_every=1):
        try:
            gen(m, 65536, 2)
        except torch.OutOfMemoryError:
            pass
    return {"detector": "oom", "kind": None,
            "note": "same model as gpu_prefill_eager; a 65,536-token prompt whose eager score matrices "
                    "(32 x 65,536^2 fp16 = 256 GiB) cannot be allocated; the OOM is caught after the recorder "
                    "closed the request"}


CASES = {
    "gpu_clean": case_clean,
    "gpu_kept_cache": case_kept_cache,
    "gpu_duplication": case_duplication,
    "gpu_fragmentation": case_fragmentation,
    "gpu_prefill_eager": lambda p: case_prefill(p, "eager"),
    "gpu_prefill_sdpa": lambda p: case_prefill(p, "sdpa"),
    "gpu_oom": case_oom,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--only", nargs="*", help="record only these cases")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("make_gpu_fixtures: needs a CUDA device", file=sys.stderr)
        return 69
    warnings.filterwarnings("ignore")
    args.outdir.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {}
    mpath = args.outdir / "manifest.json"
    if mpath.exists():
        manifest = json.loads(mpath.read_text())
    device = torch.cuda.get_device_name(0)
    import transformers

    for name, fn in CASES.items():
        if args.only and name not in args.only:
            continue
        path = args.outdir / f"{name}.kvt.h5"
        path.unlink(missing_ok=True)
        t = time.time()
        info = fn(path)
        gc.collect()
        torch.cuda.empty_cache()
        info.update(file=path.name, bytes=path.stat().st_size, seconds=round(time.time() - t, 1), device=device,
                    torch=torch.__version__, transformers=transformers.__version__, python=platform.python_version())
        manifest[name] = info
        report = kvtrace.analyze(path)
        scores = {r.name: round(r.score, 3) for r in report.results if r.status == "ran"}
        print(f"{name:20s} {info['bytes'] / MiB:5.2f} MiB {info['seconds']:5.1f} s  {scores}", flush=True)
    mpath.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    lines = ["# GPU-recorded fixtures for the analyser's planted-pathology suite", "",
             "Made by `python tests/data/make_gpu_fixtures.py tests/data/gpu` (see its docstring); tiny",
             "random-weight models from tests.helpers.models, nothing downloaded. Sizes in binary units.", ""]
    for _name, info in sorted(manifest.items()):
        lines.append(f"- `{info['file']}` ({info['bytes'] / MiB:.2f} MiB; {info['device']}, torch {info['torch']}, "
                     f"transformers {info['transformers']}): {info['note']}. Must fire: "
                     f"{info['detector'] or 'nothing (clean control)'}.")
    (args.outdir / "README.md").write_text("\n".join(lines) + "\n")
    total = sum(i["bytes"] for i in manifest.values())
    print(f"total {total / MiB:.2f} MiB in {args.outdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
