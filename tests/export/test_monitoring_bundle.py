"""The monitoring bundle beside the dashboard (as vLLM ships prometheus.yaml + compose +
dashboard): grafana/prometheus.yml, kvtrace-alerts.yml, Grafana provisioning and docker-compose.yml.

With the real tools where they are installed: promtool checks the scrape configuration and the
rules and runs the rules' unit tests (tests/export/monitoring/alerts_test.yml); a real Prometheus
started from the bundled configuration (only its target and intervals changed) scrapes a live
continuous-batching recording, and every query of the dashboard's KV-cache panels then answers (they
were empty under serving), every serving series names the model, and the end-to-end latency and
prompt-token families hold the trace's numbers. Grafana is not installed here: its provisioning
files are checked against the compose file that mounts them."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / "grafana"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="no promtool on PATH (Debian: apt-get install prometheus)")


def _load(name: str) -> dict:
    return yaml.safe_load((BUNDLE / name).read_text())


@needs_promtool
def test_promtool_accepts_the_scrape_config_and_rules():
    proc = subprocess.run([PROMTOOL, "check", "config", str(BUNDLE / "prometheus.yml")], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "SUCCESS: 1 rule files found" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    proc = subprocess.run([PROMTOOL, "check", "rules", str(BUNDLE / "kvtrace-alerts.yml")], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "SUCCESS: 4 rules found" in proc.stdout + proc.stderr, proc.stdout


@needs_promtool
def test_promtool_unit_tests_of_the_alerts():
    tests = Path(__file__).resolve().parent / "monitoring" / "alerts_test.yml"
    proc = subprocess.run([PROMTOOL, "test", "rules", tests.name], capture_output=True, text=True, timeout=60,
                          cwd=tests.parent)
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout + proc.stderr


def test_the_alerts_query_exported_families_and_labels():
    import re

    from kvtrace.export.prometheus import METRICS
    from kvtrace.export.prometheus_serving import MODEL_LABEL, SERVING_METRICS

    rules = _load("kvtrace-alerts.yml")["groups"][0]["rules"]
    for rule in rules:
        for name in re.findall(r"kvtrace_[a-z0-9_]+", rule["expr"]):
            assert name in METRICS or name in SERVING_METRICS, name
            if name in SERVING_METRICS:  # grouped by the model label the serving series carry
                assert MODEL_LABEL in rule["expr"] or "by (instance)" in rule["expr"], rule["expr"]
    thresholds = {r["alert"]: r["expr"].rsplit(" ", 1)[-1] for r in rules}
    assert thresholds["KvtraceKvPoolHigh"] == "0.8" and thresholds["KvtraceKvPoolCritical"] == "0.9"  # loadtest's


def test_compose_mounts_what_the_provisioning_points_at():
    compose = _load("docker-compose.yml")["services"]
    prom, graf = compose["prometheus"], compose["grafana"]
    mounts = {}
    for service in (prom, graf):
        for volume in service["volumes"]:
            source, target = volume.split(":")[:2]
            assert (BUNDLE / source).exists(), source  # every mounted file is in the bundle
            mounts[source.removeprefix("./")] = target
    # Prometheus reads the bundled config, and its rule file beside it where rule_files says
    config = _load("prometheus.yml")
    assert mounts["prometheus.yml"] == "/etc/prometheus/prometheus.yml" in " ".join(prom["command"])
    for rule_file in config["rule_files"]:
        assert mounts[rule_file] == f"/etc/prometheus/{rule_file}"
    assert "host.docker.internal:host-gateway" in prom["extra_hosts"]
    assert config["scrape_configs"][0]["static_configs"][0]["targets"] == ["host.docker.internal:9464"]
    # Grafana: the data source is the compose service, the dashboard provider reads where the JSON is mounted
    (ds,) = _load("provisioning/datasources/prometheus.yml")["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090" and ds["isDefault"]
    assert "9090:9090" in prom["ports"]
    (provider,) = _load("provisioning/dashboards/kvtrace.yml")["providers"]
    assert mounts["provisioning"] == "/etc/grafana/provisioning"
    assert Path(mounts["kvtrace-dashboard.json"]).parent == Path(provider["options"]["path"])
    dashboard = json.loads((BUNDLE / "kvtrace-dashboard.json").read_text())
    (var,) = [v for v in dashboard["templating"]["list"] if v["name"] == "datasource"]
    assert var["type"] == "datasource" and var["query"] == ds["type"]  # picks the provisioned default


# ---- a real Prometheus, from the bundled configuration --------------------------------------------


def _bundled_config(target: str) -> str:
    config = _load("prometheus.yml")
    config["global"].update(scrape_interval="500ms", scrape_timeout="400ms", evaluation_interval="500ms")
    config["scrape_configs"][0]["static_configs"][0]["targets"] = [target]
    return yaml.safe_dump(config)


@pytest.mark.slow
def test_real_prometheus_from_the_bundle_fills_the_kv_panels_under_serving(tmp_path):
    from test_prometheus_server import PROMETHEUS, Prom  # the real-Prometheus harness

    if PROMETHEUS is None:
        pytest.skip("no prometheus binary on PATH (Debian: apt-get install prometheus)")
    pytest.importorskip("transformers.generation.continuous_batching")
    import sys

    import torch

    import kvtrace
    from kvtrace.format import schema
    from kvtrace.format.reader import open_trace
    from tests.helpers.net import free_port

    sys.path.insert(0, str(ROOT / "tests" / "serving_detectors"))
    import serving_scenarios as S

    torch.set_num_threads(1)
    model = S.model("llama")
    gc, cfg = S._configs(24, page_size=16, num_blocks=24, max_batch_tokens=64)
    port = free_port()
    for rule_file in _load("prometheus.yml")["rule_files"]:
        shutil.copy(BUNDLE / rule_file, tmp_path / rule_file)
    prom = Prom(tmp_path, "", config_text=_bundled_config(f"127.0.0.1:{port}"))
    dash = json.loads((BUNDLE / "kvtrace-dashboard.json").read_text())
    kv_exprs = [(p["title"], t["expr"].replace("$instance", ".*")) for p in dash["panels"]
                for t in p.get("targets", []) if "kvtrace_kv_cache_" in t["expr"] or "kvtrace_serving_kv_cache_b"
                in t["expr"] or "kvtrace_serving_kv_cache_tokens" in t["expr"]]
    seen: dict[tuple[str, str], dict] = {}
    path = tmp_path / "serve.kvt.h5"
    reached, resume, calls = threading.Event(), threading.Event(), [0]

    def hold(*_):  # the CB loop waits inside its 12th forward until Prometheus has scraped the state
        calls[0] += 1
        if calls[0] == 12:
            reached.set()
            resume.wait(timeout=120)

    handle = model.register_forward_pre_hook(hold)
    errors: list[BaseException] = []
    try:
        prom.wait_ready()
        with kvtrace.record(model, path, prometheus=f"127.0.0.1:{port}", prometheus_linger_s=0,
                            model_id="tiny-llama-under-test"):
            prom.wait_for('up{job="kvtrace"} == 1')

            def run() -> None:
                try:
                    model.generate_batch(inputs=S.prompts([6, 8, 5, 7]), generation_config=gc,
                                         continuous_batching_config=cfg, warmup=False)
                except BaseException as exc:  # noqa: BLE001 - surfaced below
                    errors.append(exc)
                    reached.set()

            worker = threading.Thread(target=run)
            worker.start()
            try:
                assert reached.wait(timeout=120)
                prom.wait_for('sum(kvtrace_serving_kv_cache_bytes{job="kvtrace"}) > 0')  # scraped mid-run
                panels: dict[str, list[str]] = {}
                for title, expr in kv_exprs:
                    panels.setdefault(title, []).append(expr)
                for title, exprs in panels.items():  # each panel's query of the paged pool answers mid-run
                    for expr in exprs:
                        if "kvtrace_serving_" in expr:
                            seen[(title, expr)] = prom.wait_for(expr)
                        else:
                            seen[(title, expr)] = prom.query(expr)
            finally:
                resume.set()
                worker.join(timeout=120)
            assert not errors, errors
            time.sleep(1.5)  # two more scrapes of the final state
            models = prom.query('count by (model_name) ({__name__=~"kvtrace_serving_.+", job="kvtrace"})')
            totals = {name: prom.query(f'{name}{{job="kvtrace"}}') for name in (
                "kvtrace_serving_e2e_request_latency_seconds_count", "kvtrace_serving_prompt_tokens_total")}
            with urllib.request.urlopen(f"http://{prom.web}/api/v1/rules", timeout=10) as r:
                rules = json.load(r)["data"]["groups"]
    finally:
        handle.remove()
        resume.set()
        prom.stop()
    # every KV panel query (generate's per-layer gauges or the paged pool's) answered under serving
    titles = {title for title, _ in seen}
    assert titles == {title for title, _ in kv_exprs}, sorted(set(t for t, _ in kv_exprs) - titles)
    serving_kv = [got for (_, expr), got in seen.items() if "kvtrace_serving_kv_cache_bytes" in expr]
    # why: the per-layer gauges of generate() have no sample under continuous batching
    assert not any(got for (_, e), got in seen.items() if "kvtrace_kv_cache_bytes" in e and "serving" not in e)
    assert any(v > 0 for got in serving_kv for v in got.values())
    assert list(models) == ["model_name=tiny-llama-under-test"]  # one model, on every serving series
    with open_trace(path) as t:
        sched, ends = t.sched[:], t.events.where(kind=schema.EventKind.REQUEST_END)
    assert totals["kvtrace_serving_e2e_request_latency_seconds_count"] == {"model_name=tiny-llama-under-test": ends.size}
    assert totals["kvtrace_serving_prompt_tokens_total"] == {"model_name=tiny-llama-under-test":
                                                             int(sched["prefill_tokens"].sum())}
    loaded = [r for g in rules for r in g["rules"]]
    assert {r["name"] for r in loaded} == {"KvtraceKvPoolHigh", "KvtraceKvPoolCritical", "KvtracePreemptions",
                                           "KvtraceRecorderSilent"}
    assert all(r["health"] == "ok" for r in loaded), loaded
