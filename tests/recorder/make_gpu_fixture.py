"""Make the small GPU-recorded trace kept under tests/data (run on a CUDA machine):

    python tests/recorder/make_gpu_fixture.py OUT_DIR

Writes OUT_DIR/gpu_gemma3_tiny.kvt.h5 and OUT_DIR/gpu_gemma3_tiny.md (how it was made, with the
software versions and device taken from the trace itself). The model is the tiny random-weight
gemma3_text of tests.helpers.models (two sliding layers with window 8, one full layer), bf16,
two requests of 12 prompt tokens: 16 and 6 new tokens, K/V contents sampled every 5 steps.
"""

from __future__ import annotations

import sys
from pathlib import Path

NAME = "gpu_gemma3_tiny"


def main(out_dir: str) -> Path:
    import torch

    import kvtrace
    from kvtrace.format.reader import Trace
    from kvtrace.format.summary import summarize
    from tests.helpers.models import tiny_model, tiny_prompt

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{NAME}.kvt.h5"
    model = tiny_model("gemma3_text", dtype=torch.bfloat16).to("cuda")
    with kvtrace.record(model, path, model_id="tests.helpers.models:gemma3_text",
                        sampling={"every_n_steps": 5}, structure_every=1) as rec:
        for seed, new in ((0, 16), (1, 6)):
            ids = tiny_prompt(12, seed=seed).to("cuda")
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    with Trace(path) as t:
        s = summarize(t)
    dev = s["devices"][0]["name"] if s["devices"] else "unknown"
    sw = s["software"]
    note = f"""# {NAME}.kvt.h5

Recorded on a GPU by `python tests/recorder/make_gpu_fixture.py OUT_DIR` (kvtrace {sw['kvtrace']}).

- device: {dev}; torch {sw['torch']}, transformers {sw['transformers']}, CUDA {sw['cuda']}, driver {sw['driver']}
- model: `tests.helpers.models.tiny_model("gemma3_text", dtype=torch.bfloat16)` (random weights, seed 0;
  layers: sliding window 8, sliding window 8, full), on cuda:0
- requests: `tiny_prompt(12, seed=0)` + 16 new tokens, `tiny_prompt(12, seed=1)` + 6 new tokens,
  greedy, `min_new_tokens == max_new_tokens`
- recorder: defaults (telemetry 20 Hz, gc + empty_cache after each request), sampling every 5 steps
  (plus prefill end and last step): {s['payloads']['count']} payloads
- rows: {s['rows']['kv']} kv, {s['rows']['steps']} steps, {s['rows']['telemetry/allocator']} allocator,
  {s['rows']['telemetry/nvml']} nvml; recorder errors: {rec.recorder_errors}
- sources: {', '.join(k for k, v in sorted(s['sources'].items()) if v.get('available'))}
"""
    (out / f"{NAME}.md").write_text(note, encoding="utf-8")
    print(note)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
