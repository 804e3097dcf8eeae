"""GPU check of `kvtrace analyze --gpu` (run on the CUDA machine, from the repository root):

    PYTHONPATH=. python3 tests/analyzer/run_contents_gpu.py [OUT_DIR]

1. `python3 -m kvtrace.cli analyze --gpu tests/data/gpu_gemma3_tiny.kvt.h5` must exit 0 and print
   "backend triton/cuda" (the Triton kernels ran);
2. records tiny llama and gemma3_text traces on cuda:0 (bf16, sampled K/V/Q) and compares the
   content analyses on the GPU (Triton) with the CPU (torch reference): entropy within 5e-4,
   mean norms within rtol 2e-5 (docs/kernels.md tolerances), identical eviction counts and bytes.

Needs torch with CUDA, triton, and zstandard (the trace codec; carry a wheel to the GPU host).
OUT_DIR keeps the traces and both analyses: tests/data/gpu_contents/ holds one such run (traces
and the Triton side), which tests/analyzer/test_gpu_contents.py checks the CPU path against.
Exits 0 when every check passed, 1 otherwise, 69 when the machine cannot run it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from contents_compare import contents_disagree  # tests/analyzer is this script's directory

FIXTURE = Path("tests/data/gpu_gemma3_tiny.kvt.h5")


def main() -> int:
    try:
        import torch
        import triton  # noqa: F401
        import zstandard  # noqa: F401
    except ImportError as exc:
        print(f"cannot run: {exc}")
        return 69
    if not torch.cuda.is_available():
        print("cannot run: no CUDA device")
        return 69
    import kvtrace
    from kvtrace.analyzer.contents import analyze_contents
    from tests.helpers.models import tiny_model, tiny_prompt

    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    out_dir.mkdir(parents=True, exist_ok=True)
    failures: list[str] = []
    p = subprocess.run([sys.executable, "-m", "kvtrace.cli", "analyze", "--gpu", str(FIXTURE)],
                       capture_output=True, text=True, env={**__import__("os").environ, "COLUMNS": "160"})
    (out_dir / "fixture_analyze.txt").write_text(p.stdout + p.stderr)
    print(p.stdout[-4000:], p.stderr[-2000:])
    if p.returncode != 0 or "backend triton/cuda" not in p.stdout:
        failures.append(f"CLI on the fixture: rc {p.returncode}, triton backend line present: "
                        f"{'backend triton/cuda' in p.stdout}")
    for name in ("llama", "gemma3_text"):
        path = out_dir / f"{name}.kvt.h5"
        model = tiny_model(name, dtype=torch.bfloat16).to("cuda")
        with kvtrace.record(model, str(path), sampling={"every_n_steps": 4, "queries": True}):
            model.generate(tiny_prompt(24).to("cuda"), max_new_tokens=9, min_new_tokens=9, do_sample=False)
        gpu = analyze_contents(path, device="cuda").to_dict()
        cpu = analyze_contents(path, device="cpu").to_dict()
        (out_dir / f"{name}_contents.json").write_text(json.dumps({"gpu": gpu, "cpu": cpu}, indent=1))
        print(f"{name}: gpu backend {gpu['backend']}, cpu backend {cpu['backend']}, "
              f"{len(gpu['entropy'])} entropy / {len(gpu['dead_heads'])} dead-head / {len(gpu['eviction'])} eviction rows")
        problem = contents_disagree(gpu, cpu)
        if problem:
            failures.append(f"{name}: GPU and CPU disagree: {problem}")
    print("FAILED:\n  " + "\n  ".join(failures) if failures else "OK: triton/cuda ran and matches torch/cpu")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
