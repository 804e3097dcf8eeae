"""Where content sampling costs the decode loop: per-step time by phase after a sampling step.

    python bench/sampling_phases.py [--new-tokens 512] [--rounds 5] [--variants base,samp,samp_discard]

Pythia-1.4B geometry, bf16, random weights, greedy HF generate (on the CPU a 2-layer, narrow
smoke-test model). Each round runs every variant once, in shuffled order:

  base          no recorder
  samp          the recorder's defaults + sampling every 32 steps
  samp_all      the same with whole samples (tokens="all")
  samp_discard  diagnostic: the workers wait for the copy and drop it (no encoding or writing)
  samp_nosubmit diagnostic: sampling steps read the structure but submit no copy

For each variant: the median over rounds of the mean decode step, and of the mean step time at
phases 0, 1, 2, 3, 8, 16 and 31 after a sampling step (phase 0 is the sampling step itself, whose
hooks stage the copies; later phases show the background threads' cost to the model's thread).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.table import Table

PHASES = (0, 1, 2, 3, 8, 16, 31)
EVERY = 32
VARIANTS: dict[str, dict[str, Any] | None] = {
    "base": None,
    "samp": {"sampling": {"every_n_steps": EVERY}},
    "samp_all": {"sampling": {"every_n_steps": EVERY, "tokens": "all"}},
    "samp_discard": {"sampling": {"every_n_steps": EVERY}},
    "samp_nosubmit": {"sampling": {"every_n_steps": EVERY}},
}


@contextlib.contextmanager
def _diagnostic(variant: str) -> Iterator[None]:
    """Switch one part of the sampler off for one run (diagnostic variants only)."""
    from kvtrace.recorder import sampling

    cls = sampling.PayloadSampler
    if variant == "samp_discard":
        original, name = cls._work, "_work"

        def discard(self: Any) -> None:
            while (jobs := self._jobs.get()) is not None:
                for event in {id(j.event): j.event for j in jobs if j.event is not None}.values():
                    event.synchronize()
                with self._lock:
                    self._pinned_in_flight -= sum(j.pinned_bytes for j in jobs)
                    self._pending -= len(jobs)
                    if self._pending == 0:
                        self._idle.notify_all()
                for _ in jobs:
                    self._slots.release()

        cls._work = discard
    elif variant == "samp_nosubmit":
        original, name = cls.submit, "submit"
        cls.submit = lambda self, *args, **kwargs: False
    else:
        yield
        return
    try:
        yield
    finally:
        setattr(cls, name, original)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--variants", default="base,samp,samp_discard")
    args = p.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    unknown = set(names) - set(VARIANTS)
    if unknown or "base" not in names:
        print(f"variants must include base and come from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2

    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    import kvtrace
    from kvtrace import presets

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shrink = {} if dev == "cuda" else {"layers": 2, "width_scale": 0.0625, "vocab": 512}
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(presets.preset_config("pythia-1.4b", **shrink),
                                                 dtype=torch.bfloat16).eval()
    model.generation_config.pad_token_id = 0
    ids = torch.randint(3, 500, (1, 64)).to(dev)

    def run(variant: str, new: int) -> tuple[float, list[float]]:
        times: list[int] = []

        def clock(_ids: Any, scores: Any) -> Any:
            times.append(time.perf_counter_ns())
            return scores

        kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False,
              "logits_processor": LogitsProcessorList([clock])}
        if dev == "cuda":
            torch.cuda.synchronize()
        options = VARIANTS[variant]
        if options is None:
            model.generate(ids, **kw)
        else:
            with tempfile.TemporaryDirectory() as tmp, _diagnostic(variant), \
                    kvtrace.record(model, f"{tmp}/p.kvt.h5", **options):
                model.generate(ids, **kw)
        step_ms = [(b - a) / 1e6 for a, b in zip(times, times[1:], strict=False)]  # [i]: decode step i + 1
        phases = [statistics.mean(t for i, t in enumerate(step_ms) if (i + 1) % EVERY == ph) for ph in PHASES]
        return statistics.mean(step_ms), phases

    for name in names:  # warm-up
        run(name, 2 * EVERY + 2)
    results: dict[str, list[tuple[float, list[float]]]] = {name: [] for name in names}
    rng = random.Random(0)
    for _ in range(args.rounds):
        order = list(names)
        rng.shuffle(order)
        for name in order:
            results[name].append(run(name, args.new_tokens))
    device = torch.cuda.get_device_name(0) if dev == "cuda" else "cpu (smoke test)"
    print(f"{device}: {args.rounds} rounds x {args.new_tokens} new tokens; decode step in ms (median over rounds)")
    table = Table("variant", "ratio", "step", *(f"ph{ph}" for ph in PHASES), box=None)
    base = [r[0] for r in results["base"]]
    for name, rs in results.items():
        ratio = [r[0] / b for r, b in zip(rs, base, strict=True)]
        ratio_s = f"{statistics.median(ratio):.3f} [{min(ratio):.3f}-{max(ratio):.3f}]"
        phases = [f"{statistics.median(r[1][j] for r in rs):.1f}" for j in range(len(PHASES))]
        table.add_row(name, ratio_s, f"{statistics.median(r[0] for r in rs):.2f}", *phases)
    for col in table.columns[1:]:
        col.justify = "right"
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
