"""Storage faults at many points of a trace's life (spec §8.1): a file object that fails after N
bytes stands in for a full disk (ENOSPC), a file size limit (EFBIG) and a failing device (EIO).
At every N the writer's callers never see an error, it stops writing at the first failure, the
file opens and validates, holds every row flushed before the failure, is never marked complete,
and says why it stopped where the disk still takes the in-place /stop stamp."""

from __future__ import annotations

import errno
import io
import os
import signal
import sys

import numpy as np
import pytest

from kvtrace.format import CacheDType, PayloadKind, Trace, TraceWriter, encode_payload
from kvtrace.format.storage import GuardedFile, hold_sigxfsz, lookup3, release_sigxfsz
from kvtrace.format.summary import stopped
from kvtrace.format.validate import validate

ROUNDS = 60
FLUSH_EVERY = 6
PAYLOAD_EVERY = 4
PAYLOAD_ELEMENTS = 40_000  # 2 chunks of uint16 each, incompressible: ~80 KB per payload


class FailingFile(io.FileIO):
    """A real file whose writes fail past ``limit`` bytes.

    "space" (ENOSPC, EFBIG): the file cannot grow past ``limit`` bytes, as on a full disk or under
    RLIMIT_FSIZE: a write crossing it is short, the next one fails; overwrites below it succeed.
    "device" (EIO): every write fails once ``limit`` bytes were written in all, overwrites too.
    """

    def __init__(self, path, limit: int, kind: str, code: int) -> None:
        super().__init__(path, "w+")
        self.limit, self.kind, self.code, self.written, self.broken = limit, kind, code, 0, False

    def write(self, b) -> int:
        n = memoryview(b).nbytes
        if self.kind == "device":
            if self.broken or self.written + n > self.limit:
                self.broken = True  # a failed device stays failed
                raise OSError(self.code, "injected " + errno.errorcode[self.code])
        else:
            pos = self.tell()
            if pos + n > self.limit:
                if pos >= self.limit:
                    raise OSError(self.code, "injected " + errno.errorcode[self.code])
                b = memoryview(b)[: self.limit - pos]
                n = self.limit - pos
        self.written += n
        return super().write(b)

    def truncate(self, size=None) -> int:
        if self.kind == "space" and size is not None and size > self.limit:
            raise OSError(self.code, "injected " + errno.errorcode[self.code])
        return super().truncate(size)


def _payload(i: int):
    rng = np.random.default_rng(i)
    raw = rng.integers(0, 1 << 16, PAYLOAD_ELEMENTS, dtype=np.uint16)
    return raw, encode_payload(0, i, i % 3, PayloadKind.KEY, CacheDType.FLOAT16, raw, level=1)


PAYLOADS = {i: _payload(i) for i in range(0, ROUNDS, PAYLOAD_EVERY)}


def _workload(path, raw=None, phases: list[str] | None = None, growth: list | None = None):  # noqa: C901
    """Write a small trace; returns (writer or None if creation failed, rows appended by the last
    flush that completed before any failure, the failures reported). ``phases`` gets the call
    during which the fault happened; ``growth`` the file size before and after each flush."""
    faults: list = []
    try:
        w = TraceWriter(path, {"model_id": "faults", "contains_tensor_payloads": True}, flush_interval_s=60,
                        raw=raw, on_failure=faults.append)
    except OSError as exc:
        return None, 0, [exc]

    def call(phase: str, fn, *args, **kwargs):
        before = w.failure
        fn(*args, **kwargs)
        if before is None and w.failure is not None and phases is not None:
            phases.append(phase)

    row = [0] * 15
    row[2], row[5], row[8] = 1, -1, b"0" * 64
    w.begin_request(tuple(row))
    good = 0
    for i in range(ROUNDS):
        w.append("telemetry/process", [(i * 10 + j, (i * 10 + j) * 7) for j in range(10)])
        off, n = w.add_text(f"event {i}")
        w.append("events", (i, 1, 0, i, -1, -1, i, off, n))
        if i in PAYLOADS:
            call("payload", w.write_payload, PAYLOADS[i][1])
        if i % FLUSH_EVERY == FLUSH_EVERY - 1:
            before = _used(raw, path)
            call("flush", w.flush)
            if growth is not None:
                growth.append((before, _used(raw, path)))
            if w.failure is None:
                good = (i + 1) * 10
    w.update_request(0, outcome=1, end_ns=123)
    call("close", w.close)
    return w, good, faults


def _check(path, good: int) -> Trace:
    report = validate(path)
    assert report.valid, report.problems
    t = Trace(path)
    assert not t.complete
    rows = t.process[:]
    n = rows.shape[0]
    assert n >= good, (n, good)
    assert np.array_equal(rows["t_ns"], np.arange(n))
    assert np.array_equal(rows["rss_bytes"], np.arange(n) * 7)
    index = t.payload_index[:]
    for k in range(index.shape[0]):
        p = t.payload(k)
        assert np.array_equal(p.data, PAYLOADS[int(index["step"][k])][0])
    return t


def _used(raw, path) -> int:
    """What a FailingFile's limit counts: bytes written in all for a device, else the file size."""
    return raw.written if raw is not None and raw.kind == "device" else path.stat().st_size


def _fault_free(tmp_path, kind: str, code: int) -> tuple[int, list[int]]:
    """The fault-free run through a FailingFile that never fails: its final count (file size or
    bytes written, as the limit counts them) and counts that fall inside flushes."""
    path = tmp_path / "full.kvt.h5"
    growth: list = []
    raw = FailingFile(path, 1 << 40, kind, code)
    w, _good, faults = _workload(path, raw, growth=growth)
    assert w is not None and w.failure is None and not faults
    with Trace(path) as t:  # the control: the same workload without a fault is complete
        assert t.complete and stopped(t) is None
        assert t.process[:].shape[0] == ROUNDS * 10
    inside = [(a + b) // 2 for a, b in growth if b > a + 1]
    assert inside  # flushes write something (rows, metadata): a fault can hit one
    return _used(raw, path), inside[:3]


@pytest.mark.parametrize(("kind", "code"), [("space", errno.ENOSPC), ("space", errno.EFBIG),
                                            ("device", errno.EIO)])
def test_fault_sweep(tmp_path, capfd, kind, code):
    size, in_flushes = _fault_free(tmp_path, kind, code)
    # creation, then points spread over the run (payload writes, flushes) and its close
    limits = [200, 2_000, 6_000] + [int(size * f) for f in np.linspace(0.03, 0.98, 15)] + in_flushes + [size - 64, size - 1]
    outcomes = {"refused": 0, "stopped": 0, "incomplete": 0}
    phases: list[str] = []
    for limit in limits:
        path = tmp_path / f"f{limit}.kvt.h5"
        w, good, faults = _workload(path, FailingFile(path, limit, kind, code), phases)
        if w is None:  # the empty layout did not fit: refused up front, before any recording
            assert isinstance(faults[0], OSError) and faults[0].errno == code
            outcomes["refused"] += 1
            continue
        assert len(faults) == 1, (limit, faults)  # told once, however many calls came after
        assert w.failure is not None and w.failure.errno == code
        with _check(path, good) as t:
            stop = stopped(t)
        if kind == "space":  # the stamp overwrites existing bytes: a full disk still takes it
            assert stop is not None and stop["errno"] == code
            assert errno.errorcode[code] in stop["reason"]
            outcomes["stopped"] += 1
        else:  # a failing device refuses the stamp too: the trace reads as killed
            assert stop is None
            outcomes["incomplete"] += 1
    assert outcomes["refused"] >= 1  # the sweep covers creation...
    assert outcomes["stopped"] + outcomes["incomplete"] >= 15
    assert {"payload", "flush", "close"} <= set(phases), phases  # ...and every later phase
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception ignored" not in err, err[:2000]


def test_fault_during_close_keeps_last_flush(tmp_path):
    """Everything flushed, then the disk fills before close: the final flush fails, the trace
    keeps every flushed row and says why it is not complete."""
    path = tmp_path / "c.kvt.h5"
    raw = FailingFile(path, 1 << 40, "space", errno.ENOSPC)
    w = TraceWriter(path, {"model_id": "close"}, flush_interval_s=60, raw=raw)
    w.append("telemetry/process", [(i, i * 7) for i in range(100)])
    w.flush()
    w.append("telemetry/process", [(i, i * 7) for i in range(100, 200)])
    raw.limit = path.stat().st_size  # no room for anything new
    w.close()
    assert w.failure is not None and w.failure.errno == errno.ENOSPC
    with _check(path, 100) as t:
        assert stopped(t)["errno"] == errno.ENOSPC


def test_fault_after_rewriting_a_flushed_request_row(tmp_path):
    """update_request rewrites a row already in the file (through HDF5's chunk cache); when the
    device fails before that reaches the disk, the file keeps the row as flushed."""
    path = tmp_path / "u.kvt.h5"
    raw = FailingFile(path, 1 << 40, "device", errno.EIO)
    faults: list = []
    w = TraceWriter(path, {"model_id": "update"}, flush_interval_s=60, raw=raw, on_failure=faults.append)
    row = [0] * 15
    row[2], row[5], row[8] = 1, -1, b"0" * 64
    w.begin_request(tuple(row))
    w.flush()
    raw.limit = raw.written  # the next write fails
    w.update_request(0, outcome=1)
    with pytest.raises(ValueError, match="nope"):  # a caller's mistake is raised, not a fault
        w.update_request(0, nope=1)
    w.close()
    assert [f.errno for f in faults] == [errno.EIO]
    with _check(path, 0) as t:
        assert t.requests[:]["outcome"].tolist() == [0]  # running: the rewrite never reached the disk


def test_an_error_inside_hdf5_is_not_called_a_storage_error(tmp_path):
    faults: list = []
    w = TraceWriter(tmp_path / "e.kvt.h5", {"model_id": "bad"}, flush_interval_s=60, on_failure=faults.append)
    w.append("telemetry/process", ("not a number", 0))  # fails converting at the flush
    w.flush()
    w.close()
    assert len(faults) == 1 and faults[0].errno == 0
    assert faults[0].describe().startswith("ValueError") and "during hdf5" in faults[0].describe()


def test_deleted_file_stops_at_next_flush(tmp_path):
    path = tmp_path / "d.kvt.h5"
    faults = []
    w = TraceWriter(path, {"model_id": "gone"}, flush_interval_s=60, on_failure=faults.append)
    w.append("telemetry/process", (0, 0))
    w.flush()
    path.unlink()
    w.append("telemetry/process", (1, 7))
    w.flush()
    assert [f.errno for f in faults] == [errno.ENOENT]
    assert w.failed
    w.append("telemetry/process", (2, 14))  # a no-op now, not an error
    assert w.write_payload(PAYLOADS[0][1]) is False
    w.close()
    assert not path.exists()


FORK_CHILD = """
import os, sys
from kvtrace.format import TraceWriter
w = TraceWriter(sys.argv[1], {"model_id": "fork"}, flush_interval_s=60)
w.append("telemetry/process", [(i, i * 7) for i in range(10)])
w.flush()
pid = os.fork()
if pid == 0:  # the child appends, flushes and exits normally (its atexit runs): all dropped
    w.append("telemetry/process", [(i, -1) for i in range(10, 50)])
    w.flush()
    sys.exit(0 if w.failed else 2)
_, status = os.waitpid(pid, 0)
w.append("telemetry/process", [(i, i * 7) for i in range(10, 20)])
w.close()
print("child", os.waitstatus_to_exitcode(status), "parent failure", w.failure)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_forked_child_never_writes_to_the_parents_trace(tmp_path):
    import subprocess

    path = tmp_path / "fork.kvt.h5"
    proc = subprocess.run([sys.executable, "-c", FORK_CHILD, str(path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "child 0 parent failure None" in proc.stdout  # the child exited cleanly, detached
    assert "Traceback" not in proc.stderr
    with Trace(path) as t:
        assert t.complete
        rows = t.process[:]
        assert np.array_equal(rows["t_ns"], np.arange(20)) and np.array_equal(rows["rss_bytes"], np.arange(20) * 7)


def test_unfaulted_writes_reach_the_disk_unchanged(tmp_path):
    """The control for the guard: without a fault it passes every byte through (the file equals
    what it read back) and keeps no overlay."""
    path = tmp_path / "plain.bin"
    g = GuardedFile(open(path, "w+b", buffering=0))
    g.seek(10)
    g.write(b"abc")
    buf = bytearray(16)
    g.seek(0)
    g.readinto(buf)
    assert bytes(buf) == bytes(10) + b"abc" + bytes(3)
    assert g.fault is None and not g._overlay
    g.close_raw()
    assert path.read_bytes() == bytes(10) + b"abc"


def test_after_a_fault_reads_see_the_overlay_and_the_disk_is_untouched(tmp_path):
    path = tmp_path / "o.bin"
    raw = FailingFile(path, 8, "space", errno.ENOSPC)
    g = GuardedFile(raw)
    g.seek(0)
    g.write(b"01234567")
    g.write(b"89")  # past the limit: the fault
    assert g.fault is not None and g.fault.errno == errno.ENOSPC and g.fault.offset == 8
    g.seek(2)
    g.write(b"XY")  # after the fault: overlay only
    buf = bytearray(10)
    g.seek(0)
    g.readinto(buf)
    assert bytes(buf) == b"01XY456789"
    g.close_raw()
    assert path.read_bytes() == b"01234567"


def test_superblock_checksum_matches_hdf5(tmp_path):
    import h5py

    path = tmp_path / "sb.h5"
    with h5py.File(path, "w", libver=("v110", "v110")) as f:
        f.attrs["x"] = 1
    sb = path.read_bytes()[:48]
    assert sb[8] == 3  # superblock version 3, 8-byte addresses: checksum over the first 44 bytes
    assert lookup3(sb[:44]) == int.from_bytes(sb[44:48], "little")
    assert lookup3(sb[:43]) != int.from_bytes(sb[44:48], "little")


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="no SIGXFSZ on this platform")
def test_sigxfsz_ignored_only_while_held_and_only_from_default():
    before = signal.getsignal(signal.SIGXFSZ)
    try:
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        assert hold_sigxfsz()
        assert signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN
        release_sigxfsz()
        assert signal.getsignal(signal.SIGXFSZ) == signal.SIG_DFL

        def handler(signum, frame):  # the user's own: left alone
            pass

        signal.signal(signal.SIGXFSZ, handler)
        assert not hold_sigxfsz()
        assert signal.getsignal(signal.SIGXFSZ) is handler
    finally:
        signal.signal(signal.SIGXFSZ, before)
