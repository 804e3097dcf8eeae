"""Request end with content sampling: waiting for the staged copies only (now) against waiting for
every sample to be encoded and written (``sampler.drain()``, as the recorder once did).

    python bench/request_end_sampling.py [--device cpu] [--batch 1] [--prompt 1024] [--new 4] [--pairs 6]

One process, one model (Pythia-1.4B geometry; shrunk on a CPU), K/V sampling every 32 steps
(incremental). Each pair records one session per variant in ABBA order and reports the time
``generate`` takes to return (what the caller waits for) and the whole ``with record(...)`` block
(close joins the background writing, so the block's total shows where the work went, not that it
vanished). On a CPU the copies are synchronous clones made on the model's thread, so this measures
only the encoding and writing moved off the return path; it is a proxy for a GPU, where the copies
are asynchronous and the prefill sample was measured at ~3 GiB for batch 16 x 1k tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--new", type=int, default=4)
    p.add_argument("--pairs", type=int, default=6)
    args = p.parse_args(argv)

    import torch

    import kvtrace
    from kvtrace import presets
    from kvtrace.recorder import sampling

    gpu = args.device.startswith("cuda")
    model = presets.preset_model("pythia-1.4b", dtype=torch.bfloat16 if gpu else torch.float32,
                                 device=args.device, shrink=not gpu)
    ids = torch.randint(3, int(model.config.vocab_size), (args.batch, args.prompt)).to(args.device)
    from kvtrace.recorder.requests import Requests

    wait_copies = sampling.PayloadSampler.wait_copies
    finish = Requests.finish
    finish_s: list[float] = []

    def timed_finish(self, *a, **kw):  # the request-end work on the caller's thread
        t = time.perf_counter()
        try:
            return finish(self, *a, **kw)
        finally:
            finish_s.append(time.perf_counter() - t)

    Requests.finish = timed_finish

    def run(variant: str, path: Path) -> tuple[float, float, int]:
        # "drain": the old request end (every queued sample encoded and written before return)
        sampling.PayloadSampler.wait_copies = sampling.PayloadSampler.drain if variant == "drain" else wait_copies
        t0 = time.perf_counter()
        with kvtrace.record(model, path, sampling={"every_n_steps": 32}) as rec, torch.no_grad():
            model.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
            if gpu:
                torch.cuda.synchronize()
        t2 = time.perf_counter()
        sampling.PayloadSampler.wait_copies = wait_copies
        return finish_s[-1], t2 - t0, rec.sampler.stats()["written"]

    times: dict[str, list[tuple[float, float]]] = {"drain": [], "copies": []}
    with tempfile.TemporaryDirectory() as tmp:
        run("copies", Path(tmp) / "warm.kvt.h5")
        for i in range(args.pairs):
            order = ("drain", "copies") if i % 2 == 0 else ("copies", "drain")
            for v in order:
                gen, total, written = run(v, Path(tmp) / f"{i}{v}.kvt.h5")
                times[v].append((gen, total))
                print(f"pair {i} {v:6s}: request end {gen * 1e3:8.1f} ms, block {total * 1e3:8.1f} ms, "
                      f"{written} samples", flush=True)
    for v, rows in times.items():
        print(f"{v:6s} median: request end {statistics.median(r[0] for r in rows) * 1e3:8.1f} ms, "
              f"whole block {statistics.median(r[1] for r in rows) * 1e3:8.1f} ms")
    ratios = [a[0] / b[0] for a, b in zip(times["copies"], times["drain"], strict=True)]
    print(f"request-end ratio copies/drain: median {statistics.median(ratios):.3f} "
          f"(pairs {min(ratios):.3f}..{max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
