#!/usr/bin/env python
"""Record the GPU cases of the labelled accuracy suite (run on a CUDA machine):

    python tests/accuracy/make_gpu_accuracy_fixtures.py OUTDIR [--only NAME ...]

Writes one small trace per case (no tensor payloads unless a case samples contents), a
`manifest.json` (label, detector, accepted kinds, how it was made, device, versions, size) and
prints every case's detector scores. tests/accuracy/test_gpu_accuracy.py asserts the targets on
the committed copies in tests/data/accuracy (no GPU needed there). Models are tiny or width-
shrunk random-weight models from real configs; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))
sys.path.insert(0, str(HERE.parent))

from tests.helpers.hfcache import cache_kwargs, call_cache, output_cache  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
HZ = 100  # telemetry rate: tiny models decode a step in a few ms
KV4x64 = dict(num_key_value_heads=4, num_attention_heads=4, head_dim=64)
KV16x64 = dict(num_key_value_heads=16, num_attention_heads=16, head_dim=64)
# Weights (~1.3 GiB fp16) dominate what is resident, as in serving: transients are measured
# against something realistic. 32 query heads: eager scores are 32 x S^2 per layer.
PREFILL_MODEL = dict(hidden_size=2048, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=64, intermediate_size=8192, vocab_size=32000, max_position_embeddings=70000)


def _torch() -> Any:
    import torch

    return torch


def model(name: str = "llama", dtype: Any = None, warm: bool = True, attn: str | None = None, **extra: Any) -> Any:
    torch = _torch()
    from tests.helpers.models import tiny_model, tiny_prompt

    if attn:
        extra["attn_implementation"] = attn
    m = tiny_model(name, dtype=dtype or torch.float16, **extra).to("cuda")
    if warm:  # a warm process: first-use workspaces exist before recording, as in serving
        with torch.no_grad():
            m.generate(tiny_prompt(8).to("cuda"), max_new_tokens=2, min_new_tokens=2, do_sample=False)
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
    return m


def gen(m: Any, prompt: int, new: int, batch: int = 1, **kw: Any) -> Any:
    from tests.helpers.models import tiny_prompt

    kw.setdefault("do_sample", False)
    return m.generate(tiny_prompt(prompt, batch=batch).to("cuda"), max_new_tokens=new, min_new_tokens=new, **kw)


def rec(m: Any, path: Path, **opts: Any) -> Any:
    import kvtrace

    opts.setdefault("telemetry_hz", HZ)
    return kvtrace.record(m, path, **opts)


# ---- clean controls ------------------------------------------------------------------------------

def clean_fresh_single(path: Path) -> dict:
    m = model("llama", warm=False, **KV4x64)  # run in its own process: nothing ran on the GPU before
    with rec(m, path):
        gen(m, 32, 32)
    return {"note": "tiny llama fp16 4x64 KV heads, ONE request in a fresh process (no warm-up): the first "
                    "matmul creates the cuBLAS workspace during the request"}


def clean_gptoss_long_eager(path: Path) -> dict:
    torch = _torch()
    from transformers import AutoModelForCausalLM

    from kvtrace.presets import preset_config

    cfg = preset_config("gpt-oss-120b", layers=4, width_scale=1 / 16, vocab=4096)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to("cuda").eval()
    m.generation_config.pad_token_id = 0
    with torch.no_grad():
        gen(m, 8, 2)
    with rec(m, path):
        gen(m, 3840, 16)
    return {"note": "gpt-oss-120b KV geometry (8 KV heads x 64, window 128, sliding/full alternating; 4 layers, "
                    "width 1/16), bf16, eager attention, 3,840-token prompt + 16 tokens: an ordinary long eager prefill"}


def clean_multi(path: Path) -> dict:
    from kvtrace.recorder.sampling import SamplingSettings

    m = model("llama", **KV4x64)
    with rec(m, path, sampling=SamplingSettings(every_n_steps=8)):
        gen(m, 32, 32)
        gen(m, 16, 24, batch=4)
        gen(m, 48, 16)
    return {"note": "tiny llama fp16 4x64, three requests in one process (32+32, batch 4 16+24, 48+16), K/V "
                    "contents sampled every 8 steps"}


def clean_hybrid_sdpa(path: Path) -> dict:
    m = model("gemma3_text")
    with rec(m, path):
        gen(m, 200, 40)
        gen(m, 20, 20)
    return {"note": "tiny gemma3 (sliding/full hybrid, window 8) fp16 sdpa, 200+40 and 20+20 tokens"}


def clean_eager_4k(path: Path) -> dict:
    m = model("llama", attn="eager", **PREFILL_MODEL)
    with rec(m, path):
        gen(m, 4096, 4)
    return {"note": "llama-like 8 layers, hidden 2048, 32 heads x 64 (8 KV), fp16, eager attention, 4,096-token "
                    "prompt: an ordinary long eager prefill on a large device"}


def clean_sdpa_4k(path: Path) -> dict:
    m = model("llama", attn="sdpa", **PREFILL_MODEL)
    with rec(m, path):
        gen(m, 4096, 4)
    return {"note": "same model as clean_eager_4k with SDPA attention"}


# ---- planted -------------------------------------------------------------------------------------

def retention_hook(path: Path) -> dict:
    m = model("llama", **KV4x64)
    stash: list[Any] = []

    def keep(module: Any, args: Any, kwargs: dict) -> None:
        c = call_cache(args, kwargs)
        if c is not None and (not stash or stash[-1] is not c):
            stash.append(c)

    h = m.register_forward_pre_hook(keep, with_kwargs=True)
    with rec(m, path):
        gen(m, 32, 64)
        gen(m, 32, 32)
    h.remove()
    stash.clear()
    return {"note": "tiny llama fp16 4x64, a forward pre-hook stashes every cache it sees in a list"}


def retention_global_list(path: Path) -> dict:
    m = model("gemma3_text")
    kept: list[Any] = []
    with rec(m, path):
        for p in (32, 48):
            out = gen(m, p, 32, return_dict_in_generate=True)
            kept.append(output_cache(out))
            del out
    kept.clear()
    return {"note": "tiny gemma3 hybrid fp16, every request's cache appended to a list"}


def dup_cat_subclass(path: Path) -> dict:
    from transformers import DynamicCache

    from tests.helpers import cases

    m = model("qwen3", **KV16x64)
    with rec(m, path):
        c = DynamicCache()
        c.layer_class_to_replicate = cases._cat_layer_class()
        gen(m, 32, 96, **cache_kwargs(m, c))
        del c
    return {"note": "tiny qwen3 fp16 16x64 KV heads, a DynamicLayer subclass (torch.cat) keeps every earlier K/V "
                    "in a list: copies outside the cache's storages"}


class OddTemporaries:
    """Logits processor (once per decode step): two odd-sized allocations a step, a temporary and a
    smaller one kept alive (every other allocation kept). Sizes grow past the caching allocator's
    10 MiB large-segment threshold, so each temporary gets its own segment, the kept block is carved
    from it after it is freed, and the rest of that segment stays behind as an inactive split block."""

    def __init__(self, base: int, grow: int, keep: float) -> None:
        self.kept: list[Any] = []
        self.i = 0
        self.base, self.grow, self.keep = base, grow, keep

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        torch = _torch()
        size = self.base + self.grow * self.i + 4097
        t = torch.empty(size, dtype=torch.uint8, device=scores.device)
        del t
        self.kept.append(torch.empty(int(size * self.keep) + 1025, dtype=torch.uint8, device=scores.device))
        self.i += 1
        return scores


def frag_user_decode(path: Path) -> dict:
    """Run in a subprocess with PYTORCH_CUDA_ALLOC_CONF set by the caller."""
    from transformers import LogitsProcessorList

    m = model("llama", **KV4x64)
    proc = OddTemporaries(12 * MiB, 512 << 10, 0.6)
    with rec(m, path):
        gen(m, 32, 64, logits_processor=LogitsProcessorList([proc]))
        gen(m, 32, 16)
    proc.kept.clear()
    return {"note": "tiny llama fp16 4x64, 32+64 tokens; a logits processor allocates an odd-sized temporary "
                    "(12 MiB + 512 KiB*i + 4,097 B) each decode step, frees it and keeps a 60% block (held until after "
                    f"a second request); PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF')!r}"}


def frag_cache_growth(path: Path) -> dict:
    """Run in a subprocess with PYTORCH_CUDA_ALLOC_CONF set by the caller."""
    m = model("llama", num_hidden_layers=4, num_key_value_heads=8, num_attention_heads=8, head_dim=128,
              hidden_size=1024, intermediate_size=2048)
    with rec(m, path):
        gen(m, 16, 240, batch=16)
    return {"note": f"llama 4 layers, 8 KV heads x 128, fp16, batch 16, 16+240 tokens (every step torch.cat grows "
                    f"each layer's K/V by 64 KiB) with PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF')!r}"}


def _eager_peak(m: Any, prompt: int) -> int:
    torch = _torch()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        gen(m, prompt, 2)
    peak = int(torch.cuda.max_memory_allocated())
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    return peak


def prefill_near_cap(path: Path) -> dict:
    torch = _torch()
    m = model("llama", attn="eager", **PREFILL_MODEL)
    _eager_peak(m, 4096)
    peak = int(torch.cuda.max_memory_reserved())  # the cap applies to reserved memory
    total = torch.cuda.get_device_properties(0).total_memory
    frac = peak / 0.97 / total
    torch.cuda.set_per_process_memory_fraction(frac)
    try:
        with rec(m, path):
            try:
                gen(m, 4096, 4)
            except torch.OutOfMemoryError:
                pass
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    return {"note": f"llama-like 8 layers hidden 2048, 32 heads, fp16, eager, 4,096-token prompt under "
                    f"set_per_process_memory_fraction({frac:.4f}) (reserved peak measured first: {peak / GiB:.2f} GiB "
                    "= 97% of the allowed memory)"}


def prefill_near_device(path: Path) -> dict:
    torch = _torch()
    m = model("llama", attn="eager", **PREFILL_MODEL)
    p4k = _eager_peak(m, 4096)
    resident = torch.cuda.memory_allocated()
    free = torch.cuda.mem_get_info()[0]
    # eager transients grow with S^2: aim the peak at ~88% of what the device holds
    s = int(4096 * ((0.88 * (free + resident) - resident) / max(p4k - resident, 1)) ** 0.5) // 256 * 256
    s = max(4096, min(s, 65536))
    with rec(m, path):
        try:
            gen(m, s, 2)
        except torch.OutOfMemoryError:
            pass
    return {"note": f"same model, eager, a {s:,}-token prompt sized so the eager prefill peaks near the device's "
                    "memory (no cap)"}


def oom_cap(path: Path) -> dict:
    torch = _torch()
    m = model("llama", attn="eager", **PREFILL_MODEL)
    torch.cuda.set_per_process_memory_fraction(0.05)
    try:
        with rec(m, path):
            gen(m, 32, 4)
            try:
                gen(m, 8192, 2)
            except torch.OutOfMemoryError:
                pass
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    return {"note": "same model, eager, set_per_process_memory_fraction(0.05) then an 8,192-token prompt "
                    "(eager scores 4 GiB per layer)"}


def oom_real(path: Path) -> dict:
    torch = _torch()
    m = model("llama", attn="eager", **PREFILL_MODEL)
    with rec(m, path):
        gen(m, 32, 4)
        try:
            gen(m, 65536, 2)
        except torch.OutOfMemoryError:
            pass
    return {"note": "same model, eager, a 65,536-token prompt whose scores (256 GiB) exceed the device"}


# ---- owners decide (every request checked, copies vs temporaries, by-design growth) ---------------

KEPT: list[Any] = []


class RaiseAt:
    """A stopping criterion (user code) raising once the sequence grew ``n`` tokens."""

    def __init__(self, n: int, exc: BaseException) -> None:
        self.n, self.exc, self.start = n, exc, None

    def __call__(self, input_ids: Any, scores: Any, **kw: Any) -> Any:
        torch = _torch()
        self.start = input_ids.shape[-1] if self.start is None else self.start
        if input_ids.shape[-1] - self.start >= self.n:
            raise self.exc
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _failing_request(path: Path, keep: bool) -> None:
    """A request whose stopping criterion raises at decode step 24, then a plain one; the exception is
    kept (``keep``) or only its text."""
    from transformers import StoppingCriteriaList

    m = model("llama", **KV16x64)
    with rec(m, path):
        try:
            gen(m, 64, 64, stopping_criteria=StoppingCriteriaList([RaiseAt(24, ValueError("criterion"))]))
        except ValueError as exc:
            KEPT.append(exc if keep else str(exc))
        gen(m, 32, 16)
    KEPT.clear()


def retention_kept_exception(path: Path) -> dict:
    _failing_request(path, keep=True)
    return {"note": "tiny llama fp16 16x64; a stopping criterion raises at decode step 24 and the caller keeps "
                    "the exception (its traceback holds the cache); outcome error",
            "owner": "exception (its traceback)"}


def retention_slice_views(path: Path) -> dict:
    m = model("llama", **KV16x64)
    with rec(m, path):
        for p in (64, 80, 96):
            out = gen(m, p, 32, return_dict_in_generate=True)
            KEPT.append(output_cache(out).layers[1].keys[:, :, -1:])
            del out
    KEPT.clear()
    return {"note": "tiny llama fp16 16x64; a one-token view of layer 1's keys kept after each of 3 requests "
                    "(each holds the layer's whole key storage): the issue's small accumulating slice",
            "owner": "retention accumulates"}


def dup_hook_clones(path: Path) -> dict:
    from kvtrace.recorder.hooks import cache_of_output

    m = model("llama", **KV16x64)
    copies: list[Any] = []

    def keep(module: Any, args: Any, kwargs: dict, output: Any) -> None:
        c = cache_of_output(output)
        if c is not None:
            copies.extend(t.clone() for layer in c.layers for t in (layer.keys, layer.values))

    h = m.register_forward_hook(keep, with_kwargs=True)
    with rec(m, path, memory_history=True):
        gen(m, 32, 96)
    h.remove()
    copies.clear()
    return {"note": "tiny llama fp16 16x64, 32+96 tokens; a forward hook keeps clones of every layer's K and V "
                    "each step (user code keeping copies of the cache during decode); memory history on",
            "owner": "sized like the cache's own K/V"}


def non_kv_odd_temporaries(path: Path) -> dict:
    torch = _torch()
    m = model("llama", **KV16x64)
    kept: list[Any] = []

    def keep(module: Any, args: Any, output: Any) -> None:
        kept.append(torch.empty(3_000_009, dtype=torch.uint8, device="cuda"))

    h = m.register_forward_hook(keep)
    with rec(m, path, memory_history=True):
        gen(m, 32, 96)
    h.remove()
    kept.clear()
    return {"note": "tiny llama fp16 16x64, 32+96 tokens; a forward hook keeps an odd-sized 2.9 MiB buffer each "
                    "step (not shaped like K/V); memory history on", "owner": "unknown"}


def clean_scores_logits(path: Path) -> dict:
    m = model("llama", vocab_size=131072, **KV4x64)
    with rec(m, path):
        out = gen(m, 32, 256, return_dict_in_generate=True, output_scores=True, output_logits=True)
        scores = out.scores
        del out
        gen(m, 16, 8)
    del scores
    return {"note": "tiny llama fp16 4x64, vocabulary 131,072; output_scores + output_logits over 256 steps "
                    "(512 KiB float32 rows per step, asked for), the caller keeps the scores"}


def clean_beams(path: Path) -> dict:
    m = model("qwen3", **KV4x64)
    with rec(m, path):
        gen(m, 32, 48, num_beams=4, num_return_sequences=2)
    return {"note": "tiny qwen3 fp16 4x64; beam search, 4 beams, 2 returned sequences"}


def clean_prompt_lookup(path: Path) -> dict:
    torch = _torch()
    from tests.helpers.models import tiny_prompt

    m = model("llama", **KV4x64)
    prompt = torch.cat([tiny_prompt(32), tiny_prompt(32)], dim=-1).to("cuda")
    with rec(m, path):
        m.generate(prompt, max_new_tokens=48, min_new_tokens=48, do_sample=False, prompt_lookup_num_tokens=4)
    return {"note": "tiny llama fp16 4x64; prompt-lookup assisted decoding on a repeated 64-token prompt"}


def clean_static_compiled(path: Path) -> dict:
    m = model("llama", **KV4x64)
    gen(m, 32, 64, cache_implementation="static")  # compile (same shapes) outside the recording
    with rec(m, path):
        gen(m, 32, 64, cache_implementation="static")
        gen(m, 32, 64, cache_implementation="static")
    return {"note": "tiny llama fp16 4x64; generate(cache_implementation='static') compiled by transformers "
                    "(compiled once before recording), two requests"}


def clean_error_dropped(path: Path) -> dict:
    _failing_request(path, keep=False)
    return {"note": "tiny llama fp16 16x64; a stopping criterion raises at step 24, the caller keeps only str(exc)",
            "outcomes": ["error", "ok"]}


def oom_kept_requests(path: Path) -> dict:
    torch = _torch()
    m = model("llama", max_position_embeddings=8192, **KV16x64)
    base = torch.cuda.memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory
    frac = (base + 1 * GiB) / total
    torch.cuda.set_per_process_memory_fraction(frac)
    kept: list[Any] = []
    try:
        with rec(m, path):
            for _ in range(128):
                try:
                    kept.append(gen(m, 4000, 4, return_dict_in_generate=True))
                except torch.OutOfMemoryError:
                    break
    finally:
        kept.clear()
        torch.cuda.set_per_process_memory_fraction(1.0)
    return {"note": f"tiny llama fp16 16x64 under set_per_process_memory_fraction({frac:.4f}) (resident + 1 GiB); "
                    "every request's output (4,000-token prompt, ~31 MiB of KV) kept until one runs out",
            "owner": "KV of earlier requests"}


RET, DUP = ["retained_after_request"], ["duplication"]
CASES: dict[str, tuple[Any, str | None, str | None, list[str], bool, dict[str, str]]] = {
    # name: (fn, pathology, detector, kinds, own process, env)
    "gpu_clean_fresh_single": (clean_fresh_single, None, None, [], True, {}),
    "gpu_clean_gptoss_long_eager": (clean_gptoss_long_eager, None, None, [], False, {}),
    "gpu_clean_multi": (clean_multi, None, None, [], False, {}),
    "gpu_clean_hybrid_sdpa": (clean_hybrid_sdpa, None, None, [], False, {}),
    "gpu_clean_eager_4k": (clean_eager_4k, None, None, [], False, {}),
    "gpu_clean_sdpa_4k": (clean_sdpa_4k, None, None, [], False, {}),
    "gpu_retention_hook": (retention_hook, "retention", "post_eos", RET, False, {}),
    "gpu_retention_global_list": (retention_global_list, "retention", "post_eos", RET, False, {}),
    "gpu_dup_cat_subclass": (dup_cat_subclass, "duplication", "growth_curve", DUP, False, {}),
    "gpu_frag_user_decode": (frag_user_decode, "fragmentation", "fragmentation", ["split_fragmentation"], True,
                             {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}),
    "gpu_frag_user_decode_expandable": (frag_user_decode, "fragmentation", "fragmentation", ["split_fragmentation"],
                                        True, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    "gpu_clean_batch16_noexp": (frag_cache_growth, None, None, [], True,
                                {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}),
    "gpu_clean_batch16_exp": (frag_cache_growth, None, None, [], True,
                              {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    "gpu_prefill_near_cap": (prefill_near_cap, "prefill_spike", "prefill_spike", ["eager_attention_spike"], False, {}),
    "gpu_prefill_near_device": (prefill_near_device, "prefill_spike", "prefill_spike", ["eager_attention_spike"],
                                False, {}),
    "gpu_oom_cap": (oom_cap, "oom", "oom", ["oom_memory_cap"], False, {}),
    "gpu_oom_real": (oom_real, "oom", "oom", ["oom_prefill"], False, {}),
    # other mechanisms of the same classes, decided by owners
    "gpu_retention_kept_exception": (retention_kept_exception, "retention", "post_eos", RET, False, {}),
    "gpu_retention_slice_views": (retention_slice_views, "retention", "post_eos", RET, False, {}),
    "gpu_dup_hook_clones": (dup_hook_clones, "duplication", "growth_curve", DUP, False, {}),
    "gpu_non_kv_odd_temporaries": (non_kv_odd_temporaries, "non_kv_growth", "growth_curve",
                                   ["unexplained_memory_growth"], False, {}),
    "gpu_clean_scores_logits": (clean_scores_logits, None, None, [], False, {}),
    "gpu_clean_beams": (clean_beams, None, None, [], False, {}),
    "gpu_clean_prompt_lookup": (clean_prompt_lookup, None, None, [], False, {}),
    "gpu_clean_static_compiled": (clean_static_compiled, None, None, [], False, {}),
    "gpu_clean_error_dropped": (clean_error_dropped, None, None, [], False, {}),
    "gpu_oom_kept_requests": (oom_kept_requests, "oom", "oom", ["oom_memory_cap", "oom_retained_kv"], False, {}),
}
OWNER_CASES = [n for n in CASES if n.startswith(("gpu_retention_kept", "gpu_retention_slice", "gpu_dup_hook",
                                             "gpu_non_kv", "gpu_clean_scores", "gpu_clean_beams",
                                             "gpu_clean_prompt", "gpu_clean_static", "gpu_clean_error",
                                             "gpu_oom_kept"))]


def _run_one(name: str, outdir: Path) -> dict:
    torch = _torch()
    import transformers

    fn = CASES[name][0]
    path = outdir / f"{name}.kvt.h5"
    path.unlink(missing_ok=True)
    t = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        info = fn(path)
    gc.collect()
    torch.cuda.empty_cache()
    info.update(file=path.name, bytes=path.stat().st_size, seconds=round(time.time() - t, 1),
                device=torch.cuda.get_device_name(0), torch=torch.__version__,
                transformers=transformers.__version__, python=platform.python_version())
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.outdir.mkdir(parents=True, exist_ok=True)
    if args.child:  # one case in this (fresh) process; its manifest entry on stdout's last line
        print(json.dumps(_run_one(args.child, args.outdir)))
        return 0
    manifest_path = args.outdir / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    own = [n for n, c in CASES.items() if c[4] and (not args.only or n in args.only)]
    rest = [n for n, c in CASES.items() if not c[4] and (not args.only or n in args.only)]
    for name in own + rest:  # own-process cases first: this process has not touched CUDA yet
        fn, pathology, det, kinds, separate, env = CASES[name]
        try:
            if separate:
                p = subprocess.run([sys.executable, str(HERE), str(args.outdir), "--child", name],
                                   capture_output=True, text=True, env={**os.environ, **env}, timeout=300)
                if p.returncode:
                    raise RuntimeError(p.stderr[-1500:])
                info = json.loads(p.stdout.strip().splitlines()[-1])
            else:
                info = _run_one(name, args.outdir)
        except Exception as exc:  # noqa: BLE001 - one failed case must not lose the others
            print(f"{name}: FAILED {type(exc).__name__}: {exc}", flush=True)
            continue
        info.update(pathology=pathology, detector=det, kinds=kinds, env=env)
        manifest[name] = info
        manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        with contextlib.suppress(Exception):
            import kvtrace

            r = kvtrace.analyze(args.outdir / info["file"])
            top = sorted(((round(f.score, 2), f.detector, f.kind) for f in r.findings if f.score > 0), reverse=True)
            print(f"{name:30s} {info['bytes'] / 1024:7.1f} KiB {info['seconds']:5.1f} s {top[:4]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
