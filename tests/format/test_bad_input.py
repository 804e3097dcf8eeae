"""Every kind of bad input: one line on stderr, the documented exit code, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import zstandard
from fmt_helpers import write_minimal

from kvtrace import exitcodes
from kvtrace.format import CacheDType, PayloadKind, TraceWriter, encode_payload, schema
from kvtrace.format.codec import decode_chunk
from kvtrace.format.errors import CorruptChunk


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, KVTRACE_DEBUG="")
    return subprocess.run([sys.executable, "-m", "kvtrace.cli", *args], capture_output=True,
                          text=True, env=env, timeout=120)


def assert_one_line_error(proc: subprocess.CompletedProcess, code: int) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) >= 1
    return proc.stderr


def payload_trace(path: Path) -> None:
    rng = np.random.default_rng(1)
    with TraceWriter(path, {"model_id": "m", "contains_tensor_payloads": True}) as w:
        w.write_payload(encode_payload(0, 0, 0, PayloadKind.KEY, CacheDType.BFLOAT16,
                                       rng.integers(0, 1 << 16, (1, 2, 40, 64), dtype=np.uint16)))


@pytest.mark.parametrize("command", ["info", "validate"])
def test_random_bytes(tmp_path, command):
    p = tmp_path / "random.kvt.h5"
    p.write_bytes(np.random.default_rng(0).bytes(4096))
    err = assert_one_line_error(run_cli(command, str(p)), exitcodes.UNREADABLE)
    assert "not an HDF5 file" in err


@pytest.mark.parametrize("command", ["info", "validate"])
def test_empty_file(tmp_path, command):
    p = tmp_path / "empty.kvt.h5"
    p.touch()
    err = assert_one_line_error(run_cli(command, str(p)), exitcodes.UNREADABLE)
    assert "empty file" in err


def test_missing_file(tmp_path):
    assert_one_line_error(run_cli("info", str(tmp_path / "nope.h5")), exitcodes.UNREADABLE)


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9])
def test_truncated_trace(tmp_path, fraction):
    p = tmp_path / "t.kvt.h5"
    payload_trace(p)
    data = p.read_bytes()
    p.write_bytes(data[: int(len(data) * fraction)])
    proc = run_cli("validate", str(p))
    # Depending on where the cut falls HDF5 refuses to open (2) or objects fail to read (1).
    assert proc.returncode in (exitcodes.UNREADABLE, exitcodes.INVALID), proc.stderr
    assert_one_line_error(proc, proc.returncode)


def test_hdf5_that_is_not_a_trace(tmp_path):
    p = tmp_path / "other.h5"
    with h5py.File(p, "w") as f:
        f["x"] = np.arange(10)
    err = assert_one_line_error(run_cli("validate", str(p)), exitcodes.UNREADABLE)
    assert "not a kvtrace trace" in err


def test_newer_major_version_names_both_versions(tmp_path):
    p = tmp_path / "v2.kvt.h5"
    write_minimal(p)
    with h5py.File(p, "a") as f:
        f.attrs["format_version"] = "2.0"
    for command in ("info", "validate"):
        err = assert_one_line_error(run_cli(command, str(p)), exitcodes.VERSION)
        assert "2.0" in err and schema.FORMAT_VERSION in err


def test_missing_required_dataset_is_invalid_and_listed(tmp_path):
    p = tmp_path / "m.kvt.h5"
    write_minimal(p)
    with h5py.File(p, "a") as f:
        del f["kv"]
        del f["events"]
    err = assert_one_line_error(run_cli("validate", str(p)), exitcodes.INVALID)
    assert "missing required dataset /kv" in err and "missing required dataset /events" in err


def _first_chunk_offset(path: Path) -> tuple[int, int]:
    with h5py.File(path, "r") as f:
        info = f[schema.payload_dataset_name(2)].id.get_chunk_info(0)
        return info.byte_offset, info.size


def test_corrupted_zstd_chunk(tmp_path):
    p = tmp_path / "c.kvt.h5"
    payload_trace(p)
    offset, size = _first_chunk_offset(p)
    with open(p, "r+b") as fh:
        fh.seek(offset + size // 2)
        fh.write(b"\xde\xad\xbe\xef" * 4)
    err = assert_one_line_error(run_cli("validate", str(p)), exitcodes.INVALID)
    assert "payload 0" in err
    # The rest of the trace stays usable.
    assert run_cli("info", str(p)).returncode == 0


def test_decompression_bomb_refused_before_allocating(tmp_path, monkeypatch):
    p = tmp_path / "bomb.kvt.h5"
    payload_trace(p)
    bomb = zstandard.ZstdCompressor(level=1).compress(b"\0" * (64 << 20))
    assert len(bomb) < 64 << 10
    with h5py.File(p, "a") as f:
        f[schema.payload_dataset_name(2)].id.write_direct_chunk((0,), bomb, filter_mask=0)
    err = assert_one_line_error(run_cli("validate", str(p)), exitcodes.INVALID)
    assert "refused" in err
    # And in-process: the decompressor is never called for a frame with the wrong size.
    called = []
    for method in ("decompress", "decompressobj"):
        monkeypatch.setattr(zstandard.ZstdDecompressor, method, lambda *a, **k: called.append(1))
    with pytest.raises(CorruptChunk, match="claims 67108864 bytes"):
        decode_chunk(0, bomb, schema.PAYLOAD_CHUNK_BYTES, 2)
    assert not called


def test_frame_without_content_size_refused():
    cobj = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    frame = cobj.compress(b"\1" * 100) + cobj.flush()
    with pytest.raises(CorruptChunk, match="content size"):
        decode_chunk(0, frame, 100, 1)


def test_filter_mask_honoured():
    raw = np.arange(64, dtype=np.uint16).tobytes()
    # zstd skipped (bit 1): stored bytes are only shuffled.
    from kvtrace.format.codec import shuffle_bytes

    assert decode_chunk(0x2, shuffle_bytes(raw, 2), len(raw), 2) == raw
    # both skipped: stored raw.
    assert decode_chunk(0x3, raw, len(raw), 2) == raw


def test_bad_cli_arguments_exit_usage(tmp_path):
    assert_one_line_error(run_cli("info"), exitcodes.USAGE)
    assert_one_line_error(run_cli("no-such-command"), exitcodes.USAGE)
    assert_one_line_error(run_cli("validate", "--bogus-flag", "x"), exitcodes.USAGE)


def test_no_code_path_unpickles(tmp_path):
    """A pickled attribute or object-typed data never gets loaded into Python objects."""
    p = tmp_path / "pickle.kvt.h5"
    write_minimal(p)
    import pickle

    evil = pickle.dumps(ValueError("would be rebuilt by unpickling"))
    with h5py.File(p, "a") as f:
        f["meta"].attrs["evil_json"] = np.void(evil)
    proc = run_cli("validate", str(p))
    assert proc.returncode == exitcodes.INVALID
    assert "Traceback" not in proc.stderr


# ---- the same class from every command (one reader): in-process through the CLI entry point ----

def run_main(*args: str) -> tuple[int, str]:
    import contextlib
    import io

    from kvtrace.cli import main

    out = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            main(list(args))
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue()


def every_command(path: Path, tmp: Path) -> dict[str, tuple[int, str]]:
    p = str(path)
    good = tmp / "good.kvt.h5"
    if not good.exists():
        write_minimal(good)
    return {
        "info": run_main("info", p),
        "validate": run_main("validate", p),
        "analyze": run_main("analyze", p),
        "diff": run_main("diff", str(good), p),
        "report": run_main("report", p, "-o", str(tmp / "r.html"), "-q"),
        "perfetto": run_main("export", "perfetto", p, "-o", str(tmp / "t.json"), "-q"),
        "zenodo": run_main("export", "zenodo", p, "-o", str(tmp / "z"), "--creator", "Doe, J", "-q"),
    }


def assert_all(results: dict[str, tuple[int, str]], code: int, message: str) -> None:
    for name, (got, text) in results.items():
        assert got == code, (name, got, text)
        assert "Traceback" not in text and "internal error" not in text, (name, text)
        assert message in text, (name, text)


def test_directory_is_not_a_trace_everywhere(tmp_path):
    d = tmp_path / "dir.kvt.h5"
    d.mkdir()
    assert_all(every_command(d, tmp_path), exitcodes.UNREADABLE, "is a directory")


def test_unknown_outcome_is_invalid_not_internal(tmp_path):
    """'9 is not a valid Outcome' was exit 70 in info and report. Since 1.3 the column is an HDF5
    enum type: a code it does not name is still stored as written and refused by kvtrace."""
    p = tmp_path / "enum.kvt.h5"
    write_minimal(p)
    with h5py.File(p, "a") as f:
        row = f["requests"][0]
        row["outcome"] = 9
        f["requests"][0] = row
    assert_all(every_command(p, tmp_path), exitcodes.INVALID, "/requests outcome has unknown codes [9]")


@pytest.mark.parametrize("name", ["kv", "payloads/data_2", "payloads/index", "status"])
def test_deleted_dataset_is_invalid_everywhere(tmp_path, name):
    """/kv deleted gave 0 from info and report; a deleted payload dataset gave 70."""
    p = tmp_path / "del.kvt.h5"
    payload_trace(p)
    with h5py.File(p, "a") as f:
        del f[name]
    assert_all(every_command(p, tmp_path), exitcodes.INVALID, f"/{name}")


def test_unreadable_table_chunk_is_invalid_everywhere(tmp_path):
    """HDF5 objects that fail to read inside an identified trace: validate said 1 while analyze,
    report and diff said 2."""
    p = tmp_path / "chunk.kvt.h5"
    write_minimal(p)
    with h5py.File(p, "r") as f:
        info = f["requests"].id.get_chunk_info(0)
    with open(p, "r+b") as fh:
        fh.seek(info.byte_offset)
        fh.write(b"\xff" * info.size)
    results = every_command(p, tmp_path)
    assert_all(results, exitcodes.INVALID, "/requests")


def test_out_of_memory_is_a_clear_error_not_internal():
    """A file within the reader's limits can still need more memory than a machine has: one line
    and 69 (a needed resource is absent), never 70 with 'internal error'."""
    from kvtrace.commands.common import guarded

    @guarded
    def needs_too_much() -> None:
        raise MemoryError

    with pytest.raises(SystemExit) as exc:
        needs_too_much()
    assert exc.value.code == exitcodes.UNAVAILABLE
