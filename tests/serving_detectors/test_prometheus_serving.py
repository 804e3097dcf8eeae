"""Live serving metrics: `kvtrace.record(model, path, prometheus="127.0.0.1:PORT")` around
generate_batch serves kvtrace_serving_* on the exporter's endpoint. Scraped over loopback (parsed by
prometheus_client's parser) while the CB loop is held inside a forward, then after the run; every
value is checked against the trace the same recording wrote."""

from __future__ import annotations

import threading
import urllib.request

import numpy as np
import pytest

from tests.helpers.net import free_port

pytest.importorskip("transformers.generation.continuous_batching")
pytest.importorskip("prometheus_client")

import serving_scenarios as S  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import kvtrace  # noqa: E402
from kvtrace.export.prometheus import PrometheusExporter  # noqa: E402
from kvtrace.export.prometheus_serving import SERVING_METRICS, ServingMetrics, vllm_mapping  # noqa: E402
from kvtrace.format import schema  # noqa: E402
from kvtrace.format.reader import open_trace  # noqa: E402

HOLD_AT = 12  # forward calls before the mid-run scrape


class Hold:
    """A forward pre-hook that blocks the CB loop once, inside its HOLD_AT-th forward."""

    def __init__(self) -> None:
        self.calls = 0
        self.reached, self.resume = threading.Event(), threading.Event()

    def __call__(self, module, args, kwargs):
        self.calls += 1
        if self.calls == HOLD_AT:
            self.reached.set()
            self.resume.wait(timeout=60)



def scrape(port: int) -> dict:
    """{(sample name, sorted labels): value} of one real scrape of the endpoint; the serving samples'
    model_name label (the same on all of them) under ("model_name", ()) and dropped from their labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return labelled(text)


def labelled(text: str) -> dict:
    out: dict = {}
    models = set()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = dict(s.labels)
            if s.name.startswith("kvtrace_serving_"):
                models.add(labels.pop("model_name"))  # every serving series names the model
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    assert len(models) <= 1, models
    out[("model_name", ())] = models.pop() if models else None
    return out


def _value(metrics: dict, name: str, **labels) -> float | None:
    return metrics.get((name, tuple(sorted(labels.items()))))


def test_live_serving_metrics_match_the_trace(tmp_path):
    import torch

    torch.set_num_threads(1)
    model = S.model("llama")
    hold = Hold()
    handle = model.register_forward_pre_hook(hold, with_kwargs=True)
    port = free_port()
    path = tmp_path / "live.kvt.h5"
    gc, cfg = S._configs(40, page_size=16, num_blocks=4, max_batch_tokens=64)  # preempts (plant_preemption)
    errors: list[BaseException] = []
    try:
        with kvtrace.record(model, path, prometheus=f"127.0.0.1:{port}", prometheus_linger_s=0):
            def run() -> None:
                try:
                    model.generate_batch(inputs=S.prompts([4, 3, 5, 3]), generation_config=gc,
                                         continuous_batching_config=cfg, warmup=False)
                except BaseException as exc:  # noqa: BLE001 - surfaced below
                    errors.append(exc)
                    hold.reached.set()

            worker = threading.Thread(target=run)
            worker.start()
            assert hold.reached.wait(timeout=120)
            try:
                mid = scrape(port)
            finally:
                hold.resume.set()
                worker.join(timeout=120)
            assert not errors, errors
            after = scrape(port)
    finally:
        handle.remove()

    with open_trace(path) as t:
        sched = t.sched[:]
        pre = t.events.where(kind=schema.EventKind.PREEMPTED)
        first = t.events.where(kind=schema.EventKind.FIRST_TOKEN)
        reqs = t.requests[:]
        groups = t.sched_groups[:]
        model_id = t.meta.model_id
        end_events = t.events.where(kind=schema.EventKind.REQUEST_END)
    by_start = {int(r["request"]): int(r["start_ns"]) for r in reqs}
    assert _value(mid, "model_name") == _value(after, "model_name") == model_id  # vLLM's label, the trace's model
    # mid-run: the gauges are the last scheduled step's row, the counters the sums up to it
    steps = int(_value(mid, "kvtrace_serving_scheduler_steps_total"))
    assert 1 <= steps < sched.size
    row = sched[sched["step"] == steps - 1][0]
    assert _value(mid, "kvtrace_serving_requests_running") == row["running"] > 0
    assert _value(mid, "kvtrace_serving_requests_waiting") == row["waiting"]
    assert _value(mid, "kvtrace_serving_kv_cache_usage_ratio") == pytest.approx(
        (row["pool_bytes"] - row["free_bytes"]) / row["pool_bytes"])
    assert _value(mid, "kvtrace_serving_kv_cache_token_usage_ratio") == pytest.approx(row["valid_bytes"] / row["pool_bytes"])
    assert _value(mid, "kvtrace_serving_kv_pool_bytes") == row["pool_bytes"]
    assert _value(mid, "kvtrace_serving_kv_blocks", layer_type="full", state="in_use") == row["blocks_in_use"]
    mine = groups[groups["step"] == steps - 1]  # the KV the running requests' blocks hold, feeding the KV panels
    assert _value(mid, "kvtrace_serving_kv_cache_bytes", layer_type="full") == int(
        (mine["blocks_in_use"] * mine["bytes_per_block"]).sum()) > 0
    assert _value(mid, "kvtrace_serving_kv_cache_tokens") == row["tokens_cached"]
    assert _value(mid, "kvtrace_requests_in_flight") == 4  # the exporter's own gauges are served beside them

    # after the run: totals equal the trace's, nothing runs any more
    assert _value(after, "kvtrace_serving_scheduler_steps_total") == sched.size
    assert _value(after, "kvtrace_serving_preemptions_total") == pre.size > 0
    assert _value(after, "kvtrace_serving_requests_running") == 0
    assert _value(after, "kvtrace_serving_requests_waiting") == 0
    assert _value(after, "kvtrace_serving_kv_cache_bytes", layer_type="full") == 0  # no request holds blocks
    assert _value(after, "kvtrace_serving_prompt_tokens_total") == int(sched["prefill_tokens"].sum())
    t_end = {int(e["request"]): int(e["t_ns"]) for e in end_events}
    ends = sorted(t_end)
    assert _value(after, "kvtrace_serving_e2e_request_latency_seconds_count") == len(ends) == 4
    e2e = sum((t_end[r] - by_start[r]) / 1e9 for r in ends)
    assert _value(after, "kvtrace_serving_e2e_request_latency_seconds_sum") == pytest.approx(e2e, rel=0.05, abs=0.005)
    prefill = int(sched["prefill_tokens"].sum())
    assert _value(after, "kvtrace_serving_prefix_cache_queries_tokens_total") == prefill + int(sched["prefix_hit_tokens"].sum())
    assert _value(after, "kvtrace_serving_prefix_cache_hits_tokens_total") == int(sched["prefix_hit_tokens"].sum())
    assert _value(after, "kvtrace_serving_time_to_first_token_seconds_count") == first.size == 4
    ttft_sum = _value(after, "kvtrace_serving_time_to_first_token_seconds_sum")
    by_req = {int(r["request"]): int(r["start_ns"]) for r in reqs}
    trace_ttft = sum((int(e["t_ns"]) - by_req[int(e["request"])]) / 1e9 for e in first)
    assert ttft_sum == pytest.approx(trace_ttft, rel=0.05, abs=0.005)  # arrival taken a few us after start_ns
    assert _value(after, "kvtrace_serving_request_queue_time_seconds_count") == 4
    # ITL: one observation per request decoded in a step that follows another step
    assert _value(after, "kvtrace_serving_inter_token_latency_seconds_count") == int(sched["decode_tokens"][1:].sum())
    gaps = np.diff(sched["t_ns"].astype(np.int64)) / 1e9
    assert _value(after, "kvtrace_serving_inter_token_latency_seconds_sum") == pytest.approx(
        float((gaps * sched["decode_tokens"][1:]).sum()), rel=1e-6)


def test_pool_gauges_are_absent_until_the_cache_reports_them(tmp_path):
    exp = PrometheusExporter(None, None, textfile=tmp_path / "m.prom", linger_s=0)
    sm = ServingMetrics(exp)
    from prometheus_client import generate_latest

    def text() -> str:
        return generate_latest(exp.registry).decode()

    assert "kvtrace_serving_kv_cache_usage_ratio" not in text()
    unknown = schema.SchedRow(1, 0, 0, 1, 4, 0, 1, 0, -1, -1, -1, -1, -1, -1, -1, 4, 0, 0, 0, 0)
    sm.on_serving_step(unknown, [])
    body = text()
    assert "kvtrace_serving_kv_cache_usage_ratio" not in body and "kvtrace_serving_kv_pool_bytes" not in body
    assert 'kvtrace_serving_requests_running{model_name="unknown"} 1.0' in body
    known = unknown._replace(step=1, pool_bytes=1000, free_bytes=250, valid_bytes=500)
    sm.on_serving_step(known, [])
    body = text()
    assert 'kvtrace_serving_kv_cache_usage_ratio{model_name="unknown"} 0.75' in body
    assert 'kvtrace_serving_kv_cache_token_usage_ratio{model_name="unknown"} 0.5' in body
    assert "_created" not in body


def test_vllm_mapping_covers_the_issue_names():
    mapped = {v.split(" ")[0] for _, _, v in vllm_mapping() if v}
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
            "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"} <= mapped
    assert all(name.startswith("kvtrace_serving_") for name in SERVING_METRICS)


def test_replay_of_a_served_trace_equals_the_live_end_state(tmp_path):
    """kvtrace.export.prometheus_serving.replay: a finished trace's serving metrics as the endpoint
    showed them at its end (what the textfile renderer can add), checked against a live textfile."""
    from prometheus_client import generate_latest

    from kvtrace.export.prometheus_serving import replay

    live = tmp_path / "live.prom"
    path = tmp_path / "t.kvt.h5"
    model = S.model("llama")
    gc, cfg = S._configs(6, page_size=16, num_blocks=8, max_batch_tokens=64)
    with kvtrace.record(model, path, prometheus_textfile=str(live)):
        model.generate_batch(inputs=S.prompts([20, 5, 9]), generation_config=gc, continuous_batching_config=cfg,
                             warmup=False)

    def serving(text: str) -> dict:
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                # histogram sums/buckets of TTFT and queue time use arrivals a few us apart (live clock)
                timed = s.name.startswith(("kvtrace_serving_time_to_first", "kvtrace_serving_request_queue",
                                           "kvtrace_serving_e2e"))
                if s.name.startswith("kvtrace_serving_") and not (timed and not s.name.endswith("_count")):
                    out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    exp = PrometheusExporter(None, None, textfile=tmp_path / "replay.prom", linger_s=0)
    with open_trace(path) as t:
        assert replay(exp, t) is not None
    got, want = serving(generate_latest(exp.registry).decode()), serving(live.read_text())
    assert got == want and any(name == "kvtrace_serving_scheduler_steps_total" for name, _ in got)
    assert {dict(labels)["model_name"] for _, labels in got} == {"LlamaForCausalLM"}  # the trace's model
    assert any(name == "kvtrace_serving_e2e_request_latency_seconds_count" for name, _ in got)


def test_spec_table_lists_every_serving_metric_and_its_vllm_name():
    from pathlib import Path

    spec = (Path(__file__).resolve().parents[2] / "spec" / "prometheus-serving.md").read_text()
    for name, _, vllm in vllm_mapping():
        row = next((line for line in spec.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None, name
        if vllm:
            assert vllm.split(" ")[0] in row, (name, vllm)


def test_histogram_buckets_follow_prometheus_le(tmp_path):
    """A value on a bound counts in that bound's bucket (le = less or equal); n observations at once."""
    from prometheus_client import generate_latest

    exp = PrometheusExporter(None, None, textfile=tmp_path / "m.prom", linger_s=0)
    sm = ServingMetrics(exp)
    sm.on_request_start(7)
    sm._arrival[7] = 0
    sm.on_serving_event(int(schema.EventKind.FIRST_TOKEN), 7, 0, 10_000_000)  # 0.01 s, a bucket bound
    step = schema.SchedRow(0, 0, 0, 2, 0, 2, 2, 0, -1, -1, -1, -1, -1, -1, -1, 4, 0, 0, 0, 0)
    sm.on_serving_step(step, [])
    sm.on_serving_step(step._replace(step=1, t_ns=3_000_000), [])  # 3 ms gap, 2 requests decoded
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for fam in text_string_to_metric_families(generate_latest(exp.registry).decode()) for s in fam.samples}
    ttft = "kvtrace_serving_time_to_first_token_seconds"
    got = {(name, tuple(kv for kv in labels if kv[0] != "model_name")): v for (name, labels), v in got.items()}
    assert got[(f"{ttft}_bucket", (("le", "0.005"),))] == 0 and got[(f"{ttft}_bucket", (("le", "0.01"),))] == 1
    itl = "kvtrace_serving_inter_token_latency_seconds"
    assert got[(f"{itl}_bucket", (("le", "0.0025"),))] == 0 and got[(f"{itl}_bucket", (("le", "0.005"),))] == 2
    assert got[(f"{itl}_count", ())] == 2 and got[(f"{itl}_sum", ())] == pytest.approx(0.006)
    assert got[(f"{itl}_bucket", (("le", "+Inf"),))] == 2
