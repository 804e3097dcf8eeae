"""Run what-if policies over a trace: bytes from the recorded sizes, attention and reconstruction
measures from the sampled K/V/Q (offline proxies, not model quality). JSON contract:
spec/whatif-json.md.

Order of the work: unit by unit (a sampled (request, layer) at a step). For each unit the
keep-sets of every eviction policy at every ratio are planned first, then measured together in
one ``keep_measures_many`` call per chunk of queries (one kernel pass over the unit's K/V on a
GPU, instead of one per policy and ratio); quantisers follow on the same unit. The document is
assembled per policy and ratio as if each had been evaluated alone."""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from kvtrace.format.reader import Trace
from kvtrace.jsonable import plain
from kvtrace.whatif import source
from kvtrace.whatif.accelerated import Accelerated, Exact, open_numerics
from kvtrace.whatif.policies import (
    Observed,
    Paging,
    Policy,
    PolicyError,
    Quantizer,
    ScorerPolicy,
    StreamingLLM,
)

__all__ = ["SCHEMA", "NEEDS", "run_whatif"]

SCHEMA = 1
NEEDS = {
    "bytes": "sizes", "attention_mass_recall": "Q and K", "attention_output_error": "Q, K and V",
    "key_mse": "K", "key_cosine": "K", "value_mse": "V", "value_cosine": "V",
}
NOTE = ("offline proxies from the recorded sizes and sampled tensors, not model quality: bytes for "
        "every recorded step; attention measures at each (request, layer)'s last sampled step, for "
        "the queries sampled at that step, with the full cache as reference")
STEPS_NOTE = {"last": "each (request, layer)'s last sampled step",
              "all": f"up to {source.MAX_STEPS} sampled steps of each (request, layer), evenly spaced, the last included"}

# (policy, ratio, its result in the document): one evaluation of the content measures.
_Job = tuple[Policy, float | None, dict[str, Any]]


def run_whatif(trace: Trace | str | os.PathLike[str], policies: list[Policy], ratios: list[float],
               device: str = "cpu", steps: str = "last") -> dict[str, Any]:
    """The what-if document (spec/whatif-json.md) for ``policies`` at compression ``ratios``;
    ``device`` cpu (numerics.py, float64) | cuda | auto (the Triton kernels where CUDA is, within
    the tolerances of whatif/accelerated.py; else cpu, said in ``numerics.note``). ``steps``: the
    content measures at each (request, layer)'s last sampled step, or at up to MAX_STEPS of them
    ("all"; one layer row per step)."""
    if not isinstance(trace, Trace):
        with Trace(trace) as t:
            return run_whatif(t, policies, ratios, device, steps)
    calc = open_numerics(device)
    for r in ratios:
        if not 0 <= r < 1:
            raise PolicyError(f"ratio must be in [0, 1), got {r}")
    sz = source.sizes(trace)
    if steps not in STEPS_NOTE:
        raise PolicyError(f"steps must be one of {', '.join(STEPS_NOTE)}, got {steps!r}")
    units = list(source.units(trace, steps))
    base = _totals(sz, sz.allocated)
    doc: dict[str, Any] = {
        "kvtrace_whatif": SCHEMA, "kind": "proxy", "note": NOTE.replace(STEPS_NOTE["last"], STEPS_NOTE[steps]),
        "steps": steps, "needs": NEEDS, "ratios": ratios,
        "numerics": {"backend": calc.label, "note": calc.note},
        "baseline": {"layout": "the trace's own", "bytes_peak": base[0], "bytes_mean": base[1],
                     "valid_peak": _totals(sz, sz.valid)[0], "kv_rows": len(sz)},
        "sampled_units": len(units), "policies": [],
    }
    no_contents = "" if units else "the trace holds no sampled K/V (record with sampling={'every_n_steps': N})"
    jobs: list[_Job] = []
    for pol in policies:
        entry: dict[str, Any] = {"policy": pol.name, "label": pol.label(), "family": pol.family,
                                 "needs": pol.needs, "params": pol.params(), "results": []}
        if pol.note:
            entry["note"] = pol.note
        for ratio in (ratios if isinstance(pol, ScorerPolicy) and not _fixed(pol) else [None]):
            res = _result(pol, ratio, sz, base, no_contents)
            entry["results"].append(res)
            if pol.family != "paging" and not no_contents:
                jobs.append((pol, ratio, res))
        doc["policies"].append(entry)
    _replay(jobs, units, calc)
    for _, _, res in jobs:
        res["overall"] = _overall(res["layers"])
    return plain(doc)


def _fixed(pol: Policy) -> bool:
    return isinstance(pol, StreamingLLM) and pol.window > 0


def _totals(sz: source.Sizes, per_row: np.ndarray) -> tuple[float, float]:
    """(peak, mean) over the recorded (request, step) of the bytes summed over layers."""
    if not len(sz):
        return 0.0, 0.0
    keys = sz.request * (int(sz.step.max()) + 1) + sz.step
    _, inv = np.unique(keys, return_inverse=True)
    tot = np.bincount(inv, weights=per_row)
    return float(tot.max()), float(tot.mean())


def _kept_bytes(pol: Policy, ratio: float | None, sz: source.Sizes) -> np.ndarray:
    bpt = sz.per_token
    if isinstance(pol, Paging):
        return pol.tokens_allocated(sz.tokens) * bpt
    if isinstance(pol, StreamingLLM):
        kept = np.minimum(sz.tokens, pol.n_sink + pol.window) if pol.window else _n_kept(sz.tokens, ratio)
        return kept * bpt
    if isinstance(pol, ScorerPolicy):
        return _n_kept(sz.tokens, ratio) * bpt
    assert isinstance(pol, Quantizer)
    out = np.zeros(len(sz))
    for i in range(len(sz)):
        t = int(sz.tokens[i])
        per_head = pol.stored_bytes(t, int(sz.k_dim[i]), int(sz.k_bytes[i]), "key") + \
            pol.stored_bytes(t, int(sz.v_dim[i]), int(sz.v_bytes[i]), "value")
        out[i] = per_head * sz.kv_heads[i] * sz.batch[i]
    return out


def _n_kept(tokens: np.ndarray, ratio: float | None) -> np.ndarray:
    """policies.n_kept per row: max(1, int(T * (1 - ratio))) for T > 0, as kvpress."""
    kept = (tokens * (1 - (ratio or 0.0))).astype(np.int64)
    return np.where(tokens > 0, np.maximum(kept, 1), 0)


def _result(pol: Policy, ratio: float | None, sz: source.Sizes, base: tuple[float, float],
            no_contents: str) -> dict[str, Any]:
    """The result of ``pol`` at ``ratio`` with its bytes; the content measures are filled in by
    :func:`_replay` (none for paging, a skip when the trace has no contents)."""
    kept = _totals(sz, _kept_bytes(pol, ratio, sz))
    res: dict[str, Any] = {
        "ratio": ratio,
        "bytes": {"kept_peak": kept[0], "kept_mean": kept[1], "saved_peak": base[0] - kept[0],
                  "saved_mean": base[1] - kept[1]},
        "overall": {}, "layers": [], "skipped": [],
    }
    if pol.family == "paging":
        res["bytes"]["waste_peak"], res["bytes"]["waste_mean"] = _totals(sz, _kept_bytes(pol, ratio, sz) - sz.valid)
    elif no_contents:
        res["skipped"].append({"measure": "all content measures", "request": None, "layer": None, "reason": no_contents})
    return res


def _replay(jobs: list[_Job], units: list[source.Unit], calc: Exact | Accelerated) -> None:
    """Content measures of every job on every unit, into the jobs' results: per unit, the keep-sets
    of all eviction jobs in one :func:`_measure_keeps`, then each quantiser."""
    scorers = [j for j in jobs if isinstance(j[0], ScorerPolicy)]
    quantizers = [j for j in jobs if not isinstance(j[0], ScorerPolicy)]
    for u in units:
        _scorer_unit(scorers, u, calc)
        for pol, _, res in quantizers:
            try:
                res["layers"].append(_quantizer_unit(pol, u, res["skipped"], calc))
            except PolicyError as exc:
                _skip(res["skipped"], "all content measures", u, str(exc))


def _skip(skipped: list[dict[str, Any]], measure: str, u: source.Unit, reason: str) -> None:
    skipped.append({"measure": measure, "request": u.request, "layer": u.layer, "reason": reason})


def _row(u: source.Unit) -> dict[str, Any]:
    row: dict[str, Any] = {"request": u.request, "layer": u.layer, "step": u.step, "layer_type": u.layer_type,
                           "tokens": int(u.k.shape[2]), "kv_heads": u.kv_heads}
    if u.latent:
        row["tensors"] = ["latent", "rope_key"]  # what key_* / value_* measure on an MLA cache
    if u.notes:
        row["notes"] = list(u.notes)
    return row


def _attn(u: source.Unit) -> tuple[Any, ...]:
    return (u.eval_q, u.k, u.v, u.eval_pos, u.k_pos, u.window, u.scale)


def _plan(pol: ScorerPolicy, ratio: float | None, u: source.Unit, skipped: list[dict[str, Any]]) -> np.ndarray | None:
    """``pol``'s keep-set [B, Hk, T] of ``u``, or None with the skip said (no observed queries).
    Raises PolicyError where the policy cannot plan this unit."""
    obs = None
    if pol.needs.startswith("Q"):
        if u.obs_q is None:
            reason = u.no_queries or f"no query sampled before step {u.step} to score with"
            _skip(skipped, "all content measures", u, f"{pol.name} needs observed queries: {reason}")
            return None
        obs = Observed(u.obs_q, u.obs_pos, u.k_pos, u.window, u.scale)
    return pol.plan(u.k, ratio if ratio is not None else 0.0, obs, u.v)


def _scorer_unit(jobs: list[_Job], u: source.Unit, calc: Exact | Accelerated) -> None:
    """Every eviction job on ``u``: plan each keep-set, measure them all at once, one row each."""
    planned: list[tuple[dict[str, Any], np.ndarray]] = []
    for pol, ratio, res in jobs:
        assert isinstance(pol, ScorerPolicy)
        try:
            keep = _plan(pol, ratio, u, res["skipped"])
        except PolicyError as exc:
            _skip(res["skipped"], "all content measures", u, str(exc))
            continue
        if keep is not None:
            planned.append((res, keep))
    if not planned:
        return
    measurable = u.eval_q is not None and not u.latent
    measures = _measure_keeps(calc, _attn(u), [keep for _, keep in planned]) if measurable else []
    hk = u.k.shape[1]
    for i, (res, keep) in enumerate(planned):
        row = _row(u)
        row["kept_tokens_per_head"] = keep.sum(axis=(0, 2)).tolist()
        if measurable:
            row["attention_mass_recall"] = _per_kv_head(measures[i][0], hk)
            row["attention_output_error"] = _per_kv_head(measures[i][1], hk)
        else:
            _skip(res["skipped"], "attention_mass_recall", u, u.no_queries)
            _skip(res["skipped"], "attention_output_error", u, u.no_queries)
        res["layers"].append(row)


def _measure_keeps(calc: Exact | Accelerated, attn: tuple[Any, ...], keeps: list[np.ndarray]
                   ) -> list[tuple[np.ndarray, np.ndarray]]:
    """(recall, output error) [B, Hq, Tq] of each keep-set: one ``keep_measures_many`` call per
    chunk of queries for all sets."""
    flat = _by_queries(lambda a: [x for pair in calc.keep_measures_many(*a, keeps) for x in pair], attn)
    return list(zip(flat[0::2], flat[1::2], strict=True))


def _quantizer_unit(pol: Policy, u: source.Unit, skipped: list[dict[str, Any]],
                    calc: Exact | Accelerated) -> dict[str, Any]:
    assert isinstance(pol, Quantizer)
    row = _row(u)
    for name, x in (("key", u.k), ("value", u.v)):
        row[f"{name}_mse"], row[f"{name}_cosine"] = calc.reconstruction(pol, x, name)
    if u.eval_q is None:
        _skip(skipped, "attention_output_error", u, u.no_queries)
    else:
        err = _by_queries(lambda a: (calc.output_error(pol, *a),), _attn(u))[0]
        row["attention_output_error"] = _per_kv_head(err, u.k.shape[1])
    return row


# Per [B, Hq, queries, T] array of one pass (128 MiB in float64). Not divided by the number of
# keep-sets measured in the pass: Exact measures them one after another (the peak is one set's),
# the torch reference holds the probabilities once plus one set's temporaries, and the Triton
# kernels' partial states are (sets + 1) x rows x Dv fp32 (key splits only where rows x sets are
# few) -- (sets + 1) * Dv / (2 T) of this budget, small at the long caches where chunks matter.
CHUNK_ELEMENTS = 1 << 24


def _by_queries(fn: Any, attn: tuple[Any, ...]) -> tuple[np.ndarray, ...]:
    """``fn(attn)`` over chunks of the evaluation queries, joined along the query axis: a long
    prefill's queries times a long cache would not fit at once (``attn``: q, k, v, q_pos, ...)."""
    q, k, v, q_pos, *rest = attn
    n = max(1, CHUNK_ELEMENTS // max(1, q.shape[0] * q.shape[1] * k.shape[2]))
    if q.shape[2] <= n:
        return tuple(fn(attn))
    parts = [fn((q[:, :, i:i + n], k, v, q_pos[i:i + n], *rest)) for i in range(0, q.shape[2], n)]
    return tuple(np.concatenate(xs, axis=2) for xs in zip(*parts, strict=True))


def _per_kv_head(x: np.ndarray, hk: int) -> list[float]:
    """[B, Hq, Tq] -> mean per KV head (over its query heads, the batch and the queries)."""
    B, hq, tq = x.shape
    return [float(np.nanmean(a)) for a in x.reshape(B, hk, hq // hk, tq).transpose(1, 0, 2, 3).reshape(hk, -1)]


_WORST = {"attention_mass_recall": min, "key_cosine": min, "value_cosine": min}


def _overall(layers: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in NEEDS:
        vals = [x for row in layers for x in row.get(m, []) if isinstance(x, float) and math.isfinite(x)]
        if vals:
            worst = _WORST.get(m, max)
            out[m] = {"mean": float(np.mean(vals)), "worst": worst(vals), "heads": len(vals), "needs": NEEDS[m]}
    return out


