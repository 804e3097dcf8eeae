"""Format 1.3: the file describes itself to generic HDF5 tools (spec §1 Self-description)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest
from fmt_helpers import write_minimal

from kvtrace.format import Trace, schema

DATA = Path(__file__).resolve().parents[1] / "data"
OLD_TRACE = DATA / "accuracy" / "gpu_clean_fresh_single.kvt.h5"  # written by format 1.2 (no enum types, no attributes)


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("self") / "t.kvt.h5"
    write_minimal(path)
    return path


def test_enum_columns_are_hdf5_enums_with_the_schema_names(trace_path: Path) -> None:
    with h5py.File(trace_path, "r") as f:
        for name, table in schema.TABLE_DECLS.items():
            for column in table.columns:
                mapping = h5py.check_enum_dtype(f[name].dtype[column.name])
                if column.enum is None:
                    assert mapping is None, (name, column.name)
                else:
                    assert mapping == {m.name.lower(): int(m) for m in column.enum}, (name, column.name)


def test_every_table_and_carrier_carries_units_and_descriptions(trace_path: Path) -> None:
    with h5py.File(trace_path, "r") as f:
        for name, table in {**schema.TABLE_DECLS, "status": schema.STATUS_TABLE, "stop": schema.STOP_TABLE}.items():
            attrs = f[name].attrs
            assert attrs["description"] == table.title
            names = list(attrs["column_names"])
            assert names == list(f[name].dtype.names)
            units = dict(zip(names, attrs["column_units"], strict=True))
            docs = dict(zip(names, attrs["column_descriptions"], strict=True))
            assert all(docs.values()), name  # every column explained in one line
            for column in table.columns:
                assert units[column.name] == column.unit_label
        assert f["requests"].attrs["column_units"][list(schema.REQUESTS.names).index("start_ns")] == "ns"
        sentinel = dict(zip(schema.READINGS.names, f["readings"].attrs["column_not_recorded"], strict=True))
        assert sentinel["rss_bytes"] == "-1" and sentinel["t_ns"] == ""
        for obj in ("text", *(schema.payload_dataset_name(s) for s in schema.PAYLOAD_ITEMSIZES)):
            assert f[obj].attrs["description"] and f[obj].attrs["units"], obj
        for group in ("meta", "telemetry", "payloads"):
            assert f[group].attrs["description"], group


def test_kvtrace_reads_enum_typed_1_3_and_plain_1_2_alike(trace_path: Path) -> None:
    with Trace(trace_path) as new, Trace(OLD_TRACE) as old:
        assert (new.version, old.version) == (schema.FORMAT_VERSION, "1.2")
        for t in (new, old):
            requests = t.table("requests")
            assert requests.dtype == schema.REQUESTS  # enum members compare equal to their uint8 codes
            assert schema.Outcome(int(requests["outcome"][0])) == schema.Outcome.OK
    with h5py.File(OLD_TRACE, "r") as f:  # control: 1.2 files have neither
        assert h5py.check_enum_dtype(f["requests"].dtype["outcome"]) is None
        assert "column_units" not in f["requests"].attrs


@pytest.mark.skipif(shutil.which("h5dump") is None, reason="h5dump not installed (apt-get install hdf5-tools)")
def test_h5dump_prints_enum_names_and_attributes(trace_path: Path) -> None:
    header = subprocess.run(["h5dump", "-H", str(trace_path)], capture_output=True, text=True, check=True).stdout
    outcome = re.search(r'H5T_ENUM \{\s+H5T_STD_U8LE;([^}]*)\} "outcome";', header)
    assert outcome and re.findall(r'"(\w+)"\s+(\d+);', outcome.group(1)) and \
        {n: int(c) for n, c in re.findall(r'"(\w+)"\s+(\d+);', outcome.group(1))} == \
        {m.name.lower(): int(m) for m in schema.Outcome}
    assert header.count('ATTRIBUTE "column_units"') == len(schema.TABLE_DECLS) + 2  # + /status, /stop
    data = subprocess.run(["h5dump", "-d", "/requests", str(trace_path)], capture_output=True, text=True,
                          check=True).stdout
    assert re.search(r"\(0\): \{\s+0,\s+ok,", data)  # the outcome printed by name
    old = subprocess.run(["h5dump", "-H", str(OLD_TRACE)], capture_output=True, text=True, check=True).stdout
    assert 'H5T_STD_U8LE "outcome";' in old and "column_units" not in old  # control: a 1.2 file


def test_declared_row_types_build_rows_the_writer_accepts() -> None:
    row = schema.ReadingRow(t_ns=5, request=0, label=int(schema.ReadingLabel.PEAK), device=-1,
                            allocated_bytes=10, reserved_bytes=20)
    arr = np.array([row], dtype=schema.READINGS)
    assert arr["rss_bytes"][0] == -1 and arr["reserved_bytes"][0] == 20  # omitted: "not recorded"
    assert schema.KvRow._fields == schema.KV.names
    with pytest.raises(TypeError):
        schema.KvRow(request=0)  # columns without a sentinel must be given
