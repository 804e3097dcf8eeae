"""Where the recorder's per-step time goes: a breakdown, not an A/B benchmark.

    python bench/profile_recorder.py [--device cuda] [--json out.json]

Wraps the recorder's step-path functions with perf_counter timers and runs generate on the
Pythia-1.4B geometry (bf16, random weights) twice per mode: structure read every step, every 4th,
the default (every 8th), and the default with sampling every 32 steps. Prints microseconds per decode step for each component, the decode-step times of
sampling steps, of the steps right after them and of the others (against a run without the
recorder), and the background workers' time split (waiting, shuffle+compress, write). Costs of
the raw calls involved (allocator stats, pinned allocation) are measured alone too. The timers
add their own small cost; read the components as proportions.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ACC: collections.Counter = collections.Counter()
CNT: collections.Counter = collections.Counter()


def timed(owner: Any, name: str, label: str) -> None:
    fn = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            ACC[label] += time.perf_counter_ns() - t0
            CNT[label] += 1

    setattr(owner, name, wrapper)


def instrument() -> None:
    import kvtrace.format.writer as writer
    import kvtrace.recorder.allocator as allocator
    import kvtrace.recorder.sampling as sampling
    import kvtrace.recorder.steps as steps
    import kvtrace.recorder.submission as submission

    timed(steps, "read_step_fast", "read_step_fast")
    timed(steps, "read_cache", "read_cache (general)")
    timed(writer.TraceWriter, "append", "writer.append")
    timed(allocator, "read_allocated_reserved", "allocator step reading")
    timed(steps.StepRecorder, "on_step_end", "on_step_end (all)")
    timed(steps.StepRecorder, "on_step_start", "on_step_start")
    timed(submission.SampleSubmission, "sample", "sample (all submits)")
    timed(sampling.PayloadSampler, "_stage_cuda", "sampler._stage_cuda")
    timed(sampling.PayloadSampler, "submit", "sampler.submit")
    # worker side (background threads)
    timed(sampling, "encode_samples", "worker: encode_samples")
    timed(sampling, "compress_shuffled_many", "worker: compress")
    timed(writer.TraceWriter, "write_payload", "worker: write_payload")


def raw_costs(device: str) -> dict[str, float]:
    import torch

    out: dict[str, float] = {}

    def per_call(fn: Any, n: int = 500) -> float:
        fn()
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        return (time.perf_counter_ns() - t0) / n / 1e3

    if device.startswith("cuda"):
        out["memory_stats_as_nested_dict us"] = per_call(lambda: torch.cuda.memory_stats_as_nested_dict(0))
        out["memory_allocated us"] = per_call(lambda: torch.cuda.memory_allocated(0))
        out["mem_get_info us"] = per_call(lambda: torch.cuda.mem_get_info(0))
        out["torch.empty pinned 4 MiB us"] = per_call(
            lambda: torch.empty(2 * 1024 * 1024, dtype=torch.int16, pin_memory=True), 200)
    return out


def run(model: Any, ids: Any, new: int, rec_kwargs: dict | None, tmp: Path, tag: str) -> dict[str, Any]:
    import torch
    from transformers import LogitsProcessorList

    import kvtrace

    times: list[int] = []

    def clock(input_ids: Any, scores: Any) -> Any:
        times.append(time.perf_counter_ns())
        return scores

    ACC.clear()
    CNT.clear()
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False,
              logits_processor=LogitsProcessorList([clock]))
    info: dict[str, Any] = {}
    if rec_kwargs is None:
        model.generate(ids, **kw)
    else:
        with kvtrace.record(model, tmp / f"{tag}.kvt.h5", **rec_kwargs) as rec:
            model.generate(ids, **kw)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            info["hook_us_per_step"] = rec.hook_time_ns / max(rec.hook_calls / 2, 1) / 1e3
            if rec.sampler is not None:
                t0 = time.perf_counter()
                rec.sampler.drain()
                info["drain_after_generate_s"] = time.perf_counter() - t0
    steps = [(b - a) / 1e3 for a, b in zip(times, times[1:], strict=False)]
    info["step_us"] = steps
    info["components_us_per_step"] = {k: ACC[k] / max(new, 1) / 1e3 for k in sorted(ACC)}
    info["calls"] = dict(CNT)
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="pythia-1.4b")
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--width", type=float, default=None, help="width scale (CPU smoke tests)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from kvtrace import presets

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("profile_recorder needs a CUDA device (or --device cpu)", file=sys.stderr)
        return 69
    instrument()
    cfg = presets.preset_config(args.model, layers=args.layers, width_scale=args.width)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    gen = model.generation_config
    if gen.pad_token_id is None:
        eos = gen.eos_token_id
        gen.pad_token_id = eos[0] if isinstance(eos, list) else (eos or 0)
    ids = torch.randint(3, int(cfg.vocab_size), (1, 64)).to(args.device)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
                           "model": args.model, "new_tokens": args.new_tokens, "raw": raw_costs(args.device)}
    modes = {"base": None, "every1": {"structure_every": 1}, "every4": {"structure_every": 4},
             "default": {}, "sampling32": {"sampling": {"every_n_steps": 32}}}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, kw in modes.items():  # warm-up
            run(model, ids, 40, kw, Path(tmp), f"warm-{mode}")
        for rnd in range(2):
            for mode, kw in modes.items():
                out.setdefault(mode, []).append(run(model, ids, args.new_tokens, kw, Path(tmp), f"{mode}-{rnd}"))
    base_med = statistics.median([s for r in out["base"] for s in r["step_us"]])
    print(f"device {out['device']}, {args.model}, {args.new_tokens} new tokens; base decode step median "
          f"{base_med:.0f} us")
    for k, v in out["raw"].items():
        print(f"  raw {k}: {v:.1f}")
    for mode in [m for m in modes if m != "base"]:
        print(f"{mode}: {modes[mode]}")
        for r in out[mode]:
            print(f"  hook {r['hook_us_per_step']:.1f} us/step = {100 * r['hook_us_per_step'] / base_med:.2f}% of a "
                  "base step" +
                  (f"; sampler drain after generate {r['drain_after_generate_s']:.2f} s"
                   if "drain_after_generate_s" in r else ""))
            for k, v in r["components_us_per_step"].items():
                print(f"    {k:<28} {v:9.1f} us/step  ({r['calls'].get(k, 0)} calls)")
            steps = r["step_us"]
            # steps[i] is the time from token i to token i+1, i.e. forward number i+1 (decode step i+1)
            sample = [s for i, s in enumerate(steps) if (i + 1) % 32 == 0]
            after = [s for i, s in enumerate(steps) if (i + 1) % 32 == 1 and i > 0]
            other = [s for i, s in enumerate(steps) if (i + 1) % 32 not in (0, 1)]
            print(f"    step median us: sampling-steps {statistics.median(sample):.0f}, after {statistics.median(after):.0f}, "
                  f"other {statistics.median(other):.0f} (base {base_med:.0f}); mean all {statistics.mean(steps):.0f}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(out, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
