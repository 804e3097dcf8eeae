"""Record a tiny trace with a real retention bug and draw the report's memory timeline from it:
the picture at the top of README.md (docs/img/retention-timeline.png).

The bug is the common one: the caller keeps every ``generate`` output
(``return_dict_in_generate=True``), and each output holds its request's KV cache. The model is
kvtrace's gpt-oss-20b preset (random weights, the real sliding/full KV geometry, shrunk to run on a
CPU in seconds; nothing is downloaded). The trace goes through the same code as ``kvtrace report``:
the analyser's verdict, then the report's own memory-timeline figure.

    python scripts/readme_figure.py                 # writes docs/img/retention-timeline.png
    python scripts/readme_figure.py -o /tmp/x.png --trace /tmp/x.kvt.h5
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PICTURE = ROOT / "docs" / "img" / "retention-timeline.png"
PRESET = "gpt-oss-20b"
REQUESTS = (160, 64, 112)  # new tokens per request (24-token prompts): the first fills the 128-token window


def record_retention(path: str | Path) -> list[Any]:
    """Record three requests whose outputs the caller keeps (the KV of each stays alive); returns
    the kept outputs (drop them to free the caches)."""
    import torch

    import kvtrace
    from kvtrace.presets import preset_model

    model = preset_model(PRESET)
    kept: list[Any] = []  # the bug: every output, and with it every request's cache, is kept
    gen = torch.Generator().manual_seed(0)
    with kvtrace.record(model, path, model_id=f"preset:{PRESET}"):
        for new in REQUESTS:
            ids = torch.randint(3, 500, (1, 24), generator=gen)
            kept.append(model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                       return_dict_in_generate=True))
    return kept


def draw(trace: str | Path, out: str | Path) -> Path:
    """The report's memory timeline of ``trace`` as a PNG (the lower panel: KV bytes)."""
    import kvtrace
    from kvtrace.report import data, figures

    with kvtrace.open(trace) as t:
        timelines = data.memory_timelines(t)
        (tl,) = [x for x in timelines if any(s.source == "kv" for s in x.series)]
        tl.series = [s for s in tl.series if s.source in ("kv", "retention")]  # the KV panel alone
        gc = [m for m in data.phase_markers(t) if m.kind == "gc"]  # the retention checks' collections
        fig = figures.memory_timeline(tl, gc, data.time_zero_ns(t))
    fig.axes[0].set_title("KV cache of three requests whose outputs the caller keeps (kvtrace report)")
    fig.set_size_inches(9, 3.2)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=110, metadata={"Software": None})
    figures.close(fig)
    return Path(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--output", default=str(PICTURE), help="PNG to write")
    ap.add_argument("--trace", default=None, help="where to keep the recorded trace (default: a temp dir)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(args.trace or Path(tmp) / "retention.kvt.h5")
        kept = record_retention(trace)
        import kvtrace

        report = kvtrace.analyze(trace)
        for f in report.findings:
            if f.severity >= f.severity.MEDIUM:
                print(f"{f.severity.label}: {f.detector} {f.kind}: {f.message}")
        del kept
        print(f"wrote {draw(trace, args.output)}")


if __name__ == "__main__":
    main()
