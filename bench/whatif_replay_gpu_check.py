"""GPU check of the what-if replay end to end: record tiny GQA, sliding-window and MLA models on the
GPU (bf16, K/V/Q sampled), replay every registry policy at three ratios through the kernels
(device cuda; the many-query keep-sets forced through the signature-pieces path, then "auto") and
through the exact numpy reference, and report the largest differences of every content measure.

    PYTHONPATH=. python3 bench/whatif_replay_gpu_check.py --json-out bench/results/whatif_replay_gpu.json

Exit 69 without CUDA; 1 when a difference exceeds the bridge's stated tolerance (recall and error
1e-5 absolute + 1e-4 relative at these sizes, MSE and cosine 1e-9, whatif/accelerated.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = ("llama", "gemma3_text", "deepseek_v3")
POLICIES = ("knorm", "keydiff", "random", "streaming_llm", "observed_attention", "tova", "snapkv",
            "expected_attention", "kivi:nbits=2,residual_length=4", "quanto:nbits=4,residual_length=4", "fp8")
TOL = {"attention_mass_recall": (1e-5, 1e-4), "attention_output_error": (1e-5, 1e-4)}


def _walk(a, b, path, worst):
    if isinstance(a, dict):
        for k in a:
            _walk(a[k], b.get(k) if isinstance(b, dict) else None, f"{path}.{k}", worst)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for x, y in zip(a, b, strict=True):
            _walk(x, y, path, worst)
    elif isinstance(a, float) and isinstance(b, float) and not (math.isnan(a) and math.isnan(b)):
        name = path.rsplit(".", 1)[-1]
        atol, rtol = TOL.get(name, (1e-9, 1e-9) if ("mse" in name or "cosine" in name) else (0.0, 0.0))
        if name in TOL or "mse" in name or "cosine" in name:
            d = abs(a - b)
            w = worst.setdefault(name, {"max_abs": 0.0, "over": 0})
            w["max_abs"] = max(w["max_abs"], d)
            w["over"] += int(d > atol + rtol * abs(b))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("whatif_replay_gpu_check: no CUDA device", file=sys.stderr)
        return 69
    import kvtrace
    from kvtrace.kernels.whatif_config import KernelConfig
    from kvtrace.recorder.sampling import SamplingSettings
    from kvtrace.whatif import parse_policy
    from kvtrace.whatif.run import run_whatif
    from tests.helpers.models import tiny_model

    out = {"device": torch.cuda.get_device_name(), "models": {}}
    bad = 0
    with tempfile.TemporaryDirectory() as d:
        for name in MODELS:
            model = tiny_model(name, dtype=torch.bfloat16).to("cuda")
            ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(0)).to("cuda")
            path = Path(d) / f"{name}.kvt.h5"
            with kvtrace.record(model, path, sampling=SamplingSettings(every_n_steps=4, queries=True)):
                model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
            pols = [parse_policy(p) for p in POLICIES]
            exact = run_whatif(path, pols, [0.25, 0.5, 0.75], device="cpu", steps="all")
            res = {}
            for mode in (True, "auto"):
                gpu = run_whatif(path, pols, [0.25, 0.5, 0.75], device="cuda", steps="all",
                                 kernel_config=KernelConfig(pieces=mode))
                worst: dict = {}
                _walk(gpu, exact, "", worst)
                res[str(mode)] = {"numerics": gpu["numerics"], "worst": worst}
                bad += sum(w["over"] for w in worst.values())
            out["models"][name] = res
            print(name, json.dumps(res), flush=True)
    if a.json_out:
        a.json_out.write_text(json.dumps(out, indent=1))
    print(f"{bad} values over tolerance")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
