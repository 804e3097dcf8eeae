"""No kvtrace command writes onto one of its inputs or onto an existing trace (a typo
must not destroy a recording).

Every case checks the exit code (64: the command line names a file it must not write; 73: the
output cannot be created), a one-line message, and that the protected file is byte-for-byte
unchanged. The clean controls beside them show the same options do write where they may.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from kvtrace import exitcodes
from tests.helpers.cli_run import run_main as run

FIXTURE = Path(__file__).parent / "data" / "gpu_gemma3_tiny.kvt.h5"


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture()
def files(tmp_path):
    a, b = tmp_path / "a.kvt.h5", tmp_path / "b.kvt.h5"
    shutil.copyfile(FIXTURE, a)
    shutil.copyfile(FIXTURE, b)
    link = tmp_path / "link-to-a.json"
    link.symlink_to(a)
    hard = tmp_path / "hard-a.out"
    os.link(a, hard)
    return {"a": a, "b": b, "link": link, "hard": hard, "dir": tmp_path}


# (argv template, what it protects). {a} is the command's input, {b} another existing trace,
# {link} a symlink to {a}, {hard} a hard link to {a}.
REFUSED = [
    (["info", "{a}", "--json-out", "{a}"], "a"),
    (["info", "{a}", "--json-out", "{link}"], "a"),
    (["info", "{a}", "--json-out", "{hard}"], "a"),
    (["info", "{a}", "--json-out", "{b}"], "b"),
    (["validate", "{a}", "--json-out", "{a}"], "a"),
    (["analyze", "{a}", "--json-out", "{a}"], "a"),
    (["analyze", "{a}", "{b}", "--json-out", "{b}"], "b"),
    (["analyze", "{a}", "--json", "{b}.json"], "a"),  # the old `--json FILE`: a usage error now
    (["diff", "{a}", "{b}", "--json-out", "{b}"], "b"),
    (["report", "{a}", "-o", "{a}"], "a"),
    (["report", "{a}", "-o", "{link}"], "a"),
    (["report", "{a}", "-o", "{b}"], "b"),
    (["report", "{a}", "-o", "{dir}/r.html", "--json-out", "{dir}/r.html"], "a"),
    (["report", "{a}", "-o", "{dir}/r.html", "--figures", "{b}"], "b"),
    (["export", "perfetto", "{a}", "-o", "{a}"], "a"),
    (["export", "perfetto", "{a}", "-o", "{b}"], "b"),
    (["export", "perfetto", "{a}", "-o", "{dir}/t.json", "--json-out", "{a}"], "a"),
    (["export", "prometheus-textfile", "{a}", "-o", "{hard}"], "a"),
    (["export", "zenodo", "{a}", "-o", "{a}", "--creator", "Doe, Jane"], "a"),
    (["export", "zenodo", "{a}", "-o", "{b}", "--creator", "Doe, Jane"], "b"),
    (["calc", "--trace", "{a}", "--context", "4096", "--gpu-memory", "80GiB", "--json-out", "{a}"], "a"),
    (["presets", "--json-out", "{b}"], "b"),
    (["record", "--model", "preset:llama-3.1-8b", "--tiny", "--prompt", "x", "--max-new-tokens", "2",
      "-o", "{dir}"], "a"),  # a directory as the trace file: 64 like click's own path checks
]


@pytest.mark.parametrize("argv, protected", REFUSED, ids=[" ".join(a[:3]) for a, _ in REFUSED])
def test_outputs_never_replace_inputs_or_traces(files, capsys, argv, protected):
    keep = {k: digest(files[k]) for k in ("a", "b")}
    code, _, err = run([part.format(**files) for part in argv], capsys)
    assert code == exitcodes.USAGE, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert digest(files[protected]) == keep[protected]
    assert digest(files["a"]) == keep["a"] and digest(files["b"]) == keep["b"]


def test_analyze_json_before_traces_reads_both_and_writes_neither(files, capsys):
    """The reported case: `analyze --json a b` replaced a with JSON. Now --json is a flag."""
    keep = digest(files["a"])
    code, out, err = run(["analyze", "--json", str(files["a"]), str(files["b"])], capsys)
    assert code == 0, err
    assert len(json.loads(out)["reports"]) == 2
    assert digest(files["a"]) == keep


@pytest.mark.parametrize("argv", [
    ["info", "{a}", "--json-out", "{dir}/no/such/dir/x.json"],
    ["report", "{a}", "-o", "{dir}/no/such/dir/r.html"],
    ["export", "perfetto", "{a}", "-o", "{dir}/no/such/dir/t.json"],
    ["analyze", "{a}", "--json-out", "{dir}/no/such/dir/r.json"],
])
def test_uncreatable_outputs_exit_73(files, capsys, argv):
    code, _, err = run([part.format(**files) for part in argv], capsys)
    assert code == exitcodes.CANNOT_WRITE, err
    assert err.count("\n") == 1


def test_json_out_writes_what_json_prints(files, capsys):
    """The clean control: --json-out writes a new file, identical to what --json prints."""
    out_file = files["dir"] / "info.json"
    code, printed, err = run(["info", str(files["a"]), "--json", "--json-out", str(out_file)], capsys)
    assert code == 0, err
    assert json.loads(out_file.read_text()) == json.loads(printed)
    # an existing non-trace output (a previous JSON) may be replaced: only traces and inputs are protected
    code, _, err = run(["validate", str(files["a"]), "--json-out", str(out_file)], capsys)
    assert code == 0, err
    assert json.loads(out_file.read_text())["valid"] is True


def test_record_refuses_existing_output_and_its_prompts_file(files, capsys, monkeypatch):
    import kvtrace.commands.record as rec_cmd

    def never(*a, **k):
        raise AssertionError("model loaded despite a refused output")

    monkeypatch.setattr(rec_cmd, "load_model", never)
    base = ["record", "--model", "preset:llama-3.1-8b", "--tiny", "--max-new-tokens", "2"]
    keep = digest(files["a"])
    code, _, err = run([*base, "--prompt", "x", "-o", str(files["a"])], capsys)
    assert code == exitcodes.USAGE and "--force" in err and err.count("\n") == 1
    prompts = files["dir"] / "prompts.txt"
    prompts.write_text("hello\n")
    code, _, err = run([*base, "--prompts", str(prompts), "-o", str(prompts), "--force"], capsys)
    assert code == exitcodes.USAGE and "input" in err
    assert prompts.read_text() == "hello\n" and digest(files["a"]) == keep
    code, _, err = run([*base, "--prompt", "x", "-o", str(files["dir"] / "m.kvt.h5"),
                        "--prometheus-textfile", str(files["dir"] / "m.kvt.h5")], capsys)
    assert code == exitcodes.USAGE and "same file" in err


# ---- files inside an output directory are created, never written through (no symlink is followed) -----


def _plant(kind: str, at: Path, outside: Path) -> None:
    """Put a symlink to, a hard link of, or a FIFO at ``at`` (outside: a file in another directory)."""
    if at.exists() or at.is_symlink():
        at.unlink()
    if kind == "symlink":
        at.symlink_to(outside)
    elif kind == "hardlink":
        os.link(outside, at)
    else:
        os.mkfifo(at)


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "elsewhere" / "victim.bin"
    victim.parent.mkdir()
    victim.write_bytes(b"victim: must stay byte-identical\n")
    return victim


def _all_regular(directory: Path) -> None:
    for p in directory.rglob("*"):
        assert p.is_dir() or (p.is_file() and not p.is_symlink() and os.stat(p).st_nlink == 1), p


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "fifo"])
def test_export_parquet_replaces_links_in_its_directory(tmp_path, capsys, kind):
    """A symlink, hard link or FIFO at the names `export parquet` writes (the per-trace tables; the
    manifest and traces.parquet are read first, and a link there is a damaged fleet, exit 2):
    replaced by a new file; the file it pointed to keeps every byte, a FIFO is never opened."""
    pytest.importorskip("pyarrow")
    pytest.importorskip("duckdb")
    trace, out = tmp_path / "t.kvt.h5", tmp_path / "fleet"
    shutil.copyfile(FIXTURE, trace)
    code, printed, err = run(["export", "parquet", str(trace), "-o", str(out), "--json"], capsys)
    assert code == 0, err
    tid = json.loads(printed)["exported"][0]["trace_id"]
    victim = _victim(tmp_path)
    keep = digest(victim)
    planted = [p for p in out.glob(f"*/{tid}.parquet")]
    assert planted
    for p in planted:
        _plant(kind, p, victim)
    code, _, err = run(["export", "parquet", str(trace), "-o", str(out), "--force"], capsys)
    assert code == 0, err
    assert digest(victim) == keep and os.stat(victim).st_nlink == 1
    _all_regular(out)
    for name in ("_manifest.json", "traces.parquet"):  # read before anything is written: refused
        saved = (out / name).read_bytes()
        _plant("symlink", out / name, victim)
        code, _, err = run(["export", "parquet", str(trace), "-o", str(out), "--force"], capsys)
        assert code == exitcodes.UNREADABLE and name in err and err.count("\n") == 1, err
        assert digest(victim) == keep
        (out / name).unlink()
        (out / name).write_bytes(saved)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["symlink", "hardlink", "fifo"])
def test_report_figures_replace_links_in_their_directory(tmp_path, capsys, kind):
    """The same for `report --figures DIR`: every figure is a new file; what a planted link points
    to keeps every byte."""
    pytest.importorskip("matplotlib")
    trace, figs = tmp_path / "t.kvt.h5", tmp_path / "figs"
    shutil.copyfile(FIXTURE, trace)
    code, printed, err = run(["report", str(trace), "-o", str(tmp_path / "r.html"), "--figures", str(figs),
                              "--no-whatif", "--no-analysis", "--json"], capsys)
    assert code == 0, err
    names = [Path(p).name for p in json.loads(printed)["figures"]]
    assert names
    victim = _victim(tmp_path)
    keep = digest(victim)
    for name in names:
        _plant(kind, figs / name, victim)
    code, _, err = run(["report", str(trace), "-o", str(tmp_path / "r.html"), "--figures", str(figs),
                        "--no-whatif", "--no-analysis"], capsys)
    assert code == 0, err
    assert digest(victim) == keep and os.stat(victim).st_nlink == 1
    _all_regular(figs)
    assert sorted(p.name for p in figs.iterdir()) == sorted(names)  # no staging directory left


def test_report_figures_failing_midway_leave_no_partial_set(tmp_path, capsys, monkeypatch):
    """A full disk at the third figure: exit 73; a --figures directory the run made is gone, and
    an existing one holds exactly what it held (an earlier run's figures, unchanged)."""
    import errno

    pytest.importorskip("matplotlib")
    from kvtrace.report import build

    trace = tmp_path / "t.kvt.h5"
    shutil.copyfile(FIXTURE, trace)
    real, calls = build.create_in_dir, []

    def full(root, rel, write):
        calls.append(rel)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(root, rel, write)

    monkeypatch.setattr(build, "create_in_dir", full)
    argv = ["report", str(trace), "-o", str(tmp_path / "r.html"), "--no-whatif", "--no-analysis", "--figures"]
    code, _, err = run([*argv, str(tmp_path / "new")], capsys)
    assert code == exitcodes.CANNOT_WRITE and err.count("\n") == 1, err
    assert not (tmp_path / "new").exists()
    old = tmp_path / "old"
    old.mkdir()
    (old / "layer_footprint.svg").write_text("<svg>an earlier run</svg>")
    before = {p.name: digest(p) for p in old.iterdir()}
    calls.clear()
    code, _, err = run([*argv, str(old)], capsys)
    assert code == exitcodes.CANNOT_WRITE, err
    assert {p.name: digest(p) for p in old.iterdir()} == before
    monkeypatch.setattr(build, "create_in_dir", lambda *a: (_ for _ in ()).throw(RuntimeError("a bug midway")))
    code, _, err = run([*argv, str(old)], capsys)
    assert code == exitcodes.INTERNAL  # the injected bug; the directory is still as it was
    assert {p.name: digest(p) for p in old.iterdir()} == before


def test_explicit_output_may_be_a_device_fifo_or_link(files, capsys):
    """A path the user named is theirs: a FIFO (`--json-out >(jq .)`) or a symlink to a device
    (`/dev/stdout`) is written in place; a hard-linked regular file is replaced by a new file, so
    the other name keeps its content."""
    import threading

    fifo = files["dir"] / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    code, _, err = run(["info", str(files["a"]), "--json-out", str(fifo)], capsys)
    reader.join(60)
    assert code == 0 and json.loads(got[0])["path"], err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    null = files["dir"] / "null"
    null.symlink_to(os.devnull)
    code, _, err = run(["info", str(files["a"]), "--json-out", str(null)], capsys)
    assert code == 0 and null.is_symlink() and stat.S_ISCHR(os.stat(os.devnull).st_mode), err
    other = files["dir"] / "other.json"
    other.write_text('{"kept": true}')
    os.link(other, files["dir"] / "out.json")
    code, _, err = run(["info", str(files["a"]), "--json-out", str(files["dir"] / "out.json")], capsys)
    assert code == 0, err
    assert json.loads(other.read_text()) == {"kept": True}
    assert json.loads((files["dir"] / "out.json").read_text())["path"]
