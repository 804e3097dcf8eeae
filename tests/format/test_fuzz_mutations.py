"""Mutation fuzzer: damaged copies of a small real trace through every command that reads traces.

Each example damages one copy of a trace holding every table, prompt text and sampled tensors
(byte-range overwrites, truncation, deleted/retyped/linked datasets, out-of-range enums, wrong
payload shapes and chunk counts, damaged and extra zstd frames, bad /meta and root attributes,
text references out of range, tables inflated to a billion rows) and runs info, validate, analyze,
diff, report, calc --trace, export perfetto/prometheus/zenodo in-process through the CLI entry point. Asserted:

- no exit 70 and no traceback, ever; an exit is 0, 1, 2 or 4 (1 invalid, 2 not a trace, 4 newer);
- agreement: every command that fails exits with validate's code, and none fails on a file that
  validate calls valid;
- a file whose structure breaks the spec (what opening checks) fails every command with 1, and a
  file that cannot be identified as a trace fails every command with 2;
- bounded memory: the examples run in a fresh child process that first runs every command on the
  clean file; the damaged files may raise its peak RSS by at most 256 MiB over that (the 512 MiB
  bound for validate alone is checked process by process in test_hostile.py).

hypothesis runs derandomized (fixed examples, no database) so CI sees the same files every time.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
EXAMPLES = 80
# A damaged file may not cost more memory than this above what the same commands need on the clean
# file in the same process (torch, matplotlib and the caches of a warm run are in the baseline).
GROWTH_LIMIT = 256 << 20


@pytest.mark.slow
def test_mutation_fuzzer(tmp_path):
    env = dict(os.environ, KVTRACE_DEBUG="", MPLBACKEND="Agg")
    proc = subprocess.run([sys.executable, str(Path(__file__)), str(tmp_path)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["examples"] >= EXAMPLES * 0.9  # hypothesis did run them
    assert len(result["codes"]) >= 3, result["codes"]  # the mutations reach 0, 1 and 2
    assert result["peak_rss"] - result["baseline_rss"] < GROWTH_LIMIT, result


# ---- the child process ----------------------------------------------------------------------------


def _run(main, args: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(args)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return code, out.getvalue() + err.getvalue()


def _mutations():
    from hypothesis import strategies as st

    offset = st.integers(0, 2**20)  # taken modulo the file size
    row = st.integers(0, 1000)
    enums = ["requests.outcome", "layers.layer_type", "kv.layer_type", "kv.k_dtype", "kv.v_dtype",
             "steps.phase", "events.kind", "readings.label", "payloads/index.kind", "payloads/index.dtype"]
    index_fields = ["ndim", "shape", "n_elements", "n_chunks", "first_chunk", "itemsize"]
    return st.one_of(
        st.tuples(st.just("bytes"), offset, st.integers(1, 64), st.integers(0, 2**32)),
        st.tuples(st.just("truncate"), offset),
        st.tuples(st.just("delete"), st.integers(0, 100)),
        st.tuples(st.just("retype"), st.integers(0, 100),
                  st.sampled_from(["float", "group", "2d", "scalar", "soft", "external"])),
        st.tuples(st.just("enum"), st.sampled_from(enums), row, st.sampled_from([16, 99, 200, 255])),
        st.tuples(st.just("index"), st.sampled_from(index_fields), row,
                  st.sampled_from([0, 1, 3, 7, 255, 2**31 - 1, 2**40, -1])),
        st.tuples(st.just("frame"), st.sampled_from(["append", "cut", "junk", "bomb", "empty", "garbage"]),
                  st.integers(0, 20)),
        st.tuples(st.just("meta"), st.integers(0, 100), st.sampled_from(["del", "int", "json", "list", "str", "utf8", "deep"])),
        st.tuples(st.just("textref"), st.sampled_from(["requests", "events", "layers"]), row,
                  st.sampled_from(["past", "huge"])),
        st.tuples(st.just("rows"), st.sampled_from(["kv", "steps", "events", "requests", "payloads/index",
                                                    "telemetry/nvml", "text"]),
                  st.sampled_from([2, 1000, 10**9])),
        st.tuples(st.just("root"), st.sampled_from(["2.0", "1.x", "0.9", "1.99", "array", "nomarker"])),
        st.tuples(st.just("privacy"), st.sampled_from(["contains_prompt_text", "contains_tensor_payloads"])),
        st.tuples(st.just("reshape"), row, st.sampled_from(["flat", "ones", "swap", "six"])),
    )


def _mutate(path: Path, m: tuple) -> None:
    import h5py
    import numpy as np
    import zstandard

    from kvtrace.format import schema

    kind = m[0]
    if kind == "bytes":
        _, where, n, seed = m
        size = path.stat().st_size
        with open(path, "r+b") as fh:
            fh.seek(where % size)
            fh.write(np.random.default_rng(seed).bytes(n))
        return
    if kind == "truncate":
        with open(path, "r+b") as fh:
            fh.truncate(m[1] % path.stat().st_size)
        return
    with h5py.File(path, "a") as f:
        names: list[str] = []
        f.visit(names.append)
        if kind == "delete":
            del f[names[m[1] % len(names)]]
        elif kind == "retype":
            datasets = [n for n in names if isinstance(f[n], h5py.Dataset)]
            name = datasets[m[1] % len(datasets)]
            n = f[name].shape[0] if f[name].shape else 1
            del f[name]
            how = m[2]
            if how == "float":
                f[name] = np.zeros(n)
            elif how == "group":
                f.create_group(name)
            elif how == "2d":
                f[name] = np.zeros((n, 2), dtype=np.uint8)
            elif how == "scalar":
                f[name] = "not a table"
            elif how == "soft":
                f[name] = h5py.SoftLink("/" + datasets[(m[1] + 1) % len(datasets)])
            else:
                f[name] = h5py.ExternalLink("/etc/passwd", "/x")
        elif kind == "enum":
            table, column = m[1].rsplit(".", 1)
            _set_field(f[table], m[2], column, m[3])
        elif kind == "index":
            ds = f["payloads/index"]
            value = m[3]
            if m[1] == "shape":
                if ds.shape[0]:
                    r = ds[m[2] % ds.shape[0]]
                    r["shape"][value % 6 if value >= 0 else 0] = value
                    ds[m[2] % ds.shape[0]] = r
            else:
                info = np.iinfo(ds.dtype[m[1]])
                _set_field(ds, m[2], m[1], int(np.clip(value, info.min, info.max)))
        elif kind == "frame":
            ds = f[schema.payload_dataset_name(2)]
            written = ds.id.get_num_chunks()  # an open trace reserves extent it has not written
            if not written:
                return
            coord = ds.id.get_chunk_info(m[2] % written).chunk_offset
            _, stored = ds.id.read_direct_chunk(coord)
            stored = {
                "append": stored + zstandard.ZstdCompressor().compress(b"\0" * 100_000),
                "cut": stored[: len(stored) // 2],
                "junk": stored + b"junk",
                "bomb": zstandard.ZstdCompressor().compress(b"\0" * (16 << 20)),
                "empty": b"\0",  # HDF5 refuses a zero-byte chunk
                "garbage": bytes(range(256)) * 4,
            }[m[1]]
            ds.id.write_direct_chunk(coord, stored, filter_mask=0)
        elif kind == "meta":
            keys = sorted(f["meta"].attrs.keys())
            key = keys[m[1] % len(keys)]
            how = m[2]
            if how == "del":
                del f["meta"].attrs[key]
            elif how == "utf8":  # invalid UTF-8 in a UTF-8 string attribute (h5py: lone surrogates)
                f["meta"].attrs.create(key, b'{"x": "\xff\xfe"}', dtype=h5py.string_dtype("utf-8"))
            elif how == "deep":  # JSON nested deeper than Python's recursion limit
                f["meta"].attrs[key] = "[" * 100_000 + "]" * 100_000
            else:
                f["meta"].attrs[key] = {"int": 7, "json": "{not json", "list": np.arange(3), "str": "yes"}[how]
        elif kind == "textref":
            field = {"requests": "prompt_text", "events": "text", "layers": "module"}[m[1]]
            big = m[3] == "huge"
            _set_field(f[m[1]], m[2], f"{field}_off", 0 if big else 2**40)
            _set_field(f[m[1]], m[2], f"{field}_len", 2**31 if big else 5)
            if big:
                f["text"].resize((2**31 + 1,))  # never written: zeros that occupy no space
        elif kind == "rows":
            ds = f[m[1]]
            ds.resize((max(1, ds.shape[0]) * m[2] if m[2] < 10**9 else m[2],))
        elif kind == "privacy":  # the flag denies what the trace holds
            f["meta"].attrs[m[1]] = False
        elif kind == "reshape":  # a consistent but unusual shape: valid, and the analysers must cope
            ds = f["payloads/index"]
            if ds.shape[0]:
                i = m[1] % ds.shape[0]
                r = ds[i]
                shape = [int(x) for x in r["shape"][: r["ndim"]]]
                n = int(np.prod(shape))
                new = {"flat": [n], "ones": [1, 1, n, 1], "swap": shape[::-1],
                       "six": [1, 1, 1, 1, 1, n]}[m[2]]
                r["ndim"] = len(new)
                r["shape"] = new + [0] * (6 - len(new))
                ds[i] = r
        elif kind == "root":
            how = m[1]
            if how == "nomarker":
                del f.attrs["format"]
            else:
                f.attrs["format_version"] = np.arange(3) if how == "array" else how


def _set_field(ds, row: int, column: str, value: int) -> None:
    if ds.shape[0] == 0:
        return
    i = row % ds.shape[0]
    r = ds[i]
    r[column] = value
    ds[i] = r


def _commands(path: Path, base: Path, out: Path) -> dict[str, list[str]]:
    p = str(path)
    return {
        "validate": ["validate", p],
        "info": ["info", "--json", p],
        "analyze": ["analyze", p],
        "contents": ["analyze", "--contents", p],
        "diff": ["diff", str(base), p],
        "perfetto": ["export", "perfetto", p, "-o", str(out / "t.json"), "-q"],
        "prometheus": ["export", "prometheus-textfile", p, "-o", str(out / "t.prom"), "-q"],
        "zenodo": ["export", "zenodo", p, "-o", str(out / "bundle"), "--creator", "Doe, Jane", "--allow-content",
                   "-q"],
        "report": ["report", p, "-o", str(out / "r.html"), "-q"],
        "calc": ["calc", "--trace", p, "--context", "1k", "--gpu-memory", "80GiB"],
    }


def _structure_class(path: Path) -> int | None:
    """1 when opening (which checks structure) must refuse the file, 2 when it is not a trace,
    4 for a newer major version, None when the structure is sound."""
    from kvtrace import exitcodes
    from kvtrace.format.errors import NotATrace, TraceError, UnsupportedVersion
    from kvtrace.format.reader import Trace
    from kvtrace.format.trace_rules import structure_problems

    try:
        with Trace(path, check=False) as t:
            problems, _ = structure_problems(t)
    except NotATrace:
        return exitcodes.UNREADABLE
    except UnsupportedVersion:
        return exitcodes.VERSION
    except TraceError:
        return exitcodes.INVALID
    return exitcodes.INVALID if problems else None


def child(work: Path) -> dict:
    sys.path[:0] = [str(HERE), str(HERE.parents[1])]  # this directory, and the checkout: tests.helpers
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from kvtrace import exitcodes
    from kvtrace.cli import main
    from tests.helpers.synth_trace import write_synthetic_trace

    base = write_synthetic_trace(work / "base.kvt.h5", requests=2, new_tokens=6, payloads=True,
                                 prompt_text=True, recorder_error="sampler died")
    # a second kind of file: never closed (a killed writer), two devices, sampled contents
    open_base = write_synthetic_trace(work / "open.kvt.h5", requests=2, new_tokens=6, payloads=True,
                                      devices=2, close=False)
    seen_codes: set[int] = set()
    count = [0]
    warm = work / "warm"
    warm.mkdir()
    for source in (base, open_base):
        for name, args in _commands(source, base, warm).items():
            code, text = _run(main, args)
            assert code == 0, (name, text[-2000:])  # the control: the clean files pass everywhere
            shutil.rmtree(warm / "bundle", ignore_errors=True)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(mutation=_mutations(), with_report=st.integers(0, 3), closed=st.booleans())
    def one(mutation: tuple, with_report: int, closed: bool) -> None:
        count[0] += 1
        case = work / f"case{count[0]}"
        case.mkdir()
        path = case / "m.kvt.h5"
        shutil.copy(base if closed else open_base, path)
        _mutate(path, mutation)
        expected = _structure_class(path)
        codes = {}
        for name, args in _commands(path, base, case).items():
            if name == "report" and with_report:
                continue  # the slowest command (figures): one example in four
            code, text = _run(main, args)
            assert "Traceback" not in text, (name, mutation, text[-3000:])
            assert code != exitcodes.INTERNAL and code in (0, 1, 2, 4), (name, mutation, code, text[-2000:])
            codes[name] = code
        seen_codes.update(codes.values())
        failing = {n: c for n, c in codes.items() if c}
        assert all(c == codes["validate"] for c in failing.values()), (mutation, codes)
        if expected is not None:
            assert all(c == expected for c in codes.values()), (mutation, expected, codes)
        if os.environ.get("KVTRACE_FUZZ_VERBOSE"):
            print(mutation, codes, file=sys.stderr)
        shutil.rmtree(case)

    one()
    return {"examples": count[0], "codes": sorted(seen_codes), "baseline_rss": baseline,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


if __name__ == "__main__":
    print(json.dumps(child(Path(sys.argv[1]))))
