"""A one-time allocation left by the first request (the cuBLAS workspace, 32 MiB on Hopper) is not
a per-request leak: real H100 trace, tests/data/gpu_gemma3_tiny.kvt.h5 (see its .md note)."""

from __future__ import annotations

from pathlib import Path

import kvtrace

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "gpu_gemma3_tiny.kvt.h5"


def test_first_request_workspace_is_one_time_not_a_leak():
    report = kvtrace.analyze(FIXTURE)
    findings = {f.requests[0]: f for f in report.findings if f.detector == "post_eos"}
    first = findings[0]
    # measured, not assumed: the 32 MiB workspace plus one 512 B allocator block
    assert 32 << 20 <= first.evidence["retained_bytes"].value <= (32 << 20) + 4096
    # the weak references prove no KV storage survived: a first-use allocation, information
    assert first.kind == "first_use_allocation" and first.score <= 0.1
    assert "first-use allocation" in first.message and "cuBLAS workspace" in first.message
    assert all(f.score <= 0.1 for f in findings.values())
