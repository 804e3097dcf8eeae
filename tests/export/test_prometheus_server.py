"""A real Prometheus server scrapes a live recording on 127.0.0.1 every 0.5 s; its query API must
then hold the recording's true final state, see the first event of each outcome with increase(),
and still answer the Grafana dashboard's age query after the recorder has gone.

Needs the `prometheus` binary (Debian package `prometheus`; .ci/run installs it best effort):
without it the test skips and says so. Typical run: about 10 s (Prometheus start-up included).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvtrace  # noqa: E402
from kvtrace.format import Outcome, Trace  # noqa: E402
from tests.helpers.models import tiny_model, tiny_prompt  # noqa: E402
from tests.helpers.net import free_port  # noqa: E402

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="no prometheus binary on PATH (Debian: apt-get install prometheus; .ci/run tries it)",
)
DASHBOARD = Path(__file__).resolve().parents[2] / "grafana" / "kvtrace-dashboard.json"
INTERVAL = "500ms"
NEW = 6


class Raise(transformers.StoppingCriteria):
    """Raises `exc` at the second decode step (after prefill and one step were recorded)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc, self.calls = exc, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == 2:
            raise self.exc
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


class Prom:
    """One Prometheus process with a throw-away data directory, scraping one target."""

    def __init__(self, tmp: Path, target: str, config_text: str | None = None) -> None:
        """``config_text``: a whole configuration of the caller's (the bundled grafana/prometheus.yml)."""
        self.web = f"127.0.0.1:{free_port()}"
        config = tmp / "prometheus.yml"
        config.write_text(config_text or (
            f"global:\n  scrape_interval: {INTERVAL}\n  scrape_timeout: 400ms\n"
            f"scrape_configs:\n  - job_name: kvtrace\n    static_configs:\n      - targets: ['{target}']\n"))
        self.log = (tmp / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address={self.web}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, within_s: float = 30) -> None:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"prometheus exited with {self.proc.returncode}: {self.logtext()}")
            try:
                with urllib.request.urlopen(f"http://{self.web}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        pytest.fail(f"prometheus not ready within {within_s} s: {self.logtext()}")

    def logtext(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-2000:]

    def query(self, expr: str) -> dict[str, float]:
        """Instant query at now: {"label=value,...": value} (an empty dict when no series)."""
        url = f"http://{self.web}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return {",".join(f"{k}={v}" for k, v in sorted(s["metric"].items()) if k not in ("__name__", "job", "instance")):
                float(s["value"][1]) for s in body["data"]["result"]}

    def wait_for(self, expr: str, within_s: float = 20) -> dict[str, float]:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            got = self.query(expr)
            if got:
                return got
            time.sleep(0.2)
        pytest.fail(f"no result for {expr} within {within_s} s: {self.logtext()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def refused(port: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                pass
        except OSError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_real_prometheus_sees_the_final_state_and_first_events(tmp_path):
    model = tiny_model("llama")
    ids = tiny_prompt(8)
    port = free_port()
    prom = Prom(tmp_path, f"127.0.0.1:{port}")
    exporter = None
    try:
        prom.wait_ready()
        path = tmp_path / "live.kvt.h5"
        # the default linger (30 s): the test itself never scrapes, Prometheus is the only client
        with kvtrace.record(model, path, prometheus=f"127.0.0.1:{port}") as rec:
            exporter = rec.exporter
            # every outcome is a series at 0 before anything happened: Prometheus has them now
            before = prom.wait_for('kvtrace_requests_total{job="kvtrace"}')
            assert before == {f"outcome={o}": 0 for o in ("error", "interrupted", "ok", "oom")}
            model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
            for exc in (ValueError("user code failed"), torch.OutOfMemoryError("CUDA out of memory (simulated)")):
                with pytest.raises(type(exc)):
                    model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                   stopping_criteria=transformers.StoppingCriteriaList([Raise(exc)]))
            # the last two requests took well under one scrape interval: their outcomes reach
            # Prometheus through the final state served after close
        t_closed = time.monotonic()
        # Prometheus, the one scraper seen, fetched the final state: the endpoint stops long before 30 s
        assert refused(port, within_s=10), "endpoint still up 10 s after the recording closed"
        assert time.monotonic() - t_closed < 10
        prom.wait_for('up{job="kvtrace"} == 0')  # a failed scrape: the series are stale from here on

        with Trace(path) as t:
            requests, n_layers, process = t.requests[:], t.nrows("layers"), t.process[:]
        outcomes = sorted(Outcome(int(o)).name.lower() for o in requests["outcome"])
        assert outcomes == ["error", "ok", "oom"]

        last = {name: prom.query(f"last_over_time({name}[5m])") for name in (
            "kvtrace_requests_total", "kvtrace_generated_tokens_total", "kvtrace_requests_in_flight",
            "kvtrace_kv_cache_bytes", "kvtrace_kv_cache_tokens", "kvtrace_process_resident_memory_bytes")}
        assert last["kvtrace_requests_total"] == {"outcome=error": 1, "outcome=interrupted": 0, "outcome=ok": 1,
                                                  "outcome=oom": 1}
        assert last["kvtrace_generated_tokens_total"] == {"": int(requests["new_tokens"].sum())}
        assert last["kvtrace_requests_in_flight"] == {"": 0}
        assert len(last["kvtrace_kv_cache_bytes"]) == n_layers and set(last["kvtrace_kv_cache_bytes"].values()) == {0}
        assert last["kvtrace_kv_cache_tokens"] == {"": 0}
        if process.size:  # the RSS the recorder sampled last, as the trace stores it
            assert last["kvtrace_process_resident_memory_bytes"] == {"": int(process["rss_bytes"][-1])}

        # increase() sees the first event of each outcome (each series existed at 0 before it)
        first = prom.query('increase(kvtrace_requests_total{job="kvtrace"}[5m])')
        assert {k: v >= 0.9 for k, v in first.items()} == {"outcome=error": True, "outcome=interrupted": False,
                                                           "outcome=ok": True, "outcome=oom": True}
        assert first["outcome=interrupted"] == 0

        # the dashboard's age panel answers after the recorder is gone; a plain instant query does not
        assert prom.query("kvtrace_last_update_timestamp_seconds") == {}
        dash = json.loads(DASHBOARD.read_text())
        (age_expr,) = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])
                       if "kvtrace_last_update_timestamp_seconds" in t["expr"]]
        age = prom.query(age_expr.replace("$instance", ".*"))
        assert len(age) == 1 and 0 <= age[""] < 120, age
    finally:
        if exporter is not None:  # a failure above must not leave pytest's exit waiting on the linger
            exporter.stop_serving()
        prom.stop()
