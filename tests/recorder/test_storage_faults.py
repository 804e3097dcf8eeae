"""The recorder under real storage faults (spec §8.1): a file size limit (RLIMIT_FSIZE, in a child
process), a full tmpfs, the output directory removed mid-recording. generate() always finishes
and returns normally, one warning line names the file and the error, the trace validates as
incomplete with the reason, and `kvtrace record` exits 74 after generation."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

import kvtrace
from kvtrace import exitcodes
from kvtrace.format.reader import Trace
from kvtrace.format.summary import stopped
from kvtrace.format.validate import validate
from tests.helpers.models import tiny_model, tiny_prompt

WARNING = "kvtrace: warning: stopped writing trace"
LIMIT = 1_500_000  # bytes: a few requests with whole K/V samples at every step need ~10 MB

# Three requests recording whole K/V samples at every step. SIGXFSZ is reset to its default
# action first (what an embedding application may have): without the recorder ignoring it while
# recording, the first write past the limit would kill the process.
CHILD = textwrap.dedent(
    """
    import resource, signal, sys
    limit = int(sys.argv[2])
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    import kvtrace
    from tests.helpers.models import tiny_model, tiny_prompt
    m = tiny_model("llama")
    with kvtrace.record(m, sys.argv[1], sampling={"every_n_steps": 1, "tokens": "all"},
                        flush_interval_s=0.05) as rec:
        for i in range(3):
            out = m.generate(tiny_prompt(120), max_new_tokens=30, min_new_tokens=30, do_sample=False)
            print("generated", i, out.shape[-1], flush=True)
    print("failure", rec.storage_failure.errno if rec.storage_failure else 0, flush=True)
    print("sigxfsz restored", signal.getsignal(signal.SIGXFSZ) == signal.SIG_DFL, flush=True)
    """
)


def _clean(err: str) -> None:
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    assert err.count(WARNING) == 1, err[-3000:]


def _cli(argv: list[str], capfd: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`kvtrace ARGV` in-process: (exit code, stdout + stderr)."""
    from kvtrace.cli import main

    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
        raise SystemExit(0)
    out = capfd.readouterr()
    return int(exit_info.value.code or 0), out.out + out.err


def _check_stopped(path: Path, code: int, capfd: pytest.CaptureFixture[str]) -> None:
    """Valid, incomplete, and says why; `kvtrace info` and `validate` say so too."""
    report = validate(path)
    assert report.valid, report.problems
    assert any("stopped early" in w and errno.errorcode[code] in w for w in report.warnings), report.warnings
    with Trace(path) as t:
        assert not t.complete
        stop = stopped(t)
        assert stop is not None and stop["errno"] == code
    rc, text = _cli(["info", str(path)], capfd)
    assert rc == 0 and f"INCOMPLETE (writer stopped early: {errno.errorcode[code]}" in text, text
    rc, text = _cli(["validate", str(path)], capfd)
    assert rc == 0 and "stopped early" in text, text


@pytest.mark.slow
def test_rlimit_fsize_generate_finishes_and_trace_says_why(tmp_path, capfd):
    path = tmp_path / "limited.kvt.h5"
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path), str(LIMIT)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [ln for ln in proc.stdout.splitlines() if ln.startswith("generated")] == [
        "generated 0 150", "generated 1 150", "generated 2 150"]
    assert f"failure {errno.EFBIG}" in proc.stdout
    assert "sigxfsz restored True" in proc.stdout  # ignored only while recording
    _clean(proc.stderr)
    assert str(path) in proc.stderr and "EFBIG" in proc.stderr
    assert path.stat().st_size <= LIMIT
    _check_stopped(path, errno.EFBIG, capfd)


@pytest.mark.slow
def test_cli_record_exits_74_after_generation(tmp_path, capfd):
    out = tmp_path / "cli.kvt.h5"
    cmd = [sys.executable, "-m", "kvtrace.cli", "record", "--model", "preset:llama-3.1-8b", "--layers", "2",
           "--width", "0.05", "--vocab", "512", "--prompt", "x" * 60, "--prompt", "y" * 60,
           "--max-new-tokens", "24", "--min-new-tokens", "24", "--sample-every", "1", "--sample-tokens", "all",
           "-o", str(out)]

    def limit() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (400_000, 400_000))

    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, preexec_fn=limit)
    assert proc.returncode == exitcodes.IO_ERROR == 74, proc.stderr[-3000:]
    _clean(proc.stderr)
    assert "request 1: 60 prompt tokens, 24 new" in proc.stderr  # generation ran to the end
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("kvtrace: ") and "trace incomplete" in last and "EFBIG" in last
    _check_stopped(out, errno.EFBIG, capfd)


def _generate(model, n: int = 3) -> list[int]:
    lengths = []
    for _ in range(n):
        out = model.generate(tiny_prompt(120), max_new_tokens=30, min_new_tokens=30, do_sample=False)
        lengths.append(int(out.shape[-1]))
    return lengths


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs, where this process may mount one (root, or a user namespace that allows it)."""
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
    mnt.mkdir()
    try:
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot run mount: {exc}")
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30)


def test_full_tmpfs(small_tmpfs, capfd):
    model = tiny_model("llama")
    path = small_tmpfs / "full.kvt.h5"
    with torch.no_grad(), kvtrace.record(model, path, sampling={"every_n_steps": 1, "tokens": "all"},
                                         flush_interval_s=0.05) as rec:
        assert _generate(model) == [150, 150, 150]
    assert rec.storage_failure is not None and rec.storage_failure.errno == errno.ENOSPC
    _clean(capfd.readouterr().err)
    _check_stopped(path, errno.ENOSPC, capfd)


def test_output_directory_removed_mid_recording(tmp_path, capfd):
    model = tiny_model("llama")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    path = out_dir / "gone.kvt.h5"
    with torch.no_grad(), kvtrace.record(model, path, flush_interval_s=0.05) as rec:
        assert _generate(model, 1) == [150]
        shutil.rmtree(out_dir)
        assert _generate(model, 2) == [150, 150]  # the user's run goes on
    assert rec.storage_failure is not None and rec.storage_failure.errno == errno.ENOENT
    err = capfd.readouterr().err
    _clean(err)
    assert "deleted or its directory removed" in err
    assert not out_dir.exists()


def test_recording_without_a_fault_prints_nothing(tmp_path, capfd):
    """The control for the tests above: the same recording on a healthy disk is larger than
    their limits (so they did hit them) and ends complete, with no warning."""
    model = tiny_model("llama")
    path = tmp_path / "ok.kvt.h5"
    with torch.no_grad(), kvtrace.record(model, path, sampling={"every_n_steps": 1, "tokens": "all"},
                                         flush_interval_s=0.05) as rec:
        assert _generate(model) == [150, 150, 150]
    assert rec.storage_failure is None
    assert WARNING not in capfd.readouterr().err
    assert os.path.getsize(path) > 2 * 1024 * 1024 > LIMIT
    with Trace(path) as t:
        assert t.complete and stopped(t) is None
