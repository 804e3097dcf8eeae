#!/usr/bin/env python
"""The labelled accuracy suite as tables: confusion matrix (pathology x detector, with scores)
and false-positive table (clean controls x detector).

    python bench/accuracy.py                 # record the CPU cases (~3 min on 2 cores) + GPU fixtures
    python bench/accuracy.py --traces DIR    # reuse CPU traces recorded there earlier
    python bench/accuracy.py --gpu-only      # only the committed GPU fixtures (no torch needed)

CPU cases are tests/helpers/cases.py (recorded here, tiny random-weight models); GPU cases are
the traces under tests/data/accuracy (recorded on an H100 by
tests/accuracy/make_gpu_accuracy_fixtures.py) and the analyser suite's earlier H100 fixtures in
tests/data/gpu. A planted case is a hit when its own detector
reports one of its kinds with score >= 0.5; a clean control is a false positive for every
detector with a finding of severity low or above (score > 0.1). docs/accuracy.md keeps the output.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "accuracy"))

import kvtrace  # noqa: E402
from kvtrace.analyzer.base import detector_names  # noqa: E402

GPU_DIR = ROOT / "tests" / "data" / "accuracy"
HIT, LOW = 0.5, 0.1


@dataclass
class Row:
    name: str
    where: str  # "cpu" | "gpu"
    pathology: str | None
    detector: str | None
    kinds: list[str]
    scores: dict[str, float] = field(default_factory=dict)  # detector -> max score
    own: float = 0.0  # max score of the expected detector over the expected kinds
    top: str = ""  # the strongest finding, "detector/kind score"
    only: str | None = None  # a twin: clean for this detector only (its planted sibling's)

    @property
    def hit(self) -> bool:
        return self.own >= HIT

    def judged(self, detector: str) -> bool:
        """Whether this clean row counts for `detector` (a twin counts for its own detector only)."""
        return not self.pathology and detector in self.scores and self.only in (None, detector)

    def false_positives(self) -> dict[str, float]:
        return {d: s for d, s in self.scores.items() if self.judged(d) and s > LOW}


def analyse(name: str, where: str, path: Path, pathology: str | None, detector: str | None,
            kinds: list[str], only: str | None = None) -> Row:
    r = kvtrace.analyze(path)
    row = Row(name, where, pathology, detector, list(kinds), only=only)
    for res in r.results:
        if res.status == "ran":
            row.scores[res.name] = round(res.score, 3)
    if detector:
        row.own = max((f.score for f in r.result(detector).findings if f.kind in kinds), default=0.0)
    if r.findings:
        f = max(r.findings, key=lambda f: f.score)
        row.top = f"{f.detector}/{f.kind} {f.score:.2f}"
    return row


def cpu_rows(traces: Path | None) -> list[Row]:
    from tests.helpers import cases

    outdir = traces or Path(tempfile.mkdtemp(prefix="kvtrace-accuracy-"))
    outdir.mkdir(parents=True, exist_ok=True)
    todo = [c for c in cases.all_cases() if not cases.trace_path(outdir, c.name).exists()]
    fresh = [c.name for c in todo if c.fresh]
    failed = cases.record_fresh(outdir, fresh) if fresh else {}
    for c in todo:
        if not c.fresh:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                c.record(cases.trace_path(outdir, c.name))
    rows = []
    for c in cases.all_cases():
        path = cases.trace_path(outdir, c.name)
        if c.name in failed or not path.exists():
            print(f"{c.name}: not recorded ({failed.get(c.name, 'missing')})", file=sys.stderr)
            continue
        rows.append(analyse(c.name, "cpu", path, c.pathology, c.detector, list(c.kinds)))
    print(f"CPU traces in {outdir}", file=sys.stderr)
    return rows


# The analyser suite's earlier H100 fixtures (tests/data/gpu), labelled in this suite's terms: the
# same relabels as tests/analyzer/test_gpu_fixtures.py (an ordinary 4,096-token eager prefill on an
# 80 GiB device is a clean control; copies kept outside the cache are duplication).
OLD_GPU_DIR = ROOT / "tests" / "data" / "gpu"
OLD_LABELS = {
    "gpu_clean": (None, None, []),
    "gpu_duplication": ("duplication", "growth_curve", ["duplication"]),
    "gpu_fragmentation": ("fragmentation", "fragmentation", ["split_fragmentation"]),
    "gpu_kept_cache": ("retention", "post_eos", ["retained_after_request"]),
    "gpu_oom": ("oom", "oom", ["oom_prefill"]),
    "gpu_prefill_eager": (None, None, []),
    "gpu_prefill_sdpa": (None, None, []),
}


def gpu_rows() -> list[Row]:
    rows = []
    old = OLD_GPU_DIR / "manifest.json"
    if old.exists():
        for name, info in sorted(json.loads(old.read_text()).items()):
            if name in OLD_LABELS:
                pathology, det, kinds = OLD_LABELS[name]
                rows.append(analyse(f"data/gpu/{name}", "gpu", OLD_GPU_DIR / info["file"], pathology, det, kinds))
    manifest = GPU_DIR / "manifest.json"
    if not manifest.exists():
        return rows
    for name, info in sorted(json.loads(manifest.read_text()).items()):
        rows.append(analyse(name, "gpu", GPU_DIR / info["file"], info.get("pathology"), info.get("detector"),
                            info.get("kinds") or [], info.get("only")))
    return rows


def render(rows: list[Row]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=230)
    dets = [d for d in detector_names() if any(d in r.scores for r in rows)]

    def cell(score: float | None, expected: bool = False) -> str:
        if score is None:
            return "-"
        text = f"{score:.2f}"
        if expected:
            return f"[bold green]{text}[/]" if score >= HIT else f"[bold red]{text}[/]"
        return f"[yellow]{text}[/]" if score > LOW else f"[dim]{text}[/]"

    planted = [r for r in rows if r.pathology]
    t = Table(title="Confusion matrix: planted pathology (rows) x detector (max score; bold = its own detector)")
    t.add_column("case", no_wrap=True)
    t.add_column("cpu/gpu")
    t.add_column("pathology", no_wrap=True)
    for d in dets:
        t.add_column(d.replace("_", " "), justify="right")
    t.add_column("own >= 0.5")
    for r in sorted(planted, key=lambda r: (r.pathology or "", r.where, r.name)):
        t.add_row(r.name, r.where, r.pathology or "", *[cell(r.scores.get(d), d == r.detector) for d in dets],
                  "[green]yes[/]" if r.hit else "[red]NO[/]")
    console.print(t)

    clean = [r for r in rows if not r.pathology]
    fp = Table(title=f"False positives: clean controls with a finding of severity low or above (score > {LOW})")
    fp.add_column("detector")
    fp.add_column("clean runs", justify="right")
    fp.add_column("false positives", justify="right")
    fp.add_column("max score on clean", justify="right")
    fp.add_column("where")
    for d in dets:
        ran = [r for r in clean if r.judged(d)]
        bad = [r for r in ran if r.scores[d] > LOW]
        worst = max((r.scores[d] for r in ran), default=0.0)
        fp.add_row(d, str(len(ran)), str(len(bad)), f"{worst:.2f}", ", ".join(r.name for r in bad[:4]) or "-")
    console.print(fp)

    by = {}
    for r in planted:
        by.setdefault(r.pathology, []).append(r)
    s = Table(title="Per pathology: named by its own detector with score >= 0.5")
    for col in ("pathology", "detector", "cases", "hits", "min own score", "mechanisms"):
        s.add_column(col)
    for p, rs in sorted(by.items()):
        s.add_row(p or "", rs[0].detector or "", str(len(rs)), str(sum(r.hit for r in rs)),
                  f"{min(r.own for r in rs):.2f}", ", ".join(r.name.split(":")[-1] for r in rs))
    console.print(s)
    n_fp = sum(bool(r.false_positives()) for r in clean)
    twins = sum(r.only is not None for r in clean)
    console.print(f"{len(clean)} clean controls ({twins} of them twins judged on their own detector only), "
                  f"{n_fp} with any finding above info; "
                  f"{len(planted)} planted cases, {sum(r.hit for r in planted)} named by their own detector "
                  f"with score >= {HIT}.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", type=Path, help="directory for (or of) the CPU traces")
    ap.add_argument("--gpu-only", action="store_true")
    ap.add_argument("--cpu-only", action="store_true")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    rows: list[Row] = []
    if not args.gpu_only:
        rows += cpu_rows(args.traces)
    if not args.cpu_only:
        rows += gpu_rows()
    render(rows)
    if args.json_out:
        args.json_out.write_text(json.dumps([r.__dict__ for r in rows], indent=1) + "\n")
    return 0 if all(r.hit for r in rows if r.pathology) and not any(r.false_positives() for r in rows
                                                                     if not r.pathology) else 1


if __name__ == "__main__":
    sys.exit(main())
