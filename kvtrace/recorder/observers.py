"""Live listeners of a recording: the observer protocol and its fan-out.

An observer sees what the recorder writes as it writes it (request start/end, each step with its
per-layer KV bytes, the telemetry thread's memory readings, dropped samples, recorder errors). The
recorder knows only this protocol; the Prometheus exporter (kvtrace.export.prometheus) is one
implementation, handed in by whoever composes the session (``kvtrace.record``), so the recorder
imports nothing from kvtrace.export. A serving recorder reports to the same protocol.

Every call into an observer is guarded: an exception is a recorder error (reported under the
observer's ``name``), never the model's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kvtrace.recorder.rows import KvRow

if TYPE_CHECKING:  # pragma: no cover
    from kvtrace.recorder.options import RecordOptions


@runtime_checkable
class RecorderObserver(Protocol):
    """What a live listener implements. ``start`` may bind resources (raise OSError if it cannot:
    the session then fails before the model runs); ``close`` runs once, at session close, after
    the telemetry thread's last tick."""

    name: str  # names the observer in RECORDER_ERROR events ("prometheus: ...")

    def start(self) -> Any: ...
    def close(self) -> None: ...
    def on_session_start(self, model: str, model_type: str, rss: Callable[[], int] | None) -> None: ...
    def on_request_start(self, request: int | None = None) -> None: ...
    def on_step(self, phase: str = "decode", tokens_seen: int | None = None) -> None: ...
    def on_kv(self, layer: int, layer_type: str, nbytes: int) -> None: ...
    def on_memory(self, device: int, used_bytes: int | None = None, *, total_bytes: int | None = None,
                  reserved_bytes: int | None = None, allocated_bytes: int | None = None,
                  inactive_split_bytes: int | None = None, num_alloc_retries: int | None = None,
                  num_ooms: int | None = None) -> None: ...
    def on_request_end(self, outcome: Any = "ok", new_tokens: int = 0) -> None: ...
    def on_dropped_samples(self, n: int = 1) -> None: ...
    def on_recorder_error(self) -> None: ...


# Builds the observers a session's options ask for (e.g. RecordOptions.prometheus); called once,
# when the session is created, so a malformed option fails before anything starts.
ObserverFactory = Callable[["RecordOptions"], Sequence[RecorderObserver]]


def _name(observer: Any) -> str:
    return str(getattr(observer, "name", type(observer).__name__))


class Observers:
    """The observers of one session, called in order. Empty is falsy, so the hot path pays one
    truth test when nobody listens."""

    def __init__(self, on_error: Callable[[str, BaseException], None]) -> None:
        self._on_error = on_error
        self._list: list[RecorderObserver] = []

    def __bool__(self) -> bool:
        return bool(self._list)

    def __iter__(self) -> Any:
        return iter(self._list)

    def start(self, observers: Sequence[RecorderObserver]) -> None:
        """Start each observer; on a failure the ones already started are closed, then it raises."""
        started: list[RecorderObserver] = []
        try:
            for obs in observers:
                obs.start()
                started.append(obs)
        except BaseException:
            for obs in started:
                try:
                    obs.close()
                except Exception:  # noqa: BLE001, S110 - the start failure is what the caller hears
                    pass
            raise
        self._list = started

    def close(self) -> None:
        observers, self._list = self._list, []
        for obs in observers:
            try:
                obs.close()
            except Exception as exc:  # noqa: BLE001 - e.g. a textfile's directory went away
                self._on_error(_name(obs), exc)

    def notify(self, method: str, *args: Any, **kwargs: Any) -> None:
        """One update to every observer; a failure is a recorder error, never the model's."""
        for obs in self._list:
            try:
                getattr(obs, method)(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001
                self._on_error(_name(obs), exc)

    def kv(self, rows: Sequence[KvRow], layer_type_name: Callable[[int], str]) -> None:
        """Per-layer unique KV bytes of one step (its /kv rows)."""
        for obs in self._list:
            try:
                for row in rows:
                    obs.on_kv(row.layer, layer_type_name(row.layer_type), row.bytes_unique)
            except Exception as exc:  # noqa: BLE001
                self._on_error(_name(obs), exc)

    def memory(self, device: int, **values: int | None) -> None:
        """A telemetry tick (called on the telemetry thread, which reports its own listener errors)."""
        for obs in self._list:
            obs.on_memory(device, **values)

    def recorder_error(self) -> None:
        for obs in self._list:
            try:
                obs.on_recorder_error()
            except Exception:  # noqa: BLE001, S110 - counted already; never recurse into on_error
                pass
