"""Chrome trace-event JSON for ui.perfetto.dev (and chrome://tracing).

Layout: one process per device (pid 100 + device index; the CPU, device -1, is pid 99) holding
a counter track per memory series in bytes ("C" events), plus one "kvtrace host" process (pid 1)
with request / prefill / decode spans ("X"), request-level phase instants and the analyser's
findings as global instants ("i", scope "g"). Timestamps are microseconds since the trace's time
zero (kvtrace.report.data.time_zero_ns); the wall-clock anchor is kept in "otherData".
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvtrace.analyzer.report import AnalysisReport
from kvtrace.errors import CannotWrite
from kvtrace.format import schema
from kvtrace.format.reader import Trace
from kvtrace.report import data
from kvtrace.report.findings import FindingRow
from kvtrace.wholefile import write_whole

HOST_PID = 1
REQUESTS_TID = 1
PHASES_TID = 2
FINDINGS_TID = 3

# Counter names (the track shows "<name> bytes": the one arg key is the unit).
COUNTER_NAMES = {
    "nvml_used": "nvml used",
    "nvml_process_used": "nvml process used",
    "allocator_reserved": "allocator reserved",
    "allocator_allocated": "allocator allocated",
    "allocator_inactive_split": "allocator inactive split",
    "kv_bytes": "kv cache",
    "kv_retained": "kv alive after its request",
}
INSTANT_KINDS = (
    schema.EventKind.REQUEST_START, schema.EventKind.PREFILL_START, schema.EventKind.PREFILL_END,
    schema.EventKind.EOS, schema.EventKind.GENERATE_RETURN, schema.EventKind.GC,
    schema.EventKind.EMPTY_CACHE, schema.EventKind.OOM, schema.EventKind.RECORDER_ERROR,
    schema.EventKind.DROPPED_SAMPLES, schema.EventKind.REQUEST_END, schema.EventKind.EXCEPTION,
    schema.EventKind.INTERRUPT, schema.EventKind.NOTE,
)


def device_pid(device: int) -> int:
    return 100 + int(device)


def _us(t_ns: int | np.integer, t0: int) -> float:
    return round((int(t_ns) - t0) / 1000.0, 3)


def _meta(pid: int, name: str, sort_index: int) -> list[dict[str, Any]]:
    return [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": sort_index}},
    ]


def _thread(pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}


def trace_events(trace: Trace, findings: list[FindingRow] | None = None) -> dict[str, Any]:
    """The whole JSON document as a dict (see the module docstring for its layout)."""
    t0 = data.time_zero_ns(trace)
    meta = trace.meta
    events: list[dict[str, Any]] = _meta(HOST_PID, f"kvtrace host: {meta.model_id}", 0)
    events += [_thread(HOST_PID, REQUESTS_TID, "requests"), _thread(HOST_PID, PHASES_TID, "phases"),
               _thread(HOST_PID, FINDINGS_TID, "findings")]
    devices = {int(d["device"]) for d in trace.devices[:]}
    timelines = data.memory_timelines(trace)
    devices |= {tl.device for tl in timelines}
    for dev in sorted(devices):
        events += _meta(device_pid(dev), data.device_label(trace, dev), 10 + dev)
        events.append(_thread(device_pid(dev), 0, "memory"))
    for tl in timelines:
        pid = device_pid(tl.device)
        for s in tl.series:
            name = COUNTER_NAMES.get(s.name, s.name)
            events += [{"ph": "C", "name": name, "pid": pid, "tid": 0, "ts": _us(t, t0),
                        "args": {"bytes": int(v)}} for t, v in zip(s.t_ns, s.values, strict=True)]
    events += _request_spans(trace, t0)
    events += _instants(trace, t0, devices)
    events += _finding_instants(trace, findings or [], t0)
    events.sort(key=lambda e: (e["ph"] != "M", e.get("ts", 0.0)))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "producer": "kvtrace", "kvtrace_version": meta.kvtrace_version, "model_id": meta.model_id,
            "trace": str(trace.path), "format_version": trace.version, "units": "counters in bytes",
            "time_zero_mono_ns": str(t0),
            "time_zero_wall_ns": str(meta.wall_ns(t0)),
        },
    }


def _request_spans(trace: Trace, t0: int) -> list[dict[str, Any]]:
    """Request spans, and within them prefill and decode spans from PREFILL_START/END and EOS."""
    out = []
    events = trace.events[:]
    for r in trace.requests[:]:
        start, end = int(r["start_ns"]), int(r["end_ns"])
        if start == 0:
            continue
        outcome = schema.Outcome(int(r["outcome"])).name.lower() if int(r["outcome"]) in \
            schema.Outcome._value2member_map_ else str(int(r["outcome"]))
        if end == 0 or end < start:  # still running, or crashed: end at the last row we have
            mine = events[events["request"] == r["request"]]
            end = int(mine["t_ns"].max()) if mine.size else start
        args = {"request": int(r["request"]), "outcome": outcome, "prompt_tokens": int(r["prompt_tokens"]),
                "new_tokens": int(r["new_tokens"]), "batch_size": int(r["batch_size"])}
        out.append({"ph": "X", "name": f"request {int(r['request'])}", "cat": "request", "pid": HOST_PID,
                    "tid": REQUESTS_TID, "ts": _us(start, t0), "dur": _us(end, start), "args": args})
        mine = events[events["request"] == r["request"]]

        def first(kind: schema.EventKind, mine: np.ndarray = mine) -> int | None:
            hit = mine[mine["kind"] == int(kind)]
            return int(hit["t_ns"].min()) if hit.size else None

        p0, p1 = first(schema.EventKind.PREFILL_START), first(schema.EventKind.PREFILL_END)
        eos = first(schema.EventKind.EOS) or first(schema.EventKind.GENERATE_RETURN)
        if p0 is not None and p1 is not None and p1 >= p0:
            out.append({"ph": "X", "name": "prefill", "cat": "phase", "pid": HOST_PID, "tid": PHASES_TID,
                        "ts": _us(p0, t0), "dur": _us(p1, p0), "args": {"request": int(r["request"])}})
            if eos is not None and eos >= p1:
                out.append({"ph": "X", "name": "decode", "cat": "phase", "pid": HOST_PID, "tid": PHASES_TID,
                            "ts": _us(p1, t0), "dur": _us(eos, p1), "args": {"request": int(r["request"])}})
    return out


def _instants(trace: Trace, t0: int, devices: set[int]) -> list[dict[str, Any]]:
    events = trace.events[:]
    keep = events[np.isin(events["kind"], [int(k) for k in INSTANT_KINDS])]
    out = []
    for e in keep:
        kind = schema.EventKind(int(e["kind"])).name.lower()
        args: dict[str, Any] = {"request": int(e["request"]), "step": int(e["step"]), "value": int(e["value"])}
        if int(e["layer"]) >= 0:
            args["layer"] = int(e["layer"])
        if int(e["text_len"]):
            args["text"] = trace.text(int(e["text_off"]), int(e["text_len"]))[:2000]
        dev = int(e["device"])
        if dev >= 0 and dev in devices:  # device-specific (e.g. OOM on cuda:1): on that device
            out.append({"ph": "i", "s": "p", "name": kind, "cat": "event", "pid": device_pid(dev), "tid": 0,
                        "ts": _us(e["t_ns"], t0), "args": args})
        else:
            out.append({"ph": "i", "s": "t", "name": kind, "cat": "event", "pid": HOST_PID, "tid": PHASES_TID,
                        "ts": _us(e["t_ns"], t0), "args": args})
    return out


def _finding_instants(trace: Trace, findings: list[FindingRow], t0: int) -> list[dict[str, Any]]:
    """Findings at their first step, else at the end of their request, else at the trace end."""
    if not findings:
        return []
    requests = {int(r["request"]): int(r["end_ns"]) or int(r["start_ns"]) for r in trace.requests[:]}
    ends = [v for v in requests.values() if v]
    trace_end = max(ends) if ends else t0
    steps = trace.steps[:]
    step_t = {(int(s["request"]), int(s["step"])): int(s["t_ns"]) for s in steps} if any(
        f.steps for f in findings) else {}
    out = []
    for f in findings:
        t = 0
        if f.request is not None and f.steps:
            t = step_t.get((f.request, f.steps[0]), 0)
        if not t and f.request is not None:
            t = requests.get(f.request, 0)
        t = t or trace_end
        args = {"detector": f.detector, "severity": f.severity, "score": f.score, "message": f.message,
                "evidence": json.loads(json.dumps(f.evidence, default=str))}
        if f.request is not None:
            args["request"] = f.request
        if f.layers:
            args["layers"] = f.layers[:64]
        if f.kind:
            args["kind"] = f.kind
        out.append({"ph": "i", "s": "g", "name": f"{f.severity}: {f.detector}", "cat": "finding",
                    "pid": HOST_PID, "tid": FINDINGS_TID, "ts": _us(max(t, t0), t0), "args": args})
    return out


def write_perfetto(
    trace_path: str | os.PathLike[str],
    out_json: str | os.PathLike[str],
    *,
    findings: list[FindingRow] | None = None,
    run_analyzer: bool = True,
    progress: Callable[[str], None] | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Write the trace-event JSON; returns (path, {"events": n, "findings": n or None, "note": ...})."""
    with Trace(trace_path) as trace:  # opened once: the analyser and the events read the same trace
        return render(trace, None, out_json, findings=findings, run_analyzer=run_analyzer,
                      progress=progress)


def render(
    trace: Trace,
    analysis: AnalysisReport | None,
    out_json: str | os.PathLike[str],
    *,
    findings: list[FindingRow] | None = None,
    run_analyzer: bool = True,
    progress: Callable[[str], None] | None = None,
) -> tuple[Path, dict[str, Any]]:
    """The Perfetto renderer: trace events of an open trace, with the analysis's findings as
    instants (`analysis`, else `findings` rows, else kvtrace.analyze on the same trace unless
    `run_analyzer` is False)."""
    from kvtrace.report import findings as fmod

    step = progress or (lambda _s: None)
    note = "findings given by the caller"
    if analysis is not None:
        findings = fmod.flatten(analysis)
    elif findings is None and run_analyzer:
        step("analyse")
        analysis, note = fmod.run_analysis(trace)
        findings = None if analysis is None else fmod.flatten(analysis)
    elif findings is None:
        note = "analysis skipped"
    step("read")
    doc = trace_events(trace, findings)
    step("write")
    out = Path(out_json)

    def write(p: Path) -> None:
        with open(p, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, separators=(",", ":"))

    try:
        write_whole(out, write)  # a full disk leaves no truncated JSON (nor replaces an earlier one)
    except OSError as exc:
        raise CannotWrite(f"{out}: cannot write ({exc.strerror})") from None
    return out, {"events": len(doc["traceEvents"]), "findings": None if findings is None else len(findings),
                 "note": note}
