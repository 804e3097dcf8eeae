"""Holdout runs for the serving detectors: continuous-batching recordings that are NOT in the test
suite or the accuracy suite, kept so that the claim in docs/detectors.md ("two holdouts, the first
showed two false alarms that general rules fixed, the second was judged after them unchanged") can
be re-run. Same rules as the suite: a clean run has no finding above info (score > 0.1) from any
detector; a planted run is named by its own detector at >= 0.5.

    python tests/serving_detectors/serving_holdout.py      # ~1 minute on 2 CPU cores

Prints one line per run (the findings above info) and exits 1 listing what failed. Not collected
by pytest (it would add a minute to the suite and is a measurement, not a regression test).
"""

from __future__ import annotations

import random
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import serving_scenarios as S  # noqa: E402


def _eos(path: Path, arch: str, lengths: list[int], new: int, seed: int, **cb: Any) -> Path:
    """Sampling with EOS live (ids 2..29 end a request), seeded."""
    from transformers import GenerationConfig

    import kvtrace

    m = S.model(arch)
    gc = GenerationConfig(max_new_tokens=new, do_sample=True, temperature=1.0, eos_token_id=list(range(2, 30)),
                          pad_token_id=0)
    _, cfg = S._configs(new, seed=seed, **cb)
    with kvtrace.record(m, path):
        m.generate_batch(inputs=S.prompts(lengths), generation_config=gc, continuous_batching_config=cfg, warmup=False)
    return path


def _two_managers(path: Path) -> Path:
    import kvtrace

    m = S.model("llama")
    with kvtrace.record(m, path):
        for lengths, start in (([5, 8, 6], 3), ([9, 4, 7, 6], 50)):
            gc, cfg = S._configs(6, page_size=16, num_blocks=32, max_batch_tokens=128)
            m.generate_batch(inputs=S.prompts(lengths, start), generation_config=gc, continuous_batching_config=cfg,
                             warmup=False)
    return path


def _rand(seed: int, n: int, lo: int, hi: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randint(lo, hi) for _ in range(n)]


def _qwen3_waves(path: Path) -> Path:
    rnd = random.Random(1)
    plan = [[(S.prompts([rnd.randint(3, 30)], 10 * w + i)[0], rnd.randint(5, 20)) for i in range(rnd.randint(2, 5))]
            for w in range(5)]
    return S.waves(path, plan, arch="qwen3", page_size=16, num_blocks=64, max_batch_tokens=128)


def _growth_queue(path: Path) -> Path:
    plan = [[(S.prompts([4])[0], 2)] + [(p, 40) for p in S.prompts([4] * 7, 30)], S._wave([4] * 5, 4, start=90)]
    return S.waves(path, plan, page_size=16, num_blocks=16, max_batch_tokens=256)


def _two_long(path: Path) -> Path:
    plan = [[(p, 6) for p in S.prompts([10] * 6)] + [(S.prompts([10], 70)[0], 30), (S.prompts([10], 80)[0], 30)]]
    return S.waves(path, plan, arch="qwen3", page_size=16, num_blocks=64, max_batch_tokens=128)


def _prompt_spike(path: Path) -> Path:
    plan = [S._wave([8, 9, 7], 6), S._wave([8, 10, 9], 6, start=40),
            [(S.prompts([60], 90)[0], 6)] + S._wave([9, 8], 6, start=120)]
    return S.waves(path, plan, arch="qwen2", page_size=16, num_blocks=64, max_batch_tokens=128)


def _sharing_off_phi3(path: Path) -> Path:
    p = S.prompts([40], 7)[0]
    return S.sequential(path, [p, S.prompts([30], 90)[0], p, p], 4, arch="phi3", page_size=16, num_blocks=32,
                        max_batch_tokens=128, allow_block_sharing=False)


def _mistral_repeats(path: Path) -> Path:
    p = S.prompts([40], 5)[0]
    return S.sequential(path, [p, p, p], 4, arch="mistral", page_size=16, num_blocks=32, max_batch_tokens=128)


Run = Callable[[Path], Path]
# name -> (recording, the detector that must name it or None for a clean run)
FIRST: dict[str, tuple[Run, str | None]] = {
    "qwen3_waves": (_qwen3_waves, None),
    "gpt_oss_16": (lambda p: S.batch(p, _rand(2, 16, 5, 15), 16, arch="gpt_oss", page_size=16, num_blocks=64,
                                     max_batch_tokens=128), None),
    "mistral_long_decode": (lambda p: S.batch(p, [5, 9, 7, 12, 6, 8], 40, arch="mistral", page_size=16,
                                              num_blocks=32, max_batch_tokens=64), None),
    "gemma3_long_tail": (lambda p: S.batch(p, [6, 7, 40, 6, 8, 5, 7, 38, 6, 7], 6, arch="gemma3_text", page_size=16,
                                           num_blocks=64, max_batch_tokens=256), None),
    "phi3_spread": (lambda p: S.batch(p, list(range(4, 41, 4)), 4, arch="phi3", page_size=16, num_blocks=64,
                                      max_batch_tokens=256), None),
    "used_63pct": (lambda p: S.batch(p, [10] * 6, 20, page_size=16, num_blocks=19, max_batch_tokens=256), None),
    "two_managers": (_two_managers, None),
    "llama_eos": (lambda p: _eos(p, "llama", [6] * 12, 30, 0, page_size=16, num_blocks=64, max_batch_tokens=128), None),
    "gemma3_preemption": (lambda p: S.batch(p, [4, 3, 5, 3], 40, arch="gemma3_text", page_size=16, num_blocks=6,
                                            max_batch_tokens=64), "preemption"),
    "mixed_spike": (lambda p: S.batch(p, S.MIXED + [60, 5, 8], 8, arch="qwen3", page_size=16, num_blocks=64,
                                      max_batch_tokens=256), "context_spike"),
    "phi3_sharing_off": (_sharing_off_phi3, "prefix_cache"),
    "growth_queue": (_growth_queue, "queueing"),
    "offered_7_of_8": (lambda p: S.batch(p, [20] * 7, 4, page_size=16, num_blocks=16, max_batch_tokens=256),
                       "concurrency_headroom"),
    "mistral_64_pages": (lambda p: S.batch(p, [10] * 6, 6, arch="mistral", page_size=64, num_blocks=6,
                                           max_batch_tokens=256), "block_waste"),
}
SECOND: dict[str, tuple[Run, str | None]] = {
    "qwen2_eos": (lambda p: _eos(p, "qwen2", _rand(5, 20, 3, 40), 24, 5, page_size=16, num_blocks=96,
                                 max_batch_tokens=256), None),
    "gpt_oss_eos": (lambda p: _eos(p, "gpt_oss", _rand(6, 14, 3, 20), 32, 6, page_size=16, num_blocks=96,
                                   max_batch_tokens=128), None),
    "mistral_repeats": (_mistral_repeats, None),
    "phi3_default_pages_light": (lambda p: S.batch(p, [5, 9], 6, arch="phi3", page_size=256, num_blocks=8,
                                                   max_batch_tokens=256), None),
    "two_long_generations": (_two_long, None),
    "qwen2_prompt_spike": (_prompt_spike, "context_spike"),
    "phi3_memory_percent": (lambda p: S.batch(p, [4, 5, 6, 4, 5, 6], 36, arch="phi3", page_size=16,
                                              max_batch_tokens=32, max_requests_per_batch=8,
                                              max_memory_percent=S._memory_percent(220 << 10)), "preemption"),
    "gpt_oss_128_pages": (lambda p: S.batch(p, [4, 6, 5, 7, 8, 4, 6], 6, arch="gpt_oss", page_size=128, num_blocks=8,
                                            max_batch_tokens=256), "block_waste"),
    "gemma3_budget_16": (lambda p: S.batch(p, [40] * 6, 4, arch="gemma3_text", page_size=16, num_blocks=128,
                                           max_batch_tokens=16), "queueing"),
}


def main() -> int:
    import warnings

    import torch

    import kvtrace

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for group, runs in (("first", FIRST), ("second", SECOND)):
            for name, (record, detector) in runs.items():
                r = kvtrace.analyze(record(Path(tmp) / f"{name}.kvt.h5"))
                loud = {f"{f.detector}/{f.kind}": round(f.score, 2) for f in r.findings if f.score > 0.1}
                own = max((f.score for f in r.findings if f.detector == detector), default=0.0) if detector else None
                ok = own >= 0.5 if detector else not loud
                print(f"{group} {name} ({detector or 'clean'}): {'ok' if ok else 'FAIL'} {loud}")
                if not ok:
                    failures.append(name)
    for name in failures:
        print("FAILED", name)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
