"""Live Prometheus metrics of continuous batching (transformers generate_batch, the manager API, any
serving loop recorded by kvtrace.record with a Prometheus option), served by the recording's
PrometheusExporter endpoint and textfile.

:class:`ServingMetrics` is a recorder observer (kvtrace.recorder.observers) that adds its families
to an exporter's private registry. The serving recorder calls its optional methods
``on_serving_step(sched_row, group_rows)`` once per scheduler step (the /sched and /sched_groups
rows it writes, format 1.4) and ``on_serving_event(kind, request, value, t_ns)`` for lifecycle
events; ``on_request_start`` gives each request's arrival. Each update takes one lock and sets a
few values.

Names: ``kvtrace_serving_*``, with the vLLM metric of the same meaning in the mapping table of
spec/prometheus-serving.md (and docs/exports.md). kvtrace does not export ``vllm:`` names: they
would mix a transformers process into dashboards and recording rules that aggregate vLLM engines,
and some meanings differ slightly (usage is read as each step is scheduled; queries count
recomputed prefills too). vLLM names checked against https://docs.vllm.ai/en/stable/usage/metrics/
and vllm docs/design/metrics.md (v1: vllm:kv_cache_usage_perc, vllm:num_requests_running,
vllm:num_requests_waiting, vllm:num_preemptions, vllm:prefix_cache_queries, vllm:prefix_cache_hits,
vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds, vllm:request_queue_time_seconds).

Every series carries the recorded model as ``model_name`` (vLLM's label for the same purpose), so a
dashboard over several servers can tell them apart without joining kvtrace_info.

What is not measured is not exported: the pool gauges have no series until the first step
reported the pool (a transformers version without the counter writes -1 and the gauge stays
absent). End-to-end latency is arrival to the REQUEST_END the serving recorder writes (finished,
failed or cancelled).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvtrace.export.prometheus import PrometheusExporter, _Families, require_client
from kvtrace.export.prometheus import observers_for as _exporters
from kvtrace.format import schema

# name -> (kind, help, labels, vLLM metric of the same meaning or ""). Every family also carries
# MODEL_LABEL (the recorded model, as vLLM's series carry model_name), first.
MODEL_LABEL = "model_name"
SERVING_METRICS: dict[str, tuple[str, str, tuple[str, ...], str]] = {
    "kvtrace_serving_requests_running": (
        "gauge", "Continuous-batching requests admitted and not finished (they hold cache), at the last step.", (),
        "vllm:num_requests_running"),
    "kvtrace_serving_requests_waiting": (
        "gauge", "Continuous-batching requests queued and not admitted (preempted ones included), at the last step.",
        (), "vllm:num_requests_waiting"),
    "kvtrace_serving_kv_cache_usage_ratio": (
        "gauge", "Block-level paged KV pool usage, (pool - free) / pool, 0-1, at the last step.", (),
        "vllm:kv_cache_usage_perc (v0: vllm:gpu_cache_usage_perc)"),
    "kvtrace_serving_kv_cache_token_usage_ratio": (
        "gauge", "Token-level paged KV pool usage, valid KV bytes / pool, 0-1, at the last step.", (), ""),
    "kvtrace_serving_kv_pool_bytes": (
        "gauge", "Bytes of the paged KV pool allocated up front.", (), ""),
    "kvtrace_serving_kv_pool_free_bytes": (
        "gauge", "Free bytes of the paged KV pool (in no block table, not kept for prefix reuse), at the last step.",
        (), ""),
    "kvtrace_serving_kv_cache_bytes": (
        "gauge", "KV bytes in the running requests' blocks (blocks in use x bytes per block, every layer of the "
        "cache group), by attention type, at the last step.", ("layer_type",), ""),
    "kvtrace_serving_kv_cache_tokens": (
        "gauge", "Sequence positions the running requests' caches hold once the last step's forward has run.", (), ""),
    "kvtrace_serving_kv_blocks": (
        "gauge", "Paged KV blocks by cache group attention type and state (in_use, cached, free), at the last step.",
        ("layer_type", "state"), ""),
    "kvtrace_serving_batch_tokens": (
        "gauge", "Query tokens of the last scheduled batch by kind (prefill, decode).", ("kind",), ""),
    "kvtrace_serving_scheduler_steps_total": (
        "counter", "Continuous-batching scheduler steps that found work.", (), ""),
    "kvtrace_serving_prompt_tokens_total": (
        "counter", "Prompt tokens computed (prefill query tokens scheduled; recomputed ones after a soft reset "
        "included, prefix-cache hits not).", (), "vllm:prompt_tokens_total"),
    "kvtrace_serving_preemptions_total": (
        "counter", "Requests preempted (soft reset or offloaded) to free blocks.", (), "vllm:num_preemptions_total"),
    "kvtrace_serving_prefix_cache_queries_tokens_total": (
        "counter", "Prompt tokens looked up in the prefix cache: prefill tokens scheduled plus tokens served from "
        "cached blocks.", (), "vllm:prefix_cache_queries_total"),
    "kvtrace_serving_prefix_cache_hits_tokens_total": (
        "counter", "Prompt tokens served from cached blocks.", (), "vllm:prefix_cache_hits_total"),
    "kvtrace_serving_evicted_blocks_total": (
        "counter", "Cached prefix blocks evicted to make room.", (), ""),
    "kvtrace_serving_time_to_first_token_seconds": (
        "histogram", "Arrival (queued) to the first generated token.", (), "vllm:time_to_first_token_seconds"),
    "kvtrace_serving_inter_token_latency_seconds": (
        "histogram", "Time between consecutive scheduler steps, once per request decoded in the later step.", (),
        "vllm:inter_token_latency_seconds"),
    "kvtrace_serving_request_queue_time_seconds": (
        "histogram", "Arrival to first admission by the scheduler.", (), "vllm:request_queue_time_seconds"),
    "kvtrace_serving_e2e_request_latency_seconds": (
        "histogram", "Arrival (queued) to the request's end (finished, failed or cancelled).", (),
        "vllm:e2e_request_latency_seconds"),
}
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # vLLM's request-latency buckets
BLOCK_STATES = ("in_use", "cached", "free")
_LAYER_TYPES = {int(t): t.name.lower() for t in schema.LayerType}
E = schema.EventKind


class ServingMetrics:
    """The serving gauges, counters and histograms of one recording, registered into `exporter`'s
    registry (one endpoint, one textfile). A recorder observer: the protocol's other calls are no-ops."""

    name = "prometheus-serving"

    def __init__(self, exporter: PrometheusExporter, clock: Callable[[], int] = time.monotonic_ns) -> None:
        pc = require_client()
        self.exporter = exporter
        self._clock = clock
        self._m: dict[str, Any] = {}
        for name, (kind, text, labels, _) in SERVING_METRICS.items():
            if kind == "histogram":
                buckets = (TTFT_BUCKETS if "first_token" in name or "queue" in name else
                           E2E_BUCKETS if "e2e" in name else ITL_BUCKETS)
                self._m[name] = _Histogram(name, text, buckets, lambda: self.model)
            else:
                cls = pc.Counter if kind == "counter" else pc.Gauge
                self._m[name] = cls(name, text, (MODEL_LABEL, *labels), registry=None)
        # gauges of pool state have no series until a step reported it (-1: not measured)
        self._optional = {"kvtrace_serving_kv_cache_usage_ratio", "kvtrace_serving_kv_cache_token_usage_ratio",
                          "kvtrace_serving_kv_pool_bytes", "kvtrace_serving_kv_pool_free_bytes",
                          "kvtrace_serving_kv_cache_tokens"}
        self._seen: set[str] = set()
        self.active = False  # no serving family is served before the first scheduler step or event
        self._families = _Families([m for n, m in self._m.items() if n not in self._optional])
        exporter.registry.register(_Served(self))
        self._lock = threading.Lock()
        self._arrival: dict[int, int] = {}
        self._in_flight = 0
        self._last_step_ns: dict[int, int] = {}  # manager -> t_ns of its previous step
        self._kv_kinds: set[str] = set()  # layer types of kvtrace_serving_kv_cache_bytes seen

    @property
    def model(self) -> str:
        """The recorded model (the exporter's kvtrace_info model): every serving series' model_name."""
        return getattr(self.exporter, "model", "unknown")

    def _c(self, name: str, *labels: str) -> Any:
        """The child of family ``name`` for the recorded model and ``labels``."""
        return self._m[name].labels(self.model, *labels)

    def _activate(self) -> None:
        """The first scheduler step or serving event: every series with no label of its own but the
        model's exists from now on (counters at 0), so rate() and increase() see the first event."""
        if self.active:
            return
        self.active = True
        for name, (kind, _, labels, _) in SERVING_METRICS.items():
            if kind != "histogram" and not labels and name not in self._optional:
                self._c(name)
        for kind in ("prefill", "decode"):
            self._c("kvtrace_serving_batch_tokens", kind)

    # ---- serving calls (kvtrace.recorder.serving) ------------------------------------------------

    def on_serving_step(self, sched: Any, groups: Any) -> None:
        c = self._c
        with self._lock:
            self._activate()
            c("kvtrace_serving_scheduler_steps_total").inc()
            c("kvtrace_serving_requests_running").set(int(sched.running))
            c("kvtrace_serving_requests_waiting").set(int(sched.waiting))
            c("kvtrace_serving_batch_tokens", "prefill").set(int(sched.prefill_tokens))
            c("kvtrace_serving_batch_tokens", "decode").set(int(sched.decode_tokens))
            c("kvtrace_serving_prompt_tokens_total").inc(int(sched.prefill_tokens))
            pool, free, valid = int(sched.pool_bytes), int(sched.free_bytes), int(sched.valid_bytes)
            if pool > 0:
                self._set("kvtrace_serving_kv_pool_bytes", pool)
                if free >= 0:
                    self._set("kvtrace_serving_kv_pool_free_bytes", free)
                    self._set("kvtrace_serving_kv_cache_usage_ratio", (pool - free) / pool)
                if valid >= 0:
                    self._set("kvtrace_serving_kv_cache_token_usage_ratio", valid / pool)
            if int(sched.tokens_cached) >= 0:
                self._set("kvtrace_serving_kv_cache_tokens", int(sched.tokens_cached))
            blocks: dict[tuple[str, str], int] = {}
            in_use_bytes: dict[str, int] = {}
            for g in groups or ():
                kind = _LAYER_TYPES.get(int(g.layer_type), "unknown")
                for state, value in (("in_use", g.blocks_in_use), ("cached", g.blocks_cached), ("free", g.blocks_free)):
                    if int(value) >= 0:
                        blocks[(kind, state)] = blocks.get((kind, state), 0) + int(value)
                if int(g.blocks_in_use) >= 0 and int(g.bytes_per_block) >= 0:
                    in_use_bytes[kind] = in_use_bytes.get(kind, 0) + int(g.blocks_in_use) * int(g.bytes_per_block)
            for (kind, state), value in blocks.items():
                c("kvtrace_serving_kv_blocks", kind, state).set(value)
            for kind, value in in_use_bytes.items():
                c("kvtrace_serving_kv_cache_bytes", kind).set(value)
                self._kv_kinds.add(kind)
            hits = max(int(sched.prefix_hit_tokens), 0)
            c("kvtrace_serving_prefix_cache_hits_tokens_total").inc(hits)
            c("kvtrace_serving_prefix_cache_queries_tokens_total").inc(int(sched.prefill_tokens) + hits)
            c("kvtrace_serving_evicted_blocks_total").inc(max(int(sched.evicted_blocks), 0))
            previous = self._last_step_ns.get(int(sched.manager))
            self._last_step_ns[int(sched.manager)] = int(sched.t_ns)
            if previous is not None and int(sched.decode_tokens) > 0 and int(sched.t_ns) > previous:
                gap = (int(sched.t_ns) - previous) / 1e9
                self._m["kvtrace_serving_inter_token_latency_seconds"].observe(gap, int(sched.decode_tokens))
        self._updated()

    def on_serving_event(self, kind: Any, request: int, value: int, t_ns: int) -> None:
        kind = int(kind)
        m = self._m
        with self._lock:
            self._activate()
            arrival = self._arrival.get(int(request))
            if kind == E.PREEMPTED:
                self._c("kvtrace_serving_preemptions_total").inc()
            elif kind == E.FIRST_TOKEN and arrival is not None and t_ns >= arrival:
                m["kvtrace_serving_time_to_first_token_seconds"].observe((t_ns - arrival) / 1e9)
            elif kind == E.SCHEDULED and int(value) == 1 and arrival is not None and t_ns >= arrival:
                m["kvtrace_serving_request_queue_time_seconds"].observe((t_ns - arrival) / 1e9)
            elif kind == E.REQUEST_END and arrival is not None and t_ns >= arrival:
                m["kvtrace_serving_e2e_request_latency_seconds"].observe((t_ns - arrival) / 1e9)
            else:
                return
        self._updated()

    # ---- the observer protocol -------------------------------------------------------------------

    def on_request_start(self, request: int | None = None) -> None:
        with self._lock:
            self._in_flight += 1
            if request is not None:
                self._arrival[int(request)] = self._clock()

    def on_request_end(self, outcome: Any = "ok", new_tokens: int = 0) -> None:
        """The last request in flight ending: nothing runs or waits any more (the pool gauges keep the
        last step's values: the recorder reads the pool only as a step is scheduled)."""
        with self._lock:
            self._in_flight = max(self._in_flight - 1, 0)
            if self._in_flight:
                return
            self._idle()
        self._updated()

    def _idle(self) -> None:
        self._arrival.clear()
        self._last_step_ns.clear()
        self._c("kvtrace_serving_requests_running").set(0)
        self._c("kvtrace_serving_requests_waiting").set(0)
        for kind in self._kv_kinds:  # no request holds blocks any more
            self._c("kvtrace_serving_kv_cache_bytes", kind).set(0)

    def start(self) -> ServingMetrics:
        return self

    def close(self) -> None:
        pass

    def on_session_start(self, model: str, model_type: str, rss: Any = None) -> None:
        pass

    def on_step(self, phase: str = "decode", tokens_seen: int | None = None) -> None:
        pass

    def on_kv(self, layer: int, layer_type: str, nbytes: int) -> None:
        pass

    def on_memory(self, device: int, used_bytes: int | None = None, **values: int | None) -> None:
        pass

    def on_dropped_samples(self, n: int = 1) -> None:
        pass

    def on_recorder_error(self) -> None:
        pass

    # ---- helpers ---------------------------------------------------------------------------------

    def _set(self, name: str, value: float) -> None:
        self._c(name).set(value)
        self._seen.add(name)

    def _updated(self) -> None:
        # the exporter's update stamp and rate-limited textfile: the same rules as its own metrics
        with self.exporter._lock:
            self.exporter._touch()
        self.exporter._maybe_textfile()


class _Histogram:
    """A histogram that takes one value n times in one call (a step's gap, once per decoded request:
    64 requests would be 64 prometheus_client observe calls per step on the CB loop)."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...],
                 model: Callable[[], str] = lambda: "unknown") -> None:
        self.name, self.help, self.model = name, help_text, model
        self.bounds = np.array(buckets, dtype=np.float64)
        self.counts = np.zeros(len(buckets) + 1, dtype=np.int64)  # last: above the largest bound
        self.total = 0.0
        self._lock = threading.Lock()  # a scrape reads counts and sum of the same instant

    def observe(self, value: float, n: int = 1) -> None:
        """`n` observations of `value`; bucket `le` holds values <= its bound, as Prometheus defines."""
        with self._lock:
            self.counts[int(np.searchsorted(self.bounds, value, side="left"))] += n
            self.total += value * n

    def collect(self) -> Any:
        from prometheus_client.core import HistogramMetricFamily

        with self._lock:
            counts, total = self.counts.copy(), self.total
        cumulative = np.cumsum(counts)
        buckets = [(repr(float(b)), int(c)) for b, c in zip(self.bounds, cumulative[:-1], strict=True)]
        buckets.append(("+Inf", int(cumulative[-1])))
        family = HistogramMetricFamily(self.name, self.help, labels=[MODEL_LABEL])
        family.add_metric([self.model()], buckets, sum_value=total)
        yield family


class _Served:
    """The serving families, once the recording has served (a generate()-only session shows none of
    them, as its replay from the trace does), and of the pool gauges only those that had a value
    (absent rather than an invented 0)."""

    def __init__(self, owner: ServingMetrics) -> None:
        self.owner = owner

    def collect(self) -> Any:
        if not self.owner.active:
            return
        yield from self.owner._families.collect()
        for name in sorted(self.owner._seen):
            yield from self.owner._m[name].collect()


def observers_for(options: Any) -> list[Any]:
    """kvtrace.record's live observers: the exporter the options ask for (kvtrace.export.prometheus),
    followed by the serving metrics on its registry."""
    exporters = _exporters(options)
    return [*exporters, *(ServingMetrics(e) for e in exporters)]


def vllm_mapping() -> list[tuple[str, str, str]]:
    """(metric name, kind, vLLM name or "") for the mapping table in the docs and spec."""
    return [(name, kind, vllm) for name, (kind, _, _, vllm) in SERVING_METRICS.items()]


def replay(exporter: PrometheusExporter, trace: Any) -> ServingMetrics | None:
    """The serving metrics of a finished trace (a Trace), as the live endpoint showed them at its
    end: its /sched rows and serving events fed in time order, arrivals from /requests start_ns.
    None for a trace without /sched (nothing served, nothing added to the exporter)."""
    sched = trace.sched[:]
    if not sched.size:
        return None
    exporter.set_info(trace.meta.model_id, trace.meta.model_type)  # the series' model_name
    sm = ServingMetrics(exporter)
    by_step: dict[tuple[int, int], list[Any]] = {}
    for g in trace.sched_groups[:]:
        by_step.setdefault((int(g["manager"]), int(g["step"])), []).append(schema.SchedGroupRow(*g.tolist()))
    events = trace.serving_events
    # e2e latency: the live endpoint hears the end of continuous-batching requests only
    cb = {int(r) for r in trace.cb_requests["request"]}
    events = events[(events["kind"] != int(E.REQUEST_END)) | np.isin(events["request"], list(cb))]
    reqs = trace.requests[:]
    sm._arrival = {int(r["request"]): int(r["start_ns"]) for r in reqs}
    order = sorted([(int(t), 1, i) for i, t in enumerate(sched["t_ns"])]
                   + [(int(t), 0, j) for j, t in enumerate(events["t_ns"])])
    for _, is_step, i in order:
        if is_step:
            row = sched[i]
            sm.on_serving_step(schema.SchedRow(*row.tolist()), by_step.get((int(row["manager"]), int(row["step"])), []))
        else:
            e = events[i]
            sm.on_serving_event(int(e["kind"]), int(e["request"]), int(e["value"]), int(e["t_ns"]))
    if not np.any(reqs["outcome"] == int(schema.Outcome.RUNNING)):
        sm._idle()  # every request ended: the endpoint showed nothing running
    return sm
