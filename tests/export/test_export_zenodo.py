"""Zenodo bundles: content refusal, metadata files, data card numbers, checksums."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from dataclasses import dataclass

import pytest
from click.testing import CliRunner

from kvtrace import exitcodes
from kvtrace.cli import cli, main
from kvtrace.export import zenodo as z
from tests.helpers.synth_trace import write_synthetic_trace

CREATOR = "Doe, Jane; Example University; 0000-0002-1825-0097"


@dataclass
class Result:
    exit_code: int
    output: str  # stdout + stderr


@pytest.fixture
def run(capsys):
    """Run the real entry point (kvtrace.cli.main maps click usage errors to exit 64)."""

    def _run(*args: str) -> Result:
        try:
            main(["export", "zenodo", *args])
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0)
        cap = capsys.readouterr()
        return Result(code, cap.out + cap.err)

    return _run


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("zen")
    return {
        "clean": write_synthetic_trace(d / "clean.kvt.h5"),
        "messy": write_synthetic_trace(d / "messy.kvt.h5", dropped_samples=4, recorder_error="sampler thread died",
                                       telemetry_gap_ms=30, unavailable=("process", "nvml")),
        "prompts": write_synthetic_trace(d / "prompts.kvt.h5", prompt_text=True),
        "tensors": write_synthetic_trace(d / "tensors.kvt.h5", payloads=True),
        "crashed": write_synthetic_trace(d / "crashed.kvt.h5", close=False),
    }


def test_refuses_content_naming_which_and_why(traces, tmp_path, run):
    res = run(str(traces["clean"]), str(traces["prompts"]), str(traces["tensors"]), "-o", str(tmp_path / "b"),
               "--creator", CREATOR)
    assert res.exit_code == exitcodes.REFUSED
    msg = res.output
    assert "prompts.kvt.h5: holds prompt text" in msg
    assert "tensors.kvt.h5: holds tensor contents (20 sampled tensors" in msg
    assert "clean.kvt.h5" not in msg
    assert "--allow-content" in msg
    assert not (tmp_path / "b").exists()  # nothing written before the refusal
    res = run(str(traces["prompts"]), str(traces["tensors"]), "-o", str(tmp_path / "b"), "--creator", CREATOR,
               "--allow-content", "-q")
    assert res.exit_code == 0 and res.output == ""
    assert (tmp_path / "b" / "data" / "tensors.kvt.h5").exists()


def test_bundle_files_and_metadata(traces, tmp_path, run):
    out = tmp_path / "bundle"
    res = run(str(traces["clean"]), str(traces["messy"]), "-o", str(out), "--creator", CREATOR,
               "--creator", "Lab Collective", "--title", "Tiny hybrid KV traces", "--keyword", "sliding window",
               "--version", "2.1", "--related", "issupplementto:10.5281/zenodo.19871039", "--json")
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    assert sorted(info["files"]) == [".zenodo.json", "CITATION.cff", "README.md", "SHA256SUMS",
                                     "data/clean.kvt.h5", "data/messy.kvt.h5"]
    for name in ("clean", "messy"):
        assert (out / "data" / f"{name}.kvt.h5").read_bytes() == traces[name].read_bytes()

    meta = json.loads((out / ".zenodo.json").read_text())
    assert meta["upload_type"] == "dataset" and meta["license"] == "cc-by-4.0"
    assert meta["title"] == "Tiny hybrid KV traces" and meta["version"] == "2.1"
    assert meta["creators"] == [
        {"name": "Doe, Jane", "affiliation": "Example University", "orcid": "0000-0002-1825-0097"},
        {"name": "Lab Collective"}]
    assert meta["related_identifiers"] == [{"relation": "isSupplementTo", "identifier": "10.5281/zenodo.19871039"}]
    assert "sliding window" in meta["keywords"] and "qwen3" in meta["keywords"]
    assert "2 trace files of 4 generate requests" in meta["description"]

    yaml = pytest.importorskip("yaml")  # CFF is YAML; PyYAML is only needed to check it here
    cff = yaml.safe_load((out / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0" and cff["type"] == "dataset" and cff["license"] == "CC-BY-4.0"
    assert cff["authors"][0] == {"family-names": "Doe", "given-names": "Jane", "affiliation": "Example University",
                                 "orcid": "https://orcid.org/0000-0002-1825-0097"}
    assert cff["authors"][1] == {"name": "Lab Collective"}
    assert cff["version"] == "2.1" and cff["references"][0]["doi"] == "10.5281/zenodo.19871039"
    assert "qwen3" in cff["keywords"] and "sliding window" in cff["keywords"]


def test_checksums_verify(traces, tmp_path, run):
    out = tmp_path / "b"
    assert run(str(traces["clean"]), "-o", str(out), "--creator", CREATOR, "-q").exit_code == 0
    lines = (out / "SHA256SUMS").read_text().splitlines()
    assert len(lines) == 4
    for line in lines:
        digest, name = line.split("  ", 1)
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
    if shutil.which("sha256sum"):
        assert subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=out).returncode == 0
    # the checksums catch a flipped byte
    data = bytearray((out / "data" / "clean.kvt.h5").read_bytes())
    data[-1] ^= 1
    (out / "data" / "clean.kvt.h5").write_bytes(bytes(data))
    if shutil.which("sha256sum"):
        assert subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=out,
                              capture_output=True).returncode != 0


def test_data_card_reports_quality(traces, tmp_path, run):
    out = tmp_path / "b"
    res = run(str(traces["clean"]), str(traces["messy"]), str(traces["crashed"]), "-o", str(out),
               "--creator", CREATOR, "-q")
    assert res.exit_code == 0, res.output
    card = (out / "README.md").read_text()
    assert "- 3 traces, 6 requests, 72 recorded steps" in card
    assert "Synthetic GPU (80.0 GiB)" in card
    assert "- torch: 2.11.0" in card and "- transformers: 5.17.0" in card
    messy = [line for line in card.splitlines() if line.startswith("| `data/messy.kvt.h5` | yes |")]
    assert messy == ["| `data/messy.kvt.h5` | yes | 4 | nvml, process | 1 | 2 | none |"]
    assert "| `data/crashed.kvt.h5` | NO |" in card
    assert "- incomplete: the writer never closed the trace" in card
    assert "- source nvml unavailable: nvml sampling disabled in this synthetic trace" in card
    assert "| `data/clean.kvt.h5` | yes | 0 | process | 0 | 0 | none |" in card


def test_bad_inputs(traces, tmp_path, run):
    assert run(str(traces["clean"]), "-o", str(tmp_path / "a")).exit_code == exitcodes.USAGE  # no creator
    res = run(str(traces["clean"]), "-o", str(tmp_path / "a"), "--creator", "Doe, J; X; 1234")
    assert res.exit_code == exitcodes.USAGE and "ORCID" in res.output
    res = run(str(traces["clean"]), "-o", str(tmp_path / "a"), "--creator", CREATOR, "--related", "likes:x")
    assert res.exit_code == exitcodes.USAGE and "unknown relation" in res.output
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    res = run(str(traces["clean"]), "-o", str(tmp_path / "full"), "--creator", CREATOR)
    assert res.exit_code == exitcodes.CANNOT_WRITE
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(traces["clean"], other / "messy.kvt.h5")
    res = run(str(traces["messy"]), str(other / "messy.kvt.h5"), "-o", str(tmp_path / "c"), "--creator", CREATOR)
    assert res.exit_code == exitcodes.USAGE and "share a file name" in res.output
    bad = tmp_path / "bad.kvt.h5"
    bad.write_bytes(b"not a trace")
    assert run(str(bad), "-o", str(tmp_path / "d"), "--creator", CREATOR).exit_code == exitcodes.UNREADABLE
    assert "Examples:" in CliRunner().invoke(cli, ["export", "zenodo", "--help"]).output


def test_creator_and_related_parsing():
    assert z.Creator.parse("Doe, Jane") == z.Creator("Doe, Jane")
    assert z.Creator.parse("Doe, Jane;;https://orcid.org/0000-0002-1694-233X").orcid == "0000-0002-1694-233X"
    with pytest.raises(ValueError, match="wrong check digit"):
        z.Creator.parse("Doe, Jane;;0000-0002-1825-009X")
    with pytest.raises(ValueError):
        z.Creator.parse(";x")
    assert z.Related.parse("isDerivedFrom:https://example.org/x").identifier == "https://example.org/x"


HOSTILE_ID = 'evil</td><script>alert("x")</script>\n# Injected heading\n| a | b |\u2028[link](http://x) *'


def _lying(path):
    """Flags set to False on a trace that holds prompt text and sampled tensors."""
    import h5py

    with h5py.File(path, "a") as f:
        f["meta"].attrs["contains_prompt_text"] = False
        f["meta"].attrs["contains_tensor_payloads"] = False
    return path


def test_privacy_is_decided_from_contents_not_flags(tmp_path, run, capsys):
    liar = _lying(write_synthetic_trace(tmp_path / "liar.kvt.h5", payloads=True, prompt_text=True))
    res = run(str(liar), "-o", str(tmp_path / "b"), "--creator", CREATOR)
    assert res.exit_code == exitcodes.REFUSED, res.output
    assert "liar.kvt.h5: holds prompt text (prompt text of 2 request(s))" in res.output
    assert "tensor contents (20 sampled tensors" in res.output
    assert not (tmp_path / "b").exists()
    # Allowing content does not launder the lie: the trace is invalid and is not archived.
    res = run(str(liar), "-o", str(tmp_path / "b"), "--creator", CREATOR, "--allow-content")
    assert res.exit_code == exitcodes.INVALID and "contains_tensor_payloads is false" in res.output
    # info and validate say what is there; the control (honest flags) is valid.
    for args, code in ((["validate", str(liar)], exitcodes.INVALID), (["info", "--json", str(liar)], 0)):
        try:
            main(args)
            got = 0
        except SystemExit as exc:
            got = int(exc.code or 0)
        assert got == code
    out = capsys.readouterr()
    summary = json.loads(out.out[out.out.index("{"):])
    assert summary["contains_prompt_text"] and summary["contains_tensor_payloads"]
    assert summary["privacy_flags"] == {"contains_prompt_text": False, "contains_tensor_payloads": False}
    assert len(summary["privacy_mismatches"]) == 2 and "contains_prompt_text is false" in out.err
    honest = write_synthetic_trace(tmp_path / "honest.kvt.h5", payloads=True, prompt_text=True)
    from kvtrace.format.validate import validate

    assert validate(honest).valid and not validate(liar).valid


def test_hostile_model_id_is_escaped_in_every_bundle_file(tmp_path, run):
    trace = write_synthetic_trace(tmp_path / "evil.kvt.h5", model_id=HOSTILE_ID)
    out = tmp_path / "b"
    res = run(str(trace), "-o", str(out), "--creator", CREATOR, "-q")  # title and description from the trace
    assert res.exit_code == 0, res.output
    card = (out / "README.md").read_text()
    assert "<script>" not in card and "</td>" not in card
    assert not any(line.startswith(("# Injected", "| a |")) for line in card.splitlines())
    assert card.count("\n# ") == 0 and card.startswith("# KV-cache traces of evil&lt;/td&gt;")
    assert "\\[link\\](http://x) \\*" in card  # no live link or emphasis
    meta = json.loads((out / ".zenodo.json").read_text())
    assert "<script>" not in meta["description"] and "&lt;script&gt;" in meta["description"]
    assert "\n" not in meta["title"] and "\u2028" not in meta["title"]
    yaml = pytest.importorskip("yaml")
    cff_text = (out / "CITATION.cff").read_text()
    assert "\u2028" not in cff_text
    cff = yaml.safe_load(cff_text)  # parses, and the model id comes back exactly
    assert HOSTILE_ID in cff["abstract"]
