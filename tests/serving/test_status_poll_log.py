"""kvtrace serve leaves its own status polling out of uvicorn's access log unless --log-status-polls
(without it 139 of 190 log lines of a load test were GET /kvtrace/status). The served end to end
check is tests/serving/test_progress_lines.py."""

from __future__ import annotations

import logging

from kvtrace.serving.runner import QuietStatusPolls


def _access(method: str, path: str, status: int) -> logging.LogRecord:
    # what uvicorn's httptools/h11 protocols log: '%s - "%s %s HTTP/%s" %d'
    return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                             ("127.0.0.1:5000", method, path, "1.1", status), None)


def test_only_successful_status_polls_are_dropped():
    f = QuietStatusPolls()
    assert not f.filter(_access("GET", "/kvtrace/status", 200))
    assert not f.filter(_access("GET", "/kvtrace/status?x=1", 200))
    assert f.filter(_access("GET", "/kvtrace/status", 503))  # a dead worker is worth a line
    assert f.filter(_access("POST", "/kvtrace/phase", 200))
    assert f.filter(_access("GET", "/health", 200))
    assert f.filter(_access("POST", "/v1/completions", 200))
    assert f.filter(logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, "plain text", None, None))


def test_the_cli_option_exists():
    from click.testing import CliRunner

    from kvtrace.cli import cli

    assert "--log-status-polls" in CliRunner().invoke(cli, ["serve", "--help"]).output
