"""`kvtrace fleet diff`: per metric, the baseline and candidate distributions and a verdict.

Noisy metrics (peak and retained allocation per request, fragmentation per trace, findings per
trace) get a Mann-Whitney U test (scipy) with Cliff's delta as the effect size and a seeded
bootstrap confidence interval of the difference of medians. A metric regresses only when the test
rejects at ``alpha`` AND the interval excludes zero AND the median moved by more than
``min_effect`` of the baseline median: with hundreds of traces a test alone flags byte-sized
shifts nobody cares about. Exact-geometry metrics (KV bytes per token per layer type) are compared
as sets of exact values: any difference is a change, no statistics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtrace.fleet.query import FleetError, trace_columns

BOOTSTRAP = 2000
SEED = 0

# name, SQL returning (trace_id, value) rows per observation, unit, higher_is_worse.
NOISY_METRICS: tuple[tuple[str, str, str], ...] = (
    ("peak_allocated_bytes per request",
     "SELECT trace_id, peak_allocated_bytes::DOUBLE FROM requests WHERE peak_allocated_bytes IS NOT NULL", "bytes"),
    ("retained_allocated_bytes per request",
     "SELECT trace_id, retained_allocated_bytes::DOUBLE FROM requests WHERE retained_allocated_bytes IS NOT NULL",
     "bytes"),
    ("peak_kv_bytes per request",
     "SELECT trace_id, peak_kv_bytes::DOUBLE FROM requests WHERE peak_kv_bytes IS NOT NULL", "bytes"),
    ("max inactive_split_bytes per trace",
     "SELECT trace_id, max(inactive_split_bytes)::DOUBLE FROM telemetry WHERE source = 'allocator' "
     "AND inactive_split_bytes >= 0 GROUP BY trace_id", "bytes"),
    ("findings >= low per trace",
     "SELECT t.trace_id, count(f.trace_id) FILTER (WHERE f.severity_rank >= 1)::DOUBLE FROM traces t "
     "LEFT JOIN findings f USING (trace_id) GROUP BY t.trace_id", "count"),
)


@dataclass
class Selector:
    key: str
    value: str

    @classmethod
    def parse(cls, text: str) -> Selector:
        key, sep, value = text.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{text!r}: expected KEY=VALUE, e.g. transformers_version=5.23.0")
        return cls(key.strip(), value.strip())


def _trace_ids(con: Any, sel: Selector) -> list[str]:
    cols = trace_columns(con)
    if sel.key not in cols:
        raise FleetError(f"unknown key {sel.key!r}; columns of traces: {', '.join(cols)}")
    rows = con.execute(f'SELECT trace_id FROM traces WHERE CAST("{sel.key}" AS VARCHAR) = $v', {"v": sel.value})
    return [r[0] for r in rows.fetchall()]


def _values(con: Any, sql: str, ids: list[str]) -> np.ndarray:
    rows = con.execute(f"SELECT * FROM ({sql}) WHERE trace_id IN (SELECT unnest($ids))", {"ids": ids}).fetchall()
    return np.array([r[1] for r in rows if r[1] is not None], dtype=np.float64)


def _bootstrap_median_diff(a: np.ndarray, b: np.ndarray, level: float) -> tuple[float, float]:
    rng = np.random.default_rng(SEED)
    ma = np.median(rng.choice(a, (BOOTSTRAP, a.size)), axis=1)
    mb = np.median(rng.choice(b, (BOOTSTRAP, b.size)), axis=1)
    lo, hi = np.quantile(mb - ma, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi)


def _mann_whitney(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(p-value, Cliff's delta = P(b > a) - P(b < a)); scipy when present, else numpy ranks."""
    try:
        from scipy.stats import mannwhitneyu

        res = mannwhitneyu(b, a, alternative="two-sided")
        u, p = float(res.statistic), float(res.pvalue)
    except ImportError:  # normal approximation, ties averaged (no tie correction of the variance)
        ranks = _ranks(np.concatenate([b, a]))
        u = float(ranks[: b.size].sum() - b.size * (b.size + 1) / 2)
        mu, sigma = a.size * b.size / 2, np.sqrt(a.size * b.size * (a.size + b.size + 1) / 12)
        z = abs(u - mu) / sigma if sigma > 0 else 0.0
        p = float(np.exp(-0.717 * z - 0.416 * z * z))  # Polya-type approximation of 2 * (1 - Phi(z))
    return p, 2 * u / (a.size * b.size) - 1


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(x.size)
    ranks[order] = np.arange(1, x.size + 1)
    for v in np.unique(x):
        tie = x == v
        ranks[tie] = ranks[tie].mean()
    return ranks


def compare_noisy(name: str, unit: str, a: np.ndarray, b: np.ndarray, *, alpha: float, min_effect: float,
                  level: float) -> dict[str, Any]:
    out: dict[str, Any] = {"metric": name, "unit": unit, "kind": "statistical",
                           "baseline": _describe(a), "candidate": _describe(b)}
    if a.size < 2 or b.size < 2:
        return {**out, "verdict": "insufficient", "reason": "fewer than 2 observations in a group"}
    p, delta = _mann_whitney(a, b)
    lo, hi = _bootstrap_median_diff(a, b, level)
    shift = float(np.median(b) - np.median(a))
    scale = abs(float(np.median(a))) or max(abs(float(np.median(b))), 1.0)
    relative = shift / scale
    verdict = "unchanged"
    if p < alpha and (lo > 0 or hi < 0) and abs(relative) > min_effect:
        verdict = "regressed" if shift > 0 else "improved"
    return {**out, "median_shift": shift, "relative_shift": relative, "ci": [lo, hi], "ci_level": level,
            "p_value": p, "cliffs_delta": delta, "verdict": verdict}


def _describe(x: np.ndarray) -> dict[str, Any]:
    if x.size == 0:
        return {"n": 0}
    q = np.quantile(x, [0.1, 0.5, 0.9])
    return {"n": int(x.size), "p10": float(q[0]), "median": float(q[1]), "p90": float(q[2]),
            "mean": float(x.mean())}


def _geometry(con: Any, ids: list[str]) -> dict[str, set[float]]:
    rows = con.execute("SELECT DISTINCT layer_type, bytes_per_token FROM kv WHERE bytes_per_token IS NOT NULL "
                       "AND trace_id IN (SELECT unnest($ids))", {"ids": ids}).fetchall()
    out: dict[str, set[float]] = {}
    for layer_type, value in rows:
        out.setdefault(layer_type, set()).add(float(value))
    return out


def fleet_diff(con: Any, baseline: Selector, candidate: Selector, *, alpha: float = 0.05,
               min_effect: float = 0.05, level: float = 0.95) -> dict[str, Any]:
    """Compare the traces matching ``baseline`` with those matching ``candidate``."""
    a_ids, b_ids = _trace_ids(con, baseline), _trace_ids(con, candidate)
    for sel, ids in ((baseline, a_ids), (candidate, b_ids)):
        if not ids:
            raise FleetError(f"no exported trace has {sel.key} = {sel.value!r}")
    metrics = []
    ga, gb = _geometry(con, a_ids), _geometry(con, b_ids)
    for lt in sorted(set(ga) | set(gb)):
        va, vb = sorted(ga.get(lt, ())), sorted(gb.get(lt, ()))
        if va == vb:
            verdict = "unchanged"
        elif not va or not vb:
            verdict = "changed"  # the layer type exists on one side only: a different model mix
        else:
            verdict = "regressed" if max(vb) > max(va) else "improved" if max(vb) < max(va) else "changed"
        metrics.append({"metric": f"kv bytes per token ({lt} layers)", "unit": "bytes", "kind": "exact",
                        "baseline": {"values": va}, "candidate": {"values": vb}, "verdict": verdict})
    for name, sql, unit in NOISY_METRICS:
        metrics.append(compare_noisy(name, unit, _values(con, sql, a_ids), _values(con, sql, b_ids),
                                     alpha=alpha, min_effect=min_effect, level=level))
    return {"baseline": {"selector": f"{baseline.key}={baseline.value}", "traces": len(a_ids)},
            "candidate": {"selector": f"{candidate.key}={candidate.value}", "traces": len(b_ids)},
            "alpha": alpha, "min_effect": min_effect, "metrics": metrics,
            "regressed": [m["metric"] for m in metrics if m["verdict"] == "regressed"]}
