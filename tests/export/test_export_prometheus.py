"""Prometheus exporter: the real HTTP endpoint scraped over loopback, the textfile mode, and the
replay of a finished trace. Exposition text is checked with prometheus_client's parser when it
is installed (an independent implementation of the format), else with a strict line grammar."""

from __future__ import annotations

import re
import threading
import urllib.error
import urllib.request

import pytest
from click.testing import CliRunner
from synth_trace import PER_TOKEN, stored, write_synthetic_trace

from kvtrace.cli import cli
from kvtrace.export.prometheus import METRICS, PrometheusExporter, exporter_from_trace, parse_address
from kvtrace.format import Outcome, Trace

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(\\.|[^"\\])*",?)*\})? '
                    r'(-?[0-9.e+]+|NaN|[+-]Inf)$')


def parse(text: str) -> dict[tuple[str, tuple], float]:
    """{(name, sorted label items): value}."""
    assert text.endswith("\n")
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        text_string_to_metric_families = None
    out: dict[tuple[str, tuple], float] = {}
    if text_string_to_metric_families is not None:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) [a-zA-Z_:][a-zA-Z0-9_:]* .+$", line), line
            continue
        m = SAMPLE.match(line)
        assert m, line
        labels = tuple(sorted((k, _unescape(v)) for k, v in
                              re.findall(r'([a-zA-Z_]\w*)="((?:\\.|[^"\\])*)"', m.group(2) or "")))
        out[(m.group(1), labels)] = float(m.group(5))
    return out


def _unescape(value: str) -> str:
    """Label values escape backslash, double quote and newline (exposition format 0.0.4)."""
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return resp.read().decode()


def test_names_follow_conventions():
    for name, m in METRICS.items():
        assert name.startswith("kvtrace_") and re.fullmatch(r"[a-z_]+", name)
        assert name.endswith("_total") == (m.kind == "counter"), name
        if "bytes" in name:
            assert name.endswith("_bytes") or name.endswith("_bytes_total"), name


def test_http_endpoint_over_loopback():
    exp = PrometheusExporter("127.0.0.1", 0).start()
    try:
        assert exp.port and exp.url == f"http://127.0.0.1:{exp.port}/metrics"
        first = parse(scrape(exp.url))
        # nothing measured yet: no memory or KV gauges invented
        assert not any(k[0].startswith(("kvtrace_gpu", "kvtrace_kv", "kvtrace_allocator")) for k in first)
        assert not any(k[0] == "kvtrace_requests_total" for k in first)
        assert first[("kvtrace_dropped_samples_total", ())] == 0
        exp.set_info(model='org/"quoted"\nname', model_type="llama")
        exp.on_request_start(0)
        exp.on_step("prefill", tokens_seen=7)
        exp.on_kv(0, "sliding", 4096)
        exp.on_kv(1, "full", 8192)
        exp.on_memory(0, 10 * 1024**3, total_bytes=80 * 1024**3, reserved_bytes=6 * 1024**3,
                      allocated_bytes=5 * 1024**3, inactive_split_bytes=123, num_alloc_retries=4, num_ooms=0)
        exp.on_memory(1, -1, reserved_bytes=None)  # not measured: stays absent
        exp.on_memory(0, num_alloc_retries=2)  # torch's cumulative counter never goes back
        mid = parse(scrape(exp.url))
        assert mid[("kvtrace_kv_cache_bytes", (("layer", "0"), ("layer_type", "sliding")))] == 4096
        assert mid[("kvtrace_kv_cache_bytes", (("layer", "1"), ("layer_type", "full")))] == 8192
        assert mid[("kvtrace_gpu_memory_used_bytes", (("device", "0"),))] == 10 * 1024**3
        assert mid[("kvtrace_allocator_reserved_bytes", (("device", "0"),))] == 6 * 1024**3
        assert mid[("kvtrace_allocator_inactive_split_bytes", (("device", "0"),))] == 123
        assert mid[("kvtrace_alloc_retries_total", (("device", "0"),))] == 4
        assert mid[("kvtrace_requests_in_flight", ())] == 1
        assert mid[("kvtrace_kv_cache_tokens", ())] == 7
        assert not any(dict(k[1]).get("device") == "1" for k in mid)
        info = [k for k in mid if k[0] == "kvtrace_info"]
        assert dict(info[0][1])["model"] == 'org/"quoted"\nname'
        exp.on_step("decode")
        exp.on_request_end(Outcome.OK, new_tokens=12)
        exp.on_request_start(1)
        exp.on_request_end("oom")
        exp.on_dropped_samples(3)
        exp.on_recorder_error()
        end = parse(scrape(exp.url))
        assert end[("kvtrace_requests_total", (("outcome", "ok"),))] == 1
        assert end[("kvtrace_requests_total", (("outcome", "oom"),))] == 1
        assert end[("kvtrace_requests_in_flight", ())] == 0
        assert end[("kvtrace_generated_tokens_total", ())] == 12
        assert end[("kvtrace_steps_total", (("phase", "prefill"),))] == 1
        assert end[("kvtrace_dropped_samples_total", ())] == 3
        assert end[("kvtrace_recorder_errors_total", ())] == 1
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{exp.port}/other", timeout=5)
        assert err.value.code == 404
    finally:
        exp.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{exp.port}/metrics", timeout=2)


def test_scrapes_consistent_under_concurrent_updates():
    exp = PrometheusExporter("127.0.0.1", 0).start()
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            exp.on_kv(i % 48, "full", i)
            exp.on_memory(0, i, reserved_bytes=i, allocated_bytes=i)
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    try:
        for _ in range(15):  # bounded number of requests
            samples = parse(scrape(exp.url))
            assert all(v >= 0 for v in samples.values())
    finally:
        stop.set()
        t.join()
        exp.close()


def test_textfile_mode(tmp_path):
    path = tmp_path / "kvtrace.prom"
    exp = PrometheusExporter(None, None, textfile=path)
    exp.on_request_start(0)
    exp.on_kv(3, "full", 1000)
    exp.on_request_end("ok", new_tokens=5)  # request end always writes the file
    samples = parse(path.read_text())
    assert samples[("kvtrace_kv_cache_bytes", (("layer", "3"), ("layer_type", "full")))] == 1000
    assert samples[("kvtrace_requests_total", (("outcome", "ok"),))] == 1
    exp.on_kv(3, "full", 2000)
    exp.close()  # close writes the final state
    assert parse(path.read_text())[("kvtrace_kv_cache_bytes", (("layer", "3"), ("layer_type", "full")))] == 2000
    assert [p.name for p in tmp_path.iterdir()] == ["kvtrace.prom"]  # no temp files left behind


def test_replay_of_a_trace(tmp_path):
    path = write_synthetic_trace(tmp_path / "t.kvt.h5", requests=2, dropped_samples=5, recorder_error="x")
    with Trace(path) as t:
        exp = exporter_from_trace(t, tmp_path / "out.prom")
        nvml = t.nvml()
    exp.write_textfile()
    s = parse((tmp_path / "out.prom").read_text())
    for layer in range(4):
        name = "sliding" if layer % 2 == 0 else "full"
        assert s[("kvtrace_kv_cache_bytes", (("layer", str(layer)), ("layer_type", name)))] == stored(layer, 19, 1) * PER_TOKEN
    assert s[("kvtrace_requests_total", (("outcome", "ok"),))] == 2
    assert s[("kvtrace_generated_tokens_total", ())] == 24
    assert s[("kvtrace_steps_total", (("phase", "decode"),))] == 22
    assert s[("kvtrace_gpu_memory_used_bytes", (("device", "0"),))] == int(nvml["used_bytes"][-1])
    assert s[("kvtrace_dropped_samples_total", ())] == 5
    assert s[("kvtrace_recorder_errors_total", ())] == 1
    res = CliRunner().invoke(cli, ["export", "prometheus-textfile", str(path), "-o", str(tmp_path / "c.prom"),
                                   "--json"], catch_exceptions=False)
    assert res.exit_code == 0 and '"series"' in res.output
    assert parse((tmp_path / "c.prom").read_text()) == s  # same trace, same state (timestamps included)


def test_parse_address():
    assert parse_address("0.0.0.0:9464") == ("0.0.0.0", 9464)
    assert parse_address(":9000") == ("127.0.0.1", 9000)
    assert parse_address("9100") == ("127.0.0.1", 9100)
    assert parse_address("[::1]:9464") == ("::1", 9464)
    for bad in ("host:port", "1.2.3.4:70000", ""):
        with pytest.raises(ValueError):
            parse_address(bad)
    with pytest.raises(ValueError):
        PrometheusExporter(None, None)
