"""Request begin/end rows never wait on the writer's HDF5 lock (a flush or payload write in
progress): they are buffered, and an update to a row already written is applied by the next flush."""

from __future__ import annotations

import threading

from kvtrace.format import Outcome, TraceWriter
from kvtrace.format.reader import Trace


def _row(rid: int) -> tuple:
    return (rid, int(Outcome.RUNNING), 1, 4, 0, -1, 100 + rid, 0, b"0" * 64, 0, 0, 0, 0, 0, 0)


def _while_hdf5_lock_is_held(writer: TraceWriter, fn) -> bool:
    """Run ``fn`` on this thread while another thread holds the HDF5 lock; True if it finished
    before the lock was released (it never waited for it)."""
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with writer._lock:  # what a flush or a payload write holds
            held.set()
            release.wait(timeout=30)

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(timeout=10)
    fn()
    finished_first = not release.is_set()
    release.set()
    t.join()
    return finished_first


def test_begin_and_update_never_take_the_hdf5_lock(tmp_path):
    path = tmp_path / "r.kvt.h5"
    w = TraceWriter(path, flush_interval_s=60)
    w.begin_request(_row(0))
    w.flush()  # row 0 is in the file: its update must wait for the next flush
    assert _while_hdf5_lock_is_held(w, lambda: w.update_request(0, outcome=int(Outcome.OK), new_tokens=7))
    assert _while_hdf5_lock_is_held(w, lambda: w.begin_request(_row(1)))
    assert _while_hdf5_lock_is_held(w, lambda: w.update_request(1, outcome=int(Outcome.OOM), end_ns=9))
    with Trace(path) as t:  # SWMR: the file as of the last flush still shows request 0 running
        assert t.requests[:]["outcome"].tolist() == [int(Outcome.RUNNING)]
    w.update_request(0, end_ns=55)  # a second update of a flushed row merges with the first
    w.close()
    with Trace(path) as t:
        rows = t.requests[:]
        assert rows["outcome"].tolist() == [int(Outcome.OK), int(Outcome.OOM)]
        assert rows["new_tokens"].tolist() == [7, 0]
        assert rows["end_ns"].tolist() == [55, 9]
        assert rows["start_ns"].tolist() == [100, 101]  # fields not updated keep their values


def test_update_taken_between_flushes_lands_after_its_row(tmp_path):
    """An update made while a flush is writing the row (taken from the buffer, not yet in the file)
    is applied by the following flush, not lost and not written before the row."""
    path = tmp_path / "t.kvt.h5"
    w = TraceWriter(path, flush_interval_s=60)
    w.begin_request(_row(0))
    real = w._write_rows
    updated = []

    def write_rows(table, buf):
        if table == "requests" and not updated:
            w.update_request(0, outcome=int(Outcome.OK))  # the row is taken, not yet written
            updated.append(True)
        real(table, buf)

    w._write_rows = write_rows
    w.flush()
    del w._write_rows
    w.close()
    with Trace(path) as t:
        assert updated and t.requests[:]["outcome"].tolist() == [int(Outcome.OK)]
