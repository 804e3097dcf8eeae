"""The live endpoint of `kvtrace.record(..., prometheus="HOST:PORT")`, scraped over loopback while
generate is paused mid-request (a stopping criterion holds it at a known step), then after it."""

from __future__ import annotations

import dataclasses
import threading
import time
import urllib.request

import pytest

from tests.helpers.net import free_port

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_export_prometheus import parse  # noqa: E402

import kvtrace  # noqa: E402
from kvtrace.format import Trace  # noqa: E402
from kvtrace.recorder import RecordOptions  # noqa: E402
from tests.helpers.models import tiny_model  # noqa: E402

pytestmark = pytest.mark.skipif(
    "prometheus" not in {f.name for f in dataclasses.fields(RecordOptions)},
    reason="kvtrace.record has no prometheus option yet (the recorder wires PrometheusExporter in)",
)
PAUSE_AT = 6  # generated tokens before the mid-request scrape
NEW = 12



class Pause(transformers.StoppingCriteria):
    """Blocks generate once, at PAUSE_AT new tokens, until the test has scraped."""

    def __init__(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len
        self.reached = threading.Event()
        self.resume = threading.Event()

    def __call__(self, input_ids, scores, **kwargs):
        if input_ids.shape[-1] - self.prompt_len == PAUSE_AT and not self.reached.is_set():
            self.reached.set()
            self.resume.wait(timeout=30)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return parse(resp.read().decode())


def test_scrape_while_recording(tmp_path):
    model = tiny_model("gpt_oss")
    ids = torch.randint(3, 200, (1, 5), generator=torch.Generator().manual_seed(0))
    port = free_port()
    pause = Pause(ids.shape[-1])
    errors: list[BaseException] = []
    path = tmp_path / "live.kvt.h5"
    with kvtrace.record(model, path, prometheus=f"127.0.0.1:{port}"):
        def gen() -> None:
            try:
                model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                               stopping_criteria=transformers.StoppingCriteriaList([pause]))
            except BaseException as exc:  # noqa: BLE001 - surfaced below
                errors.append(exc)
                pause.reached.set()

        worker = threading.Thread(target=gen)
        worker.start()
        assert pause.reached.wait(timeout=60)
        try:
            mid = scrape(port)
        finally:
            pause.resume.set()
            worker.join(timeout=60)
        assert not errors, errors
        after = scrape(port)

    kv_mid = {dict(k[1])["layer"]: v for k, v in mid.items() if k[0] == "kvtrace_kv_cache_bytes"}
    with Trace(path) as t:
        n_layers = t.nrows("layers")
        kv = t.kv[:]
        cuda = t.meta.source_available("nvml")
    assert len(kv_mid) == n_layers and all(v > 0 for v in kv_mid.values())
    assert mid[("kvtrace_requests_in_flight", ())] == 1
    # while paused, the gauges hold the bytes of a step the trace also recorded
    steps_match = [s for s in set(kv["step"].tolist())
                   if all(int(kv[(kv["step"] == s) & (kv["layer"] == int(layer))]["bytes_unique"][0]) == v
                          for layer, v in kv_mid.items())]
    assert steps_match, "mid-request KV gauges match no recorded step"
    assert after[("kvtrace_requests_total", (("outcome", "ok"),))] == 1
    assert after[("kvtrace_requests_in_flight", ())] == 0
    assert after[("kvtrace_generated_tokens_total", ())] == NEW
    if not cuda:  # no NVML on this machine: the endpoint must not invent GPU numbers
        assert not any(k[0].startswith("kvtrace_gpu_memory") for k in after)
    # after the recording closes the endpoint lingers (default 30 s) with the final state, idle...
    final = scrape(port)
    assert {dict(k[1])["layer"]: v for k, v in final.items() if k[0] == "kvtrace_kv_cache_bytes"} == \
        dict.fromkeys(kv_mid, 0)
    assert final[("kvtrace_kv_cache_tokens", ())] == 0 and final[("kvtrace_requests_in_flight", ())] == 0
    assert final[("kvtrace_generated_tokens_total", ())] == NEW
    assert final[("kvtrace_last_update_timestamp_seconds", ())] >= after[("kvtrace_last_update_timestamp_seconds", ())]
    # ...until its only scraper (this test) has fetched that state: then it stops, well before 30 s
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            scrape(port)
        except OSError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the endpoint still serves 5 s after its only scraper fetched the final state")
