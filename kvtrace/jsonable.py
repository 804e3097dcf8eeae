"""One conversion to JSON-ready values, for every document kvtrace writes.

:func:`plain` turns a tree (objects with ``to_dict()``, mappings, lists/tuples, numpy scalars and
arrays, bytes) into plain Python, non-finite floats into None: JSON has no NaN or infinity, and an
unknown value is absent rather than made up. :func:`json_default` is the same per-value conversion
as a ``json.dumps(default=...)`` hook, for documents already made of plain containers.
A leaf module (numpy only): the analyser, the renderers and the commands all use it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from kvtrace.format.errors import InvalidTrace, UnsupportedVersion

# A JSON document kvtrace reads back (an analysis report, a what-if document) is parsed whole in
# memory: larger files are refused rather than risk the reader's memory.
MAX_JSON_DOCUMENT_BYTES = 256 * 1024 * 1024


def _leaf(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, bytes):
        return obj.decode("utf-8", errors="replace")
    return obj


def plain(obj: Any) -> Any:
    """A JSON-ready copy of ``obj`` (see the module docstring); mapping keys are kept, numpy keys
    become Python ones."""
    if hasattr(obj, "to_dict") and callable(obj.to_dict):
        return plain(obj.to_dict())
    obj = _leaf(obj)
    if isinstance(obj, Mapping):
        return {_leaf(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def json_default(obj: Any) -> Any:
    """``json.dumps(default=json_default)``: numpy scalars and arrays, bytes; TypeError otherwise."""
    if isinstance(obj, (np.generic, np.ndarray, bytes)):
        return _leaf(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def refuse_schema(path: Path, what: str, found: Any, reads: str) -> NoReturn:
    """Refuse a saved document whose schema this kvtrace does not read, as a trace's format is
    refused: UnsupportedVersion (exit 4, "upgrade kvtrace") when its major number is above the one
    of ``reads``; InvalidTrace (exit 1) otherwise (an older, or not a number)."""
    try:
        major = None if isinstance(found, bool) else int(str(found).split(".")[0])
    except ValueError:  # not a number (an int of more than 4300 digits included)
        major = None
    if major is not None and major > int(reads.split(".")[0]):
        raise UnsupportedVersion(f"{path}: {what} schema {found} is newer than this kvtrace reads ({reads}): "
                                 "written by a newer kvtrace; upgrade kvtrace")
    raise InvalidTrace(f"{path}: {what} schema {found} is not {reads}")


def read_json_document(path: Path, what: str = "JSON") -> Any:
    """The parsed contents of a JSON file kvtrace reads back; InvalidTrace (one line) when it is
    larger than MAX_JSON_DOCUMENT_BYTES or not valid JSON. ``what`` names it in the refusal."""
    if path.stat().st_size > MAX_JSON_DOCUMENT_BYTES:
        raise InvalidTrace(f"{path}: {what} larger than {MAX_JSON_DOCUMENT_BYTES} bytes; refused")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidTrace(f"{path}: not valid JSON ({exc})") from None
