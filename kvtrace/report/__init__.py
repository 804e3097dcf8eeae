"""HTML report of a trace: memory timelines, per-layer footprint, growth against the
analytical expectation, post-EOS residuals, allocator state, findings, content heatmaps.

Needs matplotlib (the `report` extra). `write_report` is what `kvtrace report` and
`kvtrace demo` call.
"""

from kvtrace.report.build import STAGES, ReportResult, build_report, write_report

__all__ = ["STAGES", "ReportResult", "build_report", "write_report"]
