"""An upload-ready Zenodo dataset bundle from one or more traces.

DIR/
  data/<trace files>      byte-for-byte copies
  .zenodo.json            deposit metadata (upload_type dataset, creators, license, ...)
  CITATION.cff            Citation File Format 1.2.0
  README.md               data card generated from the traces, with a data-quality assessment
  SHA256SUMS              `sha256sum -c SHA256SUMS` checks every other file

Traces holding prompt text or tensor contents are refused unless the caller allows content:
an archive is public and permanent, so the user has to say so explicitly. What a trace holds is
read from its contents (payload rows and chunks, stored prompt text), never taken from its /meta
flags. Traces that fail validation are refused outright.

Every string that comes from a trace (model ids, device names, software versions, reasons) or from
the command line is plain text, escaped for the file it lands in: HTML for the .zenodo.json
description (Zenodo renders it as HTML), YAML double-quoted scalars for CITATION.cff, Markdown for
README.md.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import html
import json
import os
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import yaml

from kvtrace._version import __version__
from kvtrace.errors import BundleError, ContentRefused  # noqa: F401 - z.BundleError is part of this API
from kvtrace.format.reader import Trace
from kvtrace.format.summary import summarize
from kvtrace.format.validate import ValidationReport, validate_open
from kvtrace.report import quality
from kvtrace.units import format_bytes

if TYPE_CHECKING:
    from kvtrace.analyzer.report import AnalysisReport

# Zenodo license id -> SPDX id (CITATION.cff wants SPDX).
LICENSES = {
    "cc-by-4.0": "CC-BY-4.0", "cc0-1.0": "CC0-1.0", "cc-by-sa-4.0": "CC-BY-SA-4.0",
    "cc-by-nc-4.0": "CC-BY-NC-4.0", "odc-by-1.0": "ODC-By-1.0", "odbl-1.0": "ODbL-1.0",
    "pddl-1.0": "PDDL-1.0",
}
# Relations Zenodo accepts in related_identifiers (DataCite relation types).
RELATIONS = (
    "isCitedBy", "cites", "isSupplementTo", "isSupplementedBy", "isContinuedBy", "continues",
    "isDescribedBy", "describes", "hasMetadata", "isMetadataFor", "isNewVersionOf", "isPreviousVersionOf",
    "isPartOf", "hasPart", "isReferencedBy", "references", "isDocumentedBy", "documents", "isCompiledBy",
    "compiles", "isVariantFormOf", "isOriginalFormOf", "isIdenticalTo", "isAlternateIdentifier",
    "isReviewedBy", "reviews", "isDerivedFrom", "isSourceOf", "requires", "isRequiredBy",
    "isObsoletedBy", "obsoletes",
)
KEYWORDS = ("KV cache", "LLM inference", "GPU memory", "kvtrace", "transformers")
HASH_CHUNK = 4 * 1024 * 1024

Progress = Callable[[str, int], None]  # (what, bytes done since last call)


def orcid_check_digit(base: str) -> str:
    """The ISO 7064 MOD 11-2 check character of an ORCID's first 15 digits (hyphens ignored), as
    orcid.org defines it: a typo in any one digit changes it, so a mistyped ORCID is caught here
    rather than published as someone else's."""
    total = 0
    for ch in base.replace("-", ""):
        total = (total + int(ch)) * 2
    result = (12 - total % 11) % 11
    return "X" if result == 10 else str(result)


@dataclass(frozen=True)
class Creator:
    name: str  # "Family, Given" as Zenodo wants it
    affiliation: str | None = None
    orcid: str | None = None

    @classmethod
    def parse(cls, spec: str) -> Creator:
        """'Family, Given[; affiliation[; ORCID]]'."""
        parts = [p.strip() for p in spec.split(";")]
        name = parts[0]
        if not name:
            raise ValueError(f"creator {spec!r}: empty name")
        orcid = parts[2] if len(parts) > 2 and parts[2] else None
        if orcid:
            orcid = orcid.removeprefix("https://orcid.org/")
            if not re.fullmatch(r"\d{4}-\d{4}-\d{4}-\d{3}[\dX]", orcid):
                raise ValueError(f"creator {spec!r}: ORCID {orcid!r} is not 0000-0000-0000-0000")
            expected = orcid_check_digit(orcid[:-1])
            if orcid[-1] != expected:
                raise ValueError(f"creator {spec!r}: ORCID {orcid} has a wrong check digit "
                                 f"(ISO 7064 11,2 gives {expected}); copy it again from orcid.org")
        if len(parts) > 3:
            raise ValueError(f"creator {spec!r}: expected 'Family, Given; affiliation; ORCID'")
        return cls(name, (parts[1] or None) if len(parts) > 1 else None, orcid)


@dataclass(frozen=True)
class Related:
    relation: str
    identifier: str

    @classmethod
    def parse(cls, spec: str) -> Related:
        """'RELATION:IDENTIFIER', e.g. 'isSupplementTo:10.5281/zenodo.123'."""
        relation, sep, identifier = spec.partition(":")
        if not sep or not identifier.strip():
            raise ValueError(f"related identifier {spec!r}: expected RELATION:IDENTIFIER")
        match = {r.lower(): r for r in RELATIONS}.get(relation.strip().lower())
        if match is None:
            raise ValueError(f"related identifier {spec!r}: unknown relation {relation!r} "
                             f"(one of {', '.join(RELATIONS)})")
        return cls(match, identifier.strip())


@dataclass
class BundleOptions:
    title: str | None  # None: "KV-cache traces of MODELS (kvtrace)" from the traces' model ids
    creators: Sequence[Creator]
    description: str | None = None
    license: str = "cc-by-4.0"
    keywords: Sequence[str] = ()
    version: str = "1.0"
    related: Sequence[Related] = ()
    allow_content: bool = False
    publication_date: str | None = None  # YYYY-MM-DD; today (UTC) when None


@dataclass
class TraceCard:
    """What the data card says about one trace."""

    file: str
    bytes: int
    sha256: str
    summary: dict[str, Any]
    steps: int
    quality: quality.Quality
    validation_warnings: list[str] = field(default_factory=list)


@dataclass
class Bundle:
    directory: Path
    files: list[Path]
    traces: list[TraceCard]


def content_problems(paths: Sequence[str | os.PathLike[str]]) -> list[str]:
    """One line per trace that holds prompt text or tensor contents, saying which."""
    out = []
    for p in paths:
        with Trace(p) as t:
            out.extend(_content_problem(t))
    return out


def _content_problem(trace: Trace) -> list[str]:
    """The content line of one open trace ([] when it holds neither prompt text nor tensors)."""
    held = trace.stored_contents()
    what = []
    if held["prompt_text"] or trace.meta.contains_prompt_text:
        what.append(f"prompt text ({held['prompt_text'] or 'meta.contains_prompt_text'})")
    if held["tensor_payloads"] or trace.meta.contains_tensor_payloads:
        what.append(f"tensor contents ({held['tensor_payloads'] or 'meta.contains_tensor_payloads'})")
    return [f"{trace.path}: holds {' and '.join(what)}"] if what else []


@dataclass
class _Read:
    """All the bundle needs from one trace, read in its one open."""

    model_id: str
    content: list[str]
    validation: ValidationReport
    summary: dict[str, Any] = field(default_factory=dict)
    quality: quality.Quality | None = None
    steps: int = 0


def render(trace: Trace, report: AnalysisReport | None) -> _Read:
    """The data-card renderer of one open trace: its content, validity, summary, data quality
    and step count. ``report`` is taken for the renderers' common shape and not read: the card
    describes the recording, and findings are not archived."""
    del report  # see the docstring
    validation = validate_open(trace)
    out = _Read(trace.meta.model_id, _content_problem(trace), validation)
    if validation.valid:  # an invalid trace is refused; its summary is never shown
        out.summary, out.quality, out.steps = summarize(trace), quality.assess(trace), trace.nrows("steps")
    return out


def read_traces(paths: Sequence[Path]) -> list[_Read]:
    """Each trace opened once and rendered (content, validity, card facts)."""
    out = []
    for p in paths:
        with Trace(p) as t:
            out.append(render(t, None))
    return out


def default_title(model_ids: Sequence[str]) -> str:
    return f"KV-cache traces of {', '.join(sorted(set(model_ids)))} (kvtrace)"


def sha256_file(path: Path, progress: Progress | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(HASH_CHUNK):
            h.update(chunk)
            if progress:
                progress(f"hash {path.name}", len(chunk))
    return h.hexdigest()


def _copy(src: Path, dst: Path, progress: Progress | None) -> None:
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        while chunk := fi.read(HASH_CHUNK):
            fo.write(chunk)
            if progress:
                progress(f"copy {src.name}", len(chunk))
    shutil.copystat(src, dst)


def export_zenodo(
    traces: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    options: BundleOptions,
    progress: Progress | None = None,
) -> Bundle:
    """Build the bundle. Raises ContentRefused, BundleError, or the reader's errors."""
    if not traces:
        raise BundleError("no traces given")
    if not options.creators:
        raise BundleError("at least one creator is needed (Zenodo requires creators)")
    if options.license not in LICENSES:
        raise BundleError(f"license {options.license!r} not supported (one of {', '.join(LICENSES)})")
    paths = [Path(p) for p in traces]
    names = [p.name for p in paths]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise BundleError(f"two traces share a file name ({', '.join(clash)}); rename one")
    read = read_traces(paths)
    problems = [line for r in read for line in r.content]
    if problems and not options.allow_content:
        raise ContentRefused(
            "refusing to archive content: " + "; ".join(problems)
            + ". A Zenodo record is public and permanent; re-record without prompt text / sampling, "
            "or pass --allow-content if publishing it is intended")
    for p, r in zip(paths, read, strict=True):
        report = r.validation
        if not report.valid:
            raise BundleError(f"{p}: not a valid trace ({'; '.join(report.problems[:3])}); "
                              "run 'kvtrace validate' for the full list", "invalid")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BundleError(f"{out}: exists and is not an empty directory", "output")
    created = not out.exists()
    try:
        (out / "data").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BundleError(f"{out}: cannot create ({exc.strerror})", "output") from None
    if options.title is None:
        options = dataclasses.replace(options, title=default_title([r.model_id for r in read]))
    try:
        return _write_bundle(out, paths, read, options, progress)
    except OSError as exc:  # a full disk: no half bundle (its checksums would not match) is left behind
        _discard(out, created)
        raise BundleError(f"{out}: cannot write the bundle ({exc.strerror or exc})", "output") from None


def _discard(out: Path, created: bool) -> None:
    """Remove what a failed export wrote: ``out`` was empty (or absent) before, so all it holds is ours."""
    if created:
        shutil.rmtree(out, ignore_errors=True)
        return
    for child in list(out.iterdir()):
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def _write_bundle(out: Path, paths: Sequence[Path], read: Sequence[_Read], options: BundleOptions,
                  progress: Progress | None) -> Bundle:
    cards: list[TraceCard] = []
    for p, r in zip(paths, read, strict=True):
        dst = out / "data" / p.name
        _copy(p, dst, progress)  # byte for byte: what was read from p is what the card describes
        q = cast("quality.Quality", r.quality)  # set for every valid trace, and only valid ones reach here
        cards.append(TraceCard(f"data/{p.name}", dst.stat().st_size, "", r.summary, r.steps, q,
                               r.validation.warnings))
    date = options.publication_date or _dt.datetime.now(_dt.timezone.utc).date().isoformat()
    description = options.description or _default_description(cards)
    (out / ".zenodo.json").write_text(json.dumps(zenodo_metadata(options, cards, description, date), indent=2)
                                      + "\n", encoding="utf-8")
    (out / "CITATION.cff").write_text(citation_cff(options, cards, description, date), encoding="utf-8")
    files = [out / c.file for c in cards] + [out / ".zenodo.json", out / "CITATION.cff"]
    sums: dict[str, str] = {}
    for f in files:
        sums[f.relative_to(out).as_posix()] = sha256_file(f, progress)
    for c in cards:
        c.sha256 = sums[c.file]
    (out / "README.md").write_text(data_card(options, cards, description, date), encoding="utf-8")
    sums["README.md"] = sha256_file(out / "README.md")
    (out / "SHA256SUMS").write_text("".join(f"{h}  {n}\n" for n, h in sorted(sums.items())), encoding="utf-8")
    return Bundle(out, sorted(out.rglob("*"), key=str), cards)


# ---- metadata files -----------------------------------------------------------------------------


def _models(cards: Sequence[TraceCard]) -> list[str]:
    return sorted({f"{c.summary['model']['id']} ({c.summary['model']['type']})" for c in cards})


def _devices(cards: Sequence[TraceCard]) -> list[str]:
    out = set()
    for c in cards:
        for d in c.summary["devices"]:
            total = format_bytes(d["total_memory_bytes"]) if d["total_memory_bytes"] >= 0 else "unknown memory"
            out.add(f"{d['name']} ({total})")
    return sorted(out)


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else (plural or word + 's')}"


def _held(cards: Sequence[TraceCard]) -> list[str]:
    """What the traces hold, one phrase per kind of data, from their row counts (never from /meta
    flags or from what the recorder could have recorded): a trace recorded on CPU has no NVML or
    allocator rows and is not described as having them."""
    kinds = (  # (phrase, rows of one trace that hold it)
        ("per-layer KV-cache shapes and bytes per step", lambda c: c.summary["rows"].get("kv", 0)),
        ("labelled memory readings around requests", lambda c: c.summary["rows"].get("readings", 0)),
        ("post-request cache retention checks", lambda c: c.summary["rows"].get("retention", 0)),
        ("NVML device-memory telemetry", lambda c: c.summary["rows"].get("telemetry/nvml", 0)),
        ("PyTorch allocator telemetry", lambda c: c.summary["rows"].get("telemetry/allocator", 0)),
        ("process RSS telemetry", lambda c: c.summary["rows"].get("telemetry/process", 0)),
        ("sampled K/V/Q tensor contents", lambda c: c.summary["payloads"]["count"]),
        ("prompt text", lambda c: int(c.summary["contains_prompt_text"])),
    )
    out = []
    for phrase, rows in kinds:
        having = sum(1 for c in cards if rows(c) > 0)
        if having == len(cards):
            out.append(phrase)
        elif having:
            out.append(f"{phrase} (in {having} of {len(cards)} traces)")
    return out


def _default_description(cards: Sequence[TraceCard]) -> str:
    n_req = sum(c.summary["requests"]["count"] for c in cards)
    models = _models(cards)
    held = _held(cards)
    what = ", ".join(held[:-1]) + f" and {held[-1]}" if len(held) > 1 else (held[0] if held else "no data rows")
    return (f"KV-cache traces recorded with kvtrace: {_plural(len(cards), 'trace file')} of "
            f"{_plural(n_req, 'generate request')}. {'Model' if len(models) == 1 else 'Models'} (type): "
            f"{', '.join(models)}. Each file is an HDF5 trace in the kvtrace format holding {what}.")


def _keywords(options: BundleOptions, cards: Sequence[TraceCard]) -> list[str]:
    """The user's keywords, kvtrace's, then each model type (e.g. qwen3), once each, in that order."""
    return list(dict.fromkeys([*options.keywords, *KEYWORDS, *sorted({c.summary["model"]["type"] for c in cards})]))


def zenodo_metadata(options: BundleOptions, cards: Sequence[TraceCard], description: str, date: str
                    ) -> dict[str, Any]:
    creators = []
    for c in options.creators:
        entry: dict[str, str] = {"name": c.name}
        if c.affiliation:
            entry["affiliation"] = c.affiliation
        if c.orcid:
            entry["orcid"] = c.orcid
        creators.append(entry)
    keywords = _keywords(options, cards)
    meta: dict[str, Any] = {
        "upload_type": "dataset",
        "title": _one_line(options.title),
        "description": html_text(description),
        "creators": creators,
        "access_right": "open",
        "license": options.license,
        "keywords": keywords,
        "version": options.version,
        "publication_date": date,
        "related_identifiers": [{"relation": r.relation, "identifier": r.identifier} for r in options.related],
        "notes": f"Bundle written by kvtrace {__version__}; trace format "
                 f"{', '.join(sorted({c.summary['format_version'] for c in cards}))}. "
                 "Sizes in the data card use binary units (KiB = 1024 B).",
    }
    return meta


def _one_line(s: str) -> str:
    """Control characters (newlines included) become spaces: titles and table cells are one line."""
    return re.sub(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]+", " ", s).strip()


def html_text(s: str) -> str:
    """Plain text as an HTML fragment: markup escaped, line breaks kept as <br>."""
    lines = [html.escape(_one_line(line)) for line in s.splitlines()]
    return "<br>\n".join(lines)


_MD_SPECIAL = re.compile(r"([\\`*_\[\]|~])")


def md_text(s: str, *, line_start: bool = False) -> str:
    """Plain text as inline Markdown: one line; HTML and the characters that start emphasis, code,
    links or table cells escaped; at the start of a line, a block marker (#, >, -, +, =, "1. ")
    neutralised too."""
    text = _MD_SPECIAL.sub(r"\\\1", html.escape(_one_line(s), quote=False))
    if line_start and re.match(r"(#|&gt;|[-+=]|\d+[.)](\s|$))", text):
        text = "\\" + text
    return text


class _Quoted(str):
    """A CFF string value, emitted double-quoted (as the CFF guide recommends): YAML then escapes
    every non-printable character and line separator, and "1.0", "no" or "2024-01-01" stay strings."""


class _CffDumper(yaml.SafeDumper):
    pass


_CffDumper.add_representer(_Quoted, lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", str(v), style='"'))

# CFF 1.2.0 schema patterns (definitions.doi, definitions.url): what does not match is cited as
# an identifier of type "other" instead of producing an invalid file.
_CFF_DOI = re.compile(r"^10\.\d{4,9}(\.\d+)?/[A-Za-z0-9:/_;\-.()\[\]\\]+$")
_CFF_URL = re.compile(r"^(https|http|ftp|sftp)://.+")


def _quote(value: Any) -> Any:
    if isinstance(value, str):
        return _Quoted(value)
    if isinstance(value, dict):
        return {k: _quote(v) for k, v in value.items()}  # keys stay plain
    if isinstance(value, list):
        return [_quote(v) for v in value]
    return value


def _cff_reference(r: Related) -> dict[str, Any]:
    """A related work as a CFF reference. The schema requires authors, and kvtrace knows only the
    identifier, so the author entity says where the authors are found instead of inventing any."""
    identifier = re.sub(r"^https?://(dx\.)?doi\.org/", "", r.identifier)
    ref: dict[str, Any] = {"type": "generic", "title": f"Related work {identifier}",
                           "authors": [{"name": f"the authors of {identifier}"}]}
    if _CFF_DOI.match(identifier):
        ref["doi"] = identifier
    elif _CFF_URL.match(identifier):
        ref["url"] = identifier
    else:
        ref["identifiers"] = [{"type": "other", "value": identifier}]
    ref["notes"] = f"DataCite relation of this dataset to the work: {r.relation}"
    return ref


def citation_data(options: BundleOptions, cards: Sequence[TraceCard], description: str, date: str
                  ) -> dict[str, Any]:
    """CITATION.cff (CFF 1.2.0) as a mapping, keys in the order the CFF guide suggests."""
    authors = []
    for c in options.creators:
        family, sep, given = c.name.partition(",")
        person: dict[str, Any] = ({"family-names": family.strip(), "given-names": given.strip()}
                                  if sep and family.strip() and given.strip() else {"name": c.name})
        if c.affiliation:
            person["affiliation"] = c.affiliation
        if c.orcid:
            person["orcid"] = "https://orcid.org/" + c.orcid
        authors.append(person)
    data: dict[str, Any] = {
        "cff-version": "1.2.0",
        "message": "If you use this dataset, please cite it as below.",
        "type": "dataset",
        "title": options.title,
        "abstract": description,
        "authors": authors,
        "version": options.version,
        "date-released": date,
        "license": LICENSES[options.license],
        "keywords": _keywords(options, cards),
    }
    if options.related:
        data["references"] = [_cff_reference(r) for r in options.related]
    return data


def citation_cff(options: BundleOptions, cards: Sequence[TraceCard], description: str, date: str) -> str:
    return yaml.dump(_quote(citation_data(options, cards, description, date)), Dumper=_CffDumper,
                     sort_keys=False, allow_unicode=True, width=float("inf"))  # no folded lines


def data_card(options: BundleOptions, cards: Sequence[TraceCard], description: str, date: str) -> str:
    n_req = sum(c.summary["requests"]["count"] for c in cards)
    n_steps = sum(c.steps for c in cards)
    software: dict[str, set[str]] = {}
    for c in cards:
        for k, v in c.summary["software"].items():
            software.setdefault(k, set()).add(str(v))
    lines = [
        f"# {md_text(options.title)}",
        "",
        *(md_text(line, line_start=True) for line in description.splitlines()),
        "",
        f"- Version: {options.version}, published {date}",
        f"- License: {LICENSES[options.license]}",
        f"- Creators: {md_text('; '.join(c.name for c in options.creators))}",
        f"- Produced by kvtrace {__version__} (HDF5 trace format; read with `kvtrace info FILE`, "
        "`kvtrace report FILE`, or any HDF5 reader with the zstd filter for sampled contents)",
        "- Sizes are binary units: 1 KiB = 1024 bytes, 1 MiB = 2^20, 1 GiB = 2^30.",
        "",
        "## Contents",
        "",
        f"- {_plural(len(cards), 'trace')}, {_plural(n_req, 'request')}, {_plural(n_steps, 'recorded step')}",
        f"- Models: {md_text(', '.join(_models(cards)))}",
        f"- Devices: {md_text(', '.join(_devices(cards))) or 'none recorded'}",
        *(f"- {k}: {md_text(', '.join(sorted(v)))}" for k, v in sorted(software.items())),
        "",
        "| file | bytes | model | requests (outcomes) | steps | new tokens | layers | prompt text | tensor contents |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cards:
        s = c.summary
        outcomes = ", ".join(f"{n} {k}" for k, n in sorted(s["requests"]["outcomes"].items())) or "none"
        layers = ", ".join(f"{n} {k}" for k, n in sorted(s["layers"]["types"].items())) or "none"
        lines.append(
            f"| `{c.file}` | {format_bytes(c.bytes)} | {md_text(s['model']['id'])} | {s['requests']['count']} ({outcomes}) "
            f"| {c.steps} | {s['requests']['new_tokens']} | {s['layers']['count']} ({layers}) "
            f"| {'yes' if s['contains_prompt_text'] else 'no'} | "
            f"{'yes (' + _plural(s['payloads']['count'], 'tensor') + ')' if s['contains_tensor_payloads'] else 'no'} |")
    lines += ["", "## Data quality", ""]
    lines += [
        "Counted from each trace: DROPPED_SAMPLES and RECORDER_ERROR events, sources the recorder "
        "marked unavailable in its metadata, telemetry timestamp gaps longer than "
        f"{quality.GAP_FACTOR} sampling periods, requests that did not end OK, and traces the "
        "writer never closed.",
        "",
        "| file | complete | dropped samples | unavailable sources | recorder errors | clock gaps | requests not OK |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in cards:
        q = c.quality
        not_ok = {k: v for k, v in q.requests_by_outcome.items() if k != "ok"}
        lines.append(
            f"| `{c.file}` | {'yes' if q.complete else 'NO'} | {q.dropped_samples} | "
            f"{md_text(', '.join(sorted(q.unavailable_sources))) or 'none'} | {q.recorder_errors} | {q.clock_gaps} | "
            f"{', '.join(f'{n} {k}' for k, n in sorted(not_ok.items())) or 'none'} |")
    lines.append("")
    for c in cards:
        details = c.quality.problems + [f"validation warning: {w}" for w in c.validation_warnings]
        if details:
            lines.append(f"`{c.file}`:")
            lines += [f"- {md_text(p)}" for p in details]
            lines.append("")
    if all(not c.quality.problems and not c.validation_warnings for c in cards):
        lines += ["No data-quality problems were found in any trace.", ""]
    lines += ["## Integrity", "", "`sha256sum -c SHA256SUMS` checks every file of this bundle.", "",
              "| file | sha256 |", "|---|---|"]
    lines += [f"| `{c.file}` | `{c.sha256}` |" for c in cards]
    return "\n".join(lines) + "\n"

