#!/usr/bin/env python
"""Record the accuracy suite's clean matrix (every architecture x scenario of tests/helpers/cases.py)
on a CUDA device, the GPU half of the "clean controls x {CPU, CUDA}" matrix:

    python tests/accuracy/make_gpu_clean_matrix.py OUTDIR [--device cuda] [--only ARCH:SCENARIO ...]

The recordings are exactly the CPU suite's (same tiny random-weight models, prompts, options),
built on the CPU and moved to the GPU, so model, prompts and cache live there and the
trace carries real NVML and allocator rows. "fresh" cases run in their own process that touched
no GPU before. Writes OUTDIR/<arch>__<scenario>.kvt.h5 and OUTDIR/manifest.json (device, versions,
size, and each detector's top score as analysed there). tests/accuracy/test_gpu_clean_matrix.py
asserts on the committed copies (no GPU needed there) that none has a finding of severity low or above.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))
sys.path.insert(0, str(HERE.parent))


def _file(arch: str, scenario: str) -> str:
    return f"{arch}__{scenario}.kvt.h5"


def record_one(arch: str, scenario: str, outdir: Path, device: str) -> dict:
    import torch
    import transformers

    from tests.helpers import cases

    # Build on the CPU exactly as the CPU suite does (its seeded generator lives there), then move
    # the model and every prompt to the device.
    build, prompt = cases.tiny_model, cases.tiny_prompt
    cases.tiny_model = lambda *a, **k: build(*a, **k).to(device)
    cases.tiny_prompt = lambda *a, **k: prompt(*a, **k).to(device)
    path = outdir / _file(arch, scenario)
    path.unlink(missing_ok=True)
    t = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases.record_clean(arch, scenario, path)
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else platform.processor() or "cpu"
    return {"file": path.name, "arch": arch, "scenario": scenario, "bytes": path.stat().st_size,
            "seconds": round(time.time() - t, 1), "device": name, "torch": torch.__version__,
            "transformers": transformers.__version__}


def _scores(path: Path) -> dict[str, float]:
    import kvtrace

    r = kvtrace.analyze(path)
    return {x.name: round(max((f.score for f in x.findings), default=0.0), 3) for x in r.results}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.outdir.mkdir(parents=True, exist_ok=True)
    if args.child:  # one fresh-process case; its manifest entry on stdout's last line
        print(json.dumps(record_one(*args.child, args.outdir, args.device)))
        return 0
    from tests.helpers import cases

    wanted = [(c.arch, c.scenario) for c in cases.clean_cases()
              if not args.only or f"{c.arch}:{c.scenario}" in args.only]
    fresh = [w for w in wanted if w[1] == "fresh"]
    manifest: dict[str, dict] = {}
    for arch, sc in fresh + [w for w in wanted if w[1] != "fresh"]:  # fresh first: no CUDA here yet
        key = f"{arch}:{sc}"
        try:
            if sc == "fresh":
                p = subprocess.run([sys.executable, str(HERE), str(args.outdir), "--device", args.device,
                                    "--child", arch, sc], capture_output=True, text=True, timeout=300)
                if p.returncode:
                    raise RuntimeError(p.stderr[-1500:])
                info = json.loads(p.stdout.strip().splitlines()[-1])
            else:
                info = record_one(arch, sc, args.outdir, args.device)
            info["scores"] = _scores(args.outdir / info["file"])
        except Exception as exc:  # noqa: BLE001 - one failed case must not lose the others
            manifest[key] = {"failed": f"{type(exc).__name__}: {str(exc)[-600:]}"}
            print(f"{key}: FAILED {type(exc).__name__}: {str(exc)[-300:]}", flush=True)
            continue
        manifest[key] = info
        top = sorted(((s, d) for d, s in info["scores"].items() if s > 0), reverse=True)[:3]
        print(f"{key:32s} {info['bytes'] / 1024:7.1f} KiB {info['seconds']:5.1f} s {top}", flush=True)
        (args.outdir / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    (args.outdir / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
