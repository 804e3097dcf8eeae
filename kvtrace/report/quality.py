"""Data-quality assessment of one trace: what is missing or doubtful, from the trace itself.

Used by the HTML report and by the Zenodo data card. Every item is counted from rows the
recorder wrote (DROPPED_SAMPLES and RECORDER_ERROR events, /meta sources, telemetry timestamps,
request outcomes, the writer's close mark); nothing is inferred from what a run "should" hold.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvtrace.format import schema
from kvtrace.format.reader import Trace

GAP_FACTOR = 5  # a telemetry gap longer than this many sampling periods is a clock gap
MAX_LISTED = 20  # errors and gaps listed one by one; the rest are counted

TELEMETRY = ("telemetry/nvml", "telemetry/allocator", "telemetry/process")


@dataclass
class ClockGap:
    table: str
    device: int  # -1 for the process table
    start_ns: int  # trace clock, the last sample before the gap
    gap_ns: int
    period_ns: int  # the median sampling period the gap is measured against


@dataclass
class Quality:
    path: str
    complete: bool
    dropped_sample_events: int = 0
    dropped_samples: int = 0  # sum of the events' values (samples the recorder could not keep)
    unavailable_sources: dict[str, str] = field(default_factory=dict)  # name -> reason
    recorder_errors: int = 0
    recorder_error_messages: list[str] = field(default_factory=list)
    clock_gaps: int = 0
    clock_gap_list: list[ClockGap] = field(default_factory=list)
    requests_by_outcome: dict[str, int] = field(default_factory=dict)

    @property
    def problems(self) -> list[str]:
        """One line per issue, empty when the trace is clean."""
        out = []
        if not self.complete:
            out.append("incomplete: the writer never closed the trace (crash or still recording)")
        if self.dropped_sample_events:
            out.append(f"{self.dropped_samples} samples dropped ({self.dropped_sample_events} events)")
        for name, reason in sorted(self.unavailable_sources.items()):
            out.append(f"source {name} unavailable: {reason}")
        if self.recorder_errors:
            out.append(f"{self.recorder_errors} recorder errors")
        if self.clock_gaps:
            worst = max(self.clock_gap_list, key=lambda g: g.gap_ns / max(1, g.period_ns))
            out.append(f"{self.clock_gaps} telemetry clock gaps (> {GAP_FACTOR} sampling periods; "
                       f"worst {worst.gap_ns / 1e9:.3f} s in {worst.table})")
        for outcome in ("running", "oom", "error", "interrupted"):
            n = self.requests_by_outcome.get(outcome, 0)
            if n:
                out.append(f"{n} requests ended {outcome.upper() if outcome != 'running' else 'unfinished'}")
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["problems"] = self.problems
        return d


def assess(trace: Trace) -> Quality:
    q = Quality(str(trace.path), trace.complete)
    events = trace.events[:]
    dropped = events[events["kind"] == int(schema.EventKind.DROPPED_SAMPLES)]
    q.dropped_sample_events = int(dropped.size)
    # value holds the number of samples dropped; an event without a count stands for one.
    q.dropped_samples = int(np.where(dropped["value"] > 0, dropped["value"], 1).sum()) if dropped.size else 0
    errors = events[events["kind"] == int(schema.EventKind.RECORDER_ERROR)]
    q.recorder_errors = int(errors.size)
    q.recorder_error_messages = [
        trace.text(int(e["text_off"]), int(e["text_len"])) or "(no message)" for e in errors[:MAX_LISTED]
    ]
    for name, entry in trace.meta.sources.items():
        if isinstance(entry, dict):
            if not entry.get("available"):
                q.unavailable_sources[name] = str(entry.get("reason") or entry.get("detail") or "not given")
        elif not entry:
            q.unavailable_sources[name] = "not given"
    for table in TELEMETRY:
        for gap in clock_gaps(trace, table):
            q.clock_gaps += 1
            if len(q.clock_gap_list) < MAX_LISTED:
                q.clock_gap_list.append(gap)
    for code in trace.requests[:]["outcome"]:
        try:
            name = schema.Outcome(int(code)).name.lower()
        except ValueError:
            name = f"code_{int(code)}"
        q.requests_by_outcome[name] = q.requests_by_outcome.get(name, 0) + 1
    return q


def clock_gaps(trace: Trace, table: str, factor: float = GAP_FACTOR) -> list[ClockGap]:
    """Gaps between consecutive samples of one telemetry stream longer than `factor` times the
    stream's median period. Streams with fewer than 3 samples have no period to judge by."""
    if not trace.has(table) or trace.nrows(table) < 3:
        return []
    rows = trace[table][:]
    devices = np.unique(rows["device"]) if "device" in (rows.dtype.names or ()) else np.array([-1])
    out: list[ClockGap] = []
    for dev in devices:
        sel = rows if "device" not in rows.dtype.names else rows[rows["device"] == dev]
        t = np.sort(sel["t_ns"].astype(np.int64))
        if t.size < 3:
            continue
        d = np.diff(t)
        period = int(np.median(d))
        if period <= 0:
            continue
        for i in np.nonzero(d > factor * period)[0]:
            out.append(ClockGap(table, int(dev), int(t[i]), int(d[i]), period))
    return out
