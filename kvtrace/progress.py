"""Progress for commands that take time, one helper for all of them.

Two shapes:

* :func:`progress_bar`: a rich bar on stderr for work counted in stages (report, exports). Drawn
  only on a terminal and never with --quiet or --json, so stdout stays machine-readable.
* :class:`Milestones`: a line before each long step (loading a model, recording, analysing,
  writing a report, a load-test phase). On a terminal the step shows a rich spinner while it runs
  and leaves one line with its duration; when the stream is a pipe or a file each line is written
  and flushed as the step starts, so a reader (CI log, ``| tee``) sees it when it happens, not when
  the command exits.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text


class Steps:
    """Callable advanced once per stage: `steps("stage name")`."""

    def __init__(self, progress: Progress | None, task: int | None) -> None:
        self._progress = progress
        self._task = task
        self._started = False

    def __call__(self, stage: str) -> None:
        if self._progress is None or self._task is None:
            return
        if self._started:
            self._progress.advance(self._task)
        self._started = True
        self._progress.update(self._task, description=stage)

    def advance(self, n: int = 1, description: str | None = None) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, advance=n, description=description)


@contextmanager
def progress_bar(title: str, total: int, enabled: bool = True) -> Iterator[Steps]:
    """Yield a Steps callback; the bar disappears when done (transient) and is never drawn
    when `enabled` is False or stderr is not a terminal."""
    console = Console(stderr=True)
    if not enabled or not console.is_terminal:
        yield Steps(None, None)
        return
    with Progress(TextColumn(f"[bold]{title}[/bold]"), TextColumn("{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("", total=total)
        yield Steps(progress, task)
        progress.update(task, completed=total)


def _stream(err: bool) -> TextIO:
    return sys.stderr if err else sys.stdout


def _format_s(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


class Milestones:
    """Say what a command is doing before each step that takes time.

    ``err``: write to stderr (commands whose stdout is data: --json, a server's log) instead of
    stdout. ``enabled=False`` (--quiet) prints nothing. ``terminal`` overrides the detection of a
    terminal (tests)."""

    def __init__(self, *, err: bool = False, enabled: bool = True, terminal: bool | None = None) -> None:
        self.err = err
        self.enabled = enabled
        self._terminal = terminal

    @property
    def terminal(self) -> bool:
        if self._terminal is not None:
            return self._terminal
        stream = _stream(self.err)
        try:
            return bool(stream.isatty())
        except (AttributeError, ValueError):  # a closed or replaced stream
            return False

    def say(self, text: str) -> None:
        """One line now, flushed (click.echo flushes after every write)."""
        if self.enabled:
            click.echo(text, err=self.err)

    @contextmanager
    def step(self, text: str) -> Iterator[None]:
        """``with m.step("loading the model"):`` -- on a terminal a spinner while the block runs and
        then ``text (2.3 s)``; piped, ``text ...`` written and flushed before the block runs."""
        if not self.enabled:
            yield
            return
        if not self.terminal:
            click.echo(f"{text} ...", err=self.err)
            yield
            return
        console = Console(stderr=self.err, highlight=False)
        t0 = time.monotonic()
        with console.status(Text(f"{text} ...")):
            yield
        console.print(Text(f"{text} ({_format_s(time.monotonic() - t0)})"))
