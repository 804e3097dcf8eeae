"""A real Prometheus scrapes the serving metrics of a live continuous-batching recording every 0.5 s;
every query of the Grafana dashboard's serving row then answers with series (the rates and
histogram quantiles included), and the totals equal the trace's. Skips without the `prometheus`
binary, as test_prometheus_server does."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers.generation.continuous_batching")

from test_prometheus_server import DASHBOARD, PROMETHEUS, Prom  # noqa: E402

import kvtrace  # noqa: E402
from kvtrace.format import schema  # noqa: E402
from kvtrace.format.reader import open_trace  # noqa: E402
from tests.helpers.net import free_port  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving_detectors"))
import serving_scenarios as S  # noqa: E402

pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary on PATH (Debian: apt-get install "
                                                          "prometheus; .ci/run tries it)")


@pytest.mark.slow
def test_real_prometheus_answers_the_serving_panels(tmp_path):
    import torch

    torch.set_num_threads(1)
    model = S.model("llama")
    gc, cfg = S._configs(160, page_size=16, num_blocks=24, max_batch_tokens=64)  # 4 x 164 tokens: preempts
    port = free_port()
    prom = Prom(tmp_path, f"127.0.0.1:{port}")
    path = tmp_path / "serve.kvt.h5"
    dash = json.loads(DASHBOARD.read_text())
    exprs = [(p["title"], t["expr"].replace("$instance", ".*")) for p in dash["panels"]
             for t in p.get("targets", []) if "kvtrace_serving_" in t["expr"]]
    answers: dict[str, dict] = {}
    # 10 ms per forward: the ~165 steps span several 0.5 s scrapes however fast this CPU is
    handle = model.register_forward_pre_hook(lambda *a: time.sleep(0.01))
    try:
        prom.wait_ready()
        with kvtrace.record(model, path, prometheus=f"127.0.0.1:{port}", prometheus_linger_s=0):
            prom.wait_for('up{job="kvtrace"} == 1')  # scraping before the workload starts
            t0 = time.monotonic()
            model.generate_batch(inputs=S.prompts([4, 6, 5, 3]), generation_config=gc, continuous_batching_config=cfg,
                                 warmup=False)
            assert time.monotonic() - t0 > 1.0, "the workload must span several scrapes"
            time.sleep(1.5)  # two more scrapes of the final state
            for _title, expr in exprs:
                answers[expr] = prom.query(expr)
            totals = {name: prom.query(f"{name}{{job=\"kvtrace\"}}") for name in (
                "kvtrace_serving_scheduler_steps_total", "kvtrace_serving_preemptions_total",
                "kvtrace_serving_time_to_first_token_seconds_count")}
    finally:
        handle.remove()
        prom.stop()
    empty = [expr for expr, got in answers.items() if not got]
    assert not empty, empty
    with open_trace(path) as t:
        sched, pre = t.sched[:], t.events.where(kind=schema.EventKind.PREEMPTED)
        model = f"model_name={t.meta.model_id}"  # every serving series names the model (vLLM's label)
    assert totals["kvtrace_serving_scheduler_steps_total"] == {model: sched.size}
    assert totals["kvtrace_serving_preemptions_total"] == {model: pre.size}
    assert totals["kvtrace_serving_time_to_first_token_seconds_count"] == {model: 4}
