"""Does the recorder synchronise the GPU on the model's thread? Counted with torch's sync debug mode.

    python bench/profile_syncs.py [--batch 16] [--prompt 1024] [--new 64] [--json out.json]

``torch.cuda.set_sync_debug_mode("warn")`` makes every synchronising CUDA call (a device->host
copy, ``.item()``, ``nonzero``, a blocking ``synchronize``) warn. It is switched on only while
the recorder's own code runs on the model's thread (the step hooks, a request's begin and
finish), so generate's own syncs are not counted. Steps are split into sampling and plain ones
(nothing may synchronise the GPU on a plain step). Cache kinds: the default dynamic
cache, and a static cache (``cache_implementation="static"``, compile off). Needs CUDA.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("profile_syncs: needs a CUDA device", file=sys.stderr)
        return 69
    import kvtrace
    from kvtrace import presets
    from kvtrace.recorder.requests import Requests
    from kvtrace.recorder.steps import StepRecorder

    counts: Counter = Counter()
    where: dict[str, str] = {}

    def watched(site: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def inner(self: Any, *a: Any, **k: Any) -> Any:
            req = self.ctx.active if site.startswith("step") else None
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    return fn(self, *a, **k)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    label = site  # a step's kind is known once its start hook ran
                    if req is not None:
                        label += " (sampling step)" if req.sample_now else " (plain step)"
                    hits = [w for w in caught if "synchroniz" in str(w.message).lower()]
                    counts[label] += len(hits)
                    counts[label + " calls"] += 1
                    if hits and label not in where:
                        where[label] = f"{hits[0].filename}:{hits[0].lineno}"
        return inner

    patches = [(StepRecorder, "on_step_start", "step start"), (StepRecorder, "on_step_end", "step end"),
               (Requests, "begin", "request begin"), (Requests, "_finish_unguarded", "request finish")]
    saved = [(cls, name, cls.__dict__[name]) for cls, name, _ in patches]
    model = presets.preset_model("pythia-1.4b", dtype=torch.bfloat16, device="cuda", shrink=False)
    ids = torch.randint(3, int(model.config.vocab_size), (args.batch, args.prompt), device="cuda")
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                           "batch": args.batch, "prompt": args.prompt, "new_tokens": args.new, "runs": {}}
    try:
        for cls, name, site in patches:
            setattr(cls, name, watched(site, cls.__dict__[name]))
        runs = [("dynamic, defaults", {}, {}), ("dynamic, sampling every 32", {"sampling": {"every_n_steps": 32}}, {}),
                ("static, defaults", {}, {"cache_implementation": "static", "disable_compile": True})]
        with tempfile.TemporaryDirectory() as tmp:
            for name, options, gen_kw in runs:
                counts.clear()
                where.clear()
                path = Path(tmp) / "s.kvt.h5"
                with kvtrace.record(model, path, **options):
                    model.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, **gen_kw)
                path.unlink()
                out["runs"][name] = {"syncs": dict(counts), "first_site": dict(where)}
                print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if not k.endswith("calls")
                                               ) + (f"; first at {where}" if where else ""))
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(out, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
