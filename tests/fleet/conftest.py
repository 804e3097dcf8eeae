"""Tiny fleets for the fleet tests: synthetic traces (tests/helpers/synth_trace.py) whose /meta is
then edited with h5py to stand for other versions (the writer stamps the versions it is given)."""

from __future__ import annotations

from pathlib import Path

import h5py
import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("duckdb")

from tests.helpers.synth_trace import write_synthetic_trace  # noqa: E402


def make_trace(path: Path, *, transformers_version: str = "5.17.0", residual_bytes: int = 0,
               new_tokens: int = 12) -> Path:
    write_synthetic_trace(path, residual_bytes=residual_bytes, new_tokens=new_tokens)
    with h5py.File(path, "r+") as f:
        f["meta"].attrs["transformers_version"] = transformers_version
    return path


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Path]]:
    """Three traces per group: 5.17 clean, 5.23 clean (a control), 5.99 retaining 1 MiB per request."""
    d = tmp_path_factory.mktemp("versions")
    out: dict[str, list[Path]] = {}
    for version, residual in (("5.17.0", 0), ("5.23.0", 0), ("5.99.0", 1 << 20)):
        out[version] = [make_trace(d / f"{version}-{i}.kvt.h5", transformers_version=version,
                                   residual_bytes=residual, new_tokens=10 + i) for i in range(3)]
    return out


@pytest.fixture(scope="module")
def fleet_dir(versions: dict[str, list[Path]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The nine traces of ``versions`` exported to Parquet."""
    from kvtrace.fleet.export import export_parquet

    out = tmp_path_factory.mktemp("fleet")
    result = export_parquet([str(p) for ps in versions.values() for p in ps], out)
    assert len(result.exported) == 9 and not result.failed
    return out
