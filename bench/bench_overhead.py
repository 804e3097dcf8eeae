"""What the recorder costs a generate call: paired A/B runs that can resolve 1%.

    python bench/bench_overhead.py --suite gpu --json out.json          # the matrix below, on a GPU
    python bench/bench_overhead.py --suite mechanisms --json out.json   # one mechanism at a time
    python bench/bench_overhead.py --suite anchors --json out.json      # memory history, profiler
    python bench/bench_overhead.py --suite smoke --device cpu           # tiny, seconds (tests/)

Method:

* **One process per job** (a model, a shape and a set of variants); memory history and the
  profiler, which were seen to leave a process lastingly slower, run only in processes of their own
  ("anchors"). The parent process never imports torch.
* **Warm-up** of the base path and of every variant before any timed run.
* **ABBA pairs:** each pair is one base run and one variant run; consecutive pairs swap the order
  (base-variant, variant-base, ...), and the variants of a job take turns. A pair's ratio is
  variant time / base time.
* **Median and 95% bootstrap CI** of the pair ratios (percentile bootstrap of the median, 4,000
  resamples, fixed seed), for three times: the **whole call** (``with kvtrace.record(model,
  path): model.generate(...)``, recorder start and close included; for base, generate alone),
  **generate** inside the block, and the **decode loop** (first to last token, per step, timed by a
  no-op logits processor that every run carries).
* **Shapes:** batch 1 with a 128-token prompt (launch-bound: the model's thread is the bottleneck,
  so anything that takes the GIL or the CPU from it shows) and batch 16 with a 1,024-token prompt
  (GPU-bound). Random weights from the presets' real configs, bf16.
* **Before/after:** ``--before DIR`` runs every recorder job a second time with the kvtrace package
  found in DIR (e.g. a ``git worktree`` of an older commit), in the same call, on the same machine.

Variants (recorder options, or mechanism-isolation patches; see ``VARIANTS``):

  aa           nothing attached (base against base): the noise floor and any order bias of the
               harness itself; its CI is what a zero-cost variant would show
  recorder     kvtrace.record() defaults
  sampling32   the defaults + K/V content sampling every 32 steps (incremental)
  full_exit    the defaults + empty_cache=True (gc.collect and empty_cache after every request)
  bare         the recorder opened and closed around generate with no step hooks, no telemetry
               thread, the flusher at its 60 s maximum, no retention tracking: what opening,
               closing and the per-request begin/finish work cost
  m_hooks      bare + the two step hooks, structure read only at prefill and the last step
  m_structure  bare + hooks + the per-layer structure every 8th step (no retention bookkeeping)
  m_retention  m_structure + retention bookkeeping (weak references to every KV storage)
  m_flusher    bare + the writer's flusher thread at its default 1 s interval
  m_telemetry  bare + the telemetry thread (NVML + allocator stats + RSS) at its default rate
  m_nvml       bare + the telemetry thread with NVML and RSS only
  m_allocator  bare + the telemetry thread with allocator stats and RSS only
  m_*_xN       amplified: a mechanism run N times as often as its default (telemetry at 500 Hz
               instead of 20, the flusher every 50 ms instead of 1 s, the structure every step
               instead of every 8th): its cost at the default rate is (ratio - 1) / N, resolvable
               where the plain variant's cost is below the run-to-run noise
  lo_*         leave-one-out: the defaults minus one mechanism (lo_telemetry: no telemetry thread,
               lo_flusher: flusher at 60 s, lo_retention: no retention tracking, lo_structure: the
               structure only at prefill and the last step, lo_hooks: no step hooks at all); its
               drop from "recorder" is that mechanism's share, interactions included
  memhist      torch.cuda.memory._record_memory_history() (anchor; own process)
  profiler     torch.profiler.profile(profile_memory=True) (anchor; own process)

  lo_owners    the defaults without owner readings (allocator snapshot at each request's end)
  owners_x     owner readings every 0.1 s instead of every 60 s (amplified periodic snapshot)

    python bench/bench_overhead.py --suite paths --json out.json   # every path a user runs

The "serving" workload (``--suite serving``) times ``generate_batch`` (continuous batching, CUDA
graphs on) at 16 and 64 concurrent requests, with the same ABBA pairs, A-vs-A control and CIs;
its direct cost is the wall time inside the serving recorder's per-step bodies (``_step`` and the
first-token scan) divided by the scheduler steps the trace holds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Recorder options per variant (all exist in older kvtrace versions too, so --before runs them).
_BARE = {"structure_every": 10**9, "retention": False, "flush_interval_s": 60.0}
VARIANTS: dict[str, dict[str, Any]] = {
    "recorder": {"options": {}},
    "sampling32": {"options": {"sampling": {"every_n_steps": 32}}},
    "full_exit": {"options": {"empty_cache": True}},
    "bare": {"options": _BARE, "patch": ("nohooks", "notelemetry")},
    "m_hooks": {"options": _BARE, "patch": ("notelemetry",)},
    "m_structure": {"options": {**_BARE, "structure_every": 8}, "patch": ("notelemetry",)},
    "m_retention": {"options": {**_BARE, "structure_every": 8, "retention": True}, "patch": ("notelemetry",)},
    "m_flusher": {"options": {**_BARE, "flush_interval_s": 1.0}, "patch": ("nohooks", "notelemetry")},
    "m_telemetry": {"options": _BARE, "patch": ("nohooks",)},
    "m_nvml": {"options": {**_BARE, "allocator": False}, "patch": ("nohooks",)},
    "m_allocator": {"options": {**_BARE, "nvml": False}, "patch": ("nohooks",)},
    # Amplified: the same mechanism run N times as often, so that its cost rises above the
    # run-to-run noise; its cost at the default rate is (ratio - 1) / N (see "amplify").
    "m_nvml_x25": {"options": {**_BARE, "allocator": False, "telemetry_hz": 500.0}, "patch": ("nohooks",),
                   "amplify": 25},
    "m_allocator_x25": {"options": {**_BARE, "nvml": False, "telemetry_hz": 500.0}, "patch": ("nohooks",),
                        "amplify": 25},
    "m_flusher_x20": {"options": {**_BARE, "flush_interval_s": 0.05}, "patch": ("nohooks", "notelemetry"),
                      "amplify": 20},
    "m_structure_x8": {"options": {**_BARE, "structure_every": 1}, "patch": ("notelemetry",), "amplify": 8},
    "m_retention_x8": {"options": {**_BARE, "structure_every": 1, "retention": True}, "patch": ("notelemetry",),
                       "amplify": 8},
    # Leave-one-out: the default recorder minus one mechanism; its drop from "recorder" is what that
    # mechanism costs inside the whole (interactions included), at the default rates.
    "lo_telemetry": {"options": {}, "patch": ("notelemetry",)},
    "lo_flusher": {"options": {"flush_interval_s": 60.0}},
    "lo_retention": {"options": {"retention": False}},
    "lo_structure": {"options": {"structure_every": 10**9}},
    "lo_hooks": {"options": {}, "patch": ("nohooks",)},
    "lo_owners": {"options": {"owners": False}},
    "owners_x": {"options": {"owners_every_s": 0.1}, "amplify": 600},
    "aa": {},  # nothing attached: an A/A pair, the harness's own noise floor and order bias
    "memhist": {"anchor": True},
    "profiler": {"anchor": True},
}
MECHANISMS = ("bare", "m_hooks", "m_structure", "m_retention", "m_flusher", "m_telemetry", "m_nvml",
              "m_allocator", "recorder", "full_exit")
LEAVE_ONE_OUT = ("aa", "recorder", "bare", "lo_telemetry", "lo_flusher", "lo_retention", "lo_structure", "lo_hooks")
AMPLIFIED = ("bare", "m_nvml_x25", "m_allocator_x25", "m_flusher_x20", "m_structure_x8", "m_retention_x8")

# Shapes: (name, batch, prompt tokens, new tokens).
SHAPES = {"b1": (1, 128, 128), "b16": (16, 1024, 64), "b1s": (1, 128, 64), "tiny": (1, 16, 12)}
SAVE_GAPS = False  # set in the worker from the job's "gaps"
GPU_MODELS = {"pythia-1.4b": None, "gpt-oss-20b": 6}  # preset -> layers kept (None: all)
# The compiled fast path's model: llama-style, 16 layers, hidden 2048, 16 query / 4 KV heads (a
# ~2.3 ms decode step on an H200, where fixed per-step costs show); built from llama-3.1-8b's preset.
FAST_MODEL = {"llama-16x2048": dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=8192,
                                    num_attention_heads=16, num_key_value_heads=4, head_dim=128)}
SHAPES.update({"s1": (1, 128, 256), "s8": (8, 128, 256),
               "c16": (16, 128, 128), "c64": (64, 128, 128)})  # concurrent requests, prompt, new tokens


def _job(model: str, shape: str, variants: list[str], pairs: int, **extra: Any) -> dict[str, Any]:
    return {"model": model, "layers": GPU_MODELS.get(model), "shape": shape, "variants": variants,
            "pairs": pairs, **extra}


def suite_jobs(suite: str, pairs: int | None) -> list[dict[str, Any]]:
    """The jobs of a named suite (each runs in its own process)."""
    if suite == "gpu":
        return [_job(m, s, ["aa", "recorder", "sampling32"], pairs or 12) for m in GPU_MODELS for s in ("b1", "b16")]
    if suite == "mechanisms":
        return [_job("pythia-1.4b", "b1", list(MECHANISMS), pairs or 8)]
    if suite == "leave_one_out":
        return [_job("pythia-1.4b", "b16", list(LEAVE_ONE_OUT), pairs or 10)]
    if suite == "amplified":
        return [_job("pythia-1.4b", "b1s", list(AMPLIFIED), pairs or 5)]
    if suite == "anchors":
        return [_job("pythia-1.4b", "b1s", [a], pairs or 3) for a in ("memhist", "profiler")]
    if suite == "static":  # generate(cache_implementation="static"): transformers compiles the forward
        return [_job("llama-16x2048", s, ["aa", "recorder", "m_hooks", "lo_structure", "lo_telemetry", "lo_flusher"],
                     pairs or 12, cache="static") for s in ("s1", "s8")]
    if suite == "eager":  # the same model on the eager dynamic-cache path
        return [_job("llama-16x2048", s, ["aa", "recorder"], pairs or 10) for s in ("b1", "b16")]
    if suite == "serving":  # continuous batching with CUDA graphs: 16 and 64 concurrent requests
        return [_job("llama-16x2048", s, ["aa", "recorder"], pairs or 8, workload="serving")
                for s in ("c16", "c64")]
    if suite == "owners":  # owner snapshots on the compiled static path
        return [_job("llama-16x2048", "s1", ["aa", "recorder", "lo_owners", "owners_x"], pairs or 8, cache="static")]
    if suite == "paths":
        return [j for name in ("eager", "static", "serving", "owners") for j in suite_jobs(name, pairs)]
    if suite == "smoke":
        return [_job("pythia-1.4b", "tiny", ["aa", "recorder", "m_hooks"], pairs or 2, tiny=True)]
    raise ValueError(f"unknown suite {suite!r}")


# ---- statistics (no numpy needed in the parent) -------------------------------------------------

def bootstrap_median_ci(values: list[float], resamples: int = 4000, seed: int = 0,
                        level: float = 0.95) -> tuple[float, float, float]:
    """(median, low, high): percentile bootstrap CI of the median."""
    if not values:
        return (float("nan"),) * 3
    rng = random.Random(seed)
    n = len(values)
    meds = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    lo = meds[int((1 - level) / 2 * resamples)]
    hi = meds[min(int((1 + level) / 2 * resamples), resamples - 1)]
    return statistics.median(values), lo, hi


def summarize(pairs: list[dict[str, Any]], variant: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"pairs": len(pairs)}
    for key in ("total", "generate", "decode", "median_step", "main_cpu"):
        ratios = [p[f"{key}_ratio"] for p in pairs if p.get(f"{key}_ratio") is not None]
        med, lo, hi = bootstrap_median_ci(ratios)
        out[key] = {"median": med, "ci95": [lo, hi], "min": min(ratios, default=None),
                    "max": max(ratios, default=None)}
    for key in ("enter_s", "exit_s"):
        vals = [p["variant"][key] for p in pairs if p["variant"].get(key) is not None]
        out[f"{key}_median"] = statistics.median(vals) if vals else None
    for key in ("flushes", "ticks"):
        vals = [p["variant"][key] for p in pairs if p["variant"].get(key) is not None]
        out[f"{key}_median"] = statistics.median(vals) if vals else None
    for key in ("hook_s", "threads_cpu_s", "flush_cpu_s", "tick_cpu_s"):  # direct costs, fractions of the base call
        vals = [p["variant"][key] / p["base"]["total_s"] for p in pairs if p["variant"].get(key) is not None]
        out[f"{key[:-2]}_fraction_median"] = statistics.median(vals) if vals else None
    outside = [(p["variant"]["outside_decode_s"], p["base"]["outside_decode_s"]) for p in pairs
               if "outside_decode_s" in p["variant"] and "outside_decode_s" in p["base"]]
    # per-request work (begin + finish) = the variant's generate-outside-decode minus base's
    out["request_work_s_median"] = (statistics.median([v for v, _ in outside])
                                    - statistics.median([b for _, b in outside])) if outside else None
    amplify = VARIANTS.get(variant, {}).get("amplify") if variant else None
    if amplify:
        med = out["decode"]["median"]
        out["amplify"] = amplify
        out["per_default_rate"] = {k: [(x - 1) / amplify for x in [out[k]["median"], *out[k]["ci95"]]]
                                   for k in ("total", "decode")} if med is not None else None
    for key in ("dynamo_graph_breaks", "dynamo_recompiles"):  # per run, variant minus base
        vals = [p["variant"].get(key, 0) - p["base"].get(key, 0) for p in pairs]
        out[f"{key}_extra_max"] = max(vals, default=None)
    base = [p["base"]["total_s"] for p in pairs]
    out["base_total_s_median"] = statistics.median(base) if base else None
    exits = [p["variant"]["exit_s"] / p["base"]["total_s"] for p in pairs if p["variant"].get("exit_s") is not None]
    out["exit_fraction_of_base_median"] = statistics.median(exits) if exits else None
    return out


# ---- the worker (one process per job) ------------------------------------------------------------

class StepClock:
    """A logits processor that only timestamps: identical cost in every run."""

    def __init__(self) -> None:
        self.times: list[int] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self.times.append(time.perf_counter_ns())
        return scores


def _build(job: dict[str, Any], device: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    from kvtrace import presets

    if job.get("tiny"):
        return presets.preset_model(job["model"], device=device)
    if job["model"] in FAST_MODEL:
        cfg = presets.preset_config("llama-3.1-8b")
        for k, v in FAST_MODEL[job["model"]].items():
            setattr(cfg, k, v)
    else:
        cfg = presets.preset_config(job["model"], layers=job.get("layers"))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    gen = model.generation_config
    if gen.pad_token_id is None:
        eos = gen.eos_token_id
        gen.pad_token_id = eos[0] if isinstance(eos, list) else (eos or 0)
    return model


@contextlib.contextmanager
def _patched(names: tuple[str, ...]) -> Iterator[None]:
    """Switch recorder parts off for one run (mechanism isolation): 'nohooks' leaves the step
    hooks uninstalled, 'notelemetry' never starts the telemetry thread."""
    from kvtrace.recorder import hooks, telemetry

    targets = {"nohooks": (hooks.StepHooks, "install"), "notelemetry": (telemetry.Telemetry, "start")}
    saved = []
    try:
        for name in names:
            cls, attr = targets[name]
            saved.append((cls, attr, cls.__dict__[attr]))
            setattr(cls, attr, lambda self: None)
        yield
    finally:
        for cls, attr, original in saved:
            setattr(cls, attr, original)


def kvtrace_thread_cpu_s() -> float | None:
    """CPU seconds used so far by this process's live kvtrace-* threads (telemetry, flusher,
    payload workers): what they can have taken from the model's thread through the GIL, read
    without A/B noise. schedstat (ns) where the kernel has it, else stat (clock ticks)."""
    import threading

    total, found = 0.0, False
    tick = os.sysconf("SC_CLK_TCK")
    for thread in threading.enumerate():  # names live in Python: CPython < 3.14 does not give them to the OS
        if not thread.name.startswith("kvtrace-") or thread.native_id is None:
            continue
        base = f"/proc/self/task/{thread.native_id}"
        found = True
        try:
            try:
                with open(f"{base}/schedstat", encoding="utf-8") as fh:
                    total += int(fh.read().split()[0]) / 1e9
            except OSError:
                with open(f"{base}/stat", encoding="utf-8") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except (OSError, IndexError, ValueError):
            continue
    return total if found else 0.0


def own_costs(rec: Any) -> dict[str, float]:
    """The background work the recorder counts itself (newer kvtrace only): flushes and telemetry
    ticks so far, with their wall and CPU seconds. CPU there is mostly time holding the GIL, i.e.
    time the model's thread could not run Python."""
    out: dict[str, float] = {}
    w, tel = getattr(rec, "writer", None), getattr(rec, "telemetry", None)
    if w is not None and hasattr(w, "flush_cpu_ns"):
        out.update(flushes=w.flush_count, flush_s=w.flush_ns / 1e9, flush_cpu_s=w.flush_cpu_ns / 1e9)
    if tel is not None and hasattr(tel, "tick_cpu_ns"):
        out.update(ticks=tel.ticks, tick_s=tel.tick_ns / 1e9, tick_cpu_s=tel.tick_cpu_ns / 1e9)
    return out


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


GENERATE_KW: dict[str, Any] = {}  # set in the worker from the job ("cache": "static")


def _dynamo_counts() -> dict[str, int]:
    """Graph breaks and recompilations so far (torch._dynamo's own counters): a hook that breaks or
    recompiles the compiled forward shows here as a difference between base and variant runs."""
    try:
        from torch._dynamo.utils import counters
    except Exception:  # noqa: BLE001
        return {}
    return {"graph_breaks": sum(counters["graph_break"].values()),
            "recompiles": sum(v for k, v in counters["stats"].items() if k == "unique_graphs")}


def run_generate(model: Any, variant: str, ids: Any, new: int, trace_dir: Path, tag: str) -> dict[str, Any]:
    """One timed generate call under ``variant`` ("base" = nothing attached)."""
    import torch
    from transformers import LogitsProcessorList

    clock = StepClock()
    info: dict[str, Any] = {}
    _sync()  # no gc.collect() here: each run meets the collector's state as a caller's would

    cpu: list[int] = []

    def gen() -> None:
        c0 = time.thread_time_ns()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       logits_processor=LogitsProcessorList([clock]), **GENERATE_KW)
        _sync()
        cpu.append(time.thread_time_ns() - c0)  # the model's thread's own CPU time (not GIL waits)

    spec = VARIANTS.get(variant, {})
    dyn0 = _dynamo_counts()
    t0 = time.perf_counter_ns()
    if variant in ("base", "aa"):
        t1 = t0
        gen()
        t2 = t3 = time.perf_counter_ns()
    elif variant == "memhist":
        torch.cuda.memory._record_memory_history(max_entries=100_000)
        t1 = time.perf_counter_ns()
        gen()
        t2 = time.perf_counter_ns()
        torch.cuda.memory._record_memory_history(enabled=None)
        t3 = time.perf_counter_ns()
    elif variant == "profiler":
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=acts, profile_memory=True):
            t1 = time.perf_counter_ns()
            gen()
            t2 = time.perf_counter_ns()
        t3 = t2  # the profiler's teardown (trace assembly) is not counted
    else:
        import kvtrace

        path = trace_dir / f"{tag}.kvt.h5"
        with _patched(tuple(spec.get("patch", ()))):
            rec = kvtrace.record(model, path, **spec["options"])
            rec.__enter__()
            t1 = time.perf_counter_ns()
            gen()
            t2 = time.perf_counter_ns()
            threads_s = kvtrace_thread_cpu_s()  # before close: the threads end there
            own = own_costs(rec)  # the writer's flushes and telemetry ticks during the call
            rec.__exit__(None, None, None)
            t3 = time.perf_counter_ns()
        info = {"recorder_errors": rec.recorder_errors, "hook_s": rec.hook_time_ns / 1e9,
                "threads_cpu_s": threads_s, "trace_bytes": path.stat().st_size, **own}
        path.unlink()  # large traces would fill the disk and the page cache across pairs
    steps = len(clock.times)
    decode = (clock.times[-1] - clock.times[0]) / (steps - 1) / 1e9 if steps > 1 else None
    gaps = sorted(b - a for a, b in zip(clock.times, clock.times[1:], strict=False))
    out = {"total_s": (t3 - t0) / 1e9, "generate_s": (t2 - t1) / 1e9, "decode_step_s": decode,
           # the median step is robust to a few stalled steps; the mean is what the caller pays
           "decode_median_step_s": statistics.median(gaps) / 1e9 if gaps else None,
           "main_cpu_s": cpu[0] / 1e9 if cpu else None, **info,
           **{f"dynamo_{k}": v - dyn0.get(k, 0) for k, v in _dynamo_counts().items()}}
    if SAVE_GAPS:  # per-step times (us), for phase analyses (structure steps, telemetry ticks)
        out["gaps_us"] = [round((b - a) / 1e3) for a, b in zip(clock.times, clock.times[1:], strict=False)]
    if decode is not None:  # generate outside the decode loop: prefill + per-request begin/finish work
        out["outside_decode_s"] = out["generate_s"] - decode * (steps - 1)
    if variant not in ("base", "aa"):
        out["enter_s"] = (t1 - t0) / 1e9
        out["exit_s"] = (t3 - t2) / 1e9
    return out


def _pair(base: dict[str, Any], var: dict[str, Any], order: str) -> dict[str, Any]:
    def ratio(key: str) -> float | None:
        b, v = base.get(key), var.get(key)
        return v / b if b and v is not None else None

    return {"order": order, "base": base, "variant": var, "total_ratio": ratio("total_s"),
            "generate_ratio": ratio("generate_s"), "decode_ratio": ratio("decode_step_s"),
            "median_step_ratio": ratio("decode_median_step_s"), "main_cpu_ratio": ratio("main_cpu_s")}


def worker(job: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers

    import kvtrace

    global SAVE_GAPS
    SAVE_GAPS = bool(job.get("gaps"))
    if job.get("cache"):
        GENERATE_KW["cache_implementation"] = job["cache"]
    device = job.get("device", "cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("bench_overhead: no CUDA device (use --device cpu for a smoke run)")
    t_start = time.monotonic()
    batch, prompt, new = SHAPES[job["shape"]]
    model = _build(job, device)
    vocab = int(model.config.vocab_size)
    ids = torch.randint(3, vocab, (batch, prompt), generator=torch.Generator().manual_seed(0)).to(device)
    variants = list(job["variants"])
    log = job.get("log", True)
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = Path(tmp)
        for v in ["base", "base", *variants]:  # warm-up: kernels, allocator pools, lazy imports
            run_generate(model, v, ids, new, trace_dir, f"warm-{v}")
        t_warm = time.monotonic() - t_start
        budget = float(job.get("budget_s", 1e9))
        results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
        i = 0
        round_s = 0.0
        while i < int(job["pairs"]):
            if i >= int(job.get("min_pairs", 3)) and time.monotonic() - t_start + round_s > budget:
                break
            r0 = time.monotonic()
            rot = variants[i % len(variants):] + variants[:i % len(variants)]
            for v in rot:
                # A = base; each variant's own pairs alternate AB, BA, AB, ... (ABBA)
                order = "AB" if (len(results[v]) + variants.index(v)) % 2 == 0 else "BA"
                runs = {}
                for who in (("base", v) if order == "AB" else (v, "base")):
                    runs[who] = run_generate(model, who, ids, new, trace_dir, f"p{i}-{v}")
                results[v].append(_pair(runs["base"], runs[v], order))
            round_s = time.monotonic() - r0
            i += 1
            if log:
                print(f"[{job['model']} {job['shape']}] pair {i}: " + ", ".join(
                    f"{v} {results[v][-1]['total_ratio']:.3f}" for v in variants), file=sys.stderr, flush=True)
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else f"{device} (smoke test)"
    return {**{k: v for k, v in job.items() if k != "log"}, "batch": batch, "prompt": prompt, "new_tokens": new,
            "device_name": name, "torch": torch.__version__, "transformers": transformers.__version__,
            "kvtrace_file": kvtrace.__file__, "warmup_s": t_warm, "wall_s": time.monotonic() - t_start,
            "summary": {v: summarize(results[v], v) for v in variants}, "pairs_raw": results}


# ---- workloads ---------------------------------------------------------------------------------

class ServingClock:
    """Wall time inside the serving recorder's per-step bodies (its direct cost on CB's loop thread):
    wraps ``ServingRecorder._step`` and ``_first_token`` for the whole worker process."""

    def __init__(self) -> None:
        from kvtrace.recorder import serving

        self.ns = 0
        for name in ("_step", "_first_token"):
            setattr(serving.ServingRecorder, name, self._timed(getattr(serving.ServingRecorder, name)))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                self.ns += time.perf_counter_ns() - t0
        return timed


def run_batch(model: Any, variant: str, prompts: list[list[int]], new: int, trace_dir: Path, tag: str,
              clock: ServingClock) -> dict[str, Any]:
    """One timed generate_batch call (continuous batching, CUDA graphs on) under ``variant``."""
    from transformers import GenerationConfig

    from tests.helpers.hfcache import cb_config

    gc = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    blocks = len(prompts) * (len(prompts[0]) + new) // 32 + 16
    cb = cb_config(page_size=32, num_blocks=blocks, max_batch_tokens=2048, use_cuda_graph=True)
    info: dict[str, Any] = {}
    _sync()
    t0 = time.perf_counter_ns()
    if variant in ("base", "aa"):
        model.generate_batch(inputs=prompts, generation_config=gc, continuous_batching_config=cb)
        _sync()
        t1 = time.perf_counter_ns()
    else:
        import kvtrace
        from kvtrace.format.reader import open_trace

        path = trace_dir / f"{tag}.kvt.h5"
        ns0 = clock.ns
        with kvtrace.record(model, path, **VARIANTS[variant]["options"]) as rec:
            model.generate_batch(inputs=prompts, generation_config=gc, continuous_batching_config=cb)
            _sync()
            t1 = time.perf_counter_ns()
            threads_s = kvtrace_thread_cpu_s()
        with open_trace(path) as t:
            steps = t.nrows("sched")
        info = {"recorder_errors": rec.recorder_errors, "hook_s": (clock.ns - ns0) / 1e9, "threads_cpu_s": threads_s,
                "sched_steps": steps, "trace_bytes": path.stat().st_size}
        path.unlink()
    return {"total_s": (t1 - t0) / 1e9, "generate_s": (t1 - t0) / 1e9, **info}


def serving_worker(job: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers

    if not torch.cuda.is_available():
        raise SystemExit("bench_overhead: the serving workload needs a CUDA device (CUDA graphs)")
    t_start = time.monotonic()
    n, prompt, new = SHAPES[job["shape"]]
    model = _build(job, "cuda")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, int(model.config.vocab_size), (prompt,), generator=gen).tolist() for _ in range(n)]
    clock = ServingClock()
    variants = list(job["variants"])
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = Path(tmp)
        for v in ["base", "base", *variants]:  # warm-up: graph captures, allocator pools
            run_batch(model, v, prompts, new, trace_dir, f"warm-{v}", clock)
        t_warm = time.monotonic() - t_start
        for i in range(int(job["pairs"])):
            for v in variants[i % len(variants):] + variants[:i % len(variants)]:
                order = "AB" if (len(results[v]) + variants.index(v)) % 2 == 0 else "BA"
                runs = {who: run_batch(model, who, prompts, new, trace_dir, f"p{i}-{v}", clock)
                        for who in (("base", v) if order == "AB" else (v, "base"))}
                results[v].append(_pair(runs["base"], runs[v], order))
            if job.get("log", True):
                print(f"[serving {job['shape']}] pair {i + 1}: " + ", ".join(
                    f"{v} {results[v][-1]['total_ratio']:.3f}" for v in variants), file=sys.stderr, flush=True)
    summary = {}
    for v in variants:
        summary[v] = summarize(results[v], v)
        per_step = [p["variant"]["hook_s"] / p["variant"]["sched_steps"] for p in results[v]
                    if p["variant"].get("sched_steps")]
        summary[v]["direct_us_per_step_median"] = statistics.median(per_step) * 1e6 if per_step else None
        steps = [p["variant"]["sched_steps"] for p in results[v] if p["variant"].get("sched_steps")]
        summary[v]["sched_steps_median"] = statistics.median(steps) if steps else None
    return {**{k: v for k, v in job.items() if k != "log"}, "requests": n, "prompt": prompt, "new_tokens": new,
            "device_name": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "transformers": transformers.__version__, "warmup_s": t_warm, "wall_s": time.monotonic() - t_start,
            "summary": summary, "pairs_raw": results}


WORKLOADS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {"generate": worker, "serving": serving_worker}


# ---- the parent: one subprocess per job ----------------------------------------------------------

def run_job(job: dict[str, Any], env_path: str | None) -> dict[str, Any]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    paths = [p for p in (env_path, root, env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as fh:
        out_path = fh.name
    try:
        proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job), "--worker-out", out_path],
                              env=env, check=False)
        if proc.returncode != 0:
            return {**job, "error": f"worker exited with {proc.returncode}"}
        return json.loads(Path(out_path).read_text(encoding="utf-8"))
    finally:
        os.unlink(out_path)


def _fmt(s: dict[str, Any]) -> str:
    if s["median"] is None or s["median"] != s["median"]:
        return "-"
    return f"{s['median']:.3f} [{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}]"


def _pct(x: float | None) -> str:
    return f"{x * 100:.2f}%" if x is not None else "-"


def print_table(results: list[dict[str, Any]]) -> None:
    print("ratio = variant / base of the same ABBA pair: median [95% bootstrap CI]; open/close = median ms "
          "of record()'s __enter__ / __exit__ (the per-request finish is inside 'generate')")
    print("req ms = per-request begin/finish work (generate outside its decode loop, minus base's); hooks / "
          "threads = CPU time in the step hooks / in kvtrace's threads, as a fraction of the base call")
    print(f"{'code':<7} {'model':<12} {'shape':<5} {'variant':<15} {'pairs':>5}  {'whole call':>24}  "
          f"{'generate':>24}  {'decode/step':>24}  {'open/close ms':>13}  {'req ms':>6}  {'hooks':>6}  "
          f"{'threads':>7}  {'base s':>6}")
    for r in results:
        if "error" in r:
            print(f"{r.get('code', 'after'):<7} {r['model']:<12} {r['shape']:<5} {','.join(r['variants']):<12} "
                  f"error: {r['error']}")
            continue
        for v, s in r["summary"].items():
            oc = (f"{s['enter_s_median'] * 1e3:.1f}/{s['exit_s_median'] * 1e3:.1f}"
                  if s.get("enter_s_median") is not None else "-")
            req = s.get("request_work_s_median")
            print(f"{r.get('code', 'after'):<7} {r['model']:<12} {r['shape']:<5} {v:<15} {s['pairs']:>5}  "
                  f"{_fmt(s['total']):>24}  {_fmt(s['generate']):>24}  {_fmt(s['decode']):>24}  "
                  f"{oc:>13}  {(f'{req * 1e3:.1f}' if req is not None else '-'):>6}  "
                  f"{_pct(s.get('hook_fraction_median')):>6}  {_pct(s.get('threads_cpu_fraction_median')):>7}  "
                  f"{s['base_total_s_median']:6.2f}")
            if s.get("median_step", {}).get("median") is not None:
                print(f"{'':<7} {'':<12} {'':<5} {'':<15} {'':>5}  median step {_fmt(s['median_step'])}, "
                      f"model thread CPU {_fmt(s['main_cpu'])}")
            if s.get("flush_cpu_fraction_median") is not None:
                print(f"{'':<7} {'':<12} {'':<5} {'':<15} {'':>5}  during the call: {s['flushes_median']:.0f} flushes, "
                      f"CPU {_pct(s['flush_cpu_fraction_median'])}; {s.get('ticks_median') or 0:.0f} telemetry ticks, "
                      f"CPU {_pct(s.get('tick_cpu_fraction_median'))} (of the base call)")
            if s.get("direct_us_per_step_median") is not None:
                print(f"{'':<7} {'':<12} {'':<5} {'':<15} {'':>5}  serving recorder per scheduler step: "
                      f"{s['direct_us_per_step_median']:.1f} us over {s['sched_steps_median']:.0f} steps")
            if s.get("per_default_rate"):
                d = s["per_default_rate"]["decode"]
                print(f"{'':<7} {'':<12} {'':<5} {'':<15} {'':>5}  amplified x{s['amplify']}: at the default rate "
                      f"decode/step +{d[0] * 100:.2f}% [{d[1] * 100:.2f}, {d[2] * 100:.2f}]")
    if results and "device_name" in results[0]:
        print(f"device: {results[0]['device_name']}, torch {results[0]['torch']}, "
              f"transformers {results[0]['transformers']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="gpu", help="gpu, mechanisms, leave_one_out, amplified, anchors or smoke (comma-separated)")
    p.add_argument("--models", default=None, help="restrict to these presets (comma-separated)")
    p.add_argument("--shapes", default=None, help="restrict to these shapes (b1, b16)")
    p.add_argument("--variants", default=None, help="override the variants of recorder jobs")
    p.add_argument("--pairs", type=int, default=None, help="ABBA pairs per variant (suite default)")
    p.add_argument("--budget-s", type=float, default=None, help="wall-time budget per job (>= 3 pairs)")
    p.add_argument("--before", default=None, help="directory holding an older kvtrace package: recorder "
                   "jobs run again with it ('before')")
    p.add_argument("--before-variants", default="recorder", help="variants run with --before")
    p.add_argument("--device", default="cuda")
    p.add_argument("--workload", default="generate", choices=sorted(WORKLOADS))
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--quiet", action="store_true", help="no per-pair log lines")
    p.add_argument("--gaps", action="store_true", help="keep every run's per-step times in the JSON")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker is not None:
        job = json.loads(args.worker)
        result = WORKLOADS[job.get("workload", "generate")](job)
        Path(args.worker_out).write_text(json.dumps(result, default=str), encoding="utf-8")
        return 0

    jobs: list[dict[str, Any]] = []
    for suite in args.suite.split(","):
        jobs += suite_jobs(suite.strip(), args.pairs)
    if args.models:
        keep = set(args.models.split(","))
        jobs = [j for j in jobs if j["model"] in keep]
    if args.shapes:
        keep = set(args.shapes.split(","))
        jobs = [j for j in jobs if j["shape"] in keep or j.get("tiny")]
    for j in jobs:
        if args.variants and not any(VARIANTS[v].get("anchor") for v in j["variants"]):
            j["variants"] = args.variants.split(",")
        unknown = [v for v in j["variants"] if v not in VARIANTS]
        if unknown:
            print(f"bench_overhead: unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}", file=sys.stderr)
            return 64
        j.update(device=args.device, log=not args.quiet, code="after", gaps=args.gaps)
        j.setdefault("workload", args.workload)
        if args.budget_s:
            j["budget_s"] = args.budget_s
    if args.device != "cuda" and any(j["workload"] == "serving" for j in jobs):
        print("bench_overhead: the serving workload needs a CUDA device (it times CUDA graph replays)",
              file=sys.stderr)
        return 69  # a needed component is absent (kvtrace/exitcodes.py)
    if args.before:  # each job's 'before' twin runs right after it (same machine state)
        befores = args.before_variants.split(",")
        paired = []
        for j in jobs:
            paired.append(j)
            kept = [v for v in j["variants"] if v in befores]
            if kept:
                paired.append({**j, "variants": kept, "code": "before"})
        jobs = paired
    t0 = time.monotonic()
    results = []
    for j in jobs:
        path = args.before if j["code"] == "before" else None
        r = run_job(j, path)
        r["code"] = j["code"]
        results.append(r)
        if args.json_path:  # after every job: a call cut short keeps what it measured
            Path(args.json_path).write_text(json.dumps({"jobs": results, "wall_s": time.monotonic() - t0},
                                                       indent=1, default=str), encoding="utf-8")
    print_table(results)
    print(f"wall time {time.monotonic() - t0:.0f} s")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
