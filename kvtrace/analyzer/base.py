"""The detector interface, findings, severities and the registry of detectors by name.

A detector is one small class in its own module (like a kvpress "press"): a `name`, the trace
data it `needs`, and `run(ctx)` returning findings. When the data it needs is absent it is
skipped with a stated reason instead of guessing.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # pragma: no cover
    from kvtrace.analyzer.replay import ReplayContext


class Severity(enum.IntEnum):
    INFO = 0
    LOW = 1
    MEDIUM = 2
    HIGH = 3
    CRITICAL = 4

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Severity:
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise ValueError(f"unknown severity {text!r}; use one of {', '.join(SEVERITY_NAMES)}") from None


SEVERITY_NAMES: tuple[str, ...] = tuple(s.label for s in Severity)

# Lower bounds of each severity on the score (documented in docs/detectors.md). A score at or below
# 0.1 is informational: the bound the clean controls of the planted-pathology suite must respect.
SEVERITY_THRESHOLDS: tuple[tuple[float, Severity], ...] = (
    (0.8, Severity.CRITICAL),
    (0.5, Severity.HIGH),
    (0.3, Severity.MEDIUM),
)
INFO_MAX_SCORE = 0.1


def severity_for(score: float) -> Severity:
    """Map a score in [0, 1] to a severity: >=0.8 critical, >=0.5 high, >=0.3 medium,
    >0.1 low, else info."""
    for bound, sev in SEVERITY_THRESHOLDS:
        if score >= bound:
            return sev
    return Severity.LOW if score > INFO_MAX_SCORE else Severity.INFO


# Units evidence may carry: sizes in bytes, times in ns, counts of tokens/things, plain ratios.
UNITS: frozenset[str] = frozenset(
    {"bytes", "ns", "tokens", "ratio", "count", "bytes/token", "bytes/s", "layer", "step"}
)


@dataclass(frozen=True)
class Evidence:
    value: float | int | None
    unit: str

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise ValueError(f"unknown evidence unit {self.unit!r}")

    def to_dict(self) -> dict[str, Any]:
        value = self.value
        if isinstance(value, float) and not math.isfinite(value):
            value = None  # JSON has no inf/nan; absent beats a made-up number
        return {"value": value, "unit": self.unit}


def ev(value: float | int | None, unit: str) -> Evidence:
    """Shorthand; numpy scalars become plain python numbers."""
    if value is not None and hasattr(value, "item"):
        value = value.item()
    return Evidence(value, unit)


@dataclass
class Finding:
    """One thing a detector found, with numbers a serving engineer can check."""

    detector: str
    kind: str  # what was found, e.g. "duplication", "static_over_allocation"
    score: float  # 0 = nothing wrong (informational), 1 = certainly a problem
    message: str  # one sentence, binary units
    evidence: dict[str, Evidence] = field(default_factory=dict)
    requests: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    layers: list[int] = field(default_factory=list)
    device: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.score, (int, float)) and math.isfinite(self.score)):
            raise ValueError(f"{self.detector}: score must be a finite number, got {self.score!r}")
        self.score = float(min(1.0, max(0.0, self.score)))
        self.requests = sorted({int(r) for r in self.requests})
        self.steps = sorted({int(s) for s in self.steps})
        self.layers = sorted({int(x) for x in self.layers})

    @property
    def severity(self) -> Severity:
        return severity_for(self.score)

    def to_dict(self) -> dict[str, Any]:
        return {
            "detector": self.detector,
            "kind": self.kind,
            "score": round(self.score, 4),
            "severity": self.severity.label,
            "message": self.message,
            "evidence": {k: v.to_dict() for k, v in self.evidence.items()},
            "requests": self.requests,
            "steps": self.steps,
            "layers": self.layers,
            "device": self.device,
        }


@dataclass
class DetectorResult:
    """What running one detector on one trace gave: findings, or why it did not run."""

    name: str
    status: str  # "ran" | "skipped" | "error"
    reason: str = ""
    findings: list[Finding] = field(default_factory=list)

    @property
    def score(self) -> float:
        return max((f.score for f in self.findings), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "reason": self.reason,
            "score": round(self.score, 4),
            "severity": severity_for(self.score).label if self.status == "ran" else None,
            "findings": len(self.findings),
        }


class Detector:
    """Base class. Subclasses set `name`, `needs`, `summary` and implement `run`.

    `needs` names trace data (see ReplayContext.missing for the vocabulary): "kv", "steps",
    "readings", "retention", "events", "config", "allocator", "nvml", "device_memory". Any one
    missing skips the detector with that need's reason. Detectors with alternatives (post_eos:
    allocator, else NVML, else retention) override `skip_reason`.
    """

    name: ClassVar[str] = ""
    needs: ClassVar[tuple[str, ...]] = ()
    summary: ClassVar[str] = ""

    def skip_reason(self, ctx: ReplayContext) -> str | None:
        for need in self.needs:
            reason = ctx.missing(need)
            if reason:
                return reason
        return None

    def run(self, ctx: ReplayContext) -> list[Finding]:  # pragma: no cover - abstract
        raise NotImplementedError

    def finding(self, kind: str, score: float, message: str, **kw: Any) -> Finding:
        return Finding(self.name, kind, score, message, **kw)


REGISTRY: dict[str, type[Detector]] = {}


def register(cls: type[Detector]) -> type[Detector]:
    """Class decorator: make a detector available by its name."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise ValueError(f"detector name {cls.name!r} registered twice")
    REGISTRY[cls.name] = cls
    return cls


def detector_names() -> list[str]:
    """Every registered detector, in the documented order."""
    from kvtrace.analyzer.detectors import ORDER  # registers the built-in detectors

    return [n for n in ORDER if n in REGISTRY] + [n for n in REGISTRY if n not in ORDER]


def get_detectors(names: Iterable[str] | None = None) -> list[Detector]:
    """Instances of the named detectors (all when `names` is None); unknown names raise ValueError."""
    available = detector_names()
    if names is None:
        return [REGISTRY[n]() for n in available]
    chosen = list(dict.fromkeys(names))
    unknown = [n for n in chosen if n not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown detector(s) {', '.join(unknown)}; known: {', '.join(available)}")
    return [REGISTRY[n]() for n in chosen]


def evidence_dict(items: Mapping[str, tuple[Any, str]]) -> dict[str, Evidence]:
    return {k: ev(v, u) for k, (v, u) in items.items()}
