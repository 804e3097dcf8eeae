"""Live Prometheus metrics for a recording: an HTTP endpoint and/or a node_exporter textfile.

Built on prometheus_client: metric objects in a private ``CollectorRegistry`` (never the global
one, so a user's own metrics and ours never collide), its WSGI app for the endpoint, its
``write_to_textfile`` for the atomic textfile. A recording session is handed one
:class:`PrometheusExporter` as an observer (kvtrace.record builds it from the options with
:func:`observers_for`) and calls its ``on_*`` methods from whatever thread observed the value;
each call takes one lock and sets a few values (about a microsecond); text is produced at a scrape.

What a scraper can rely on (docs/exports.md, "Prometheus"):

* every counter exists at 0 for all its known label values from the start (requests by outcome,
  steps by phase), so ``increase()``/``rate()`` see the first event of each kind, a first OOM too;
* request-scoped gauges (KV bytes per layer, tokens seen) return to 0 when no request is in flight;
* ``kvtrace_last_update_timestamp_seconds`` says when the recorder last updated anything, so a
  dashboard shows the age of the data once the recorder stops;
* after :meth:`PrometheusExporter.close` the final state stays served for ``linger_s`` seconds
  (see there), and the textfile is always written at close.

Why one module over 600 lines: the exporter is one object whose metric families, linger server
and delivery tracking share one lock and one lifecycle (about 390 lines of the class); the option
parsing and the trace replay beside it drive that same object and nothing else.

Values the recorder did not measure are never invented: a gauge of an absent source (no NVML, no
CUDA allocator, no process RSS) has no series rather than a zero.

Recorder-facing API (all thread-safe, all cheap):

    exp = PrometheusExporter("127.0.0.1", 9464).start()        # or textfile="/var/lib/node_exporter/kvtrace.prom"
    exp.set_info(model="org/name", model_type="llama")
    exp.set_rss_source(telemetry.latest_rss)                    # read at scrape time; -1: not measured
    exp.on_request_start(request)
    exp.on_step(phase="prefill"|"decode", tokens_seen=N)
    exp.on_kv(layer, layer_type, nbytes)                        # per layer, e.g. once per step
    exp.on_memory(device, used_bytes=..., total_bytes=..., reserved_bytes=..., allocated_bytes=...,
                  inactive_split_bytes=..., num_alloc_retries=..., num_ooms=...)
    exp.on_request_end(outcome="ok"|"oom"|"error"|"interrupted", new_tokens=N)
    exp.on_dropped_samples(n); exp.on_recorder_error()
    exp.close()                                                 # final state, textfile, linger
"""

from __future__ import annotations

import atexit
import errno
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtrace._version import __version__

if TYPE_CHECKING:  # the live exporter is built while recording: no reader import at module load
    from kvtrace.analyzer.report import AnalysisReport
    from kvtrace.format.reader import Trace


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: str  # "gauge" | "counter"
    help: str
    labels: tuple[str, ...] = ()


STAMP = "kvtrace_last_update_timestamp_seconds"
RSS = "kvtrace_process_resident_memory_bytes"

METRICS: dict[str, MetricDef] = {m.name: m for m in (
    MetricDef("kvtrace_info", "gauge", "Recorder and model identity (value 1).",
              ("version", "model", "model_type")),
    MetricDef("kvtrace_kv_cache_bytes", "gauge",
              "KV-cache bytes held by one layer (unique storage) for the request in flight; 0 when idle.",
              ("layer", "layer_type")),
    MetricDef("kvtrace_kv_cache_tokens", "gauge", "Tokens seen by the cache of the request in flight; 0 when idle."),
    MetricDef("kvtrace_gpu_memory_used_bytes", "gauge", "Device memory in use as NVML reports it.",
              ("device",)),
    MetricDef("kvtrace_gpu_memory_total_bytes", "gauge", "Device memory capacity as NVML reports it.",
              ("device",)),
    MetricDef("kvtrace_allocator_reserved_bytes", "gauge", "PyTorch caching allocator: reserved bytes.",
              ("device",)),
    MetricDef("kvtrace_allocator_allocated_bytes", "gauge", "PyTorch caching allocator: allocated bytes.",
              ("device",)),
    MetricDef("kvtrace_allocator_inactive_split_bytes", "gauge",
              "PyTorch caching allocator: inactive split bytes (fragmentation).", ("device",)),
    MetricDef("kvtrace_alloc_retries_total", "counter",
              "PyTorch caching allocator: allocation retries after freeing cached blocks.", ("device",)),
    MetricDef("kvtrace_allocator_ooms_total", "counter", "PyTorch caching allocator: out-of-memory errors.",
              ("device",)),
    MetricDef("kvtrace_requests_total", "counter", "Finished generate calls by outcome.", ("outcome",)),
    MetricDef("kvtrace_requests_in_flight", "gauge", "generate calls running now."),
    MetricDef("kvtrace_generated_tokens_total", "counter", "New tokens generated by finished requests."),
    MetricDef("kvtrace_steps_total", "counter", "Forward steps run under the recorder, by phase.", ("phase",)),
    MetricDef("kvtrace_dropped_samples_total", "counter", "Samples the recorder could not keep."),
    MetricDef("kvtrace_recorder_errors_total", "counter", "Errors inside the recorder (recording went on)."),
    MetricDef(RSS, "gauge", "Resident set size of the recording process (the recorder's latest sample)."),
    MetricDef(STAMP, "gauge", "Unix time of the recorder's last update (age = time() - this)."),
)}

OUTCOMES = ("ok", "oom", "error", "interrupted")
PHASES = ("prefill", "decode")
TEXTFILE_MIN_INTERVAL_S = 1.0
# Two scrape intervals at the common 15 s; the linger ends earlier once every scraper seen has
# fetched the final state (close()), so a watched process waits about one interval at most.
DEFAULT_LINGER_S = 30.0
_POLL_S = 0.1  # the server loop's shutdown check: close() with no linger returns within this

_INSTALL = "pip install 'kvtrace[record]' (or: pip install prometheus_client)"


def require_client() -> Any:
    """The prometheus_client module, or an ImportError that says how to install it."""
    try:
        import prometheus_client
    except ImportError as exc:
        raise ImportError(f"live Prometheus metrics need prometheus_client ({exc}); install with: {_INSTALL}") from None
    return prometheus_client


def parse_address(spec: str) -> tuple[str, int]:
    """'HOST:PORT', ':PORT' or 'PORT' (host 127.0.0.1), '[::1]:PORT'. Raises ValueError."""
    spec = spec.strip()
    host, sep, port = spec.rpartition(":")
    if not sep:
        host, port = "", spec
    host = host.strip("[]") or "127.0.0.1"
    try:
        p = int(port)
    except ValueError:
        raise ValueError(f"--prometheus {spec!r}: expected HOST:PORT (e.g. 127.0.0.1:9464)") from None
    if not 0 <= p <= 65535:
        raise ValueError(f"--prometheus {spec!r}: port must be in 0..65535")
    return host, p


def check_linger(seconds: Any) -> float:
    """A linger in seconds: a finite number >= 0. Raises ValueError."""
    try:
        value = float(seconds)
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(seconds, bool) or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"prometheus linger must be a number of seconds >= 0, got {seconds!r}")
    return value


class _OptionalGauge:
    """An unlabelled gauge that has no series until it has a value (a plain Gauge would show 0,
    which for RSS or a timestamp would be an invented reading). ``source``, if set, is read at
    scrape time; a negative or None value means "not measured"."""

    def __init__(self, name: str, help_text: str) -> None:
        self.name, self.help = name, help_text
        self.value: float | None = None
        self.source: Callable[[], Any] | None = None

    def read(self) -> float | None:
        source = self.source
        try:
            v = source() if source is not None else self.value
        except Exception:  # noqa: BLE001 - a failed read is "not measured", never a failed scrape
            return None
        return float(v) if v is not None and v >= 0 else None

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        v = self.read()
        if v is not None:
            yield GaugeMetricFamily(self.name, self.help, value=v)


class _Families:
    """Yields the families of prometheus_client metric objects without their ``_created`` samples:
    every counter here starts at 0 together with the exporter, so a creation time per series adds
    one more series each and tells a scraper nothing (in a replay it would even be the replay's
    clock)."""

    def __init__(self, metrics: Iterable[Any]) -> None:
        self.metrics = list(metrics)

    def collect(self) -> Iterator[Any]:
        for metric in self.metrics:
            for family in metric.collect():
                family.samples = [s for s in family.samples if not s.name.endswith("_created")]
                yield family


class _Delivered:
    """A WSGI response body that calls ``done`` once its last chunk was written to the socket
    (the server asks for the next chunk only after writing the previous one). It has a length so
    that wsgiref still sends Content-Length for a one-chunk body."""

    def __init__(self, chunks: list[bytes], done: Callable[[], None]) -> None:
        self.chunks, self.done = chunks, done

    def __len__(self) -> int:
        return len(self.chunks)

    def __iter__(self) -> Iterator[bytes]:
        yield from self.chunks
        self.done()


# Exporters whose endpoint outlives their recording (the linger), by bound address: a new
# exporter on the same address takes it over instead of failing with "address in use".
_LINGERING: dict[tuple[str, int], PrometheusExporter] = {}
_LINGERING_LOCK = threading.Lock()


class PrometheusExporter:
    """Holds the current metric values; serves them over HTTP and/or writes a textfile. A live
    observer of a recording (kvtrace.recorder.observers.RecorderObserver)."""

    name = "prometheus"  # how the recorder names this observer in RECORDER_ERROR events

    def __init__(
        self,
        host: str | None = "127.0.0.1",
        port: int | None = 9464,
        *,
        textfile: str | os.PathLike[str] | None = None,
        linger_s: float = DEFAULT_LINGER_S,
    ) -> None:
        pc = require_client()
        if port is None and textfile is None:
            raise ValueError("give a port (HTTP endpoint), a textfile path, or both")
        self.host = host or "127.0.0.1"
        self.port = port
        self.textfile = Path(textfile) if textfile is not None else None
        self.linger_s = check_linger(linger_s)
        self.registry = pc.CollectorRegistry()
        self._metrics: dict[str, Any] = {}
        for name, m in METRICS.items():
            if name in ("kvtrace_info", STAMP, RSS):
                continue
            cls = pc.Counter if m.kind == "counter" else pc.Gauge
            self._metrics[name] = cls(name, m.help, m.labels, registry=None)
        self._info = pc.Info("kvtrace", METRICS["kvtrace_info"].help, registry=None)
        self._stamp = _OptionalGauge(STAMP, METRICS[STAMP].help)
        self._rss = _OptionalGauge(RSS, METRICS[RSS].help)
        self.registry.register(_Families([self._info, *self._metrics.values()]))
        self.registry.register(self._rss)
        self.registry.register(self._stamp)
        # every label value known in advance exists at 0 from the first scrape
        self._outcomes = {o: self._metrics["kvtrace_requests_total"].labels(o) for o in OUTCOMES}
        self._steps = {p: self._metrics["kvtrace_steps_total"].labels(p) for p in PHASES}
        self._kv: dict[tuple[int, str], Any] = {}  # (layer, layer_type) -> gauge child
        self._mirrored: dict[tuple[str, str], int] = {}  # (counter, device) -> torch's last value
        self._by_device: dict[tuple[str, str], Any] = {}  # (metric, device) -> child
        self._lock = threading.Lock()
        self._in_flight = 0
        self._last_textfile = 0.0
        # endpoint state: who scraped, and who has fetched the final state (see close())
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._final = False
        self._clients: set[str] = set()
        self._final_seen: set[str] = set()
        self._served_down = threading.Event()
        self.set_info()
        self._touch()

    @classmethod
    def from_spec(cls, spec: str, *, textfile: str | os.PathLike[str] | None = None,
                  linger_s: float = DEFAULT_LINGER_S) -> PrometheusExporter:
        host, port = parse_address(spec)
        return cls(host, port, textfile=textfile, linger_s=linger_s)

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self) -> PrometheusExporter:
        """Bind and serve in a daemon thread (port 0 picks a free port; see .port). An exporter
        still lingering on the same address is stopped first: the new recording takes over."""
        if self.port is None or self._server is not None or self._final:
            return self
        try:
            server = self._bind()
        except OSError as exc:
            lingering = None
            if exc.errno == errno.EADDRINUSE:
                with _LINGERING_LOCK:
                    lingering = _LINGERING.get((self.host, int(self.port)))
            if lingering is None:
                raise OSError(f"cannot serve Prometheus metrics on {self.host}:{self.port}: "
                              f"{exc.strerror or exc}") from None
            lingering.stop_serving()
            server = self._bind()
        self._server = server
        self.port = int(server.server_address[1])
        self._thread = threading.Thread(target=server.serve_forever, name="kvtrace-prometheus",
                                        kwargs={"poll_interval": _POLL_S}, daemon=True)
        self._thread.start()
        atexit.register(self._wait_at_exit)
        return self

    def _bind(self) -> Any:
        from wsgiref.simple_server import WSGIRequestHandler, make_server

        from prometheus_client.exposition import ThreadingWSGIServer

        class Quiet(WSGIRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - no access logs
                pass

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        server_cls = type("KvtraceMetricsServer", (ThreadingWSGIServer,), {"address_family": family})
        return make_server(self.host, int(self.port or 0), self._app(), server_cls, handler_class=Quiet)

    def _app(self) -> Callable[..., Iterable[bytes]]:
        """prometheus_client's WSGI app on /metrics (and /), 404 elsewhere; notes who scraped."""
        metrics_app = require_client().make_wsgi_app(self.registry)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            if environ.get("PATH_INFO", "/") not in ("/", "/metrics"):
                start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
                return [b"only /metrics is served\n"]
            client, scrape = environ.get("REMOTE_ADDR", ""), environ.get("REQUEST_METHOD") == "GET"
            with self._cond:
                final = self._final  # read before the body is built: the body holds at least this
                if scrape:
                    self._clients.add(client)  # known from its first request on, answered or not
            body = metrics_app(environ, start_response)
            if not scrape or not final:
                return body
            return _Delivered(list(body), lambda: self._final_delivered(client))

        return app

    def _final_delivered(self, client: str) -> None:
        with self._cond:
            self._final_seen.add(client)
            self._cond.notify_all()

    @property
    def url(self) -> str | None:
        """The endpoint's address while it serves (recording and linger), else None."""
        return self._address() if self._server is not None else None

    def _address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    @property
    def serving(self) -> bool:
        """True while the HTTP endpoint is up (during recording and the linger)."""
        return self._server is not None and not self._served_down.is_set()

    def close(self) -> None:
        """The recording ended: publish the final state and keep it served for the linger.

        Request gauges are already idle when no request is in flight (on_request_end); RSS is frozen
        at its last sample and the update stamp set. The textfile, if any, is written now. The HTTP
        endpoint keeps serving from a daemon thread, so close() returns at once, until
        ``linger_s`` has passed or every client that ever scraped it has fetched this final state,
        whichever comes first. At interpreter exit the process waits for the rest of the linger only
        while such a client has not fetched it yet (a process nobody scraped exits at once).
        ``linger_s`` 0 stops the endpoint here. Safe to call twice."""
        with self._cond:
            if self._final:
                return
            self._rss.value, self._rss.source = self._rss.read(), None
            self._touch()
            self._final = True
            self._cond.notify_all()
        try:
            if self._server is not None:
                if self.linger_s > 0:
                    self._linger()
                else:
                    self.stop_serving()
        finally:
            if self.textfile is not None:
                self.write_textfile()

    def _linger(self) -> None:
        key = (self.host, int(self.port or 0))
        with _LINGERING_LOCK:
            _LINGERING[key] = self
        deadline = time.monotonic() + self.linger_s

        def wait_then_stop() -> None:
            with self._cond:
                while not self._served_down.is_set() and not self._all_final():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            self.stop_serving()

        threading.Thread(target=wait_then_stop, name="kvtrace-prometheus-linger", daemon=True).start()

    def _all_final(self) -> bool:
        return bool(self._clients) and self._clients <= self._final_seen

    def stop_serving(self) -> None:
        """Stop the HTTP endpoint now (ends a linger). Safe to call from any thread, twice."""
        with self._cond:
            server, self._server = self._server, None
            self._served_down.set()
            self._cond.notify_all()
        with _LINGERING_LOCK:
            if _LINGERING.get((self.host, int(self.port or 0))) is self:
                del _LINGERING[(self.host, int(self.port or 0))]
        atexit.unregister(self._wait_at_exit)
        if server is not None:
            server.shutdown()
            server.server_close()

    def _wait_at_exit(self) -> None:
        """atexit: a scraper is watching and has not fetched the final state yet: wait for it,
        at most the rest of the linger (Ctrl-C skips)."""
        with self._cond:
            waiting = self._final and bool(self._clients) and not self._all_final()
        if not waiting or self._served_down.is_set():
            return
        print(f"kvtrace: serving the final metrics at {self._address()} until scraped "
              f"(at most {self.linger_s:g} s; Ctrl-C skips)", file=sys.stderr)
        try:
            self._served_down.wait(self.linger_s)
        except KeyboardInterrupt:
            pass

    def __enter__(self) -> PrometheusExporter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- updates (called by the recorder) -------------------------------------------------------

    def _touch(self) -> None:
        self._stamp.value = time.time()

    def set_info(self, model: str = "unknown", model_type: str = "unknown") -> None:
        self.model = str(model)  # also the model_name label of the serving series (prometheus_serving)
        self._info.info({"version": __version__, "model": str(model), "model_type": str(model_type)})

    def on_session_start(self, model: str, model_type: str, rss: Callable[[], int] | None = None) -> None:
        """Observer protocol: the recorded model's identity and where the RSS gauge comes from."""
        self.set_info(model, model_type)
        self.set_rss_source(rss)

    def set_rss_source(self, read: Callable[[], int] | None) -> None:
        """Where the RSS gauge comes from, read at scrape time (the recorder's latest sample;
        -1: not measured, no series). close() freezes the last value."""
        self._rss.source = read

    def on_rss(self, nbytes: int) -> None:
        self._rss.value, self._rss.source = int(nbytes), None

    def _kv_child(self, layer: int, layer_type: str) -> Any:
        key = (int(layer), str(layer_type))
        child = self._kv.get(key)
        if child is None:
            child = self._kv[key] = self._metrics["kvtrace_kv_cache_bytes"].labels(str(key[0]), key[1])
        return child

    def on_kv(self, layer: int, layer_type: str, nbytes: int) -> None:
        """KV bytes of one layer of the request in flight. With no request in flight this is a late
        read of a finished one (its cache died after the end) and the idle state stands."""
        with self._lock:
            if not self._in_flight:
                return
            self._kv_child(layer, layer_type).set(int(nbytes))
            self._touch()
        self._maybe_textfile()

    def on_step(self, phase: str = "decode", tokens_seen: int | None = None) -> None:
        """One forward step of the request in flight (ignored with none in flight, as on_kv)."""
        with self._lock:
            if not self._in_flight:
                return
            child = self._steps.get(phase)
            if child is None:
                child = self._steps[phase] = self._metrics["kvtrace_steps_total"].labels(phase)
            child.inc()
            if tokens_seen is not None:
                self._metrics["kvtrace_kv_cache_tokens"].set(int(tokens_seen))
            self._touch()
        self._maybe_textfile()

    def on_memory(
        self,
        device: int,
        used_bytes: int | None = None,
        *,
        total_bytes: int | None = None,
        reserved_bytes: int | None = None,
        allocated_bytes: int | None = None,
        inactive_split_bytes: int | None = None,
        num_alloc_retries: int | None = None,
        num_ooms: int | None = None,
    ) -> None:
        """Any subset; None or a negative value (the trace's "not measured") leaves a metric unset."""
        label = str(int(device))
        pairs = (
            ("kvtrace_gpu_memory_used_bytes", used_bytes),
            ("kvtrace_gpu_memory_total_bytes", total_bytes),
            ("kvtrace_allocator_reserved_bytes", reserved_bytes),
            ("kvtrace_allocator_allocated_bytes", allocated_bytes),
            ("kvtrace_allocator_inactive_split_bytes", inactive_split_bytes),
        )
        with self._lock:
            for name, value in pairs:
                if value is not None and value >= 0:
                    self._device_child(name, label).set(int(value))
            # torch's counters are cumulative per process: mirror them, never step backwards
            for name, value in (("kvtrace_alloc_retries_total", num_alloc_retries),
                                ("kvtrace_allocator_ooms_total", num_ooms)):
                if value is not None and value >= 0:
                    child = self._device_child(name, label)  # exists at 0 from its first reading
                    last = self._mirrored.get((name, label), 0)
                    if value > last:
                        child.inc(int(value) - last)
                        self._mirrored[(name, label)] = int(value)
            self._touch()
        self._maybe_textfile()

    def _device_child(self, name: str, device: str) -> Any:
        # labels() validates and builds its key on every call (~1 us): keep the children
        child = self._by_device.get((name, device))
        if child is None:
            child = self._by_device[(name, device)] = self._metrics[name].labels(device)
        return child

    def on_request_start(self, request: int | None = None) -> None:
        with self._lock:
            self._in_flight += 1
            self._metrics["kvtrace_requests_in_flight"].set(self._in_flight)
            self._touch()
        self._maybe_textfile()

    def on_request_end(self, outcome: Any = "ok", new_tokens: int = 0) -> None:
        """`outcome`: "ok", "oom", "error", "interrupted" or a kvtrace.format.Outcome. The last
        request in flight ending returns the KV and token gauges to 0."""
        name = str(getattr(outcome, "name", outcome)).lower()
        with self._lock:
            child = self._outcomes.get(name)
            if child is None:
                child = self._outcomes[name] = self._metrics["kvtrace_requests_total"].labels(name)
            child.inc()
            self._in_flight = max(0, self._in_flight - 1)
            self._metrics["kvtrace_requests_in_flight"].set(self._in_flight)
            self._metrics["kvtrace_generated_tokens_total"].inc(max(0, int(new_tokens)))
            if not self._in_flight:
                self._idle()
            self._touch()
        self._maybe_textfile(force=True)

    def _idle(self) -> None:
        for child in self._kv.values():
            child.set(0)
        self._metrics["kvtrace_kv_cache_tokens"].set(0)

    def on_dropped_samples(self, n: int = 1) -> None:
        with self._lock:
            self._metrics["kvtrace_dropped_samples_total"].inc(max(0, int(n)))
            self._touch()
        self._maybe_textfile()

    def on_recorder_error(self) -> None:
        with self._lock:
            self._metrics["kvtrace_recorder_errors_total"].inc()
            self._touch()
        self._maybe_textfile()

    # ---- output ---------------------------------------------------------------------------------

    def value(self, name: str, **labels: Any) -> float | None:
        """Current value of one series (for tests and callers); None when it has no series."""
        return self.registry.get_sample_value(name, {k: str(v) for k, v in labels.items()})

    def render(self) -> str:
        """The exposition text (format 0.0.4), as a scraper without an Accept header gets it."""
        return require_client().generate_latest(self.registry).decode("utf-8")

    def _maybe_textfile(self, force: bool = False) -> None:
        if self.textfile is None:
            return
        with self._lock:
            now = time.monotonic()
            due = force or now - self._last_textfile >= TEXTFILE_MIN_INTERVAL_S
            if due:
                self._last_textfile = now
        if due:
            self.write_textfile()

    def write_textfile(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Atomically replace the textfile (temp file + rename: node_exporter never reads half)."""
        target = Path(path) if path is not None else self.textfile
        if target is None:
            raise ValueError("no textfile path")
        require_client().write_to_textfile(str(target), self.registry)
        return target


def observers_for(options: Any) -> list[PrometheusExporter]:
    """The exporter a recording's RecordOptions ask for (``prometheus`` "HOST:PORT" and/or
    ``prometheus_textfile``), not yet started; kvtrace.record hands it to the recorder as an
    observer. Raises ValueError for a malformed address or linger."""
    address = None
    if options.prometheus is not None:
        address = parse_address(str(options.prometheus))
        check_linger(options.prometheus_linger_s)
    if address is None and options.prometheus_textfile is None:
        return []
    host, port = address if address is not None else (None, None)
    return [PrometheusExporter(host, port, textfile=options.prometheus_textfile,
                               linger_s=options.prometheus_linger_s)]


def exporter_from_trace(trace: Any, textfile: str | os.PathLike[str]) -> PrometheusExporter:
    """:func:`render` of an open Trace with no analysis."""
    return render(trace, None, textfile)


def render(trace: Trace, report: AnalysisReport | None, textfile: str | os.PathLike[str]) -> PrometheusExporter:
    """The Prometheus renderer: replay a finished open trace into a textfile-only exporter, the
    state at the trace's end by the live exporter's rules (request counts by outcome, steps, tokens,
    dropped samples, recorder errors, last memory sample per device, last RSS). KV and token gauges
    hold the last recorded step only when the trace ended with its last request still running;
    otherwise every layer is at 0, as the live endpoint shows after a request ends.

    ``report`` is taken for the renderers' common ``render(trace, report, ...)`` shape and not read:
    the live endpoint has no finding metrics, and the replay shows what the endpoint showed."""
    import numpy as np

    from kvtrace.format import schema
    from kvtrace.labels import layer_type_name

    del report  # see the docstring: the replay has nothing to draw from an analysis
    exp = PrometheusExporter(None, None, textfile=textfile, linger_s=0)
    exp.textfile = None  # no file writes while replaying; the caller writes once
    exp.set_info(trace.meta.model_id, trace.meta.model_type)
    requests = trace.requests[:]
    running = int(schema.Outcome.RUNNING)
    for r in requests[np.argsort(requests["start_ns"], kind="stable")]:
        exp.on_request_start()
        code = int(r["outcome"])
        if code != running:
            exp.on_request_end(schema.Outcome(code) if code in schema.Outcome._value2member_map_ else "unknown",
                               int(r["new_tokens"]))
    # Counted from the per-step events when the trace has them: with structure_every > 1 not every
    # step has a /steps row. A trace without those events (another writer) falls back to rows.
    steps = trace.steps[:]
    events = trace.events[:]
    kinds = events["kind"]
    for phase, kind in ((schema.Phase.PREFILL, schema.EventKind.PREFILL_END),
                        (schema.Phase.DECODE, schema.EventKind.DECODE_STEP)):
        n = int(np.sum(kinds == int(kind))) or int(np.sum(steps["phase"] == int(phase)))
        exp._steps[phase.name.lower()].inc(n)
    if requests.size:
        last = requests[np.argmax(requests["start_ns"])]
        still_running = int(last["outcome"]) == running
        rows = trace.kv.where(request=int(last["request"]))
        if rows.size:
            rows = rows[rows["step"] == rows["step"].max()]
            for row in rows:
                child = exp._kv_child(int(row["layer"]), layer_type_name(int(row["layer_type"])))
                child.set(int(row["bytes_unique"]) if still_running else 0)
        mine = steps[steps["request"] == last["request"]] if steps.size else steps
        if still_running and mine.size:
            exp._metrics["kvtrace_kv_cache_tokens"].set(int(mine["tokens_seen"][-1]))
    nvml, alloc = trace.nvml[:], trace.allocator[:]
    for dev in np.unique(nvml["device"]):
        row = nvml[nvml["device"] == dev][-1]
        exp.on_memory(int(dev), int(row["used_bytes"]))
    for dev in np.unique(alloc["device"]):
        rows = alloc[alloc["device"] == dev]
        row = rows[-1]
        exp.on_memory(int(dev), reserved_bytes=int(row["reserved_bytes"]),
                      allocated_bytes=int(row["allocated_bytes"]),
                      inactive_split_bytes=int(row["inactive_split_bytes"]),
                      num_alloc_retries=int(rows["num_alloc_retries"].max()), num_ooms=int(rows["num_ooms"].max()))
    for d in trace.devices[:]:
        if int(d["total_memory_bytes"]) >= 0 and int(d["device"]) >= 0:
            exp.on_memory(int(d["device"]), total_bytes=int(d["total_memory_bytes"]))
    process = trace.process[:]
    if process.size and int(process["rss_bytes"][-1]) >= 0:
        exp.on_rss(int(process["rss_bytes"][-1]))
    dropped = events[kinds == int(schema.EventKind.DROPPED_SAMPLES)]
    if dropped.size:
        exp.on_dropped_samples(int(np.where(dropped["value"] > 0, dropped["value"], 1).sum()))
    n_errors = int(np.sum(kinds == int(schema.EventKind.RECORDER_ERROR)))
    if n_errors:
        exp._metrics["kvtrace_recorder_errors_total"].inc(n_errors)
    from kvtrace.export.prometheus_serving import replay

    replay(exp, trace)  # a serving trace: the kvtrace_serving_* end state (nothing without /sched)
    # "last update" is when the trace's last row was stamped, not when this replay ran
    last_ns = max([int(requests["end_ns"].max()) if requests.size else 0,
                   *(int(t["t_ns"].max()) for t in (nvml, alloc, process) if t.size)])
    exp._stamp.value = trace.meta.wall_ns(last_ns) / 1e9 if last_ns else None
    exp.textfile = Path(textfile)
    return exp
