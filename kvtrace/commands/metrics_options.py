"""The live-metrics options that `kvtrace record` and `kvtrace serve` share (--prometheus,
--prometheus-textfile, --prometheus-linger) and their checks, made before the model loads."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import click

from kvtrace.errors import Unavailable


def metrics_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Add the three options; the command receives prometheus, prometheus_textfile, prometheus_linger."""
    func = click.option("--prometheus-linger", type=click.FloatRange(min=0), default=30.0, show_default=True,
                        metavar="SECONDS",
                        help="After recording, keep serving the final metrics until every scraper seen has "
                             "fetched them, at most this long (0: stop at once).")(func)
    func = click.option("--prometheus-textfile", default=None, type=click.Path(dir_okay=False), metavar="FILE",
                        help="Write the metrics to FILE for node_exporter's textfile collector "
                             "(atomic rewrite, at most once a second, at each request end and at exit).")(func)
    return click.option("--prometheus", "prometheus", default=None, metavar="HOST:PORT",
                        help="Serve live metrics at http://HOST:PORT/metrics while recording (bind 127.0.0.1 "
                             "unless the scraper is on another host).")(func)


def check_bindable(host: str, port: int) -> None:
    """Bind and release ``host:port`` the way the metrics server will, so a busy port or a bad
    host fails before the model loads (the server binds again when recording starts)."""
    import socket

    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server does
            s.bind((host, port))
    except OSError as exc:
        raise Unavailable(f"cannot serve Prometheus metrics on {host}:{port}: {exc.strerror or exc}") from None


def check_metrics_options(prometheus: str | None, textfile: str | None, inputs: Sequence[str] = ()) -> \
        tuple[str, int] | None:
    """Refuse bad metrics options before the model loads: the client library missing (69), a bad
    address (64), a busy port (69), a textfile that is an input (64) or cannot be written (73).
    Returns the metrics (host, port), or None without --prometheus."""
    if prometheus is None and textfile is None:
        return None
    from kvtrace.commands.outputs import check_output
    from kvtrace.export.prometheus import require_client

    if textfile is not None:
        check_output(textfile, option="--prometheus-textfile", what=f"Prometheus textfile {textfile}",
                     inputs=list(inputs))
    try:
        require_client()
    except ImportError as exc:
        raise Unavailable(str(exc)) from None
    address = None
    if prometheus is not None:
        from kvtrace.export.prometheus import parse_address

        try:
            address = parse_address(prometheus)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--prometheus") from None
        check_bindable(*address)  # before the (possibly slow) model load
    if textfile is not None:
        try:
            from kvtrace.recorder.session import check_textfile
        except ImportError as exc:
            raise Unavailable(f"recording needs torch and transformers ({exc}); install kvtrace[record]") from None
        check_textfile(textfile)  # CannotWrite: exit 73 (guarded)
    return address
