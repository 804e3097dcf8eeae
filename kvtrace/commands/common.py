"""Shared CLI plumbing: one-line errors with distinct exit codes, never a traceback."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from kvtrace import exitcodes
from kvtrace.errors import BadOption, KvtraceError, Unavailable
from kvtrace.format.skipped import collect_skipped, skipped_notes
from kvtrace.jsonable import json_default

F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, code: int) -> None:
    from kvtrace.textsafe import visible  # messages quote paths and trace text: data, one line

    click.echo(f"kvtrace: {visible(message)}", err=True)
    sys.exit(code)


def exit_code_for(exc: BaseException) -> int:
    """The exit code an exception ends a command with: a KvtraceError carries its own; anything else
    is a bug of kvtrace (70)."""
    return exc.exit_code if isinstance(exc, KvtraceError) else exitcodes.INTERNAL


def stdout_closed() -> None:
    """The reader of stdout went away (`kvtrace info T | head -1`): not an error of kvtrace. Exit
    quietly with 141 (128 + SIGPIPE, what a shell reports for a tool SIGPIPE ended), pointing
    stdout at /dev/null first so that the interpreter's final flush does not complain."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    sys.exit(exitcodes.BROKEN_PIPE)


def require_cuda(option: str, alternative: str) -> None:
    """An explicit request for the GPU (``analyze --gpu``, ``whatif --device cuda``) where torch sees
    no CUDA device: Unavailable (exit 69) naming the option and what to use instead. The choices
    that fall back to the CPU are spelled otherwise (``--contents``, ``--device auto``)."""
    from kvtrace.kernels._env import cuda_available

    ok, why = cuda_available()
    if not ok:
        raise Unavailable(f"{option}: {why}; {alternative}")


def guarded(fn: F) -> F:
    """Turn known failures into one stderr line and their exit code: a KvtraceError's message and its
    ``exit_code``. An error is that one line: the notes of rows skipped from newer-minor traces
    follow only a command that answered (its own exit code included)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with collect_skipped() as skipped:  # rows of a newer minor the reader skipped (spec §2)
                try:
                    result = fn(*args, **kwargs)
                except (click.exceptions.Exit, SystemExit):
                    say_skipped(skipped)  # the command answered (an exit code of its own)
                    raise
            say_skipped(skipped)
            return result
        except (click.exceptions.Exit, click.exceptions.ClickException, SystemExit):
            raise
        except BadOption as exc:  # a library's "bad value": click's usage error, exit 64 (kvtrace.cli)
            raise click.BadParameter(str(exc), param_hint=exc.option) from None
        except KeyboardInterrupt:
            fail("interrupted", exitcodes.INTERRUPTED)
        except BrokenPipeError:
            stdout_closed()
        except KvtraceError as exc:
            fail(str(exc), exc.exit_code)
        except MemoryError:  # a trace within the reader's limits that this machine cannot hold
            fail("out of memory (the trace needs more than this machine has free)", exitcodes.UNAVAILABLE)
        except Exception as exc:  # noqa: BLE001 - last resort: one line, not a traceback
            if os.environ.get("KVTRACE_DEBUG"):
                raise
            fail(f"internal error: {type(exc).__name__}: {exc} (set KVTRACE_DEBUG=1 for details)",
                 exitcodes.INTERNAL)

    return wrapper  # type: ignore[return-value]


def say_skipped(traces: list[Any]) -> None:
    """One stderr line per trace whose rows of codes a newer minor added were skipped."""
    from kvtrace.textsafe import visible

    for line in skipped_notes(traces):
        click.echo(f"kvtrace: {visible(line)}", err=True)


def json_dump(obj: Any) -> str:
    import json

    return json.dumps(obj, indent=2, sort_keys=False, default=json_default)


