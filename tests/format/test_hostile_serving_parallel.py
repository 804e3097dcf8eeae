"""Hostile and damaged traces of format 1.4 through every consumer.

The parts 1.4 added (``/meta parallel_json``, ``/sched``, ``/sched_groups``, ``/blocks``, event kinds
16-22) are damaged one at a time in traces written by the real TraceWriter (serving_parallel_traces.py),
and every command reads the result through the CLI: validate, info (text and JSON), analyze (text
and JSON), report, export perfetto / prometheus-textfile / parquet, fleet summary, calc --trace,
diff both ways against the clean trace, whatif; rank traces also as a run (info, analyze, calc and
report over both ranks). Each case asserts:

- validate names the planted damage and exits 1 (4 for a newer major);
- every command that reads the damaged part refuses with the same code, one stderr line, no
  traceback, never 70 (the policy, spec §9.1: damage found where a command reads it refuses the
  trace; a command that does not read that part, e.g. calc of a damaged /sched, may succeed);
- no input changes and a refusing command leaves no output file;
- the control (the same trace undamaged) is valid and every command exits 0 on it.

Commands run in-process (tests/helpers/cli_run.py, like ``python -m kvtrace.cli``); a sample runs as real
subprocesses.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import serving_parallel_traces as H
from hypothesis import HealthCheck, given, settings
from hypothesis import event as note_case
from hypothesis import strategies as st

from kvtrace import exitcodes
from kvtrace.format import Trace, schema
from tests.helpers.cli_run import run_main

# A numpy warning would print lines of its own on stderr in a real process: here it fails the test (exit 70).
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("clean14")
    return {"serving": H.serving_trace(d / "serving.kvt.h5"), "rank0": H.rank_trace(d / "run.rank0.kvt.h5", 0),
            "rank1": H.rank_trace(d / "run.rank1.kvt.h5", 1), "device_map": H.device_map_trace(d / "dm.kvt.h5")}


def commands(trace: Path, base: Path, out: Path, other: Path | None) -> dict[str, list[str]]:
    """Every consumer of a trace, as its command line: name -> argv."""
    t, b = str(trace), str(base)
    cmds = {
        "validate": ["validate", t], "info": ["info", t], "info --json": ["info", "--json", t],
        "analyze": ["analyze", t], "analyze --json": ["analyze", "--json", t],
        "report": ["report", t, "-o", str(out / "report.html"), "-q"],
        "export perfetto": ["export", "perfetto", t, "-o", str(out / "trace.json")],
        "export prometheus-textfile": ["export", "prometheus-textfile", t, "-o", str(out / "kvtrace.prom")],
        "export parquet": ["export", "parquet", t, "-o", str(out / "fleet"), "-q"],
        "calc --trace": ["calc", "--trace", t, "--context", "32k", "--gpu-memory", "80GiB"],
        "diff": ["diff", b, t], "diff --json (reversed)": ["diff", "--json", t, b],
        "whatif": ["whatif", t],
    }
    if other is not None:  # a rank trace: the run of both ranks too
        o = str(other)
        cmds |= {"info ranks": ["info", t, o], "analyze ranks": ["analyze", t, o],
                 "calc --trace ranks": ["calc", "--trace", t, "--trace", o, "--context", "32k", "--gpu-memory", "80GiB"],
                 "report ranks": ["report", t, o, "-o", str(out / "run.html"), "-q"]}
    return cmds


OUTPUTS = {"report": "report.html", "export perfetto": "trace.json", "export prometheus-textfile": "kvtrace.prom",
           "export parquet": "fleet/traces.parquet", "report ranks": "run.html"}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_every_consumer(trace: Path, base: Path, out: Path, capsys: pytest.CaptureFixture[str],
                       other: Path | None = None) -> dict[str, tuple[int, str, str]]:
    """(exit code, stdout, stderr) of every command; inputs checked unchanged afterwards."""
    out.mkdir(parents=True, exist_ok=True)
    inputs = [p for p in (trace, base, other) if p is not None]
    before = {p: digest(p) for p in inputs}
    results = {name: run_main(argv, capsys) for name, argv in commands(trace, base, out, other).items()}
    if results["export parquet"][0] == 0:
        results["fleet summary"] = run_main(["fleet", "summary", str(out / "fleet")], capsys)
    assert {p: digest(p) for p in inputs} == before, "a command changed its input"
    return results


def assert_refusal(name: str, result: tuple[int, str, str], code: int, trace: Path) -> None:
    """The code, and one stderr line about `trace` (a command over several traces, e.g. analyze of
    both ranks, says one line per trace: the damaged one refused, a note about the other)."""
    rc, out, err = result
    assert rc == code, (name, rc, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert all(ln.startswith("kvtrace: ") for ln in lines), (name, err)
    assert len(lines) == 1 or ("ranks" in name and sum(str(trace) in ln for ln in lines) == 1), (name, err)
    assert "Traceback" not in err + out and "internal error" not in err, (name, err)


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTRACE_DEBUG", raising=False)  # tracebacks only on request: never here
    monkeypatch.setenv("COLUMNS", "200")


def check_case(clean: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], source: str,
               damage: H.Damage, problem: str, *, code: int = exitcodes.INVALID,
               may_succeed: tuple[str, ...] = ()) -> dict[str, tuple[int, str, str]]:
    """Damage the `source` clean trace, run every consumer, and assert the policy of the module
    docstring. `may_succeed`: commands that do not read the damaged part (exit 0 or the refusal)."""
    base = clean[source]
    trace = H.damaged(base, tmp_path / f"damaged-{source}.kvt.h5", damage)
    other = clean["rank1"] if source == "rank0" else None
    results = run_every_consumer(trace, base, tmp_path / "out", capsys, other)
    rc, out, err = results["validate"]
    assert rc == code and problem in out + err, (rc, out, err)
    assert "Traceback" not in out + err
    for name, result in results.items():
        if name == "validate":
            continue
        if name in may_succeed and result[0] == 0:
            continue
        assert_refusal(name, result, code, trace)
    for name, output in OUTPUTS.items():
        if name in results and results[name][0] != 0:
            assert not (tmp_path / "out" / output).exists(), f"{name} refused but wrote {output}"
    return results


# ---- the controls ------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["serving", "rank0", "device_map"])
def test_clean_control_passes_every_consumer(clean, tmp_path, capsys, source):
    base = clean[source]
    other = clean["rank1"] if source == "rank0" else None
    results = run_every_consumer(base, base, tmp_path / "out", capsys, other)
    for name, (rc, out, err) in results.items():
        assert rc == 0, (name, rc, err)
        assert "Traceback" not in out + err and "warning" not in err.lower(), (name, err)
    assert "valid kvtrace trace (format 1.5)" in results["validate"][1]
    for name in ("report", "export perfetto", "export prometheus-textfile", "export parquet"):
        assert (tmp_path / "out" / OUTPUTS[name]).stat().st_size > 0
    if source == "serving":  # the control is a serving trace every serving consumer reads
        assert "serving    8 scheduler steps" in results["info"][1]
        assert "kvtrace_serving" in (tmp_path / "out" / "kvtrace.prom").read_text()
    if source == "rank0":
        assert "tensor parallel: rank 0 of 2" in results["info"][1]
        assert "run 00000000-hostile-14  tensor parallel, world size 2, ranks 0, 1" in results["info ranks"][1]


# ---- /meta parallel_json (spec §3.1) -------------------------------------------------------------------

BIG_MAP = {"mode": "device_map", "device_map": {f"m{i}": f"cuda:{i}" for i in range(120_000)}}
PARALLEL = {
    "not JSON": ("rank0", H.set_parallel("{not json"), "parallel_json is not valid JSON"),
    "a JSON list": ("rank0", H.set_parallel([1, 2]), "parallel_json must hold a JSON object (holds list)"),
    "an integer attribute": ("rank0", H.set_meta("parallel_json", np.int64(3)), "must hold a JSON object (holds int)"),
    "no mode": ("rank0", H.set_parallel({"world_size": 2, "rank": 0}), "parallel_json lacks 'mode'"),
    "unknown mode": ("rank0", H.patch_parallel(mode="pipeline"), "mode 'pipeline' is not one of"),
    "negative world_size": ("rank0", H.patch_parallel(world_size=-2), "world_size -2 is not in [1, 65536]"),
    "world_size 0": ("rank0", H.patch_parallel(world_size=0), "world_size 0 is not in"),
    "world_size 10^12": ("rank0", H.patch_parallel(world_size=10**12), "world_size 1000000000000 is not in"),
    "world_size of 31 digits": ("rank0", H.patch_parallel(world_size=10**30), "world_size 100000000000...(31 digits)"),
    "world_size of 5000 digits": ("rank0", H.set_parallel('{"mode": "tensor_parallel", "world_size": ' + "9" * 5000 + "}"),
                                  "number too long to read"),
    "world_size a string": ("rank0", H.patch_parallel(world_size="2"), "world_size must be an integer"),
    "world_size a float": ("rank0", H.patch_parallel(world_size=2.5), "world_size must be an integer"),
    "negative rank": ("rank0", H.patch_parallel(rank=-1), "rank -1 is not in [0, 65536]"),
    "rank = world_size": ("rank0", H.patch_parallel(rank=2), "rank 2 is not below world_size 2"),
    "rank a boolean": ("rank0", H.patch_parallel(rank=True), "rank must be an integer"),
    "kv_heads_local > total": ("rank0", H.patch_parallel(kv_heads_local=8), "kv_heads_local 8 exceeds kv_heads_total 2"),
    "kv_heads_total 0": ("rank0", H.patch_parallel(kv_heads_total=0), "kv_heads_total 0 is not in"),
    "kv_heads_total 10^15": ("rank0", H.patch_parallel(kv_heads_local=1, kv_heads_total=10**15), "kv_heads_total 1000000000000000"),
    "run_id an object": ("rank0", H.patch_parallel(run_id={"a": [1]}), "run_id must be a string"),
    "run_id of 3 MB": ("rank0", H.patch_parallel(run_id="x" * 3_000_000), "run_id must be a string of at most 256"),
    "tp_plan a list": ("rank0", H.patch_parallel(tp_plan=[1, 2]), "tp_plan must be an object of strings"),
    "device_map a list": ("device_map", H.patch_parallel(device_map=[1, 2]), "device_map must be an object of strings"),
    "device_map a string": ("device_map", H.patch_parallel(device_map="cuda:0"), "device_map must be an object"),
    "device_map nested": ("device_map", H.patch_parallel(device_map={"a": {"b": [1]}}), "device_map must be an object"),
    "nested 100,000 deep": ("device_map", H.set_parallel(H.nested(100_000)), "parallel_json is not valid JSON"),
    "over 4 MiB": ("device_map", H.set_parallel('{"mode": "device_map", "x": "' + "y" * (5 << 20) + '"}'),
                   "parallel_json is implausibly large"),
}


@pytest.mark.parametrize("case", list(PARALLEL))
def test_damaged_parallel_json_is_refused_by_every_consumer(clean, tmp_path, capsys, case):
    """parallel_json is /meta: opening checks it (spec §3.1, §9.1), so every command refuses with 1."""
    source, damage, problem = PARALLEL[case]
    results = check_case(clean, tmp_path, capsys, source, damage, problem)
    assert problem in results["info"][2]  # the refusal names the rule, not just "invalid"


def test_device_map_naming_120000_devices_is_valid_and_info_stays_short(clean, tmp_path, capsys):
    """A device map of 120,000 modules on as many devices (under the 4 MiB JSON limit) is a valid
    map; info lists 16 devices and counts the rest instead of printing a 3 MB line."""
    trace = H.damaged(clean["device_map"], tmp_path / "map.kvt.h5", H.set_parallel(BIG_MAP))
    results = run_every_consumer(trace, clean["device_map"], tmp_path / "out", capsys)
    for name, (rc, _, err) in results.items():
        assert rc == 0, (name, err)
    line = next(ln for ln in results["info"][1].split("\nsources")[0].split("parallel   ", 1)[1:])
    assert "and 119984 more devices" in line and len(line) < 1200


def test_a_newer_minor_may_name_a_new_mode(clean, tmp_path, capsys):
    """1.5 may add a mode (a new code): a 1.4 reader reads such a trace and treats it as unknown."""
    trace = H.damaged(clean["device_map"], tmp_path / "v15.kvt.h5",
                      lambda f: (H.version("1.6")(f), H.patch_parallel(mode="pipeline")(f)))
    rc, out, err = run_main(["validate", str(trace)], capsys)
    assert rc == 0, out + err
    rc, out, err = run_main(["info", str(trace)], capsys)
    assert rc == 0 and "parallel   pipeline" in out, err


def test_rank_set_with_missing_ranks_names_at_most_16(clean, tmp_path, capsys):
    """Two ranks of the largest valid world (2^16): every line and page that names the missing ranks
    names 16 and counts the rest (with a world of 2^20 they listed every rank: 8.4 MB from analyze,
    8.3 MB from calc and the report page)."""
    world = 1 << 16
    trace = H.damaged(clean["rank0"], tmp_path / "run.rank0.kvt.h5", H.patch_parallel(world_size=world))
    other = H.damaged(clean["rank1"], tmp_path / "run.rank1.kvt.h5", H.patch_parallel(world_size=world))
    counted = f"2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, ... ({world - 2} in all)"
    rc, out, err = run_main(["info", str(trace), str(other)], capsys)
    assert rc == 0, err
    assert next(ln for ln in out.splitlines() if "MISSING" in ln).endswith(counted)
    rc, out, err = run_main(["analyze", str(trace), str(other)], capsys)
    assert rc == 0 and counted in err and len(err) < 2000 and len(out) < 100_000, (len(err), len(out))
    assert f"rank_balance/missing_ranks ranks [{counted}]" in " ".join(out.split())  # rich folds long lines
    rc, out, err = run_main(["calc", "--trace", str(trace), "--trace", str(other), "--context", "32k",
                             "--gpu-memory", "80GiB"], capsys)
    assert rc == 0 and len(out) < 5000 and f"{counted} not given" in out, len(out)
    rc, out, err = run_main(["report", str(trace), str(other), "-o", str(tmp_path / "run.html"), "-q"], capsys)
    assert rc == 0 and (tmp_path / "run.html").stat().st_size < 100_000, err
    b = [H.damaged(p, tmp_path / f"b.rank{r}.kvt.h5", H.patch_parallel(run_id="run-b")) for r, p in enumerate((trace, other))]
    rc, out, err = run_main(["diff", str(clean["rank0"]), str(clean["rank1"]), *map(str, b)], capsys)
    assert rc == 0 and len(out) < 100_000 and counted in " ".join(out.split()), (len(out), err)  # 455 KB before


# ---- real processes -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_as_real_processes(clean, tmp_path):
    """A sample of the above through `python -m kvtrace.cli` itself: exit codes and one stderr line."""
    env = dict(os.environ, KVTRACE_DEBUG="")
    trace = H.damaged(clean["rank0"], tmp_path / "bad.kvt.h5", H.patch_parallel(world_size=10**12))
    sched = H.damaged(clean["serving"], tmp_path / "sched.kvt.h5", H.set_rows("sched_groups", "tokens_per_block", 0))
    odd = H.damaged(clean["serving"], tmp_path / "odd.kvt.h5", H.set_rows("sched", "valid_bytes", 10**15))
    for argv, code in ((["validate", str(trace)], exitcodes.INVALID), (["analyze", str(trace)], exitcodes.INVALID),
                       (["info", str(clean["rank0"])], exitcodes.OK), (["analyze", str(sched)], exitcodes.INVALID),
                       (["export", "prometheus-textfile", str(sched), "-o", str(tmp_path / "k.prom")], exitcodes.INVALID),
                       (["analyze", str(odd)], exitcodes.OK), (["info", str(odd)], exitcodes.OK)):
        p = subprocess.run([sys.executable, "-m", "kvtrace.cli", *argv], capture_output=True, text=True, env=env,
                           timeout=120)
        assert p.returncode == code, (argv, p.stderr)
        assert "Traceback" not in p.stderr and "Warning" not in p.stderr, p.stderr
        if code:
            assert len(p.stderr.strip().splitlines()) == 1 or argv[0] == "validate"
        else:
            assert not p.stderr, p.stderr



# ---- /sched, /sched_groups, /blocks and serving events (spec §4.15-4.17, §7) -----------------------------

# Commands that read none of /sched, /sched_groups, /blocks, /events: they may still answer (spec §9.1).
NOT_READING_SERVING = ("calc --trace", "whatif")
# Commands that do not read continuous-batching requests' gen_args (the Prometheus export does: its
# per-request serving series, end-to-end latency among them, are counted over the CB requests).
NOT_READING_GEN_ARGS = ("info", "info --json", "calc --trace", "whatif")
F64 = "<f8"
SERVING = {
    # wrong types, wrong column sets: refused at open by every command
    "pool_bytes NaN (float column)": (H.float_column("pool_bytes", float("nan")), "/sched lacks or mistypes fields: pool_bytes", ()),
    "free_bytes inf (float column)": (H.float_column("free_bytes", float("inf")), "/sched lacks or mistypes fields: free_bytes", ()),
    "tokens_per_block NaN": (H.float_column("tokens_per_block", float("nan")), "/sched_groups lacks or mistypes fields", ()),
    "blocks -inf": (H.float_column("blocks", float("-inf")), "/blocks lacks or mistypes fields: blocks", ()),
    "/sched without pool_bytes": (H.drop_column("sched", "pool_bytes"), "/sched lacks or mistypes fields: pool_bytes", ()),
    "/blocks without request": (H.drop_column("blocks", "request"), "/blocks lacks or mistypes fields: request", ()),
    "/sched a group": (H.not_a_table("sched"), "/sched is not a 1-D table", ()),
    "/blocks two-dimensional": (H.two_dimensional("blocks"), "/blocks is not a 1-D table", ()),
    "/sched of 3 million zero rows": (H.grow("sched", 3_000_000), "/sched (3000000 rows) would decode to", ()),
    "/sched of 10^9 rows": (H.grow("sched", 10**9), "/sched (1000000000 rows) would decode to 113.6 GiB", ()),
    # a chunk that does not decode: found where a command reads it, like row contents
    "/sched_groups chunk overwritten": (H.corrupt_chunk("sched_groups"), "/sched_groups", NOT_READING_SERVING),
    # row contents: refused by every command that reads a serving table or /events
    "negative pool_bytes": (H.set_rows("sched", "pool_bytes", -5), "/sched pool_bytes holds -5", NOT_READING_SERVING),
    "negative free_bytes": (H.set_rows("sched", "free_bytes", -7), "/sched free_bytes holds -7", NOT_READING_SERVING),
    "pool of 0 bytes with free bytes": (H.set_rows("sched", "pool_bytes", 0), "/sched has rows with more free than pool bytes",
                                        NOT_READING_SERVING),
    "negative blocks_in_use": (H.set_rows("sched", "blocks_in_use", -9), "/sched blocks_in_use holds -9", NOT_READING_SERVING),
    "negative prefix_hit_tokens": (H.set_rows("sched", "prefix_hit_tokens", -100), "/sched prefix_hit_tokens holds -100 (a count",
                                   NOT_READING_SERVING),
    "negative evicted_blocks": (H.set_rows("sched", "evicted_blocks", -3), "/sched evicted_blocks holds -3", NOT_READING_SERVING),
    "a step recorded twice": (H.set_rows("sched", "step", 3), "/sched repeats step 3 of manager 0", NOT_READING_SERVING),
    "time going backwards": (H.set_rows("sched", "t_ns", 5, [4]), "/sched t_ns goes backwards at step 4 of manager 0",
                             NOT_READING_SERVING),
    "steps of other managers": (H.set_rows("sched", "manager", np.arange(8)), "/sched_groups names a step absent from /sched",
                                NOT_READING_SERVING),
    "tokens_per_block 0": (H.set_rows("sched_groups", "tokens_per_block", 0), "/sched_groups tokens_per_block holds 0",
                           NOT_READING_SERVING),
    "negative tokens_per_block": (H.set_rows("sched_groups", "tokens_per_block", -16), "tokens_per_block holds -16",
                                  NOT_READING_SERVING),
    "negative bytes_per_block": (H.set_rows("sched_groups", "bytes_per_block", -1), "/sched_groups bytes_per_block holds -1",
                                 NOT_READING_SERVING),
    "negative blocks_total": (H.set_rows("sched_groups", "blocks_total", -5), "/sched_groups blocks_total holds -5",
                              NOT_READING_SERVING),
    "negative group blocks_in_use": (H.set_rows("sched_groups", "blocks_in_use", -5), "/sched_groups blocks_in_use holds -5",
                                     NOT_READING_SERVING),
    "window 0": (H.set_rows("sched_groups", "window", 0), "/sched_groups window holds 0", NOT_READING_SERVING),
    "unknown layer_type": (H.set_rows("sched_groups", "layer_type", 200), "/sched_groups layer_type has unknown codes [200]",
                           NOT_READING_SERVING),
    "groups counting past the pool": (H.set_rows("sched_groups", "blocks_free", 62),
                                      "/sched_groups has rows counting more blocks in use, cached and free", NOT_READING_SERVING),
    "/sched_groups emptied": (H.map_rows("sched_groups", lambda r: r[:0]), "/blocks names a cache group absent from /sched_groups",
                              NOT_READING_SERVING),
    "/sched_groups of 3 million zero rows": (H.grow("sched_groups", 3_000_000), "/sched_groups tokens_per_block holds 0",
                                             NOT_READING_SERVING),
    "a request holding 10^6 blocks of a 64-block pool": (H.set_rows("blocks", "blocks", 10**6),
                                                         "/blocks has rows holding more blocks than their group's pool (1000000 of 64",
                                                         NOT_READING_SERVING),
    "2^63 tokens in a request's blocks": (H.set_rows("blocks", "tokens_valid", 2**63),
                                          "/blocks has rows holding more tokens than their blocks can", NOT_READING_SERVING),
    "blocks of an unknown request": (H.set_rows("blocks", "request", 99), "/blocks names requests absent from /requests: [99]",
                                     NOT_READING_SERVING),
    "blocks of an unknown step": (H.set_rows("blocks", "step", 10**6), "/blocks names a cache group absent from /sched_groups "
                                  "(manager 0, step 1000000, group 0)", NOT_READING_SERVING),
    "blocks of an unknown group": (H.set_rows("blocks", "group", 7), "(manager 0, step 0, group 7)", NOT_READING_SERVING),
    "more shared than held": (H.set_rows("blocks", "blocks_shared", 50), "/blocks has rows sharing more blocks than they hold",
                              NOT_READING_SERVING),
    "/blocks of 8 million zero rows": (H.grow("blocks", 8_000_000), "/blocks repeats request 0 at manager 0, step 0, group 0",
                                       NOT_READING_SERVING),
    # serving events (kinds 16-22)
    "scheduled -5": (H.event(16, -5, 0), "/events scheduled holds value -5 (at least 0)", NOT_READING_SERVING),
    "first_token of an unknown request": (H.event(17, 0, 99), "/events first_token names requests absent from /requests: [99]",
                                          NOT_READING_SERVING),
    "preempted -2^63 tokens": (H.event(18, -2**63, 1), "/events preempted holds value -9223372036854775808", NOT_READING_SERVING),
    "prefix_hit of request -7": (H.event(19, 16, -7), "/events prefix_hit names requests absent from /requests: [-7]",
                                 NOT_READING_SERVING),
    "block_evicted -1": (H.event(20, -1), "/events block_evicted holds value -1 (at least 0)", NOT_READING_SERVING),
    "offloaded -10^18 bytes": (H.event(21, -10**18, 1), "/events offloaded holds value -1000000000000000000 (at least -1)",
                               NOT_READING_SERVING),
    "phase -1": (H.event(22, -1, text="evil"), "/events phase holds value -1 (at least 0)", NOT_READING_SERVING),
    # text references are checked where text is read (spec §9.1): the Prometheus export shows no phase names
    "a phase name past the end of /text": (H.event(22, 2, text_ref=(10**6, 12)), "/events text_off points past the end of /text",
                                            (*NOT_READING_SERVING, "export prometheus-textfile"),
                                            "text reference [1000000, 1000012) past end of /text"),
    # a CB request's gen_args (JSON in /text): read by the analyser and the Prometheus export
    "gen_args manager 'zero'": (H.gen_args(0, '{"cb_request_id": "r", "manager": "zero"}'),
                                "/requests request 0's gen_args names manager 'zero'", NOT_READING_GEN_ARGS),
    "gen_args manager -1": (H.gen_args(0, '{"cb_request_id": "r", "manager": -1}'), "names manager '-1'",
                            NOT_READING_GEN_ARGS),
    "gen_args manager 10^11": (H.gen_args(0, '{"cb_request_id": "r", "manager": 99999999999}'),
                               "names manager '99999999999'", NOT_READING_GEN_ARGS),
    "gen_args manager NaN": (H.gen_args(0, '{"cb_request_id": "r", "manager": NaN}'), "names manager 'nan'",
                             NOT_READING_GEN_ARGS),
    "gen_args manager a list": (H.gen_args(0, '{"cb_request_id": "r", "manager": [1]}'), "names manager '[1]'",
                                NOT_READING_GEN_ARGS),
    # codes this reader does not know: refused by whoever reads /events (spec §2)
    "unknown event kind 23": (H.event(23, 0), "/events kind has unknown codes [23]", NOT_READING_SERVING),
    "event kind 255": (H.event(255, 0), "/events kind has unknown codes [255]", NOT_READING_SERVING),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SERVING))
def test_damaged_serving_part_is_refused_by_every_consumer_that_reads_it(clean, tmp_path, capsys, case):
    damage, problem, may_succeed, *refusal = SERVING[case]  # refusal: the reader's words, where not validate's
    results = check_case(clean, tmp_path, capsys, "serving", damage, problem, may_succeed=may_succeed)
    assert (refusal or [problem])[0] in results["analyze"][2]  # the refusal names the broken rule
    for name in may_succeed:
        assert results[name][0] == 0, (name, results[name][2])  # they answer: calc and whatif read no serving part


def test_every_planted_damage_is_listed_by_validate_at_once(clean, tmp_path, capsys):
    """Several damages in one trace: validate lists each (it does not stop at the first)."""
    damages = [H.set_rows("sched", "pool_bytes", -5), H.set_rows("sched_groups", "window", 0),
               H.set_rows("blocks", "blocks_shared", 50), H.event(20, -1), H.patch_parallel(world_size=0)]
    base = H.damaged(clean["serving"], tmp_path / "p.kvt.h5", H.set_parallel({"mode": "tensor_parallel", "rank": 0}))
    trace = H.damaged(base, tmp_path / "many.kvt.h5", lambda f: [d(f) for d in damages])
    rc, out, err = run_main(["validate", str(trace)], capsys)
    assert rc == exitcodes.INVALID
    for text in ("/sched pool_bytes holds -5", "/sched_groups window holds 0", "sharing more blocks than they hold",
                 "/events block_evicted holds value -1", "parallel_json world_size 0"):
        assert text in out + err, text


@pytest.mark.slow
@pytest.mark.parametrize(("case", "damage", "check"), [
    # values the format allows, however odd: read and shown as recorded, never a crash
    ("a field a newer minor added", H.extra_column("sched"), "serving    8 scheduler steps"),
    ("/sched rows in reverse file order", H.map_rows("sched", lambda r: r[::-1].copy()), "serving    8 scheduler steps"),
    ("token use above the pool (prefix sharing)", H.set_rows("sched", "valid_bytes", 10**15), "of tokens"),
    ("a pool of 4096 PiB", H.set_rows("sched", "pool_bytes", 2**62), "pool 4096.0 PiB"),
    ("2^32-1 running requests", H.set_rows("sched", "running", 2**32 - 1), "peak 4294967295 running"),
    ("8 steps of 2^62 prefix-hit tokens (the sum is past int64)", H.set_rows("sched", "prefix_hit_tokens", 2**62),
     f"prefix hits {8 * 2**62} tokens"),
    ("two prefix hits of 2^62 tokens each", lambda f: (H.event(19, 2**62, 0)(f), H.event(19, 2**62, 0)(f)),
     "serving    8 scheduler steps"),
    ("a 1000-character phase name", H.event(22, 5, text="x" * 1000), "x" * 100),
    ("a phase name of invalid UTF-8", H.event(22, 5, text="caf\udce9"), "caf"),
    # gen_args that are not a JSON object (nested past Python's stack): not a continuous-batching request
    ("gen_args nested 100,000 deep", H.gen_args(0, '{"cb_request_id": "r", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"),
     "serving    8 scheduler steps"),
])
def test_odd_but_valid_serving_values_pass_every_consumer(clean, tmp_path, capsys, case, damage, check):
    trace = H.damaged(clean["serving"], tmp_path / "odd.kvt.h5", damage)
    results = run_every_consumer(trace, clean["serving"], tmp_path / "out", capsys)
    for name, (rc, out, err) in results.items():
        assert rc == 0, (case, name, err)
        assert "Traceback" not in out + err
    assert check in results["info"][1]
    doc = json.loads(results["analyze --json"][1])
    assert not [d for d in doc["reports"][0]["detectors"] if d["status"] == "error"], case


# ---- versions -------------------------------------------------------------------------------------------


def test_future_minor_is_read(clean, tmp_path, capsys):
    """1.5 (a newer minor) only adds: every consumer reads it as 1.4."""
    trace = H.damaged(clean["serving"], tmp_path / "v15.kvt.h5", H.version("1.6"))
    results = run_every_consumer(trace, clean["serving"], tmp_path / "out", capsys)
    for name, (rc, _, err) in results.items():
        assert rc == 0, (name, err)
    assert "format 1.6" in results["info"][1]


def test_future_minor_with_a_new_event_kind_is_read_without_it(clean, tmp_path, capsys):
    """A 1.5 trace holding event kind 23 (a code 1.5 may add, spec §2): every consumer reads it, the
    kind-23 event skipped, and each one that read /events says so in one stderr line; validate warns
    and exits 0. (Until this change kvtrace refused it with exit 1 from every reader of /events.)"""
    trace = H.damaged(clean["serving"], tmp_path / "v15k.kvt.h5", lambda f: (H.version("1.6")(f), H.event(23, 0)(f)))
    results = run_every_consumer(trace, clean["serving"], tmp_path / "out", capsys)
    note = (f"kvtrace: {trace}: note: 1 event of kinds added after format 1.5 (kind 23) was skipped "
            "(written by format 1.6); a newer kvtrace reads them")
    for name, (rc, out, err) in results.items():
        assert rc == 0, (name, err)
        assert "Traceback" not in out + err
        if name in NOT_READING_SERVING or name in ("validate", "fleet summary"):
            continue
        assert err.splitlines() == [note], (name, err)
    assert "/events kind has codes added after format 1.5 [23] in 1 row(s)" in results["validate"][2]
    assert "valid kvtrace trace (format 1.6)" in results["validate"][1]
    # the same file claiming 1.4: the code is damage, refused as before
    (tmp_path / "as14").mkdir()
    check_case(clean, tmp_path / "as14", capsys, "serving", H.event(23, 0), "/events kind has unknown codes [23]",
               may_succeed=NOT_READING_SERVING)


def test_future_major_is_refused_with_4_by_every_consumer(clean, tmp_path, capsys):
    check_case(clean, tmp_path, capsys, "serving", H.version("2.0"), "trace format 2.0 is newer than this kvtrace reads (1.5)",
               code=exitcodes.VERSION)


# ---- fleet ingest and several traces -----------------------------------------------------------------


def test_fleet_ingest_exports_the_clean_and_reports_the_damaged(clean, tmp_path, capsys):
    """export parquet of a clean trace beside damaged ones: the clean one is exported, each damaged one
    reported on its own line, the exit code that of the worst (4, then 1); the fleet reads what was
    exported. Zenodo refuses the damaged trace; diff of two tensor-parallel runs refuses a damaged rank."""
    serving = clean["serving"]
    bad = H.damaged(serving, tmp_path / "bad.kvt.h5", H.set_rows("sched", "pool_bytes", -5))
    new = H.damaged(serving, tmp_path / "new.kvt.h5", H.version("2.0"))
    rc, out, err = run_main(["export", "parquet", str(serving), str(bad), "-o", str(tmp_path / "fleet"), "-q"], capsys)
    assert rc == exitcodes.INVALID and err.count("kvtrace: ") == 1 and "pool_bytes holds -5" in err, err
    rc, out, err = run_main(["export", "parquet", str(new), str(bad), "-o", str(tmp_path / "fleet2"), "-q"], capsys)
    assert rc == exitcodes.VERSION and err.count("kvtrace: ") == 2, err
    rc, out, err = run_main(["fleet", "summary", str(tmp_path / "fleet"), "--json"], capsys)
    assert rc == 0 and [g["traces"] for g in json.loads(out)["groups"]] == [1], out
    rc, out, err = run_main(["fleet", "report", str(tmp_path / "fleet"), "-o", str(tmp_path / "fleet.html")], capsys)
    assert rc == 0 and (tmp_path / "fleet.html").stat().st_size > 0, err
    rc, out, err = run_main(["export", "zenodo", str(bad), "-o", str(tmp_path / "bundle"), "--creator", "Doe, Jane"], capsys)
    assert_refusal("export zenodo", (rc, out, err), exitcodes.INVALID, bad)
    assert not (tmp_path / "bundle").exists()
    other = [H.damaged(clean[f"rank{r}"], tmp_path / f"b.rank{r}.kvt.h5", H.patch_parallel(run_id="run-b", **extra))
             for r, extra in ((0, {}), (1, {"rank": 5}))]
    rc, out, err = run_main(["diff", str(clean["rank0"]), str(clean["rank1"]), *map(str, other)], capsys)
    assert_refusal("diff ranks", (rc, out, err), exitcodes.INVALID, other[1])
    assert "rank 5 is not below world_size 2" in err


# ---- a killed serving recording -------------------------------------------------------------------------

KILLED_WRITER = """
import sys, time
from kvtrace.format import DeviceInfo, TraceWriter, schema
w = TraceWriter(sys.argv[1], {"model_id": "killed-serving"}, [DeviceInfo(-1, "cpu", 1 << 34)], flush_interval_s=0.01)
K = schema.EventKind
step = 0
while True:  # the recorder's order: a request row, its events, then /sched, /sched_groups, /blocks of each step
    rid = step
    w.begin_request(schema.RequestRow(rid, 0, 1, 20, 0, -1, step, 0, b"0" * 64))
    w.append("events", schema.EventRow(step, int(K.SCHEDULED), rid, step, -1, -1, 1, 0, 0))
    w.append("sched", schema.SchedRow(step, 0, step, 1, 20, 0, 1, 0, 0, 64, 1 << 20, 1 << 19, 4096, 2, 0, 20, 0, 0, 0, 0))
    w.append("sched_groups", schema.SchedGroupRow(0, step, 0, int(schema.LayerType.FULL), 2, -1, 16, 4096, 256, 2, 0,
                                                  254, 20))
    w.append("blocks", schema.BlockRow(0, step, rid, 0, 2, 0, 20))
    step += 1
    time.sleep(0.0005)  # a scheduler step takes time: the flusher runs between (and within) steps
    if step % 200 == 0:
        print(step, flush=True)
"""


@pytest.mark.parametrize("attempt", range(3))
def test_a_killed_serving_recording_stays_valid(tmp_path, capsys, attempt):
    """SIGKILL at any instant (the flusher runs every 10 ms, between the appends of one step too): the
    link rules point from /blocks to /sched_groups to /sched, the order rows are appended and flushed,
    so what the file holds is valid and every command reads it."""
    path = tmp_path / "killed.kvt.h5"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if int(line) >= 600 + 400 * attempt:
            break
    proc.kill()
    proc.wait(timeout=30)
    rc, out, err = run_main(["validate", str(path)], capsys)
    assert rc == 0 and "did not close" in out + err, out + err
    with Trace(path) as t:
        assert t.nrows("sched") >= 100 and t.nrows("blocks") >= 100  # flushed steps, not an empty file
    for argv in (["info", str(path)], ["analyze", "--json", str(path)], ["export", "prometheus-textfile", str(path), "-o",
                                                                          str(tmp_path / "k.prom")]):
        rc, out, err = run_main(argv, capsys)
        assert rc == 0, (argv, err)


# ---- memory ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("table", ["blocks", "sched_groups"])
def test_a_serving_table_at_the_decode_limit_is_checked_in_bounded_memory(clean, tmp_path, table):
    """A serving table grown to just under the reader's decode limit with unwritten (zero) rows, in a
    file of ~70 KiB (10^7 /blocks rows): the rules keep 8 bytes a row and sort in place, so validate,
    info and analyze refuse it within the 512 MiB of spec §9 (776 MiB for /blocks when the rules kept
    the rows' keys in lists and sorted copies)."""
    from test_hostile import measured  # the fresh-process peak-memory probe of the hostile-file tests

    dtype = {"blocks": schema.BLOCKS, "sched_groups": schema.SCHED_GROUPS}[table]
    trace = H.damaged(clean["serving"], tmp_path / "big.kvt.h5", H.grow(table, (256 << 20) // dtype.itemsize - 10))
    assert trace.stat().st_size < 1 << 20
    for command in ("validate", "info", "analyze"):
        r = measured(command, str(trace))
        assert r["rc"] == exitcodes.INVALID and "Traceback" not in r["err"], r
        assert f"/{table}" in r["err"].splitlines()[0]
        assert r["peak"] < 512 << 20, (command, r["peak"])


# ---- property: validate and the consumers agree ------------------------------------------------------

INTERESTING = (-2**63, -2**31, -2, -1, 0, 1, 2, 7, 15, 16, 17, 63, 64, 65, 2**31, 2**32 - 1, 2**53, 2**62, 2**63 - 1)


def _fits(dtype: np.dtype, value: int) -> bool:
    info = np.iinfo(dtype)
    return info.min <= value <= info.max


@st.composite
def serving_mutation(draw: st.DrawFn) -> tuple[str, H.Damage]:
    """One value of a serving table, or one more serving event, set to an interesting integer."""
    if draw(st.booleans()):
        kind = draw(st.integers(16, 22))
        value, request = draw(st.sampled_from(INTERESTING)), draw(st.sampled_from((-2, -1, 0, 1, 2, 99)))
        return f"event kind {kind} value {value} request {request}", H.event(kind, value, request)
    table = draw(st.sampled_from(("sched", "sched_groups", "blocks")))
    dtype = {"sched": schema.SCHED, "sched_groups": schema.SCHED_GROUPS, "blocks": schema.BLOCKS}[table]
    column = draw(st.sampled_from([n for n in dtype.names if dtype[n].kind in "iu"]))
    value = draw(st.sampled_from([v for v in INTERESTING if _fits(dtype[column], v)]))
    row = draw(st.integers(0, 7))
    return f"/{table} {column}[{row}] = {value}", H.set_rows(table, column, value, [row])


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=serving_mutation())
def test_validate_and_every_consumer_agree_on_mutated_serving_values(clean, tmp_path_factory, capsys, mutation):
    """Whatever one value of /sched, /sched_groups, /blocks or a serving event is set to: no command
    crashes; a trace validate calls valid passes every command (and no detector errors on it); one it
    calls invalid is refused with 1 by every command that reads the serving parts, and calc answers."""
    what, damage = mutation
    d = tmp_path_factory.mktemp("mut")
    trace = H.damaged(clean["serving"], d / "m.kvt.h5", damage)
    argvs = {"validate": ["validate", str(trace)], "info": ["info", "--json", str(trace)],
             "analyze": ["analyze", "--json", str(trace)],
             "prometheus": ["export", "prometheus-textfile", str(trace), "-o", str(d / "k.prom")],
             "calc": ["calc", "--trace", str(trace), "--context", "32k", "--gpu-memory", "80GiB"]}
    results = {name: run_main(argv, capsys) for name, argv in argvs.items()}
    for name, (rc, out, err) in results.items():
        assert rc in (0, 1) and "Traceback" not in out + err and "internal error" not in err, (what, name, rc, err)
    valid = results["validate"][0] == 0
    note_case("validate: valid" if valid else "validate: invalid")  # both reached: --hypothesis-show-statistics
    for name in ("info", "analyze", "prometheus"):
        assert results[name][0] == (0 if valid else 1), (what, name, results[name][2], results["validate"][1])
    assert results["calc"][0] == 0, (what, results["calc"][2])
    if valid:
        doc = json.loads(results["analyze"][1])
        assert not [r for r in doc["reports"][0]["detectors"] if r["status"] == "error"], (what, doc)
