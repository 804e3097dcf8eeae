"""The `kvtrace` command. Subcommands live in kvtrace.commands.* and load lazily, so that
`kvtrace info` starts fast and never imports torch."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from typing import Any

import click

from kvtrace import exitcodes
from kvtrace._version import __version__

# name -> "module:attribute". A module that does not exist yet is simply not listed.
COMMANDS: dict[str, str] = {
    "demo": "kvtrace.commands.demo:demo",
    "record": "kvtrace.commands.record:record",
    "presets": "kvtrace.commands.presets:presets",
    "info": "kvtrace.commands.info:info",
    "validate": "kvtrace.commands.validate:validate",
    "analyze": "kvtrace.commands.analyze:analyze",
    "diff": "kvtrace.commands.diff:diff",
    "report": "kvtrace.commands.report:report",
    "export": "kvtrace.commands.export:export",
    "calc": "kvtrace.commands.calc:calc",
    "whatif": "kvtrace.commands.whatif:whatif",
    "fleet": "kvtrace.commands.fleet:fleet",
    "serve": "kvtrace.commands.serve:serve",
    "loadtest": "kvtrace.commands.loadtest:loadtest",
    "attach": "kvtrace.commands.attach:attach",
}


def _load(name: str) -> click.Command | None:
    module_name, attr = COMMANDS[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            return None
        raise
    return getattr(module, attr)


@contextlib.contextmanager
def _closed_stdout_is_141() -> Iterator[None]:
    """`kvtrace CMD --help | head -1`: click answers a closed stdout with exit 1 (its own EPIPE
    handling); kvtrace's rule for it is a quiet 141, as every command's (commands.common.guarded)."""
    try:
        yield
    except BrokenPipeError:
        from kvtrace.commands.common import stdout_closed

        stdout_closed()


class LazyGroup(click.Group):
    # --help and --version print while the command line is parsed: the root's in make_context, a
    # subcommand's (nested groups included) inside the root's invoke
    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        with _closed_stdout_is_141():
            return super().make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx: click.Context) -> Any:
        with _closed_stdout_is_141():
            return super().invoke(ctx)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [name for name in COMMANDS if _load(name) is not None]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        return _load(cmd_name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="kvtrace")
def cli() -> None:
    """Record and analyse the KV cache of Hugging Face Transformers models.

    \b
    Start here:
      kvtrace demo                  # record a small hybrid model, analyse, report
      kvtrace info TRACE            # what a trace holds
      kvtrace validate TRACE        # check a trace against the format spec
    JSON: --json prints it on stdout, --json-out FILE writes it; no command writes onto its
    inputs or onto an existing trace. Sizes are printed in binary units (KiB = 1024 bytes).
    """


def main(argv: list[str] | None = None) -> Any:
    """Entry point: click's usage errors exit 64 (not 2, which means 'unreadable trace')."""
    try:
        return cli.main(args=argv, prog_name="kvtrace", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("kvtrace: interrupted", err=True)
        sys.exit(exitcodes.INTERRUPTED)
    except click.exceptions.UsageError as exc:
        from kvtrace.textsafe import visible  # a message may quote a path or a trace's text: data

        hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx and exc.ctx.parent else ""
        click.echo(f"kvtrace: {visible(exc.format_message())}{hint}", err=True)
        sys.exit(exitcodes.USAGE)
    except click.exceptions.ClickException as exc:
        from kvtrace.textsafe import visible

        click.echo(f"kvtrace: {visible(exc.format_message())}", err=True)
        sys.exit(exitcodes.USAGE)


if __name__ == "__main__":
    main()
