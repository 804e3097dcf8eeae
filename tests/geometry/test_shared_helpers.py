"""Small helpers once written several times, now once each: device labels, layer
type names (kvtrace.labels) and the JSON clean-up (kvtrace.jsonable)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvtrace.format import schema
from kvtrace.jsonable import json_default, plain
from kvtrace.labels import device_text, device_where, layer_type_name


def test_device_labels():
    assert device_where(-1) == "cpu" and device_where(2) == "cuda:2"
    assert device_text(-1, "cpu") == "cpu"  # not "cpu cpu"
    assert device_text(-1, " CPU ") == "cpu"
    assert device_text(0, "NVIDIA H100 80GB HBM3") == "cuda:0 NVIDIA H100 80GB HBM3"
    assert device_text(1) == "cuda:1"


def test_layer_type_names_known_and_unknown():
    assert layer_type_name(int(schema.LayerType.SLIDING)) == "sliding"
    assert layer_type_name(250) == "type_250"  # a newer recorder's code: named, not an error


class _Doc:
    def to_dict(self):
        return {"ratio": np.float32("nan"), "n": np.int64(3)}


def test_plain_makes_json_ready_values():
    doc = {"a": (np.int64(1), np.float64(2.5)), "b": np.array([1.0, np.inf]), "c": b"x\xff", "d": _Doc(),
           np.int32(7): float("-inf"), "e": 1.0}
    out = plain(doc)
    assert out == {"a": [1, 2.5], "b": [1.0, None], "c": "x\ufffd", "d": {"ratio": None, "n": 3}, 7: None, "e": 1.0}
    assert type(out["a"][0]) is int and type(out[7]) is type(None)
    json.dumps(out, allow_nan=False)  # strict JSON: would raise on NaN/inf


def test_json_default_hook():
    text = json.dumps({"x": np.int16(4), "y": np.arange(2), "z": b"ok"}, default=json_default)
    assert json.loads(text) == {"x": 4, "y": [0, 1], "z": "ok"}
    with pytest.raises(TypeError, match="not JSON serialisable"):
        json.dumps({"s": {1, 2}}, default=json_default)
    assert math.isnan(json.loads(json.dumps(np.float32("nan"), default=json_default)))  # the hook keeps NaN
