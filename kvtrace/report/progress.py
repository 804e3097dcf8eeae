"""Moved to :mod:`kvtrace.progress` (one progress helper for every command); kept so that
``from kvtrace.report.progress import progress_bar`` goes on working."""

from kvtrace.progress import Steps, progress_bar

__all__ = ["Steps", "progress_bar"]
