"""`kvtrace demo`: record a small hybrid sliding-window model, show what the trace holds,
analyse it and write the HTML report."""

from __future__ import annotations

import time
from pathlib import Path

import click

from kvtrace.commands.common import guarded
from kvtrace.commands.outputs import check_output, remove_empty_dirs
from kvtrace.errors import CannotWrite, TraceIncomplete, Unavailable
from kvtrace.progress import Milestones
from kvtrace.units import format_bytes, format_ns

# gpt-oss-20b KV geometry (8 KV heads x 64, window 128, sliding/full alternating), depth and
# width shrunk so that it generates on two CPU cores in seconds; KV geometry per layer is real.
DEMO_PRESET = "gpt-oss-20b"
DEMO_SHRINK = {"layers": 4, "width_scale": 0.05, "vocab": 512}
DEMO_PROMPT = 32
DEMO_REQUESTS = (160, 48)  # new tokens per request: the first one saturates the 128-token window


@click.command("demo")
@click.option("-o", "--output-dir", "out_dir", type=click.Path(file_okay=False), default="kvtrace-demo",
              show_default=True, help="Directory for demo.kvt.h5 (created if missing).")
@click.option("--device", default="auto", show_default=True, help="auto (CUDA when present), cpu, cuda:N.")
@guarded
def demo(out_dir: str, device: str) -> None:
    """Record a hybrid sliding-window model (gpt-oss-20b geometry, shrunk) and summarise the trace.

    \b
    Runs on CUDA when present, else on the CPU (well under a minute on two cores).
    Random weights, nothing downloaded. Sizes in binary units (KiB = 1024 B).
    """
    out = Path(out_dir)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CannotWrite(f"cannot create {out}: {exc.strerror}") from None
    trace_path = out / "demo.kvt.h5"
    if trace_path.exists() and not _written_by_demo(trace_path):
        raise click.UsageError(f"{trace_path} exists and was not written by 'kvtrace demo': refusing to "
                               "overwrite it; pick another directory with -o")
    check_output(out / "report.html", option="-o", inputs=(trace_path,))
    try:
        from kvtrace.recorder.session import check_writable
    except ImportError as exc:
        raise Unavailable(f"the demo records a model: it needs torch and transformers ({exc})") from None
    check_writable(trace_path)  # CannotWrite: exit 73 (guarded)
    steps = Milestones()  # a line before each step that takes seconds (model load, record, analyse, report)
    try:
        _record(trace_path, device, steps)
    except CannotWrite:  # as `record`: the trace cannot be created (a full disk), exit 73
        if created:
            remove_empty_dirs(out)
        raise
    show(trace_path)
    _after_recording(trace_path, steps)


def _record(trace_path: Path, device: str, steps: Milestones) -> None:
    """Record the demo requests into ``trace_path``; TraceIncomplete (74) when storage failed midway."""
    with steps.step("importing torch and transformers"):
        import torch

        import kvtrace
        from kvtrace.loading import load_model

    t0 = time.monotonic_ns()
    with steps.step(f"loading preset:{DEMO_PRESET} (random weights, {DEMO_SHRINK['layers']} layers, nothing "
                    "downloaded)"):
        loaded = load_model(f"preset:{DEMO_PRESET}", device=device, dtype="auto",
                            layers=DEMO_SHRINK["layers"], width=DEMO_SHRINK["width_scale"],
                            vocab=DEMO_SHRINK["vocab"])
    model = loaded.model
    dev = next(model.parameters()).device
    click.echo(f"recording {loaded.model_id} on {dev} ({loaded.note})")
    gen = torch.Generator().manual_seed(0)
    with kvtrace.record(model, trace_path, model_id=loaded.model_id,
                        settings_extra={"cli": {"command": "demo"}}) as rec:
        for i, new in enumerate(DEMO_REQUESTS):
            ids = torch.randint(3, DEMO_SHRINK["vocab"], (1, DEMO_PROMPT), generator=gen).to(dev)
            with steps.step(f"  request {i}: {DEMO_PROMPT} prompt tokens + {new} new tokens"):
                model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    elapsed = time.monotonic_ns() - t0
    if rec.storage_failure is not None:  # as `record`: generation finished, the trace stopped early
        raise TraceIncomplete(f"{trace_path}: trace incomplete, writing stopped early "
                              f"({rec.storage_failure.describe()}); it holds everything up to its last flush")
    click.echo(f"trace written to {trace_path} in {format_ns(elapsed)}"
               + (f" ({rec.recorder_errors} recorder errors recorded)" if rec.recorder_errors else ""))


def _written_by_demo(path: Path) -> bool:
    """Whether ``path`` is a trace an earlier demo wrote (which a new demo may replace)."""
    from kvtrace.format.errors import TraceError
    from kvtrace.format.reader import Trace

    try:
        with Trace(path) as t:
            return (t.meta.recorder_settings or {}).get("cli", {}).get("command") == "demo"
    except (TraceError, OSError, AttributeError):
        return False


def show(trace_path: Path) -> None:
    """What the trace holds: the summary plus the hybrid cache at the last step."""
    import numpy as np

    from kvtrace.format.reader import Trace
    from kvtrace.format.schema import LayerType
    from kvtrace.format.summary import summarize

    with Trace(trace_path) as t:
        s = summarize(t)
        kv, steps = t.kv.where(request=0), t.steps.where(request=0)
    click.echo(f"  {s['requests']['count']} requests, {s['requests']['new_tokens']} new tokens "
               f"(one step each), cache structure read at {s['rows']['steps']} steps "
               f"({s['rows']['kv']} per-layer rows), file {format_bytes(s['file_bytes'])}")
    sources = ", ".join(f"{k} {'yes' if v.get('available') else 'no'}" for k, v in sorted(s["sources"].items()))
    click.echo(f"  sources: {sources}")
    last = kv[kv["step"] == kv["step"].max()]
    for lt in sorted(set(last["layer_type"].tolist())):
        rows = last[last["layer_type"] == lt]
        click.echo(f"  request 0, last step, {LayerType(lt).name.lower()} layers: "
                   f"{len(rows)} x {int(rows['tokens_kept'][0])} tokens kept of {int(rows['tokens_seen'][0])} seen, "
                   f"{format_bytes(int(rows['bytes_valid'][0]))} valid / "
                   f"{format_bytes(int(rows['bytes_allocated'][0]))} allocated each")
    peak = int(np.max(steps["kv_bytes_unique"])) if len(steps) else 0
    click.echo(f"  request 0 peak KV cache: {format_bytes(peak)} (de-duplicated by storage)")
    click.echo(f"  explore it: kvtrace info {trace_path}")


def _after_recording(trace_path: Path, steps: Milestones | None = None) -> Path | None:
    """Analyse the fresh trace, print the findings, write the HTML report and print its path."""
    from kvtrace.analyzer import analyze
    from kvtrace.analyzer.terminal import console_for, render

    steps = steps or Milestones()
    with steps.step(f"analysing {trace_path.name} (every detector)"):
        report = analyze(trace_path)
    click.echo("")
    render(report, console_for())
    html_path = trace_path.with_name("report.html")
    try:
        from kvtrace.report import write_report
    except ImportError as exc:  # matplotlib is the `report` extra
        click.echo(f"HTML report skipped: {exc} (pip install 'kvtrace[report]')")
        return None
    try:
        with steps.step("writing the HTML report (figures)"):
            write_report(trace_path, html_path, analysis=report)
    except ImportError as exc:
        click.echo(f"HTML report skipped: {exc} (pip install 'kvtrace[report]')")
        return None
    click.echo(f"HTML report: {html_path.resolve()}")
    return html_path
