"""A rich progress bar on stderr for long commands (report, exports). Never drawn with --quiet or
--json, nor when stderr is not a terminal, so stdout stays machine-readable."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn


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
