"""Trace.to_pandas / to_arrow: one scalar per cell, enumerations as the
names the Parquet export writes, shapes as lists, the Parquet export's column names and types."""

from __future__ import annotations

import inspect
from dataclasses import MISSING, fields
from pathlib import Path

import numpy as np
import pytest

import kvtrace
from kvtrace.format import frames

pd = pytest.importorskip("pandas")
TRACE = Path(__file__).resolve().parent.parent / "data" / "gpu_gemma3_tiny.kvt.h5"  # committed, real


def test_kv_as_a_data_frame_with_enum_names_and_shape_lists():
    with kvtrace.open(TRACE) as t:
        rows = t.kv[:]
        df = t.to_pandas("kv")
        with pytest.raises(ValueError):  # why the helper exists: the structured array's shape columns
            pd.DataFrame(rows)
    assert isinstance(df, pd.DataFrame) and len(df) == len(rows) > 0
    assert set(df["layer_type"]) <= {"full", "sliding"} and "sliding" in set(df["layer_type"])
    assert set(df["k_dtype"]) == {"bfloat16"}
    assert all(isinstance(s, list) and len(s) == 4 for s in df["k_shape"])
    assert df["k_shape"].iloc[0] == rows["k_shape"][0].tolist()
    assert (df["bytes_valid"].to_numpy() == rows["bytes_valid"]).all()
    assert pd.DataFrame(df).shape == df.shape  # the documented way round-trips through pd.DataFrame
    # the usual first question, answered with pandas alone
    per_type = df.groupby("layer_type")["bytes_valid"].max()
    assert per_type["sliding"] < per_type["full"]


def test_other_tables_request_filter_and_errors():
    with kvtrace.open(TRACE) as t:
        req = t.to_pandas("requests")
        assert set(req["outcome"]) == {"ok"}
        first = int(req["request"].iloc[0])
        steps = t.to_pandas("steps", request=first)
        assert set(steps["request"]) == {first} and set(steps["phase"]) <= {"prefill", "decode"}
        events = t.to_pandas("events")
        assert "text" in events and not any(c.endswith(("_off", "_len")) for c in events.columns)
        assert events["kind"].map(type).eq(str).all()
        assert list(t.to_pandas("nvml").columns) == list(t.to_pandas("telemetry/nvml").columns)
        assert isinstance(t.to_pandas("devices")["name"].iloc[0], str)
        with pytest.raises(KeyError, match="tables: .*kv"):
            t.to_pandas("kvv")
        with pytest.raises(ValueError, match="no request column"):
            t.to_pandas("layers", request=0)


def test_unknown_codes_become_their_number():
    from kvtrace.format.schema import Outcome

    assert frames.enum_names(np.array([0, 1, 250], np.uint8), Outcome)[2] == "250"


def test_arrow_columns_match_the_parquet_export():
    pa = pytest.importorskip("pyarrow")
    from kvtrace.fleet.source import read_trace
    from kvtrace.fleet.tables import trace_tables

    exported = trace_tables(read_trace(TRACE, analyze=False))
    with kvtrace.open(TRACE) as t:
        for name in ("layers", "kv", "steps", "events", "readings", "retention", "payloads"):
            mine = t.to_arrow(name)
            theirs = exported[name].drop_columns(["trace_id"])
            assert mine.schema.equals(theirs.schema), (name, mine.schema, theirs.schema)
            assert mine.equals(theirs), name
        assert isinstance(t.to_arrow("kv"), pa.Table)


def test_record_has_a_typed_documented_signature():
    from kvtrace.recorder.options import RecordOptions

    params = inspect.signature(kvtrace.record).parameters
    assert list(params)[:2] == ["model", "path"]
    keywords = {n: p for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    options = {f.name: f for f in fields(RecordOptions)}
    assert set(keywords) == set(options) | {"options", "observers"}  # every option, by name
    for name, f in options.items():
        default = f.default if f.default is not MISSING else None  # settings_extra: a fresh dict
        assert keywords[name].default == default, name
        assert keywords[name].annotation not in ("Any", inspect.Parameter.empty) or name in ("tokenizer",), name
    doc = inspect.getdoc(kvtrace.record)
    for name in keywords:
        assert f"\n    {name}: " in doc, f"{name} is not documented"
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
