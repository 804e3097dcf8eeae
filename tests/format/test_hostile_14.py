"""Hostile and damaged traces of format 1.4 through every consumer.

The parts 1.4 added (``/meta parallel_json``, ``/sched``, ``/sched_groups``, ``/blocks``, event kinds
16-22) are damaged one at a time in traces written by the real TraceWriter (hostile14_traces.py),
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

Commands run in-process (tests/cli_run.py, like ``python -m kvtrace.cli``); a sample runs as real
subprocesses.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import hostile14_traces as H
import numpy as np
import pytest
from cli_run import run_main

from kvtrace import exitcodes

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
    assert "valid kvtrace trace (format 1.4)" in results["validate"][1]
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
    "negative world_size": ("rank0", H.patch_parallel(world_size=-2), "world_size -2 is not in [1, 1048576]"),
    "world_size 0": ("rank0", H.patch_parallel(world_size=0), "world_size 0 is not in"),
    "world_size 10^12": ("rank0", H.patch_parallel(world_size=10**12), "world_size 1000000000000 is not in"),
    "world_size of 31 digits": ("rank0", H.patch_parallel(world_size=10**30), "world_size 100000000000...(31 digits)"),
    "world_size of 5000 digits": ("rank0", H.set_parallel('{"mode": "tensor_parallel", "world_size": ' + "9" * 5000 + "}"),
                                  "number too long to read"),
    "world_size a string": ("rank0", H.patch_parallel(world_size="2"), "world_size must be an integer"),
    "world_size a float": ("rank0", H.patch_parallel(world_size=2.5), "world_size must be an integer"),
    "negative rank": ("rank0", H.patch_parallel(rank=-1), "rank -1 is not in [0, 1048576]"),
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
                      lambda f: (H.version("1.5")(f), H.patch_parallel(mode="pipeline")(f)))
    rc, out, err = run_main(["validate", str(trace)], capsys)
    assert rc == 0, out + err
    rc, out, err = run_main(["info", str(trace)], capsys)
    assert rc == 0 and "parallel   pipeline" in out, err


def test_rank_set_with_a_missing_rank_names_at_most_16(clean, tmp_path, capsys):
    """A valid world of 2^20 ranks with one rank given: the lines that name missing ranks stay short."""
    trace = H.damaged(clean["rank0"], tmp_path / "run.rank0.kvt.h5", H.patch_parallel(world_size=1 << 20))
    other = H.damaged(clean["rank1"], tmp_path / "run.rank1.kvt.h5", H.patch_parallel(world_size=1 << 20))
    rc, out, err = run_main(["info", str(trace), str(other)], capsys)
    assert rc == 0, err
    line = next(ln for ln in out.splitlines() if "MISSING" in ln)
    assert line.endswith(f"2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, ... ({(1 << 20) - 2} in all)")
    rc, out, err = run_main(["analyze", str(trace), str(other)], capsys)
    assert rc == 0 and len(err) < 2000, err


# ---- real processes -----------------------------------------------------------------------------------


def test_as_real_processes(clean, tmp_path):
    """A sample of the above through `python -m kvtrace.cli` itself: exit codes and one stderr line."""
    env = dict(os.environ, KVTRACE_DEBUG="")
    trace = H.damaged(clean["rank0"], tmp_path / "bad.kvt.h5", H.patch_parallel(world_size=10**12))
    for argv, code in ((["validate", str(trace)], exitcodes.INVALID), (["analyze", str(trace)], exitcodes.INVALID),
                       (["info", str(clean["rank0"])], exitcodes.OK)):
        p = subprocess.run([sys.executable, "-m", "kvtrace.cli", *argv], capture_output=True, text=True, env=env,
                           timeout=120)
        assert p.returncode == code, (argv, p.stderr)
        assert "Traceback" not in p.stderr
        if code:
            assert len(p.stderr.strip().splitlines()) == 1 or argv[0] == "validate"

