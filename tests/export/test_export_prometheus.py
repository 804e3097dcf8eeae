"""Prometheus exporter: the real HTTP endpoint scraped over loopback, the textfile mode, and the
replay of a finished trace. Exposition text is checked with prometheus_client's parser when it
is installed (an independent implementation of the format), else with a strict line grammar."""

from __future__ import annotations

import re
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from click.testing import CliRunner

from kvtrace.cli import cli
from kvtrace.export.prometheus import (
    METRICS,
    OUTCOMES,
    RSS,
    STAMP,
    PrometheusExporter,
    check_linger,
    exporter_from_trace,
    parse_address,
)
from kvtrace.format import Outcome, Trace
from tests.helpers.synth_trace import PER_TOKEN, stored, write_synthetic_trace

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
    exp = PrometheusExporter("127.0.0.1", 0, linger_s=0).start()
    try:
        assert exp.port and exp.url == f"http://127.0.0.1:{exp.port}/metrics"
        first = parse(scrape(exp.url))
        # nothing measured yet: no memory, KV-per-layer or RSS gauges invented
        assert not any(k[0].startswith(("kvtrace_gpu", "kvtrace_kv_cache_bytes", "kvtrace_allocator",
                                        "kvtrace_process")) for k in first)
        # every counter with known label values is there at 0 from the first scrape, so that
        # increase()/rate() see the first event of each outcome; idle gauges at their idle value
        assert {dict(k[1])["outcome"]: v for k, v in first.items() if k[0] == "kvtrace_requests_total"} == \
            dict.fromkeys(OUTCOMES, 0)
        assert {dict(k[1])["phase"]: v for k, v in first.items() if k[0] == "kvtrace_steps_total"} == \
            {"prefill": 0, "decode": 0}
        for name in ("kvtrace_dropped_samples_total", "kvtrace_recorder_errors_total",
                     "kvtrace_generated_tokens_total", "kvtrace_requests_in_flight", "kvtrace_kv_cache_tokens"):
            assert first[(name, ())] == 0, name
        assert abs(first[(STAMP, ())] - time.time()) < 60
        assert not any(k[0].endswith("_created") for k in first)  # no per-series creation times
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
        # no request in flight: the request-scoped gauges are back at 0 (their series stay)
        assert end[("kvtrace_kv_cache_bytes", (("layer", "0"), ("layer_type", "sliding")))] == 0
        assert end[("kvtrace_kv_cache_bytes", (("layer", "1"), ("layer_type", "full")))] == 0
        assert end[("kvtrace_kv_cache_tokens", ())] == 0
        assert end[("kvtrace_gpu_memory_used_bytes", (("device", "0"),))] == 10 * 1024**3  # not request-scoped
        exp.on_kv(0, "sliding", 999)  # a late read of a finished request's cache: the idle state stands
        exp.on_step("decode", tokens_seen=99)
        late = parse(scrape(exp.url))
        assert late[("kvtrace_kv_cache_bytes", (("layer", "0"), ("layer_type", "sliding")))] == 0
        assert late[("kvtrace_kv_cache_tokens", ())] == 0
        assert late[("kvtrace_steps_total", (("phase", "decode"),))] == 1
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
    exp = PrometheusExporter("127.0.0.1", 0, linger_s=0).start()
    exp.on_request_start(0)
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
    exp.set_rss_source(lambda: 5 << 20)
    exp.on_request_start(0)
    exp.on_kv(3, "full", 1000)
    exp.on_request_end("ok", new_tokens=5)  # request end always writes the file
    samples = parse(path.read_text())
    assert samples[("kvtrace_kv_cache_bytes", (("layer", "3"), ("layer_type", "full")))] == 0  # idle
    assert samples[("kvtrace_requests_total", (("outcome", "ok"),))] == 1
    assert samples[(RSS, ())] == 5 << 20
    exp.on_request_start(1)
    exp.on_kv(3, "full", 2000)
    exp.close()  # close writes the final state (here: closed with a request still in flight)
    final = parse(path.read_text())
    assert final[("kvtrace_kv_cache_bytes", (("layer", "3"), ("layer_type", "full")))] == 2000
    assert final[("kvtrace_requests_in_flight", ())] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["kvtrace.prom"]  # no temp files left behind


def test_replay_of_a_trace(tmp_path):
    path = write_synthetic_trace(tmp_path / "t.kvt.h5", requests=2, dropped_samples=5, recorder_error="x")
    with Trace(path) as t:
        exp = exporter_from_trace(t, tmp_path / "out.prom")
        nvml = t.nvml[:]
    exp.write_textfile()
    s = parse((tmp_path / "out.prom").read_text())
    for layer in range(4):  # every request finished: each layer's series is there, at its idle 0
        name = "sliding" if layer % 2 == 0 else "full"
        assert s[("kvtrace_kv_cache_bytes", (("layer", str(layer)), ("layer_type", name)))] == 0
    assert s[("kvtrace_requests_in_flight", ())] == 0 and s[("kvtrace_kv_cache_tokens", ())] == 0
    assert s[("kvtrace_requests_total", (("outcome", "oom"),))] == 0  # exported at 0, as live
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


class _LastRequestRunning:
    """A trace seen as if the recorder had stopped during its last request (outcome RUNNING)."""

    def __init__(self, trace: Trace) -> None:
        self._trace = trace

    def __getattr__(self, name: str):
        return getattr(self._trace, name)

    @property
    def requests(self):
        rows = self._trace.requests[:].copy()
        rows["outcome"][-1] = int(Outcome.RUNNING)
        return rows  # read as the table is: requests[:]


def test_replay_of_a_trace_that_ended_mid_request(tmp_path):
    path = write_synthetic_trace(tmp_path / "t.kvt.h5", requests=2)
    with Trace(path) as t:
        s = parse(exporter_from_trace(_LastRequestRunning(t), tmp_path / "out.prom").render())
        last_seen = int(t.steps[:]["tokens_seen"][-1])
    assert s[("kvtrace_requests_in_flight", ())] == 1
    assert s[("kvtrace_requests_total", (("outcome", "ok"),))] == 1
    for layer in range(4):  # the request in flight holds its last recorded step's KV
        name = "sliding" if layer % 2 == 0 else "full"
        assert s[("kvtrace_kv_cache_bytes", (("layer", str(layer)), ("layer_type", name)))] == \
            stored(layer, 19, 1) * PER_TOKEN > 0
    assert s[("kvtrace_kv_cache_tokens", ())] == last_seen > 0


def _refused(url: str, within_s: float) -> bool:
    """True once connecting to `url` is refused (polled, the server stops from another thread)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1).read()
        except OSError:  # refused, or reset by a server stopping mid-answer
            return True
        time.sleep(0.05)
    return False


def test_final_state_lingers_until_the_scraper_has_it():
    exp = PrometheusExporter("127.0.0.1", 0, linger_s=30).start()
    url = exp.url
    rss = [7 << 20]
    exp.set_rss_source(lambda: rss[0])  # read at scrape time while recording
    exp.on_request_start(0)
    exp.on_kv(0, "full", 4096)
    during = parse(scrape(url))  # this client is now a known scraper
    assert during[("kvtrace_kv_cache_bytes", (("layer", "0"), ("layer_type", "full")))] == 4096
    exp.on_request_end("ok", new_tokens=3)
    t0 = time.monotonic()
    exp.close()
    assert time.monotonic() - t0 < 1  # close never blocks the caller
    assert exp.serving
    rss[0] = 1  # after close RSS is frozen at the reading taken at close
    final = parse(scrape(url))
    assert final[("kvtrace_requests_in_flight", ())] == 0
    assert final[("kvtrace_requests_total", (("outcome", "ok"),))] == 1
    assert final[("kvtrace_kv_cache_bytes", (("layer", "0"), ("layer_type", "full")))] == 0
    assert final[(RSS, ())] == 7 << 20
    assert final[(STAMP, ())] >= during[(STAMP, ())]
    # the only scraper has the final state: the endpoint stops well before the 30 s linger
    assert _refused(url, within_s=5)
    assert not exp.serving


def test_linger_without_scrapers_ends_at_its_deadline():
    exp = PrometheusExporter("127.0.0.1", 0, linger_s=0.6).start()
    url = exp.url
    exp.close()
    time.sleep(0.2)
    assert exp.serving  # nobody scraped yet: still up for a first scrape
    assert _refused(url, within_s=5)  # ...but only for the linger; this probe's own scrape ends it too


def test_linger_zero_stops_at_close():
    exp = PrometheusExporter("127.0.0.1", 0, linger_s=0).start()
    url = exp.url
    scrape(url)
    exp.close()
    assert not exp.serving
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=2)


def test_next_recording_takes_over_a_lingering_endpoint():
    first = PrometheusExporter("127.0.0.1", 0, linger_s=30).start()
    port = first.port
    scrape(first.url)
    first.close()
    assert first.serving
    second = PrometheusExporter("127.0.0.1", port, linger_s=0).start()  # same address: no "in use"
    try:
        assert not first.serving and second.port == port
        assert parse(scrape(second.url))[("kvtrace_requests_total", (("outcome", "ok"),))] == 0
    finally:
        second.close()


def test_linger_value_is_checked():
    assert check_linger(0) == 0 and check_linger("2.5") == 2.5
    for bad in (-1, float("nan"), float("inf"), "soon", None, True):
        with pytest.raises(ValueError, match="linger"):
            check_linger(bad)
    with pytest.raises(ValueError, match="linger"):
        PrometheusExporter("127.0.0.1", 0, linger_s=-1)


EXIT_SCRIPT = """
import atexit, sys, threading, time, urllib.request
from kvtrace.export.prometheus import PrometheusExporter
atexit.register(lambda: print("exit", time.monotonic(), flush=True))  # runs after the exporter's wait
exp = PrometheusExporter("127.0.0.1", 0, linger_s=20).start()
url = exp.url
if sys.argv[1] == "watched":
    urllib.request.urlopen(url).read()  # a scraper that the exit will wait for
    def late_scrape():
        time.sleep(1.0)
        urllib.request.urlopen(url).read()
    threading.Thread(target=late_scrape, daemon=True).start()
exp.close()
print("closed", time.monotonic(), flush=True)
"""


@pytest.mark.parametrize("mode", ["watched", "unwatched"])
def test_process_exit_waits_only_for_a_known_scraper(mode):
    """At interpreter exit: a scraper seen during recording gets the final state before the process
    ends (here its next scrape, 1 s later); a process nobody scraped exits at once."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, mode], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    marks = dict(line.split() for line in res.stdout.splitlines())
    waited = float(marks["exit"]) - float(marks["closed"])
    if mode == "watched":
        assert 0.9 < waited < 10, waited
        assert "until scraped" in res.stderr
    else:
        assert waited < 0.5, waited
        assert res.stderr == ""


def test_promtool_accepts_the_exposition(tmp_path):
    """promtool (Prometheus' own linter, Debian package 'prometheus') on a busy exposition."""
    import shutil
    import subprocess

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package 'prometheus'; .ci/run installs it best effort)")
    exp = PrometheusExporter(None, None, textfile=tmp_path / "k.prom")
    exp.set_rss_source(lambda: 1 << 20)
    exp.on_request_start(0)
    exp.on_step("prefill", tokens_seen=5)
    exp.on_kv(0, "sliding", 10)
    exp.on_memory(0, 1, total_bytes=2, reserved_bytes=3, allocated_bytes=4, inactive_split_bytes=5,
                  num_alloc_retries=6, num_ooms=0)
    exp.on_request_end("oom")
    res = subprocess.run([promtool, "check", "metrics"], input=exp.render(), capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr


def test_missing_client_is_a_clear_error(tmp_path, monkeypatch, capsys):
    """Without prometheus_client: the API raises ImportError naming the install; the CLI exits 69
    with one line, before any model is loaded; a bad --prometheus-linger is a usage error (64)."""
    from kvtrace import exitcodes
    from kvtrace.cli import main

    def run(argv: list[str]) -> tuple[int, str]:
        with pytest.raises(SystemExit) as info:
            main(argv)
        return int(info.value.code or 0), capsys.readouterr().err

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import raises ImportError
    with pytest.raises(ImportError, match=r"kvtrace\[record\]"):
        PrometheusExporter(None, None, textfile=tmp_path / "k.prom")
    args = ["record", "--model", "preset:llama-3.1-8b", "--tiny", "--prompt", "x", "--max-new-tokens", "2",
            "-o", str(tmp_path / "x.kvt.h5")]
    code, err = run([*args, "--prometheus-textfile", str(tmp_path / "k.prom")])
    assert code == exitcodes.UNAVAILABLE, err
    assert "prometheus_client" in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "x.kvt.h5").exists()
    trace = write_synthetic_trace(tmp_path / "t.kvt.h5", requests=1)
    code, err = run(["export", "prometheus-textfile", str(trace), "-o", str(tmp_path / "t.prom")])
    assert code == exitcodes.UNAVAILABLE and "prometheus_client" in err and err.count("\n") == 1, err
    monkeypatch.delitem(sys.modules, "prometheus_client")
    code, err = run([*args, "--prometheus", "127.0.0.1:0", "--prometheus-linger", "-1"])
    assert code == exitcodes.USAGE and "--prometheus-linger" in err


def test_cli_linger_reaches_the_recording(tmp_path, capsys):
    """`kvtrace record --prometheus-linger S` is the recording's linger (stored with its settings)."""
    pytest.importorskip("torch")
    from kvtrace.cli import main

    out = tmp_path / "r.kvt.h5"
    with pytest.raises(SystemExit) as info:
        main(["record", "--model", "preset:llama-3.1-8b", "--layers", "1", "--width", "0.05", "--vocab", "64",
              "--prompt", "x", "--max-new-tokens", "2", "--prometheus", "127.0.0.1:0",
              "--prometheus-linger", "0.25", "-q", "-o", str(out)])
        raise SystemExit(0)  # main() returns on success
    assert info.value.code in (0, None), capsys.readouterr().err
    with Trace(out) as t:
        assert t.meta.recorder_settings["prometheus_linger_s"] == 0.25
