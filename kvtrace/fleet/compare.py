"""`kvtrace fleet diff`: per metric, the baseline and candidate distributions and a verdict.

Noisy metrics (peak and retained allocation per request, fragmentation per trace, findings per
trace, the recorder's own device bytes and its errors and dropped samples) get a Mann-Whitney U
test (scipy) with Cliff's delta as the effect size and a seeded bootstrap confidence interval of
the difference of medians. A metric regresses only when the test rejects at ``alpha`` AND the
interval excludes zero AND the median moved by more than ``min_effect`` of the baseline median:
with hundreds of traces a test alone flags byte-sized shifts nobody cares about. Findings rates
per detector (share of traces with a finding at or above low) get Fisher's exact test and a
bootstrap interval of the rate difference, and change only by more than ``min_effect`` rate
points. Exact-geometry metrics (KV bytes per token per model type and layer type) are compared
as sets of exact values: any difference is a change, no statistics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtrace.fleet.query import FleetError, sql_ident, trace_columns
from kvtrace.params import split_key_value

BOOTSTRAP = 2000
SEED = 0

# (name, SQL returning one (trace_id, value) row per observation, unit); higher is worse for all.
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
    ("findings >= low per trace", "SELECT trace_id, findings_low::DOUBLE FROM traces", "count"),
    # recorder overhead, where the trace records it: its own device bytes (sampler staging) per
    # request, and its health. Its time cost is not in the trace (measure it: bench/bench_overhead.py).
    ("recorder_own device bytes per request",
     "SELECT trace_id, allocated_bytes::DOUBLE FROM readings WHERE label = 'recorder_own' AND device >= 0 "
     "AND allocated_bytes >= 0", "bytes"),
    ("recorder errors per trace",
     "SELECT t.trace_id, count(e.trace_id)::DOUBLE FROM traces t LEFT JOIN events e "
     "ON e.trace_id = t.trace_id AND e.kind = 'recorder_error' GROUP BY t.trace_id", "count"),
    ("dropped samples per trace",
     "SELECT t.trace_id, coalesce(sum(e.value), 0)::DOUBLE FROM traces t LEFT JOIN events e "
     "ON e.trace_id = t.trace_id AND e.kind = 'dropped_samples' GROUP BY t.trace_id", "count"),
)

# The views fleet_diff queries (connect(directory, DIFF_TABLES)).
DIFF_TABLES = ("traces", "requests", "kv", "telemetry", "readings", "events")


@dataclass
class Selector:
    key: str
    value: str

    @classmethod
    def parse(cls, text: str) -> Selector:
        kv = split_key_value(text)
        if kv is None or not kv[0].strip():
            raise ValueError(f"{text!r}: expected KEY=VALUE, e.g. transformers_version=5.23.0")
        return cls(kv[0].strip(), kv[1].strip())


def _trace_ids(con: Any, sel: Selector) -> list[str]:
    cols = trace_columns(con)
    if sel.key not in cols:
        raise FleetError(f"unknown key {sel.key!r}; columns of traces: {', '.join(cols)}")
    rows = con.execute(f"SELECT trace_id FROM traces WHERE CAST({sql_ident(sel.key)} AS VARCHAR) = $v", {"v": sel.value})
    return [r[0] for r in rows.fetchall()]


def _values(con: Any, sql: str, ids: list[str]) -> np.ndarray:
    rows = con.execute(f"SELECT * FROM ({sql}) WHERE trace_id IN (SELECT unnest($ids))", {"ids": ids}).fetchall()
    return np.array([r[1] for r in rows if r[1] is not None], dtype=np.float64)


def _bootstrap_diff(a: np.ndarray, b: np.ndarray, level: float, stat: Any = np.median) -> tuple[float, float]:
    """Seeded bootstrap interval of stat(b) - stat(a) (median for values, mean for 0/1 rates)."""
    rng = np.random.default_rng(SEED)
    ma = stat(rng.choice(a, (BOOTSTRAP, a.size)), axis=1)
    mb = stat(rng.choice(b, (BOOTSTRAP, b.size)), axis=1)
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
    if a.size == 0 and b.size == 0:
        return {**out, "verdict": "absent", "reason": "not recorded in either group"}
    if a.size < 2 or b.size < 2:
        return {**out, "verdict": "insufficient", "reason": "fewer than 2 observations in a group"}
    p, delta = _mann_whitney(a, b)
    lo, hi = _bootstrap_diff(a, b, level)
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


def compare_rate(name: str, a: np.ndarray, b: np.ndarray, *, alpha: float, min_effect: float,
                 level: float) -> dict[str, Any]:
    """Two shares of flagged traces (arrays of 0/1): Fisher's exact test, bootstrap CI of b - a."""
    from scipy.stats import fisher_exact

    out: dict[str, Any] = {"metric": name, "unit": "rate", "kind": "rate",
                           "baseline": {"n": int(a.size), "flagged": int(a.sum()), "rate": float(a.mean())},
                           "candidate": {"n": int(b.size), "flagged": int(b.sum()), "rate": float(b.mean())}}
    if a.size < 2 or b.size < 2:
        return {**out, "verdict": "insufficient", "reason": "fewer than 2 traces in a group"}
    p = float(fisher_exact([[int(b.sum()), int(b.size - b.sum())], [int(a.sum()), int(a.size - a.sum())]])[1])
    lo, hi = _bootstrap_diff(a, b, level, np.mean)
    shift = float(b.mean() - a.mean())
    verdict = "unchanged"
    if p < alpha and (lo > 0 or hi < 0) and abs(shift) > min_effect:
        verdict = "regressed" if shift > 0 else "improved"
    return {**out, "rate_shift": shift, "ci": [lo, hi], "ci_level": level, "p_value": p, "verdict": verdict}


def _flagged_detectors(con: Any, ids: list[str]) -> dict[str, set[str]]:
    """detector -> ids of the traces with a finding of it at or above low."""
    rows = con.execute("SELECT t.trace_id, f.detector FROM traces t, unnest(t.findings_by) AS u(f) "
                       "WHERE f.severity_rank >= 1 AND t.trace_id IN (SELECT unnest($ids))", {"ids": ids}).fetchall()
    out: dict[str, set[str]] = {}
    for tid, det in rows:
        out.setdefault(det, set()).add(tid)
    return out


def _geometry(con: Any, ids: list[str]) -> dict[tuple[str, str], set[float]]:
    rows = con.execute("SELECT DISTINCT t.model_type, kv.layer_type, kv.bytes_per_token FROM kv "
                       "JOIN traces t USING (trace_id) WHERE kv.bytes_per_token IS NOT NULL "
                       "AND kv.trace_id IN (SELECT unnest($ids))", {"ids": ids}).fetchall()
    out: dict[tuple[str, str], set[float]] = {}
    for model_type, layer_type, value in rows:
        out.setdefault((model_type or "?", layer_type), set()).add(float(value))
    return out


def _exact(key: tuple[str, str], va: list[float], vb: list[float]) -> dict[str, Any]:
    if va == vb:
        verdict = "unchanged"
    elif not va or not vb:
        verdict = "not_compared"  # this model and layer type exist on one side only: another model mix
    else:
        verdict = "regressed" if max(vb) > max(va) else "improved" if max(vb) < max(va) else "changed"
    return {"metric": f"kv bytes per token ({key[0]}, {key[1]} layers)", "unit": "bytes", "kind": "exact",
            "baseline": {"values": va}, "candidate": {"values": vb}, "verdict": verdict}


def fleet_diff(con: Any, baseline: Selector, candidate: Selector, *, alpha: float = 0.05,
               min_effect: float = 0.05, level: float = 0.95) -> dict[str, Any]:
    """Compare the traces matching ``baseline`` with those matching ``candidate``."""
    a_ids, b_ids = _trace_ids(con, baseline), _trace_ids(con, candidate)
    for sel, ids in ((baseline, a_ids), (candidate, b_ids)):
        if not ids:
            raise FleetError(f"no exported trace has {sel.key} = {sel.value!r}")
    metrics = []
    ga, gb = _geometry(con, a_ids), _geometry(con, b_ids)
    for key in sorted(set(ga) | set(gb)):
        metrics.append(_exact(key, sorted(ga.get(key, ())), sorted(gb.get(key, ()))))
    for name, sql, unit in NOISY_METRICS:
        metrics.append(compare_noisy(name, unit, _values(con, sql, a_ids), _values(con, sql, b_ids),
                                     alpha=alpha, min_effect=min_effect, level=level))
    fa, fb = _flagged_detectors(con, a_ids), _flagged_detectors(con, b_ids)
    for det in sorted(set(fa) | set(fb)):
        flags = [np.array([t in f.get(det, ()) for t in ids], np.float64) for f, ids in ((fa, a_ids), (fb, b_ids))]
        metrics.append(compare_rate(f"{det} findings rate (traces with one >= low)", *flags,
                                    alpha=alpha, min_effect=min_effect, level=level))
    return {"baseline": {"selector": f"{baseline.key}={baseline.value}", "traces": len(a_ids)},
            "candidate": {"selector": f"{candidate.key}={candidate.value}", "traces": len(b_ids)},
            "alpha": alpha, "min_effect": min_effect, "metrics": metrics,
            "regressed": [m["metric"] for m in metrics if m["verdict"] == "regressed"]}


def metric_rows(doc: dict[str, Any], fmt_bytes: Any) -> list[tuple[str, str, str, str, str]]:
    """(metric, baseline, candidate, test, verdict) as text, for the CLI table and the HTML report."""
    rows = []
    for m in doc["metrics"]:
        if m["kind"] == "exact":
            base, cand = m["baseline"]["values"], m["candidate"]["values"]
            rows.append((m["metric"], ", ".join(fmt_bytes(v) for v in base) or "-",
                         ", ".join(fmt_bytes(v) for v in cand) or "-", "exact", m["verdict"]))
            continue
        if m["kind"] == "rate":
            side = lambda d: f"{d['rate']:.1%} ({d['flagged']}/{d['n']})"  # noqa: E731
            stat = (f"Fisher p={m['p_value']:.3g}, CI [{m['ci'][0]:+.1%}, {m['ci'][1]:+.1%}]"
                    if "p_value" in m else m.get("reason", ""))
            rows.append((m["metric"], side(m["baseline"]), side(m["candidate"]), stat, m["verdict"]))
            continue
        fmt = fmt_bytes if m["unit"] == "bytes" else (lambda v: f"{v:.3g}")
        med = lambda d, fmt=fmt: f"{fmt(d['median'])} (n={d['n']})" if d.get("n") else "n=0"  # noqa: E731
        stat = (f"p={m['p_value']:.3g}, delta={m['cliffs_delta']:+.2f}, "
                f"CI [{fmt(m['ci'][0])}, {fmt(m['ci'][1])}]") if "p_value" in m else m.get("reason", "")
        rows.append((m["metric"], med(m["baseline"]), med(m["candidate"]), stat, m["verdict"]))
    return rows
