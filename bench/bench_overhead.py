"""Recorder overhead on a GPU: paired, interleaved A/B runs of generate with and without kvtrace.

    python bench/bench_overhead.py [--json results.json]       # ~7-8 minutes on one H100

For each model geometry (random weights, bf16, on cuda:0) every round runs, in a shuffled order,
generate() without anything attached (base) and with each variant:

  recorder     kvtrace.record(model, ...) with its defaults (structure every 8th step + telemetry +
               gc/empty_cache)
  every1       the same with structure_every=1 (per-layer structure at every step)
  sampling32   the defaults plus sampling every 32 steps (all layers' K/V contents to the host;
               incremental, the default: each sample holds only the tokens added since the last)
  sampling32all  the same with whole samples (tokens="all": every cached token at every sample)
  telemetry1   the defaults with the telemetry thread at 1 Hz instead of 20 (a diagnostic: does the
               background sampling thread cost the decode loop?)
  nohooks      diagnostic: the recorder attached but its two step hooks not installed (what the
               background threads, the open trace and the generate wrapper cost without any step work)
  nothreads    diagnostic: the defaults without the telemetry thread and with the flusher idle
               (60 s interval): what the step hooks cost without background threads
  memhist      torch.cuda.memory._record_memory_history() (what a user can turn on today)
  profiler     torch.profiler.profile(profile_memory=True) (idem; only its in-run time is counted)

A ratio is variant time / base time of the same round; the table shows the median over rounds
(and the range). Two times are measured per run: the whole generate() call ("total", including the
recorder's per-request gc.collect/empty_cache) and the decode loop alone ("decode": first to last
token, timed by a no-op logits processor present in every run). gpt-oss-20b is depth-shrunk
(--gptoss-layers, default 6 of 24) to fit the time budget; its per-layer geometry is unchanged.
HF generate varies by ~±12% from run to run: read the ranges, not only the medians.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

VARIANTS = ("recorder", "every1", "sampling32", "sampling32all", "telemetry1", "nohooks", "nothreads",
            "memhist", "profiler")
RECORDER_VARIANTS = {
    "recorder": {}, "every1": {"structure_every": 1}, "sampling32": {"sampling": {"every_n_steps": 32}},
    "sampling32all": {"sampling": {"every_n_steps": 32, "tokens": "all"}}, "telemetry1": {"telemetry_hz": 1.0},
    "nohooks": {}, "nothreads": {"flush_interval_s": 60.0},
}
ALTERNATIVES = ("memhist", "profiler")


class StepClock:
    """A logits processor that only timestamps: identical cost in every run."""

    def __init__(self) -> None:
        self.times: list[int] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self.times.append(time.perf_counter_ns())
        return scores


def build(name: str, layers: int | None, args: argparse.Namespace) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    from kvtrace import presets

    cfg = presets.preset_config(name, layers=layers, width_scale=args.width, vocab=args.vocab)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    gen = model.generation_config
    if gen.pad_token_id is None:
        eos = gen.eos_token_id
        gen.pad_token_id = eos[0] if isinstance(eos, list) else (eos or 0)
    return model


@contextlib.contextmanager
def attached(variant: str, model: Any, trace_dir: Path, tag: str) -> Iterator[dict]:
    """Set up a variant around one generate call; yields a dict the caller may fill."""
    import torch

    import kvtrace

    info: dict[str, Any] = {}
    if variant == "base":
        yield info
    elif variant in RECORDER_VARIANTS:
        path = trace_dir / f"{tag}.kvt.h5"
        with _diagnostic_patch(variant), kvtrace.record(model, path, **RECORDER_VARIANTS[variant]) as rec:
            yield info
            # Direct cost: time inside the step hooks, read before close (gc/flush excluded).
            info["hook_ns"] = rec.hook_time_ns
            info["hook_calls"] = rec.hook_calls
        info["recorder_errors"] = rec.recorder_errors
        info["trace_bytes"] = path.stat().st_size
        path.unlink()  # GiB-sized traces would fill the disk and the page cache across rounds
    elif variant == "memhist":
        torch.cuda.memory._record_memory_history(max_entries=100_000)
        try:
            yield info
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
    elif variant == "profiler":
        from torch.profiler import ProfilerActivity, profile

        t0 = None
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=acts, profile_memory=True):
            yield info
            t0 = time.perf_counter()
        info["profiler_teardown_s"] = time.perf_counter() - t0  # not counted in the ratio
    else:
        raise ValueError(variant)


@contextlib.contextmanager
def _diagnostic_patch(variant: str) -> Iterator[None]:
    """The diagnostic variants switch one part of the recorder off by patching it for one run."""
    from kvtrace.recorder import hooks, telemetry

    target = {"nohooks": (hooks.StepHooks, "install"), "nothreads": (telemetry.Telemetry, "start")}.get(variant)
    if target is None:
        yield
        return
    cls, name = target
    original = getattr(cls, name)
    setattr(cls, name, lambda self: None)
    try:
        yield
    finally:
        setattr(cls, name, original)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def one_run(model: Any, variant: str, ids: Any, new: int, trace_dir: Path, tag: str) -> dict[str, Any]:
    from transformers import LogitsProcessorList

    clock = StepClock()
    gc.collect()
    _sync()
    with attached(variant, model, trace_dir, tag) as info:
        t0 = time.perf_counter_ns()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       logits_processor=LogitsProcessorList([clock]))
        _sync()
        t1 = time.perf_counter_ns()
    decode = (clock.times[-1] - clock.times[0]) / max(len(clock.times) - 1, 1)
    return {"variant": variant, "total_s": (t1 - t0) / 1e9, "decode_step_s": decode / 1e9, **info}


def bench_model(name: str, layers: int | None, args: argparse.Namespace, trace_dir: Path,
                budget_s: float, log: Callable[[str], None]) -> dict[str, Any]:
    import torch

    t_start = time.monotonic()
    model = build(name, layers, args)
    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (1, args.prompt), generator=gen).to(args.device)
    variants = [v for v in VARIANTS if v not in args.skip]
    for v in ["base", *variants]:  # warm-up: kernels, allocator pools, profiler init
        one_run(model, v, ids, 32, trace_dir, f"{name}-warm-{v}")
    probe = min(args.new_tokens, 128)  # a short run, scaled: a full one costs a round's worth of time
    base_est = one_run(model, "base", ids, probe, trace_dir, f"{name}-est")["total_s"] * args.new_tokens / probe
    log(f"{name}: built + warm in {time.monotonic() - t_start:.0f} s; one {args.new_tokens}-token run "
        f"~{base_est:.1f} s ({args.new_tokens / base_est:.1f} tokens/s)")
    rng = random.Random(0)
    rounds: list[list[dict[str, Any]]] = []
    last_round_s = 0.0
    while len(rounds) < args.rounds:
        todo = ["base", *[v for v in variants if v not in ALTERNATIVES or len(rounds) < args.alt_rounds]]
        # The first timed run is often slow (clocks, allocator growth): once a round has run,
        # estimate the next one from it.
        est = last_round_s * 1.1 if rounds else base_est * len(todo) * 1.5
        if rounds and time.monotonic() - t_start + est > budget_s:
            log(f"{name}: time budget reached after {len(rounds)} round(s)")
            break
        rng.shuffle(todo)
        round_t0 = time.monotonic()
        results = [one_run(model, v, ids, args.new_tokens, trace_dir, f"{name}-r{len(rounds)}-{v}") for v in todo]
        rounds.append(results)
        last_round_s = (time.monotonic() - round_t0) * len([v for v in todo if v not in ALTERNATIVES]) / len(todo)
        log(f"{name}: round {len(rounds)}: " + ", ".join(f"{r['variant']} {r['total_s']:.2f}s" for r in results))
    summary = {}
    for v in variants:
        tot, dec = [], []
        for results in rounds:
            by = {r["variant"]: r for r in results}
            if v in by:
                tot.append(by[v]["total_s"] / by["base"]["total_s"])
                dec.append(by[v]["decode_step_s"] / by["base"]["decode_step_s"])
        selfs = [by_run["hook_ns"] / max(by_run["hook_calls"] / 2, 1) / 1e9 / base_step
                 for results in rounds
                 for by_run, base_step in [({r["variant"]: r for r in results}.get(v, {}),
                                            {r["variant"]: r for r in results}["base"]["decode_step_s"])]
                 if "hook_ns" in by_run]
        sizes = [r["trace_bytes"] for results in rounds for r in results if r["variant"] == v and "trace_bytes" in r]
        if tot:
            summary[v] = {"pairs": len(tot), "trace_mib_median": statistics.median(sizes) / 2**20 if sizes else None,
                          "total_ratio_median": statistics.median(tot),
                          "self_time_fraction_median": statistics.median(selfs) if selfs else None,
                          "total_ratio_min": min(tot), "total_ratio_max": max(tot),
                          "decode_ratio_median": statistics.median(dec),
                          "decode_ratio_min": min(dec), "decode_ratio_max": max(dec)}
    bases = [r["total_s"] for results in rounds for r in results if r["variant"] == "base"]
    errors = sum(r.get("recorder_errors", 0) for results in rounds for r in results)
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"model": name, "layers": layers, "base_tokens_per_s": args.new_tokens / statistics.median(bases),
            "rounds": rounds, "summary": summary, "recorder_errors": errors}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="pythia-1.4b,gpt-oss-20b")
    p.add_argument("--gptoss-layers", type=int, default=6, help="depth of gpt-oss presets (geometry kept)")
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--rounds", type=int, default=8, help="upper bound; the time budget usually decides")
    p.add_argument("--alt-rounds", type=int, default=1, help="rounds that include memhist/profiler")
    p.add_argument("--budget-s", type=float, default=420.0, help="wall-time budget for all models")
    p.add_argument("--skip", default="", help="comma-separated variants to skip")
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--device", default="cuda", help="cpu only to smoke-test this script (with --width)")
    p.add_argument("--width", type=float, default=None, help="width scale (smoke tests only)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (smoke tests only)")
    p.add_argument("--pythia-layers", type=int, default=None, help="depth of pythia (default: all 24)")
    args = p.parse_args(argv)
    args.skip = {s for s in args.skip.split(",") if s}

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_overhead needs a CUDA device", file=sys.stderr)
        return 69
    if not args.device.startswith("cuda"):
        args.skip |= {"memhist"}  # a CUDA allocator feature
    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else f"{args.device} (smoke test)"
    models = [m.strip() for m in args.models.split(",") if m.strip()]

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t0 = time.monotonic()
    out = {"device": device, "torch": torch.__version__, "new_tokens": args.new_tokens, "prompt": args.prompt,
           "dtype": "bfloat16", "models": []}
    import transformers

    out["transformers"] = transformers.__version__
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(models):
            remaining = args.budget_s - (time.monotonic() - t0)
            share = remaining / (len(models) - i)
            layers = args.gptoss_layers if name.startswith("gpt-oss") else args.pythia_layers
            out["models"].append(bench_model(name, layers, args, Path(tmp), share, log))
    out["wall_s"] = time.monotonic() - t0

    print(f"\nkvtrace recorder overhead on {device} (torch {out['torch']}, transformers {out['transformers']}), "
          f"bf16, {args.prompt}-token prompt + {args.new_tokens} new tokens, greedy")
    print("ratio = time with variant / time without, same round; median [min-max] over pairs")
    print("self = time inside the recorder's step hooks per step / base decode step (direct, noise-free)")
    print("trace = median trace file size, MiB")
    print(f"{'model':<22} {'variant':<13} {'pairs':>5}  {'total':>22}  {'decode/step':>22}  {'self':>7}  {'trace':>9}")
    for m in out["models"]:
        label = m["model"] + (f" ({m['layers']} layers)" if m["layers"] else "")
        print(f"{label:<22} {'base':<13} {'':>5}  {m['base_tokens_per_s']:>15.1f} tok/s")
        for v, s in m["summary"].items():
            tot = f"{s['total_ratio_median']:.3f} [{s['total_ratio_min']:.3f}-{s['total_ratio_max']:.3f}]"
            dec = f"{s['decode_ratio_median']:.3f} [{s['decode_ratio_min']:.3f}-{s['decode_ratio_max']:.3f}]"
            own = s.get("self_time_fraction_median")
            own_s = f"{own * 100:6.2f}%" if own is not None else "      -"
            mib = s.get("trace_mib_median")
            mib_s = f"{mib:9.1f}" if mib is not None else "        -"
            print(f"{'':<22} {v:<13} {s['pairs']:>5}  {tot:>22}  {dec:>22}  {own_s}  {mib_s}")
        if m["recorder_errors"]:
            print(f"{'':<22} (recorder errors caught during the runs: {m['recorder_errors']})")
    print(f"total wall time {out['wall_s']:.0f} s")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(out, indent=2, default=str), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
