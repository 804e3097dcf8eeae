"""kvtrace loadtest / serve without a server: URL and option errors, an unreachable server, the
phase plan, the pool-capacity rule, per-phase verdicts on planted numbers, and the trace's phase
windows (PHASE events and the NOTE fallback, NVML and allocator readings per window)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("httpx", reason="the serving packages (kvtrace[serve]) are not installed")

from kvtrace import exitcodes  # noqa: E402
from kvtrace.format import schema  # noqa: E402
from kvtrace.format.schema import EventKind  # noqa: E402
from kvtrace.format.tables import Table  # noqa: E402
from kvtrace.serving.client import RequestResult, percentile  # noqa: E402
from kvtrace.serving.drive import PhaseRun  # noqa: E402
from kvtrace.serving.phases import Phase, build_phases, prompt  # noqa: E402
from kvtrace.serving.tracefacts import DeviceFacts, Group, PhaseFacts, capacity, phase_facts  # noqa: E402
from kvtrace.serving.verdict import judge  # noqa: E402
from tests.helpers.cli_run import run_main  # noqa: E402
from tests.helpers.net import free_port  # noqa: E402

GiB = 1024**3


def test_bad_url_is_a_usage_error(capsys):
    code, _, err = run_main(["loadtest", "ftp://example.org"], capsys)
    assert code == exitcodes.USAGE and "not an http(s) URL" in err and err.count("\n") == 1


def test_unknown_phase_is_a_usage_error(capsys):
    code, _, err = run_main(["loadtest", "http://127.0.0.1:1", "--phases", "single,warmup"], capsys)
    assert code == exitcodes.USAGE and "unknown phase(s) warmup" in err


def test_server_down_is_one_line_and_exit_69(capsys):
    port = free_port()  # nothing listens there
    code, out, err = run_main(["loadtest", f"http://127.0.0.1:{port}", "--phases", "single"], capsys)
    assert code == exitcodes.UNAVAILABLE
    assert err.startswith(f"kvtrace: cannot load-test http://127.0.0.1:{port}: ") and err.count("\n") == 1
    assert out == f"loadtest http://127.0.0.1:{port}: single; checking /health, then 1 warm-up request(s)\n"


def test_serve_refuses_unknown_presets_and_non_model_directories(tmp_path, capsys):
    code, _, err = run_main(["serve", "preset:no-such-model", "-o", str(tmp_path / "t.kvt.h5")], capsys)
    assert code == exitcodes.USAGE and "unknown preset 'no-such-model'" in err
    code, _, err = run_main(["serve", str(tmp_path), "-o", str(tmp_path / "t.kvt.h5")], capsys)
    assert code == exitcodes.USAGE and "no config.json" in err
    code, _, err = run_main(["serve", str(tmp_path / "absent"), "-o", str(tmp_path / "t.kvt.h5")], capsys)
    assert code == exitcodes.USAGE and "no such model directory" in err
    (tmp_path / "config.json").write_text("{}")
    code, _, err = run_main(["serve", str(tmp_path), "--tiny", "-o", str(tmp_path / "t.kvt.h5")], capsys)
    assert code == exitcodes.USAGE and "only apply to preset:NAME" in err
    assert not (tmp_path / "t.kvt.h5").exists()


def test_word_tokenizer_keeps_the_models_special_ids_and_one_token_per_word():
    pytest.importorskip("tokenizers")
    from kvtrace.serving.wordtok import word_tokenizer

    tok = word_tokenizer(600, bos=500, eos=[501, 7], pad=None)
    assert (tok.bos_token_id, tok.eos_token_id) == (500, 501)
    text = prompt(40, seed=3)
    ids = tok(text)["input_ids"]
    assert len(ids) == 40 and tok.unk_token_id not in ids
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "the of"}], add_generation_prompt=True, tokenize=False)
    assert chat == "user the of assistant "
    with pytest.raises(ValueError, match="too small"):
        word_tokenizer(100)


def test_serve_passes_unknown_options_to_transformers_which_may_refuse_them(tmp_path, capsys):
    pytest.importorskip("fastapi", reason="the serving packages (kvtrace[serve]) are not installed")
    (tmp_path / "config.json").write_text("{}")  # transformers parses its options before any load
    code, _, err = run_main(["serve", str(tmp_path), "-o", str(tmp_path / "t.kvt.h5"), "--port", str(free_port()),
                             "--no-such-serve-option"], capsys)
    assert code == exitcodes.USAGE and "transformers serve: No such option: --no-such-serve-option" in err
    assert not (tmp_path / "t.kvt.h5").exists()


def test_serve_on_a_busy_port_is_unavailable_before_loading(tmp_path, capsys):
    import socket

    (tmp_path / "config.json").write_text("{}")
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        code, _, err = run_main(["serve", str(tmp_path), "-o", str(tmp_path / "t.kvt.h5"), "--port", str(port)],
                                capsys)
    if code == exitcodes.UNAVAILABLE and "needs" in err:
        pytest.skip(err.strip())  # the serving packages are absent: refused before the port check
    assert code == exitcodes.UNAVAILABLE and f"cannot serve on 127.0.0.1:{port}" in err
    assert not (tmp_path / "t.kvt.h5").exists()


def test_phase_plan_keeps_protocol_order_and_prompts_differ_from_the_first_word():
    plan = build_phases(["long", "baseline", "concurrent"], concurrency=4, tokens=32, long_tokens=128, baseline_s=2)
    assert [p.name for p in plan] == ["baseline", "concurrent", "long"]
    assert plan[1] == Phase("concurrent", 4, 4, 32) and plan[2].prompt_tokens == 128 and plan[0].idle_s == 2
    firsts = [prompt(5, seed).split()[0] for seed in range(64)]
    assert len(set(firsts)) == 64  # no shared prefix: prefix caching cannot fold concurrent requests
    assert len(prompt(2048, 3).split()) == 2048


def test_percentile_matches_numpy():
    xs = [0.3, 0.1, 0.7, 0.2, 0.9]
    for q in (0, 50, 95, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) == -1


def test_capacity_counts_whole_blocks_and_the_sliding_window():
    full = Group("full", 64, 16, 4096)
    assert capacity(1024 * 1024, [full], 36) == 1024 * 1024 // (3 * 4096)  # 36 tokens -> 3 blocks of 16
    sliding = Group("sliding", 64, 16, 4096, window=8)
    assert sliding.bytes_for(1000) == 4096  # a window of 8 fits one block whatever the context
    assert capacity(1024 * 1024, [full, sliding], 36) == 1024 * 1024 // (4 * 4096)
    assert capacity(1024 * 1024, [Group("full", -1, -1, -1)], 36) is None


def _run(name: str, *, samples=(), results=(), health=200, prompt_tokens=32) -> PhaseRun:
    run = PhaseRun(Phase(name, len(results), max(len(results), 1), prompt_tokens), 0.0, 1.0)
    run.samples = [{"t_ns": i, "pool": p, "free": f, "running": r, "waiting": w} for i, (p, f, r, w) in enumerate(samples)]
    run.groups = [Group("full", 100, 16, 1000)]  # 100 blocks of 1000 B: pool 100,000 B
    run.results = list(results)
    run.health = health
    return run


def _req(prompt_tokens: int, out: int = 4, status: str = "ok") -> RequestResult:
    return RequestResult("p", 0, status, prompt_tokens, prompt_tokens, out, 0.0, 0.1, 0.01, 0.01, 0.02, 0.2)


def _checks(verdict):
    return {c.name: c for c in verdict.checks}


def test_verdicts_on_planted_numbers():
    pool = 100_000
    runs = [
        _run("single", samples=[(pool, pool - 50_000, 1, 0)], results=[_req(32)]),  # 50 %: ok
        _run("concurrent", samples=[(pool, pool - 85_000, 9, 0)], results=[_req(32)] * 3),  # 85 %: warning
        _run("long", samples=[(pool, pool - 95_000, 1, 3)], results=[_req(128, status="http 503")], health=503),
    ]
    single, concurrent, long = judge(runs, None, max_tokens=4)
    assert single.level == "ok" and _checks(single)["kv_pool_use"].level == "ok"
    c = _checks(concurrent)
    assert c["kv_pool_use"].level == "warning" and "85.0%" in c["kv_pool_use"].value
    assert c["kv_pool_use"].source.startswith("live GET /kvtrace/status")
    # 36 tokens -> 3 blocks of 1000 B per request: 33 fit in 100,000 B; 9 in flight is 27 %: ok
    assert c["concurrency"].level == "ok" and "9 in flight of 33" in c["concurrency"].value
    assert c["device_memory_use"].level == "not measured" and "--trace" in c["device_memory_use"].source
    ch = _checks(long)
    assert ch["kv_pool_use"].level == "critical"
    assert ch["requests"].level == "critical" and "http 503" in ch["requests"].source
    assert ch["health"].level == "critical" and long.level == "critical"
    assert ch["context_spike"].level == "not measured"  # its one request failed: no context to compare


def test_concurrency_and_context_spike_thresholds():
    pool = 100_000
    busy = _run("concurrent", samples=[(pool, 0, 25, 2)], results=[_req(32)] * 2)  # 27 in flight of 33: 82 %
    long = _run("long", samples=[(pool, pool, 1, 0)], results=[_req(100)])
    v_busy, v_long = judge([busy, long], None, max_tokens=4)
    assert _checks(v_busy)["concurrency"].level == "warning"
    # contexts 36, 36, 104: a typical of 36 (the 2nd largest of 3) needs 3 requests at least
    spike = _checks(v_long)["context_spike"]
    assert spike.level == "ok" and spike.value.startswith("spike: max 104 tokens = 2.89x the typical 36")
    assert "within the memory thresholds" in spike.value  # the pool sat empty in the long phase
    # the same spike while the pool is at 95%: a warning, since it also takes memory past the threshold
    full = _run("long", samples=[(pool, 5_000, 1, 0)], results=[_req(100)])
    c = _checks(judge([busy, full], None, max_tokens=4)[1])
    assert c["kv_pool_use"].level == "critical" and c["context_spike"].level == "warning"
    assert "the phase's memory reached critical" in c["context_spike"].value
    # 104 tokens = 7 blocks of 16 tokens x 1000 B: 7,000 B, 7% of the pool
    assert "its blocks hold 6.8 KiB, 7% of the pool" in c["context_spike"].value
    # under 2x: no spike; fewer than three requests: no typical context
    calm = _run("long", results=[_req(60)])
    assert _checks(judge([busy, calm], None, max_tokens=4)[1])["context_spike"].value.startswith("max 64 tokens")
    assert _checks(judge([calm], None, max_tokens=4)[0])["context_spike"].level == "not measured"


def test_kv_released_after_the_phase():
    def after(in_use, cached, running=0):
        run = _run("single", samples=[(1000, 500, 1, 0)], results=[_req(32)])
        run.after = {"t_ns": 9, "pool": 1000, "free": 1000, "running": running, "waiting": 0, "in_use": in_use,
                     "cached": cached}
        return _checks(judge([run], None, max_tokens=4)[0])["kv_released"]

    ok = after(0, 2)
    assert ok.level == "ok" and ok.value == "0 blocks in use, 2 cached for prefix reuse"
    leak = after(3, 0)
    assert leak.level == "warning" and leak.value.startswith("3 block(s) still in use")
    assert after(3, 0, running=1).level == "not measured"  # someone else's request holds them
    plain = _run("single", results=[_req(32)])
    plain.status_unavailable = "the server has no /kvtrace/status (not kvtrace serve)"
    assert _checks(judge([plain], None, max_tokens=4)[0])["kv_released"].level == "not measured"


def test_trace_numbers_win_and_missing_markers_say_so():
    run = _run("single", samples=[(100_000, 100_000, 1, 0)], results=[_req(32)])
    facts = PhaseFacts("single", 0, 10, occupancy_source="trace /sched", pool_bytes=100_000, pool_use_peak=0.92,
                       pool_use_held=0.92, in_flight_peak=1, running_peak=1, waiting_peak=0, groups=run.groups,
                       device=DeviceFacts(50, 100, None, 0.5, 0.5, 3, "no paged-cache pool recorded"),
                       fragmentation_peak=3 * GiB)
    c = _checks(judge([run], [facts], max_tokens=4)[0])
    assert c["kv_pool_use"].level == "critical" and c["kv_pool_use"].source.startswith("trace /sched")
    assert c["device_memory_use"].level == "ok" and c["fragmentation"].level == "warning"
    other = _checks(judge([run], [], max_tokens=4)[0])  # a trace without this phase's marker
    assert "no marker for this phase" in other["fragmentation"].source


class FakeTrace:
    """The reader's tables phase_facts reads (real Table objects over in-memory rows of the real
    dtypes)."""

    events = property(lambda self: Table(self, "events"))
    nvml = property(lambda self: Table(self, "telemetry/nvml"))
    allocator = property(lambda self: Table(self, "telemetry/allocator"))
    sched = property(lambda self: Table(self, "sched"))
    sched_groups = property(lambda self: Table(self, "sched_groups"))

    def __init__(self, events: list[tuple[int, int, str]], nvml=(), alloc=()):
        self.texts: list[str] = []
        ev = np.zeros(len(events), schema.EVENTS)
        for i, (kind, t, text) in enumerate(events):
            ev[i]["kind"], ev[i]["t_ns"] = kind, t
            ev[i]["text_off"], ev[i]["text_len"] = len(self.texts), 1
            self.texts.append(text)
        self.ev = ev
        self.nv = np.zeros(len(nvml), schema.NVML)
        for i, (t, used, total) in enumerate(nvml):
            self.nv[i]["t_ns"], self.nv[i]["used_bytes"], self.nv[i]["total_bytes"] = t, used, total
        self.al = np.zeros(len(alloc), schema.ALLOCATOR)
        for i, (t, allocated, reserved) in enumerate(alloc):
            self.al[i]["t_ns"], self.al[i]["allocated_bytes"], self.al[i]["reserved_bytes"] = t, allocated, reserved
        self.rows = {"events": self.ev, "telemetry/nvml": self.nv, "telemetry/allocator": self.al}

    def text(self, off, length):
        return self.texts[off]

    def has(self, name):
        return False

    def nrows(self, table):
        return len(self.rows[table])

    def table(self, name, rows=None):
        return self.rows[name] if rows is None else self.rows[name][rows]


def _occ(pool: int, free: int, running: int, waiting: int) -> str:
    return "paged cache occupancy " + json.dumps({
        "pool_bytes": pool, "free_bytes": free, "running": running, "waiting": waiting,
        "allocators": {"full_attention": {"blocks_total": 10, "tokens_per_block": 16, "bytes_per_block": 100}}})


def test_phase_windows_from_note_markers_and_occupancy_notes():
    note = int(EventKind.NOTE)
    t = FakeTrace([(note, 100, "phase: single"), (note, 150, _occ(1000, 400, 1, 0)),
                   (note, 200, "phase: concurrent"), (note, 250, _occ(1000, 100, 3, 2)),
                   (note, 260, _occ(1000, 700, 1, 0)), (note, 300, "phase: end")],
                  nvml=[(120, 10, 100), (210, 85, 100), (400, 99, 100)],  # the last one is after "end"
                  alloc=[(120, 1, 2), (230, 1, 3 * GiB)])
    single, concurrent = phase_facts(t)
    assert (single.name, single.t_start, single.t_end) == ("single", 100, 200)
    assert single.pool_use_peak == pytest.approx(0.6) and single.in_flight_peak == 1
    # device: 10 used at t=120, before the pool's first sample (t=150): no pool yet, nothing subtracted,
    # and it says so; the reading at 210 has the room at t=150 (400 free) subtracted
    assert single.device.outside_peak == pytest.approx(0.10) and single.device.room_bytes is None
    assert "no reading after the pool's first recorded step" in single.device.why_raw
    assert single.fragmentation_peak == 1
    assert concurrent.pool_use_peak == pytest.approx(0.9) and concurrent.in_flight_peak == 5
    assert concurrent.pool_use_held == pytest.approx(0.3)  # 90% at one sample, 30% at the other
    assert concurrent.waiting_peak == 2 and concurrent.occupancy_source == "trace occupancy NOTE events"
    assert concurrent.device.used_bytes == 85 and concurrent.device.room_bytes == 400
    assert concurrent.device.outside_peak == pytest.approx(0.0)  # 85 in use, 400 of free pool room: none outside
    assert concurrent.fragmentation_peak == 3 * GiB - 1
    assert concurrent.groups == [Group("full", 10, 16, 100)]


def test_phase_without_occupancy_or_telemetry_says_why():
    t = FakeTrace([(int(EventKind.NOTE), 100, "phase: baseline")])
    (baseline,) = phase_facts(t)
    assert baseline.pool_use_peak is None and "no paged-cache occupancy" in baseline.absent["paged_cache"]
    assert "no NVML readings" in baseline.absent["device_memory"]
    assert "no allocator readings" in baseline.absent["fragmentation"]


def _device_phase(pool: int, free: int, used: list[int], total: int = 100 * GiB, nvml: bool = True):
    """One phase 'concurrent' with an occupancy sample before each NVML reading."""
    note = int(EventKind.NOTE)
    events = [(note, 100, "phase: concurrent")]
    events += [(note, 110 + 20 * i, _occ(pool, free, 3, 0)) for i in range(len(used))]
    events += [(note, 900, "phase: end")]
    readings = [(120 + 20 * i, u, total) for i, u in enumerate(used)] if nvml else []
    (facts,) = phase_facts(FakeTrace(events, nvml=readings))
    run = _run("concurrent", results=[_req(32)] * 3)
    return facts, _checks(judge([run], [facts], max_tokens=4)[0])["device_memory_use"]


def test_device_memory_is_judged_outside_the_pools_free_room():
    # the pool reserved 80% of the device up front and 5% of the device is in blocks: 85% in use, by design
    facts, c = _device_phase(80 * GiB, 75 * GiB, [85 * GiB, 85 * GiB])
    assert c.level == "ok", c
    assert facts.device.outside_held == pytest.approx(0.10)
    assert c.value == "device 85% (85.0 GiB of 100.0 GiB), of which the pool's unused room 75.0 GiB: 10% outside it"
    # memory outside the pool at 85% (a small pool, something else holding the device): warning
    facts, c = _device_phase(10 * GiB, 9 * GiB, [94 * GiB, 94 * GiB])
    assert c.level == "warning" and facts.device.outside_held == pytest.approx(0.85)
    assert c.value.endswith("of which the pool's unused room 9.0 GiB: 85% outside it")
    # at 90% outside: critical; one reading at 95% among lower ones is the peak, not what is held
    _, c = _device_phase(10 * GiB, 9 * GiB, [99 * GiB, 100 * GiB])
    assert c.level == "critical"
    _, c = _device_phase(10 * GiB, 4 * GiB, [10 * GiB, 99 * GiB])
    assert c.level == "ok" and c.value.endswith("95% outside it (6% held)")


def test_device_memory_without_nvml_or_pool_says_why():
    _, c = _device_phase(80 * GiB, 75 * GiB, [85 * GiB], nvml=False)
    assert c.level == "not measured" and c.value == ""
    assert c.source == "the trace holds no NVML readings (no GPU, or recorded with --no-nvml)"
    # NVML without any pool sample (not continuous batching): the raw figure, said to be raw
    t = FakeTrace([(int(EventKind.NOTE), 100, "phase: single"), (int(EventKind.NOTE), 900, "phase: end")],
                  nvml=[(200, 85 * GiB, 100 * GiB), (300, 85 * GiB, 100 * GiB)])
    (facts,) = phase_facts(t)
    c = _checks(judge([_run("single", results=[_req(32)])], [facts], max_tokens=4)[0])["device_memory_use"]
    assert c.level == "warning" and "taken whole: no paged-cache pool recorded" in c.value


class SchedTrace(FakeTrace):
    """FakeTrace with /sched and /sched_groups rows (one manager, one full-attention group)."""

    def __init__(self, events, sched_rows, nvml=()):
        super().__init__(events, nvml=nvml)
        self.s = np.zeros(len(sched_rows), schema.SCHED)
        self.g = np.zeros(len(sched_rows), schema.SCHED_GROUPS)
        for i, (t, pool, free, cached_blocks) in enumerate(sched_rows):
            self.s[i]["t_ns"], self.s[i]["step"], self.s[i]["running"] = t, i, 1
            self.s[i]["pool_bytes"], self.s[i]["free_bytes"] = pool, free
            self.g[i]["step"], self.g[i]["layer_type"], self.g[i]["window"] = i, int(schema.LayerType.FULL), -1
            self.g[i]["tokens_per_block"], self.g[i]["bytes_per_block"] = 16, GiB
            self.g[i]["blocks_total"], self.g[i]["blocks_cached"] = pool // GiB, cached_blocks
        self.rows.update(sched=self.s, sched_groups=self.g)

    def has(self, name):
        return name in ("sched", "sched_groups")


def test_trace_sched_rows_give_the_pool_room_and_cached_blocks_count_as_free():
    """The /sched path (format 1.4): pool use with evictable cached blocks free, device memory less the
    room (free + cached) at the last step before each reading, through the detector's functions."""
    note = int(EventKind.NOTE)
    # pool 80 GiB: 40 GiB free and 30 cached blocks of 1 GiB: 10 GiB (12.5%) in use, not 50%
    rows = [(150, 80 * GiB, 40 * GiB, 30), (170, 80 * GiB, 40 * GiB, 30)]
    t = SchedTrace([(note, 100, "phase: concurrent"), (note, 900, "phase: end")], rows,
                   nvml=[(160, 90 * GiB, 100 * GiB), (180, 90 * GiB, 100 * GiB)])
    (facts,) = phase_facts(t)
    assert facts.occupancy_source == "trace /sched"
    assert facts.pool_use_held == pytest.approx(0.125)
    # 90 GiB in use, 70 GiB of it the pool's room: 20% outside
    assert facts.device.room_bytes == 70 * GiB and facts.device.outside_held == pytest.approx(0.20)
    c = _checks(judge([_run("concurrent", results=[_req(32)] * 3)], [facts], max_tokens=4)[0])
    assert c["kv_pool_use"].level == "ok" and c["device_memory_use"].level == "ok"


def test_the_probe_phase_is_the_one_the_detector_knows():
    """kvtrace analyze's context_spike reports a spike admitted in the long phase as the load test's
    probe: the two name the same phase (the analyser imports nothing from kvtrace.serving)."""
    from kvtrace.analyzer.detectors.context_spike import PROBE_PHASES
    from kvtrace.serving.phases import LONG_PROBE, PHASES

    assert PROBE_PHASES == (LONG_PROBE,) and LONG_PROBE in PHASES
    plan = build_phases(list(PHASES), concurrency=2, tokens=4, long_tokens=64, baseline_s=0)
    assert [p.name for p in plan if p.prompt_tokens == 64] == [LONG_PROBE]
