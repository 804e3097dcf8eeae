"""The CLI error contract on the what-if, fleet and serving commands (whatif, diff --whatif, fleet,
calc --trace with rank traces, loadtest, serve): bad input is one stderr line and a documented exit
code (kvtrace/exitcodes.py), never a traceback, never 70; no output replaces an input; a full disk is
exit 73 with no truncated document left behind; a closed stdout (`| head -1`) is a quiet 141.

tests/test_outputs_never_clobber.py and tests/test_cli_habits.py hold the same checks for the trace
commands (record, analyze, report, export, ...); this module extends them to the commands they do
not reach.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import h5py
import pytest
from test_cli_habits import _closed_pipe_run  # stdout a pipe whose reader already closed

from kvtrace import exitcodes
from kvtrace.cli import COMMANDS
from tests.helpers.cli_run import run_main

DATA = Path(__file__).parent / "data"
LLAMA = DATA / "gpu_contents" / "llama.kvt.h5"  # sampled K/V/Q: the what-if measures run
GEMMA = DATA / "gpu_contents" / "gemma3_text.kvt.h5"
RANKS = [DATA / "parallel_h200" / f"run.rank{r}.kvt.h5" for r in (0, 1)]
FLEET_TRACES = [DATA / "gpu" / "gpu_clean.kvt.h5", DATA / "gpu" / "gpu_oom.kvt.h5"]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _fleet_extra() -> bool:
    try:
        import duckdb  # noqa: F401
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Inputs for every case: traces, a truncated one, saved what-if and analysis documents, JSON that
    is neither, text files, a fleet directory (when the fleet extra is installed), rank traces."""
    d = tmp_path_factory.mktemp("contract")
    f: dict[str, Path] = {"dir": d}
    for name, src in (("a", LLAMA), ("b", GEMMA), ("r0", RANKS[0]), ("r1", RANKS[1])):
        f[name] = d / f"{name}.kvt.h5"
        shutil.copyfile(src, f[name])
    f["v9"] = d / "v9.kvt.h5"  # a format major version newer than this kvtrace reads
    f["v9r1"] = d / "v9.rank1.kvt.h5"
    for name, src in (("v9", LLAMA), ("v9r1", RANKS[1])):
        shutil.copyfile(src, f[name])
        with h5py.File(f[name], "r+") as h:
            h.attrs["format_major"], h.attrs["format_version"] = 9, "9.0"
    for name, change, src in (("r1other", {"run_id": "another-run"}, RANKS[1]), ("r0other", {"run_id": "another-run"},
                              RANKS[0]), ("r1world3", {"world_size": 3}, RANKS[1])):
        f[name] = d / f"{name}.rank{name[1]}.kvt.h5"  # a rank of another run / of a world of 3
        shutil.copyfile(src, f[name])
        with h5py.File(f[name], "r+") as h:
            h["meta"].attrs["parallel_json"] = json.dumps({**json.loads(h["meta"].attrs["parallel_json"]), **change})
    f["clean"] = d / "clean.kvt.h5"  # no prompt text, no tensor contents: an archive may hold it
    shutil.copyfile(FLEET_TRACES[0], f["clean"])
    f["trunc"] = d / "trunc.kvt.h5"
    f["trunc"].write_bytes(LLAMA.read_bytes()[:3000])
    for name, text in (("notwi", '{"a": 1}'), ("wrongver", '{"kvtrace_whatif": 99, "policies": []}'),
                       ("badjson", '{ "kvtrace_whatif": 1, '), ("text", "hello world, a few words to score\n"),
                       ("empty", "")):
        f[name] = d / f"{name}.json" if name not in ("text", "empty") else d / f"{name}.txt"
        f[name].write_text(text)
    for name, doc in MALFORMED.items():
        f[name] = d / f"{name}.json"
        f[name].write_text(json.dumps(doc))
    f["binary"] = d / "binary.txt"
    f["binary"].write_bytes(b"\xff\xfe\x00\x01 not UTF-8")
    f["nomodel"] = d / "nomodel"
    f["nomodel"].mkdir()
    for side, src in (("wa", "a"), ("wb", "b")):
        f[side] = d / f"{side}.json"
        code, _, err = run_main(["whatif", str(f[src]), "--policy", "knorm", "--ratio", "0.5", "--json-out", str(f[side])],
                                _Quiet())
        assert code == 0, err
    f["ra"] = d / "ra.json"
    code, _, err = run_main(["analyze", str(f["a"]), "--json-out", str(f["ra"])], _Quiet())
    assert code == 0, err
    for name, version in (("ra9", "9.0"), ("raold", "0.1"), ("raword", "two")):  # saved by another kvtrace
        f[name] = d / f"{name}.json"
        f[name].write_text(json.dumps({**json.loads(f["ra"].read_text()), "schema_version": version}))
    f["oldver"] = d / "oldver.json"
    f["oldver"].write_text(json.dumps({**json.loads(f["wa"].read_text()), "kvtrace_whatif": 0}))
    if _fleet_extra():
        from kvtrace.fleet.export import export_parquet

        f["fleet"] = d / "fleet"
        assert not export_parquet([str(p) for p in FLEET_TRACES], f["fleet"]).failed
        f["fleet_foreign"] = _fleet_copy(f["fleet"], d / "fleet_foreign", "foreign")
        f["fleet_typed"] = _fleet_copy(f["fleet"], d / "fleet_typed", "typed")
        f["fleet_damaged"] = _fleet_copy(f["fleet"], d / "fleet_damaged", "damaged")
        for how in ("foreign_bare", "older", "bare", "newer"):
            f[f"fleet_{how}"] = _fleet_copy(f["fleet"], d / f"fleet_{how}", how)
    f["emptydir"] = d / "emptydir"
    f["emptydir"].mkdir()
    return f


_BASE = {"bytes_peak": 1024, "bytes_mean": 512}
_RESULT = {"ratio": 0.5, "bytes": {"kept_peak": 1, "kept_mean": 1, "saved_peak": 1, "saved_mean": 1}, "overall": {},
           "layers": [], "skipped": []}
# what-if documents with the schema marker but not the shape the diff reads (each was exit 70)
MALFORMED = {
    "w_nobase": {"kvtrace_whatif": 1, "policies": []},
    "w_boolver": {"kvtrace_whatif": True, "policies": [], "baseline": _BASE},
    "w_intpol": {"kvtrace_whatif": 1, "policies": [1, 2], "baseline": _BASE},
    "w_strbytes": {"kvtrace_whatif": 1, "baseline": _BASE, "policies": [
        {"label": "knorm", "family": "eviction", "results": [{**_RESULT, "bytes": {"saved_peak": "a"}}]}]},
    "w_strratio": {"kvtrace_whatif": 1, "baseline": _BASE, "policies": [
        {"label": "knorm", "family": "eviction", "results": [{**_RESULT, "ratio": "half"}]}]},
    "w_badlayers": {"kvtrace_whatif": 1, "baseline": _BASE, "policies": [
        {"label": "knorm", "family": "eviction", "results": [{**_RESULT, "layers": [{"layer": "x"}]}]}]},
    "w_unknown": {"kvtrace_whatif": 1, "baseline": _BASE, "policies": [
        {"label": "nosuch:k=1", "family": "eviction", "results": [_RESULT]}]},  # valid; a newer kvtrace's policy
}


class _Quiet:
    """A stand-in for capsys in the module fixture (run_main reads it after the command)."""

    def readouterr(self):  # noqa: ANN201 - mirrors pytest's CaptureResult
        class R:
            out = err = ""

        return R()


def _fleet_copy(src: Path, dst: Path, how: str) -> Path:
    """A fleet directory whose traces.parquet is another table (foreign; foreign_bare: and no
    _manifest.json), has every column as text (typed: right names, wrong types), is not Parquet at
    all (damaged), lacks a column of this fleet schema (older: the manifest names fleet schema 1.0;
    bare: no manifest), or whose manifest names fleet schema 9.0 (newer)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    shutil.copytree(src, dst)
    traces, manifest = dst / "traces.parquet", dst / "_manifest.json"
    if how in ("older", "bare"):
        pq.write_table(pq.read_table(traces).drop_columns(["findings_by"]), traces)
    if how in ("older", "newer"):
        doc = json.loads(manifest.read_text())
        manifest.write_text(json.dumps({**doc, "fleet_schema_version": "1.0" if how == "older" else "9.0"},
                                       indent=1, sort_keys=True))
    if how in ("foreign_bare", "bare"):
        manifest.unlink()
    if how in ("foreign", "foreign_bare"):
        pq.write_table(pa.table({"x": [1, 2], "y": ["a", "b"]}), traces)
    elif how == "typed":
        t = pq.read_table(traces)
        pq.write_table(pa.table({n: pa.array([None if v is None else str(v) for v in t[n].to_pylist()],
                                             pa.string()) for n in t.column_names}), traces)
    elif how == "damaged":
        traces.write_bytes(b"PAR1 but not really Parquet")
    return dst


def _argv(template: list[str], work: dict[str, Path]) -> list[str]:
    return [part.format(**{k: str(v) for k, v in work.items()}) for part in template]


# (argv template, exit code, a phrase of the message). {x} names a path of the `work` fixture.
WHATIF = [
    (["whatif", "{a}", "--policy", "nope"], exitcodes.USAGE, "unknown policy 'nope'"),
    (["whatif", "{a}", "--policy", "knorm:foo=1"], exitcodes.USAGE, "unknown parameter 'foo'"),
    (["whatif", "{a}", "--policy", "knorm:foo"], exitcodes.USAGE, "unknown parameter 'foo'"),
    (["whatif", "{a}", "--policy", "paging:page_size=abc"], exitcodes.USAGE, "must be an integer"),
    (["whatif", "{a}", "--policy", "paging:page_size=7"], exitcodes.USAGE, "page_size must be"),
    (["whatif", "{a}", "--policy", "kivi:nbits=3"], exitcodes.USAGE, "--policy"),
    (["whatif", "{a}", "--policy", ":"], exitcodes.USAGE, "unknown policy ''"),
    (["whatif", "{a}", "--ratio", "1.0"], exitcodes.USAGE, "--ratio: every ratio must be in [0, 1)"),
    (["whatif", "{a}", "--ratio", "-0.1"], exitcodes.USAGE, "--ratio"),
    (["whatif", "{a}", "--ratio", "nan"], exitcodes.USAGE, "--ratio"),
    (["whatif", "{a}", "--ratio", "0.5,abc"], exitcodes.USAGE, "--ratio: expected comma-separated numbers"),
    (["whatif", "{a}", "--ratio", ","], exitcodes.USAGE, "--ratio"),
    (["whatif", "{a}", "--steps", "some"], exitcodes.USAGE, "--steps"),
    (["whatif", "{a}", "--device", "tpu"], exitcodes.USAGE, "--device"),
    (["whatif", "{a}", "--json-out", "{a}"], exitcodes.USAGE, "is also an input"),
    (["whatif", "{a}", "--json-out", "{b}"], exitcodes.USAGE, "existing trace"),
    (["whatif", "{a}", "--json-out", "{dir}"], exitcodes.USAGE, "directory"),
    (["whatif", "{a}", "--json-out", "{dir}/no/such/w.json"], exitcodes.CANNOT_WRITE, "does not exist"),
    (["whatif", "{trunc}"], exitcodes.UNREADABLE, "truncated or corrupt"),
    (["whatif", "{v9}"], exitcodes.VERSION, "trace format 9.0 is newer"),
    (["whatif", "{notwi}"], exitcodes.UNREADABLE, "not an HDF5 file"),
    (["whatif", "{dir}"], exitcodes.UNREADABLE, "directory"),
    (["whatif", "{dir}/missing.kvt.h5"], exitcodes.UNREADABLE, "no such file"),
    (["whatif"], exitcodes.USAGE, "give a TRACE"),
    (["whatif", "{a}", "--rerun", "preset:llama-3.1-8b"], exitcodes.USAGE, "go together"),
    (["whatif", "{a}", "--tiny"], exitcodes.USAGE, "--tiny only applies"),
    # options of a part that does not run were ignored without a word
    (["whatif", "{a}", "--max-tokens", "5"], exitcodes.USAGE, "--max-tokens only applies with --rerun"),
    (["whatif", "{a}", "--rerun-prefill", "2", "--rerun-device", "cpu"], exitcodes.USAGE,
     "--rerun-prefill/--rerun-device only apply with --rerun"),
    (["whatif", "--rerun", "preset:llama-3.1-8b", "--tiny", "--text", "{text}", "--steps", "all"], exitcodes.USAGE,
     "--steps only applies with TRACE"),
    (["whatif", "--rerun", "preset:llama-3.1-8b", "--tiny", "--text", "{text}", "--device", "cpu"], exitcodes.USAGE,
     "--device only applies with TRACE"),
    # --rerun MODEL is checked as `record --model` and `serve MODEL` check it, before any replay
    (["whatif", "{a}", "--rerun", "{dir}/no/such/model", "--text", "{text}"], exitcodes.USAGE,
     "--rerun: {dir}/no/such/model: no such model directory"),
    (["whatif", "--rerun", "{nomodel}", "--text", "{text}"], exitcodes.USAGE, "holds no config.json"),
    (["whatif", "--rerun", "{text}", "--text", "{text}"], exitcodes.USAGE, "is a file, not a model directory"),
    (["whatif", "--rerun", "preset:nosuch", "--text", "{text}"], exitcodes.USAGE, "unknown preset 'nosuch'"),
    (["whatif", "--rerun", "preset:llama-3.1-8b", "--tiny", "--text", "{binary}"], exitcodes.USAGE,
     "--text"),
    (["whatif", "--rerun", "preset:llama-3.1-8b", "--tiny", "--text", "{empty}"], exitcodes.USAGE,
     "leave none to score"),
    (["whatif", "--rerun", "preset:llama-3.1-8b", "--tiny", "--text", "{dir}/missing.txt"], exitcodes.USAGE,
     "--text"),
    (["whatif", "--rerun", "preset:llama-3.1-8b", "--tiny", "--text", "{dir}"], exitcodes.USAGE, "directory"),
    (["whatif", "--rerun", "preset:llama-3.1-8b", "--tiny", "--text", "{text}", "--json-out", "{text}"],
     exitcodes.USAGE, "is also an input"),
]

# a device name torch does not know was an internal error (70) wherever a model is loaded
DEVICES = [
    (["whatif", "--rerun", "preset:llama-3.1-8b", "--tiny", "--text", "{text}", "--rerun-device", "tpu"],
     exitcodes.USAGE, "--rerun-device: 'tpu' is not a device"),
    (["whatif", "--rerun", "preset:llama-3.1-8b", "--tiny", "--text", "{text}", "--rerun-device", "cuda:x"],
     exitcodes.USAGE, "--rerun-device: 'cuda:x' is not a device"),
    (["record", "--model", "preset:llama-3.1-8b", "--tiny", "--prompt", "x", "--max-new-tokens", "2", "--device",
      "tpu", "-o", "{dir}/never.kvt.h5"], exitcodes.USAGE, "--device: 'tpu' is not a device"),
]

DIFF_WHATIF = [
    (["diff", "{wa}", "{notwi}"], exitcodes.UNREADABLE, "notwi.json: JSON but not a kvtrace whatif document"),
    (["diff", "{notwi}", "{wa}"], exitcodes.UNREADABLE, "notwi.json: JSON but not a kvtrace whatif document"),
    (["diff", "{wa}", "{ra}"], exitcodes.UNREADABLE, "ra.json: JSON but not a kvtrace whatif document"),
    # a newer schema is refused as a newer trace is: 4 and "upgrade" (was 1 with no hint); an older one stays 1
    (["diff", "{wa}", "{wrongver}"], exitcodes.VERSION,
     "what-if schema 99 is newer than this kvtrace reads (1): written by a newer kvtrace; upgrade kvtrace"),
    (["diff", "{wrongver}", "{a}", "--whatif", "knorm"], exitcodes.VERSION, "what-if schema 99 is newer"),
    (["diff", "{wa}", "{oldver}"], exitcodes.INVALID, "what-if schema 0 is not 1"),
    (["diff", "{ra}", "{ra9}"], exitcodes.VERSION, "ra9.json: analysis schema 9.0 is newer than this kvtrace reads"),
    (["diff", "{ra9}", "{a}"], exitcodes.VERSION, "written by a newer kvtrace; upgrade kvtrace"),
    (["diff", "{ra}", "{raold}"], exitcodes.INVALID, "raold.json: analysis schema 0.1 is not"),
    (["diff", "{ra}", "{raword}"], exitcodes.INVALID, "raword.json: analysis schema two is not"),
    (["diff", "{badjson}", "{wa}"], exitcodes.INVALID, "not valid JSON"),
    (["diff", "{wa}", "{trunc}"], exitcodes.UNREADABLE, "truncated or corrupt"),
    (["diff", "{wa}", "{v9}"], exitcodes.VERSION, "trace format 9.0 is newer"),
    (["diff", "{v9}", "{b}", "--whatif", "knorm"], exitcodes.VERSION, "trace format 9.0 is newer"),
    (["diff", "{a}", "{trunc}", "--whatif", "knorm"], exitcodes.UNREADABLE, "truncated or corrupt"),
    (["diff", "{a}", "{b}", "--whatif", "nope"], exitcodes.USAGE, "--whatif: unknown policy"),
    (["diff", "{a}", "{b}", "--whatif", "knorm", "--whatif-ratio", "2"], exitcodes.USAGE,
     "--whatif-ratio: every ratio must be in [0, 1)"),
    (["diff", "{a}", "{b}", "--whatif-ratio", "abc"], exitcodes.USAGE, "--whatif-ratio"),
    (["diff", "{wa}", "{wb}", "--json-out", "{wa}"], exitcodes.USAGE, "is also an input"),
    (["diff", "{a}", "{wb}", "--json-out", "{a}"], exitcodes.USAGE, "is also an input"),
    (["diff", "{wa}", "{wb}", "--json-out", "{b}"], exitcodes.USAGE, "existing trace"),
    (["diff", "{wa}"], exitcodes.USAGE, "give two traces"),
    (["diff", "{r0}", "{r1}", "{r0other}", "{r1other}", "--whatif", "knorm"], exitcodes.USAGE,
     "not the rank traces of tensor-parallel runs"),  # --whatif was ignored without a word
    *[(["diff", f"{{{name}}}", "{wa}"], exitcodes.INVALID, f"{name}.json: not a valid what-if document")
      for name in MALFORMED if name != "w_unknown"],
    (["diff", "{a}", "{w_strbytes}"], exitcodes.INVALID, "not a valid what-if document (policies[0].results[0].bytes"),
    (["diff", "{w_unknown}", "{a}"], exitcodes.INVALID, "w_unknown.json: a policy of this what-if document cannot be "
     "replayed here (unknown policy 'nosuch';"),
]

FLEET = [
    (["fleet", "{emptydir}"], exitcodes.UNREADABLE, "no exported traces"),
    (["fleet", "diff", "{emptydir}", "--baseline", "a=b", "--candidate", "a=c"], exitcodes.UNREADABLE,
     "no exported traces"),
    (["fleet", "report", "{emptydir}", "-o", "{dir}/r.html"], exitcodes.UNREADABLE, "no exported traces"),
    (["fleet", "{dir}/missing"], exitcodes.UNREADABLE, "not a directory"),
    (["fleet", "{a}"], exitcodes.UNREADABLE, "not a directory"),
    # what is known of a traces table this kvtrace cannot read (it said "exported by an older kvtrace" of any)
    (["fleet", "{fleet_foreign}"], exitcodes.UNREADABLE,
     "traces.parquet is not a table kvtrace exported (it has no trace_id column), though _manifest.json names"),
    (["fleet", "report", "{fleet_foreign}", "-o", "{dir}/r.html"], exitcodes.UNREADABLE,
     "is not a table kvtrace exported"),
    (["fleet", "{fleet_foreign_bare}"], exitcodes.UNREADABLE,
     "fleet_foreign_bare: traces.parquet is not a table kvtrace exported (it has no trace_id column)"),
    (["fleet", "{fleet_older}"], exitcodes.UNREADABLE,
     "exported by an older kvtrace (fleet schema 1.0: traces.parquet lacks findings_by); run 'kvtrace export"),
    (["fleet", "{fleet_bare}"], exitcodes.UNREADABLE,
     "traces.parquet lacks findings_by and no _manifest.json says which kvtrace exported it"),
    (["fleet", "{fleet_newer}"], exitcodes.VERSION,
     "exported by a newer kvtrace (fleet schema 9.0; this kvtrace reads"),
    (["fleet", "diff", "{fleet_newer}", "--baseline", "a=b", "--candidate", "a=c"], exitcodes.VERSION,
     "upgrade kvtrace"),
    (["fleet", "report", "{fleet_newer}", "-o", "{dir}/r.html"], exitcodes.VERSION, "upgrade kvtrace"),
    (["fleet", "{fleet_typed}"], exitcodes.UNREADABLE, "cannot read the exported tables"),
    (["fleet", "report", "{fleet_typed}", "-o", "{dir}/r.html"], exitcodes.UNREADABLE,
     "cannot read the exported tables"),
    (["fleet", "{fleet_damaged}"], exitcodes.UNREADABLE, "cannot read the exported tables"),
    (["fleet", "diff", "{fleet_damaged}", "--baseline", "a=b", "--candidate", "a=c"], exitcodes.UNREADABLE,
     "cannot read the exported tables"),
    (["fleet", "report", "{fleet_damaged}", "-o", "{dir}/r.html"], exitcodes.UNREADABLE,
     "cannot read the exported tables"),
    # --sql reads; a statement that writes (the fleet's own files included) or several are refused
    (["fleet", "{fleet}", "--sql", "COPY (SELECT 1) TO '{fleet}/traces.parquet' (FORMAT parquet)"],
     exitcodes.USAGE, "not COPY"),
    (["fleet", "{fleet}", "--sql", "ATTACH '{dir}/x.duckdb'"], exitcodes.USAGE, "not ATTACH"),
    (["fleet", "{fleet}", "--sql", "EXPORT DATABASE '{dir}/exported'"], exitcodes.USAGE, "not EXPORT"),
    (["fleet", "{fleet}", "--sql", "SELECT 1; COPY (SELECT 1) TO '{dir}/x.csv'"], exitcodes.USAGE,
     "one SQL statement, got 2"),
    (["fleet", "{fleet}", "--sql", ""], exitcodes.USAGE, "one SQL statement, got 0"),
    (["fleet", "{fleet}", "--sql", "SELEC 1"], exitcodes.USAGE, "syntax error"),
    (["fleet", "{fleet}", "--sql", "SELECT nope FROM traces"], exitcodes.USAGE, "query failed"),
    (["fleet", "{fleet}", "--group-by", "no_such_key"], exitcodes.USAGE, "unknown group key"),
    (["fleet", "{fleet}", "--sql", "SELECT 1", "--group-by", "model_type"], exitcodes.USAGE,
     "with --sql, group in QUERY"),  # --group-by was ignored without a word
    (["fleet", "{fleet}", "--json-out", "{fleet}/traces.parquet"], exitcodes.USAGE, "inside the fleet directory"),
    (["fleet", "{fleet}", "--json-out", "{a}"], exitcodes.USAGE, "existing trace"),
    (["fleet", "{fleet}", "--json-out", "{dir}/no/such/f.json"], exitcodes.CANNOT_WRITE, "does not exist"),
    (["fleet", "diff", "{fleet}", "--baseline", "x", "--candidate", "y"], exitcodes.USAGE, "expected KEY=VALUE"),
    (["fleet", "diff", "{fleet}", "--baseline", "nokey=1", "--candidate", "model_type=llama"], exitcodes.USAGE,
     "unknown key 'nokey'"),
    (["fleet", "diff", "{fleet}", "--baseline", "model_type=none", "--candidate", "model_type=llama"],
     exitcodes.USAGE, "no exported trace has model_type = 'none'"),
    (["fleet", "diff", "{fleet}", "--baseline", "a=b"], exitcodes.USAGE, "--candidate"),
    (["fleet", "diff", "{fleet}", "--baseline", "a=b", "--candidate", "a=c", "--alpha", "1"], exitcodes.USAGE,
     "--alpha"),
    (["fleet", "diff", "{fleet}", "--baseline", "a=b", "--candidate", "a=c", "--json-out", "{fleet}/x.json"],
     exitcodes.USAGE, "inside the fleet directory"),
    (["fleet", "report", "{fleet}", "-o", "{fleet}/traces.parquet"], exitcodes.USAGE, "inside the fleet directory"),
    (["fleet", "report", "{fleet}", "-o", "{a}"], exitcodes.USAGE, "existing trace"),
    (["fleet", "report", "{fleet}", "-o", "{dir}/r.html", "--json-out", "{dir}/r.html"], exitcodes.USAGE,
     "name the same file"),
    (["fleet", "report", "{fleet}", "-o", "{dir}"], exitcodes.USAGE, "directory"),
    (["fleet", "report", "{fleet}", "-o", "{dir}/no/such/r.html"], exitcodes.CANNOT_WRITE, "does not exist"),
    (["fleet", "report", "{fleet}", "-o", "{dir}/r.html", "--baseline", "a=b"], exitcodes.USAGE, "go together"),
    (["fleet", "report", "{fleet}", "-o", "{dir}/r.html", "--group-by", "nokey"], exitcodes.USAGE,
     "unknown group key"),
    (["fleet", "report", "{fleet}", "-o", "{dir}/r.html", "--worst", "0"], exitcodes.USAGE, "--worst"),
]

CALC = [
    (["calc", "--trace", "{r0}", "--trace", "{r0}", "--context", "4k", "--gpu-memory", "80GiB"], exitcodes.USAGE,
     "rank 0 is given twice"),
    (["calc", "--trace", "{r0}", "--trace", "{r1other}", "--context", "4k", "--gpu-memory", "80GiB"],
     exitcodes.USAGE, "belong to 2 runs"),
    (["calc", "--trace", "{r0}", "--trace", "{r1world3}", "--context", "4k", "--gpu-memory", "80GiB"],
     exitcodes.USAGE, "disagree on the world size"),
    (["calc", "--trace", "{r0}", "--trace", "{a}", "--context", "4k", "--gpu-memory", "80GiB"], exitcodes.USAGE,
     "is not a tensor-parallel rank trace"),
    # report refuses the same sets calc refuses (world sizes that disagree were reported with exit 0)
    (["report", "{r0}", "{r1world3}", "-o", "{dir}/run.html"], exitcodes.USAGE, "disagree on the world size"),
    (["report", "{r0}", "{r0}", "-o", "{dir}/run.html"], exitcodes.USAGE, "give one rank twice"),
    (["calc", "--trace", "{a}", "--trace", "{b}", "--context", "4k", "--gpu-memory", "80GiB"], exitcodes.USAGE,
     "is not a tensor-parallel rank trace"),
    (["calc", "--trace", "{r0}", "--trace", "{trunc}", "--context", "4k", "--gpu-memory", "80GiB"],
     exitcodes.UNREADABLE, "truncated or corrupt"),
    (["calc", "--trace", "{r0}", "--trace", "{v9r1}", "--context", "4k", "--gpu-memory", "80GiB"],
     exitcodes.VERSION, "trace format 9.0 is newer"),
    (["calc", "--trace", "{r0}", "--trace", "{notwi}", "--context", "4k", "--gpu-memory", "80GiB"],
     exitcodes.UNREADABLE, "not an HDF5 file"),
    (["calc", "--trace", "{r0}", "--trace", "{r1}", "--preset", "llama-3.1-8b", "--context", "4k",
      "--gpu-memory", "80GiB"], exitcodes.USAGE, "exactly one of"),
    (["calc", "--trace", "{r0}", "--trace", "{r1}", "--context", "4k", "--gpu-memory", "80GiB", "--json-out", "{r1}"],
     exitcodes.USAGE, "is also an input"),
    (["calc", "--trace", "{r0}", "--trace", "{r1}", "--context", "4k", "--gpu-memory", "80GiB", "--tp", "0"],
     exitcodes.USAGE, "--tp"),
    # an int64 overflow in the planner was an internal error (70)
    (["calc", "--preset", "llama-3.1-8b", "--context", "99999999999999999999", "--gpu-memory", "80GiB"],
     exitcodes.USAGE, "more tokens than can be planned"),
    (["calc", "--preset", "llama-3.1-8b", "--context", "9223372036854775807k", "--gpu-memory", "80GiB"],
     exitcodes.USAGE, "--context"),
]

CASES = [*WHATIF, *DEVICES, *DIFF_WHATIF, *[(*c, "fleet") for c in FLEET], *CALC]


def _case(c: tuple) -> tuple:
    argv, code, phrase, *needs = c
    marks = [pytest.mark.skipif(not _fleet_extra(), reason="needs the fleet extra (duckdb, pyarrow)")] if needs else []
    return pytest.param(argv, code, phrase, marks=marks, id=" ".join(argv[:2]) + f" {code} {phrase[:40]}")


@pytest.mark.parametrize(("argv", "code", "phrase"), [_case(c) for c in CASES])
def test_bad_input_is_one_line_and_its_exit_code(work, capsys, argv, code, phrase):
    inputs = [p for k, p in work.items() if k != "dir" and p.is_file()]
    before = {p: digest(p) for p in inputs}
    fleet_files = {p: digest(p) for d in ("fleet",) if d in work for p in work[d].rglob("*") if p.is_file()}
    rc, out, err = run_main(_argv(argv, work), capsys)
    assert rc == code, err
    assert err.count("\n") == 1 and err.startswith("kvtrace: "), err
    assert "Traceback" not in err and "internal error" not in err
    assert phrase.format(**{k: str(v) for k, v in work.items()}) in err, err
    assert {p: digest(p) for p in inputs} == before  # no input touched
    assert {p: digest(p) for p in fleet_files} == fleet_files
    for leftover in ("x.duckdb", "x.csv", "exported", "r.html", "never.kvt.h5"):
        assert not (work["dir"] / leftover).exists(), leftover


def test_whatif_device_cuda_without_a_gpu_is_69(work, capsys, tmp_path):
    """--device cuda asks for the GPU: without one it is exit 69, one line naming --device cpu and
    --device auto, before any work and no --json-out written (it ran on the CPU with a note, exit 0).
    --device auto is the choice that falls back: the same numbers on the CPU, and says so."""
    if _cuda():
        pytest.skip("a GPU is visible: the refusal is not taken")
    out = tmp_path / "w.json"
    rc, printed, err = run_main(["whatif", str(work["a"]), "--policy", "knorm", "--ratio", "0.5", "--device", "cuda",
                                 "--json-out", str(out)], capsys)
    assert rc == exitcodes.UNAVAILABLE and printed == "" and err.count("\n") == 1, err
    assert err.startswith("kvtrace: --device cuda: ") and "--device cpu" in err and "--device auto" in err, err
    assert not out.exists()
    rc, printed, err = run_main(["whatif", str(work["a"]), "--policy", "knorm", "--ratio", "0.5", "--device", "auto",
                                 "--json"], capsys)
    assert rc == 0 and err == "", err
    numerics = json.loads(printed)["numerics"]
    assert numerics["backend"] == "numpy-float64/cpu" and numerics["note"].startswith("no GPU")
    rc, cpu, _ = run_main(["whatif", str(work["a"]), "--policy", "knorm", "--ratio", "0.5", "--json"], capsys)
    assert rc == 0 and json.loads(cpu)["policies"] == json.loads(printed)["policies"]


def test_whatif_rerun_device_cuda_without_a_gpu_is_69(work, capsys):
    if _cuda():
        pytest.skip("a GPU is visible")
    pytest.importorskip("torch")
    rc, _, err = run_main(["whatif", str(work["a"]), "--rerun", "preset:llama-3.1-8b", "--tiny", "--text",
                           str(work["text"]), "--rerun-device", "cuda"], capsys)
    assert rc == exitcodes.UNAVAILABLE and err.count("\n") == 1
    assert "--rerun-device cuda: CUDA is not available" in err


def test_diff_a_saved_whatif_document_beside_a_trace(work, capsys):
    """A saved what-if document beside a trace: the trace is replayed with the document's policies
    and ratios and only the what-if parts are compared (was: 'JSON but not a kvtrace analysis
    report', naming the what-if document)."""
    rc, out, err = run_main(["diff", str(work["wa"]), str(work["b"]), "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["kvtrace_whatif_diff"] == 1
    assert [(r["label"], r["ratio"]) for r in doc["results"]] == [("knorm", 0.5)]
    assert doc["only_a"] == doc["only_b"] == []
    # the control: the same trace on both sides (one replayed now, one saved) differs by nothing
    rc, out, err = run_main(["diff", str(work["a"]), str(work["wa"]), "--json"], capsys)
    assert rc == 0, err
    same = json.loads(out)
    assert all(m["delta"] in (0, 0.0, None) for r in same["results"] for m in r["bytes"].values())
    # a saved policy this kvtrace does not know is compared as saved when nothing is replayed
    rc, out, err = run_main(["diff", str(work["w_unknown"]), str(work["wa"]), "--json"], capsys)
    assert rc == 0 and json.loads(out)["only_a"] == [{"label": "nosuch:k=1", "ratio": 0.5}], err
    # two traces without --whatif stay an analysis diff, with no what-if part
    rc, out, err = run_main(["diff", str(work["a"]), str(work["b"]), "--json"], capsys)
    assert rc == 0 and "whatif" not in json.loads(out), err


def test_diff_refuses_a_huge_whatif_document_before_reading_it(work, capsys):
    huge = work["dir"] / "huge.json"
    with open(huge, "wb") as fh:  # sparse: 300 MiB on paper, a few bytes on disk
        fh.write(b'{"kvtrace_whatif": 1, "policies": [')
        fh.truncate(300 << 20)
    try:
        for argv in (["diff", str(huge), str(work["wa"])], ["diff", str(work["a"]), str(huge)]):
            rc, _, err = run_main(argv, capsys)
            assert rc == exitcodes.INVALID and "larger than" in err and err.count("\n") == 1, err
    finally:
        huge.unlink()


@pytest.mark.skipif(not _fleet_extra(), reason="needs the fleet extra (duckdb, pyarrow)")
def test_export_parquet_into_a_newer_fleet_schema_is_4_and_changes_nothing(work, capsys):
    """Re-exporting (the rule for another fleet schema) would rewrite a newer kvtrace's export in this
    one's older schema."""
    before = {p: digest(p) for p in work["fleet_newer"].rglob("*") if p.is_file()}
    rc, _, err = run_main(["export", "parquet", str(work["a"]), "-o", str(work["fleet_newer"])], capsys)
    assert rc == exitcodes.VERSION and err.count("\n") == 1, err
    assert "exported by a newer kvtrace (fleet schema 9.0" in err and "upgrade kvtrace" in err, err
    assert {p: digest(p) for p in work["fleet_newer"].rglob("*") if p.is_file()} == before


@pytest.mark.skipif(not _fleet_extra(), reason="needs the fleet extra (duckdb, pyarrow)")
def test_fleet_sql_reads_still_run(work, capsys):
    """The clean controls of the --sql refusals: queries that read run, in every form DuckDB has."""
    for sql in ("SELECT count(*) AS n FROM traces", "WITH x AS (SELECT * FROM traces) SELECT count(*) AS n FROM x",
                "FROM traces SELECT count(*) AS n", "(SELECT 1 AS n) UNION ALL (SELECT 2)"):
        rc, out, err = run_main(["fleet", str(work["fleet"]), "--sql", sql, "--json"], capsys)
        assert rc == 0, (sql, err)
        assert json.loads(out)["result"][0]["n"] in (1, 2, len(FLEET_TRACES))
    rc, out, err = run_main(["fleet", str(work["fleet"]), "--sql", "DESCRIBE traces", "--json"], capsys)
    assert rc == 0 and any(r["column_name"] == "trace_id" for r in json.loads(out)["result"]), err


# ---- full disk ------------------------------------------------------------------------------------

# Every command that writes an output, with the output on a full file system. {out} is the output
# path (a directory for demo, export zenodo and export parquet); the expected exit is 73 with one
# line, and nothing left behind: outputs are written whole or not at all (kvtrace.wholefile), and an
# output directory the command created goes with its failure.
WRITERS = [
    ["info", "{a}", "--json-out", "{out}"],
    ["validate", "{a}", "--json-out", "{out}"],
    ["analyze", "{a}", "--json-out", "{out}"],
    ["diff", "{a}", "{b}", "--json-out", "{out}"],
    ["diff", "{wa}", "{wb}", "--json-out", "{out}"],
    ["calc", "--preset", "llama-3.1-8b", "--context", "4k", "--gpu-memory", "80GiB", "--json-out", "{out}"],
    ["calc", "--trace", "{r0}", "--trace", "{r1}", "--context", "4k", "--gpu-memory", "80GiB", "--json-out", "{out}"],
    ["whatif", "{a}", "--policy", "knorm", "--ratio", "0.5", "--json-out", "{out}"],
    ["presets", "--json-out", "{out}"],
    ["report", "{a}", "-o", "{out}", "--no-whatif"],
    ["report", "{a}", "-o", "{dir}/r_figures.html", "--figures", "{out}", "--no-whatif"],  # was exit 70
    ["export", "perfetto", "{a}", "-o", "{out}"],
    ["export", "prometheus-textfile", "{a}", "-o", "{out}"],
    ["fleet", "{fleet}", "--json-out", "{out}"],
    ["fleet", "diff", "{fleet}", "--baseline", "model_type=llama", "--candidate", "model_type=llama",
     "--json-out", "{out}"],
    ["fleet", "report", "{fleet}", "-o", "{out}"],
    ["export", "parquet", "{a}", "-o", "{out}"],
    ["export", "zenodo", "{clean}", "-o", "{out}", "--creator", "Doe, Jane"],
    ["demo", "--output-dir", "{out}"],
]


def _writer_id(argv: list[str]) -> str:
    name = " ".join(a for a in argv if not a.startswith(("{", "-")) and "=" not in a)
    return f"{name} {argv[argv.index('{out}') - 1]}"


def _needs_fleet(argv: list[str]) -> None:
    if any("{fleet}" in a for a in argv) and not _fleet_extra():
        pytest.skip("needs the fleet extra (duckdb, pyarrow)")


@pytest.fixture
def full_fs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs filled to the last byte (every write: ENOSPC), where this process may mount one."""
    mnt = tmp_path / f"full-{uuid.uuid4().hex[:8]}"
    mnt.mkdir()
    try:
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot run mount: {exc}")
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {res.stderr.strip()}")
    try:
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:  # ENOSPC: full
            pass
        finally:
            os.close(fd)
        yield mnt
    finally:
        _umount(mnt)


def _umount(mnt: Path) -> None:
    """Unmount; lazily when a failed command left a file open there (umount: target is busy)."""
    if subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30).returncode != 0:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def _out_name(argv: list[str]) -> str:
    if argv[0] == "demo" or argv[:2] in (["export", "zenodo"], ["export", "parquet"]):
        return "out"  # a directory
    return "out.html" if argv[0] in ("report",) or argv[:2] == ["fleet", "report"] else "out.json"


def _left(directory: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name not in keep)


@pytest.mark.parametrize("argv", WRITERS, ids=_writer_id)
def test_full_disk_is_73_in_one_line_and_leaves_nothing(work, capsys, full_fs, argv):
    _needs_fleet(argv)
    out = full_fs / _out_name(argv)
    rc, _, err = run_main(_argv(argv, {**work, "out": out}), capsys)
    assert rc == exitcodes.CANNOT_WRITE, err
    assert err.count("\n") == 1 and "Traceback" not in err and "No space left on device" in err, err
    assert _left(full_fs, {"filler"}) == []  # neither a truncated document, a temporary nor an empty directory
    assert not (work["dir"] / "r_figures.html").exists()  # no page without its figures


def test_record_full_disk_says_it_once(work, capsys, full_fs):
    """The trace cannot be created: 73, one line that names the trace and the cause once (it read
    'cannot write trace to X: [Errno 28] cannot write trace X: ENOSPC (...)')."""
    pytest.importorskip("torch")
    out = full_fs / "r.kvt.h5"
    rc, _, err = run_main(["record", "--model", "preset:llama-3.1-8b", "--tiny", "--prompt", "x", "--max-new-tokens",
                           "2", "--device", "cpu", "-o", str(out)], capsys)
    assert rc == exitcodes.CANNOT_WRITE, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("kvtrace: cannot write trace") and "No space left on device" in line, err
    assert line.count(str(out)) == 1 and line.count("cannot write") == 1 and "[Errno" not in line, err
    assert _left(full_fs, {"filler"}) == []


def test_read_only_file_system_is_73_and_says_so(work, capsys, tmp_path):
    """A read-only mount: exit 73 naming the cause (root may write anywhere else, so os.access is
    what tells; the message said 'permission denied')."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(mnt)], capture_output=True,
                         text=True, timeout=30)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        for argv in (["whatif", str(work["a"]), "--policy", "knorm", "--ratio", "0.5", "--json-out", str(mnt / "w.json")],
                     ["calc", "--preset", "llama-3.1-8b", "--context", "4k", "--gpu-memory", "80GiB",
                      "--json-out", str(mnt / "c.json")],
                     ["serve", "preset:llama-3.1-8b", "--tiny", "-o", str(mnt / "s.kvt.h5")]):
            rc, _, err = run_main(argv, capsys)
            assert rc == exitcodes.CANNOT_WRITE and "read-only file system" in err and err.count("\n") == 1, err
    finally:
        _umount(mnt)


# RLIMIT_FSIZE (as `ulimit -f` sets it) in a child process: CPython ignores SIGXFSZ, so a write past
# the limit fails with EFBIG. 200 bytes: every JSON document here is larger.
_LIMIT = 200


def _limited() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (_LIMIT, _LIMIT))


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "win32", reason="RLIMIT_FSIZE needs POSIX")
@pytest.mark.parametrize("argv", [
    ["whatif", "{a}", "--policy", "knorm", "--ratio", "0.5", "--json-out", "{out}"],
    ["diff", "{wa}", "{wb}", "--json-out", "{out}"],
    ["calc", "--trace", "{r0}", "--trace", "{r1}", "--context", "4k", "--gpu-memory", "80GiB", "--json-out", "{out}"],
    ["fleet", "{fleet}", "--json-out", "{out}"],
    ["report", "{a}", "-o", "{out}", "--no-whatif"],
    ["export", "perfetto", "{a}", "-o", "{out}"],
    ["fleet", "report", "{fleet}", "-o", "{out}"],
], ids=lambda a: " ".join(a[:2]))
def test_file_size_limit_is_73_and_leaves_no_partial_document(work, tmp_path, argv):
    _needs_fleet(argv)
    out = tmp_path / "limited" / "out.json"
    out.parent.mkdir()
    out.write_text('{"previous": "document"}\n')  # an earlier run's output: kept whole on failure
    proc = subprocess.run([sys.executable, "-m", "kvtrace.cli", *_argv(argv, {**work, "out": out})],
                          capture_output=True, text=True, timeout=300, preexec_fn=_limited)
    assert proc.returncode == exitcodes.CANNOT_WRITE, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "File too large" in proc.stderr, proc.stderr
    assert out.read_text() == '{"previous": "document"}\n'
    assert _left(out.parent, {"out.json"}) == []


def test_json_out_onto_a_pipe_does_not_wait_to_read_it(work, tmp_path):
    """`--json-out /dev/stdout | jq` must not hang: the check for an existing trace read from the
    pipe (its own stdout) and waited forever."""
    script = (f'"{sys.executable}" -m kvtrace.cli calc --trace "{work["r0"]}" --trace "{work["r1"]}" --context 4k '
              f'--gpu-memory 80GiB --json-out /dev/stdout --quiet | cat; echo "rc=${{PIPESTATUS[0]}}"')
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.stdout.rstrip().endswith("rc=0"), (proc.stdout[-500:], proc.stderr[-2000:])
    body = proc.stdout[:proc.stdout.rindex("rc=0")]
    assert '"rank_check"' in body and body.rstrip().endswith("FITS")


# ---- a closed stdout ----------------------------------------------------------------------------

PRINTERS = [
    ["whatif", "{a}", "--policy", "knorm", "--ratio", "0.5"],
    ["whatif", "{a}", "--policy", "knorm", "--ratio", "0.5", "--json"],
    ["diff", "{wa}", "{wb}"],
    ["diff", "{a}", "{b}", "--whatif", "knorm", "--whatif-ratio", "0.5"],
    ["calc", "--trace", "{r0}", "--trace", "{r1}", "--context", "4k", "--gpu-memory", "80GiB"],
    ["fleet", "{fleet}"],
    ["fleet", "{fleet}", "--sql", "SELECT * FROM steps"],
    ["fleet", "{fleet}", "--json"],
    ["fleet", "diff", "{fleet}", "--baseline", "model_type=llama", "--candidate", "model_type=llama"],
    ["presets"],
]


@pytest.mark.slow
@pytest.mark.parametrize("argv", PRINTERS, ids=lambda a: " ".join(x for x in a[:3] if not x.startswith("{")))
def test_closed_stdout_is_a_quiet_141(work, argv):
    _needs_fleet(argv)
    proc = _closed_pipe_run(*_argv(argv, work))
    assert proc.returncode == exitcodes.BROKEN_PIPE, proc.stderr[-2000:]
    assert proc.stderr == ""


HELP = [["--help"], ["--version"], *[[name, "--help"] for name in COMMANDS],
        ["export", "perfetto", "--help"], ["fleet", "report", "--help"]]


@pytest.mark.parametrize("argv", HELP, ids=" ".join)
def test_help_onto_a_closed_stdout_is_a_quiet_141(argv):
    """`kvtrace CMD --help | head -1` was exit 1 (click's own EPIPE handling)."""
    proc = _closed_pipe_run(*argv)
    assert proc.returncode == exitcodes.BROKEN_PIPE, proc.stderr[-2000:]
    assert proc.stderr == ""
    # the control: the same text onto an open stdout is exit 0
    proc = subprocess.run([sys.executable, "-m", "kvtrace.cli", *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-2000:]


# ---- loadtest and serve (kvtrace/serving/**, commands/loadtest.py and serve.py: tested here) ---------

class _Server:
    """A local HTTP server answering /health 200 and, on POST, as ``mode`` says: "openai" streams
    a completion as an OpenAI-compatible server does; "html" answers 200 with a web page; "404"
    answers every POST with 404 (a server that is not an OpenAI one)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path == "/health":
                    self._send(200, b'{"status": "ok"}', "application/json")
                else:
                    self._send(404, b"not found", "text/plain")

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if server.mode == "openai" and self.path.startswith("/v1/"):
                    chunks = [json.dumps({"choices": [{"index": 0, "text": w}]}) for w in ("a", " b")]
                    chunks.append(json.dumps({"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 2}}))
                    body = "".join(f"data: {c}\n\n" for c in chunks) + "data: [DONE]\n\n"
                    self._send(200, body.encode(), "text/event-stream")
                elif server.mode == "html":
                    self._send(200, b"<html><body>a web page</body></html>", "text/html")
                else:
                    self._send(404, b"not found", "text/plain")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[_Server]:
    pytest.importorskip("httpx")
    s = _Server(getattr(request, "param", "openai"))
    try:
        yield s
    finally:
        s.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_QUICK = ["--phases", "single", "--tokens", "8", "--max-tokens", "2", "--timeout", "10"]


@pytest.mark.parametrize(("args", "code", "phrase"), [
    (["notaurl"], exitcodes.USAGE, "is not an http(s) URL"),
    (["ftp://host/"], exitcodes.USAGE, "is not an http(s) URL"),
    (["http://127.0.0.1:99999"], exitcodes.USAGE, "Port out of range"),
    (["{url}", "--phases", "nope"], exitcodes.USAGE, "unknown phase(s) nope"),
    (["{url}", "--phases", ""], exitcodes.USAGE, "no phase named"),
    (["{url}", "--phases", ","], exitcodes.USAGE, "no phase named"),
    (["{url}", "--concurrency", "0"], exitcodes.USAGE, "--concurrency"),
    (["{url}", "--trace", "{a}", "-o", "{a}"], exitcodes.USAGE, "is also an input"),
    (["{url}", "--json-out", "{b}"], exitcodes.USAGE, "existing trace"),
    (["{url}", "-o", "{dir}/no/such/lat.csv"], exitcodes.CANNOT_WRITE, "does not exist"),
    (["{url}", *_QUICK, "--trace", "{trunc}"], exitcodes.UNREADABLE, "truncated or corrupt"),
    (["{url}", *_QUICK, "--trace", "{notwi}"], exitcodes.UNREADABLE, "not an HDF5 file"),
    (["{url}", *_QUICK, "--trace", "{v9}"], exitcodes.VERSION, "trace format 9.0 is newer"),
    (["http://127.0.0.1:{port}", *_QUICK], exitcodes.UNAVAILABLE, "cannot load-test"),
    (["http://[::1", *_QUICK], exitcodes.USAGE, "Invalid value for URL: 'http://[::1' is not an http(s) URL"),
    # a missing trace is 2 as for every command that reads one (was 64), and before any request is sent
    (["{url}", *_QUICK, "--trace", "{dir}/missing.kvt.h5"], exitcodes.UNREADABLE, "missing.kvt.h5: no such file"),
    (["{url}", *_QUICK, "--trace", "{dir}"], exitcodes.UNREADABLE, ": is a directory"),
], ids=lambda v: v if isinstance(v, (int, str)) else " ".join(map(str, v[:2])))
def test_loadtest_bad_input(work, capsys, server, args, code, phrase):
    argv = ["loadtest", *_argv(args, {**work, "url": server.url, "port": _free_port()})]  # type: ignore[dict-item]
    rc, _, err = run_main(argv, capsys)
    assert rc == code, err
    assert err.count("\n") == 1 and "Traceback" not in err and phrase in err, err


@pytest.mark.parametrize("server", ["html", "404"], indirect=True)
def test_loadtest_against_a_server_that_is_not_openai_is_69(work, capsys, server):
    rc, _, err = run_main(["loadtest", server.url, *_QUICK, "--warmup", "1"], capsys)
    assert rc == exitcodes.UNAVAILABLE, err
    assert err.count("\n") == 1 and "OpenAI" in err, err


def test_loadtest_clean_control_and_its_outputs(work, capsys, server, tmp_path):
    """The fake OpenAI server is load-tested (exit 0): the refusals above are about the input."""
    csv, doc = tmp_path / "lat.csv", tmp_path / "lt.json"
    rc, _, err = run_main(["loadtest", server.url, *_QUICK, "-o", str(csv), "--json-out", str(doc)], capsys)
    assert rc == 0, err
    rows = csv.read_text().splitlines()
    assert len(rows) >= 2 and json.loads(doc.read_text())["url"] == server.url


def test_loadtest_full_disk_is_73(work, capsys, server, full_fs):
    for opt, name in (("-o", "lat.csv"), ("--json-out", "lt.json")):
        rc, _, err = run_main(["loadtest", server.url, *_QUICK, opt, str(full_fs / name)], capsys)
        assert rc == exitcodes.CANNOT_WRITE, err
        assert err.count("\n") == 1 and "No space left on device" in err, err


def test_loadtest_closed_stdout_is_a_quiet_141(work, server):
    proc = _closed_pipe_run("loadtest", server.url, *_QUICK)
    assert proc.returncode == exitcodes.BROKEN_PIPE, proc.stderr[-2000:]
    assert proc.stderr == ""


@pytest.mark.parametrize(("args", "code", "phrase"), [
    (["{dir}/no/such/model", "-o", "{dir}/s.kvt.h5"], exitcodes.USAGE, "no such model directory"),
    (["{nomodel}", "-o", "{dir}/s.kvt.h5"], exitcodes.USAGE, "config.json"),
    (["preset:nosuch", "-o", "{dir}/s.kvt.h5"], exitcodes.USAGE, "unknown preset 'nosuch'"),
    (["preset:llama-3.1-8b", "--tiny", "-o", "{dir}/no/such/s.kvt.h5"], exitcodes.CANNOT_WRITE, "does not exist"),
    (["preset:llama-3.1-8b", "--tiny", "-o", "{a}"], exitcodes.USAGE, "--force"),
    (["preset:llama-3.1-8b", "--tiny", "-o", "{dir}"], exitcodes.USAGE, "directory"),
    (["preset:llama-3.1-8b", "--tiny", "-o", "{dir}/s.kvt.h5", "--port", "0"], exitcodes.USAGE, "--port"),
], ids=lambda v: v if isinstance(v, (int, str)) else " ".join(map(str, v[:1])))
def test_serve_bad_input(work, capsys, args, code, phrase):
    before = digest(work["a"])
    rc, _, err = run_main(["serve", *_argv(args, work)], capsys)
    assert rc == code, err
    assert err.count("\n") == 1 and "Traceback" not in err and phrase in err, err
    assert digest(work["a"]) == before and not (work["dir"] / "s.kvt.h5").exists()


def test_serve_port_in_use_is_69_and_writes_no_trace(work, tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("torch")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = tmp_path / "s.kvt.h5"
        proc = subprocess.run([sys.executable, "-m", "kvtrace.cli", "serve", "preset:llama-3.1-8b", "--tiny",
                               "-o", str(out), "--port", str(port), "--device", "cpu", "--quiet"],
                              capture_output=True, text=True, timeout=300)
    assert proc.returncode == exitcodes.UNAVAILABLE, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("kvtrace: cannot serve on") and "in use" in last, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not out.exists()


@pytest.mark.slow
def test_serve_full_disk_is_73(work, full_fs):
    """A trace that cannot be written is 73 as in record (was 69 'cannot serve ...: CannotWriteTrace'),
    said once."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, "-m", "kvtrace.cli", "serve", "preset:llama-3.1-8b", "--tiny", "-o",
                           str(full_fs / "s.kvt.h5"), "--port", str(_free_port()), "--device", "cpu", "--quiet"],
                          capture_output=True, text=True, timeout=300)
    assert "Traceback" not in proc.stderr
    assert proc.returncode == exitcodes.CANNOT_WRITE, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("kvtrace: cannot write trace") and "No space left on device" in last, proc.stderr[-3000:]
    assert last.count("s.kvt.h5") == 1 and "[Errno" not in last, last
