"""Zenodo bundles against the real validators: .zenodo.json against Zenodo's deposit schema
(vendored in tests/export/schemas, source named there), CITATION.cff with cffconvert; ORCID check
digits; descriptions that say only what the traces hold."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from kvtrace import exitcodes
from kvtrace.export import zenodo as z
from tests.helpers.cli_run import run_main
from tests.helpers.synth_trace import write_synthetic_trace

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema not installed (pip install kvtrace[test])")
cffconvert_create = pytest.importorskip("cffconvert.cli.create_citation",
                                        reason="cffconvert not installed (pip install kvtrace[test])")


def _deposit_schema() -> dict:
    """The vendored deposit-form schema, with what Zenodo's REST loader (the marshmallow
    CommonMetadataSchemaV1 in zenodo/modules/records/serializers/schemas/common.py, same commit)
    adds: a `version` string the form schema lacks, titles of at least 3 characters, creators and
    related identifiers that must name themselves. Nothing is loosened except adding `version`."""
    schema = json.loads((Path(__file__).parent / "schemas" / "zenodo-legacyrecord.json").read_text())
    props = schema["properties"]
    props["version"] = {"type": "string"}
    props["title"]["minLength"] = 3
    props["creators"]["items"]["required"] = ["name"]
    props["related_identifiers"]["items"]["required"] = ["identifier", "relation"]
    return schema


SCHEMA = _deposit_schema()
# Zenodo's REST documentation (developers.zenodo.org, "Deposit metadata") marks these required;
# the form schema itself requires nothing.
REST_REQUIRED = ("upload_type", "publication_date", "title", "creators", "description", "access_right", "license")
CREATOR = "Doe, Jane; Example University; 0000-0002-1825-0097"
# Related identifiers of every shape: a DOI, a doi.org URL, a plain URL, a non-URL identifier.
RELATED = ("isSupplementTo:10.5281/zenodo.19871039", "cites:https://doi.org/10.48550/arXiv.2309.06180",
           "isDocumentedBy:https://example.org/kv-notes", "isDerivedFrom:arXiv:2401.00001")


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("zs")
    return {"gpu": write_synthetic_trace(d / "gpu.kvt.h5"),
            "cpu": write_synthetic_trace(d / "cpu.kvt.h5", cpu=True, requests=1)}


def _bundle(capsys, out: Path, *traces: Path, extra: tuple[str, ...] = ()) -> Path:
    code, stdout, stderr = run_main(["export", "zenodo", *map(str, traces), "-o", str(out), "--creator", CREATOR,
                                     "-q", *extra], capsys)
    assert code == 0, stdout + stderr
    return out


def _cff_valid(path: Path) -> None:
    cffconvert_create.create_citation(str(path), None).validate()  # raises jsonschema's ValidationError


@pytest.mark.parametrize("related", [(), RELATED], ids=["no-related", "related"])
def test_bundle_metadata_passes_zenodo_schema_and_cffconvert(traces, tmp_path, capsys, related):
    extra = tuple(a for r in related for a in ("--related", r))
    out = _bundle(capsys, tmp_path / "b", traces["gpu"], extra=extra)
    meta = json.loads((out / ".zenodo.json").read_text())
    jsonschema.Draft4Validator(SCHEMA).validate(meta)
    assert all(meta.get(k) for k in REST_REQUIRED)
    _cff_valid(out / "CITATION.cff")
    yaml = pytest.importorskip("yaml")
    cff = yaml.safe_load((out / "CITATION.cff").read_text())
    assert "qwen3" in cff["keywords"] and "qwen3" in meta["keywords"]  # the model type, in both files
    refs = cff.get("references", [])
    assert len(refs) == len(related) == len(meta["related_identifiers"])
    if related:
        assert [r.get("doi") for r in refs] == ["10.5281/zenodo.19871039", "10.48550/arXiv.2309.06180", None, None]
        assert refs[2]["url"] == "https://example.org/kv-notes"
        assert refs[3]["identifiers"] == [{"type": "other", "value": "arXiv:2401.00001"}]
        assert all(r["authors"] for r in refs) and "isDerivedFrom" in refs[3]["notes"]


def test_validators_catch_what_the_old_files_got_wrong(traces, tmp_path, capsys):
    """Controls: the checks above can fail. A reference without authors (the old CITATION.cff for a
    DOI) fails cffconvert; an unknown relation or a string creator fails Zenodo's schema."""
    yaml = pytest.importorskip("yaml")
    out = _bundle(capsys, tmp_path / "b", traces["gpu"], extra=("--related", RELATED[0]))
    cff = yaml.safe_load((out / "CITATION.cff").read_text())
    del cff["references"][0]["authors"]
    bad = tmp_path / "CITATION.cff"
    bad.write_text(yaml.safe_dump(cff))
    with pytest.raises(jsonschema.ValidationError, match="'authors' is a required property"):
        _cff_valid(bad)
    meta = json.loads((out / ".zenodo.json").read_text())
    validator = jsonschema.Draft4Validator(SCHEMA)
    for mutate in (lambda m: m["related_identifiers"][0].update(relation="likes"),
                   lambda m: m.update(creators=["Doe, Jane"]), lambda m: m.update(upload_type="trace")):
        broken = copy.deepcopy(meta)
        mutate(broken)
        assert not validator.is_valid(broken)


def test_hostile_strings_stay_valid_cff(tmp_path, capsys):
    trace = write_synthetic_trace(tmp_path / "evil.kvt.h5", model_id='a"b\\c: - [x]\n# y\u2028\x85 no')
    out = _bundle(capsys, tmp_path / "b", trace, extra=("--version", "1.10", "--keyword", "no"))
    _cff_valid(out / "CITATION.cff")
    yaml = pytest.importorskip("yaml")
    cff = yaml.safe_load((out / "CITATION.cff").read_text())
    assert cff["version"] == "1.10" and "no" in cff["keywords"]  # strings, not the float 1.1 or False


# ORCID's documented examples (orcid.org "Structure of the ORCID Identifier"), one ending in X.
GOOD_ORCIDS = ("0000-0002-1825-0097", "0000-0001-5109-3700", "0000-0002-1694-233X")


def test_orcid_check_digit_iso_7064():
    for orcid in GOOD_ORCIDS:
        assert z.orcid_check_digit(orcid[:-1]) == orcid[-1]
        assert z.Creator.parse(f"Doe, J;; https://orcid.org/{orcid}").orcid == orcid
    # MOD 11-2 catches every single-digit error: change each digit of a valid ORCID in turn.
    good = GOOD_ORCIDS[0]
    for i, ch in enumerate(good):
        if ch == "-":
            continue
        for other in "0123456789" + ("X" if i == len(good) - 1 else ""):
            if other != ch:
                with pytest.raises(ValueError, match="ORCID"):
                    z.Creator.parse(f"Doe, J;; {good[:i]}{other}{good[i + 1:]}")


def test_wrong_orcid_check_digit_is_one_line_usage_error(traces, tmp_path, capsys):
    code, out, err = run_main(["export", "zenodo", str(traces["gpu"]), "-o", str(tmp_path / "b"),
                               "--creator", "Doe, Jane; U; 0000-0002-1825-0098"], capsys)
    assert code == exitcodes.USAGE == 64
    assert "wrong check digit" in err and "gives 7" in err and len(err.strip().splitlines()) == 1
    assert "Traceback" not in out + err and not (tmp_path / "b").exists()


def test_description_says_only_what_the_traces_hold(traces, tmp_path, capsys):
    cpu = json.loads((_bundle(capsys, tmp_path / "cpu", traces["cpu"]) / ".zenodo.json").read_text())["description"]
    assert "NVML" not in cpu and "allocator" not in cpu  # a CPU recording has neither
    assert "process RSS telemetry" in cpu and "per-layer KV-cache shapes" in cpu
    assert "1 trace file of 1 generate request." in cpu  # singular, not "1 traces"
    assert "sampled K/V/Q" not in cpu and "prompt text" not in cpu
    gpu = json.loads((_bundle(capsys, tmp_path / "gpu", traces["gpu"]) / ".zenodo.json").read_text())["description"]
    assert "NVML device-memory telemetry" in gpu and "PyTorch allocator telemetry" in gpu  # the control
    assert "process RSS" not in gpu  # the synthetic GPU trace has no RSS rows
    both = _bundle(capsys, tmp_path / "both", traces["gpu"], traces["cpu"])
    mixed = json.loads((both / ".zenodo.json").read_text())["description"]
    assert "2 trace files of 3 generate requests." in mixed
    assert "NVML device-memory telemetry (in 1 of 2 traces)" in mixed
    card = (tmp_path / "cpu" / "README.md").read_text()
    assert "- 1 trace, 1 request, " in card and "recorded steps" in card
