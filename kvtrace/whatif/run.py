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
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtrace.format.reader import Trace
from kvtrace.jsonable import plain
from kvtrace.whatif import source
from kvtrace.whatif.accelerated import Accelerated, Exact, open_numerics
from kvtrace.whatif.kvpress import presses_sliding
from kvtrace.whatif.policies import (
    Observed,
    ObservedAttention,
    Paging,
    Policy,
    PolicyError,
    Quantizer,
    ScorerPolicy,
    StreamingLLM,
    Unsupported,
    descending,
)

if TYPE_CHECKING:
    from kvtrace.kernels.whatif_config import KernelConfig

__all__ = ["SCHEMA", "SCHEMA_MINOR", "NEEDS", "run_whatif"]

SCHEMA = 1
# 1: per-row "status" (measured | unsupported | not_pressed) and "reason", "units" per result,
#    "sliding", a policy-free baseline with the recorded layout's effects on their own line
SCHEMA_MINOR = 1
BASELINE = "policy-free: the recorded tokens at the recorded bytes per token (bytes_valid)"
LAYOUT_NOTE = ("the trace's own layout (bytes_allocated) minus the policy-free bytes: views pinning larger "
               "storages, preallocated or paged caches -- not a policy's effect")
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
               device: str = "cpu", steps: str = "last", sliding: str = "auto",
               progress: Callable[[int], AbstractContextManager[Any]] | None = None, *,
               kernel_config: KernelConfig | None = None) -> dict[str, Any]:
    """The what-if document (spec/whatif-json.md) for ``policies`` at compression ``ratios``;
    ``device`` cpu (numerics.py, float64) | cuda | auto (the Triton kernels where CUDA is, within
    the tolerances of whatif/accelerated.py; else cpu, said in ``numerics.note``). ``steps``: the
    content measures at each (request, layer)'s last sampled step, or at up to MAX_STEPS of them
    ("all"; one layer row per step). ``sliding``: whether eviction presses sliding-window layers
    (auto: kvpress's choice for the model, kvtrace.whatif.kvpress.presses_sliding; press; keep).
    ``progress(total)``: a context manager yielding a callable told each unit as it starts
    (kvtrace.progress.progress_bar). ``kernel_config``: how the Triton kernels run (None: the
    defaults, kvtrace/kernels/whatif_config.py)."""
    if not isinstance(trace, Trace):
        with Trace(trace) as t:
            return run_whatif(t, policies, ratios, device, steps, sliding, progress, kernel_config=kernel_config)
    calc = open_numerics(device, kernel_config=kernel_config)
    for r in ratios:
        if not 0 <= r < 1:
            raise PolicyError(f"ratio must be in [0, 1), got {r}")
    if steps not in STEPS_NOTE:
        raise PolicyError(f"steps must be one of {', '.join(STEPS_NOTE)}, got {steps!r}")
    cfg = trace.meta.model_config if isinstance(trace.meta.model_config, dict) else {}
    press_sliding, sliding_reason = presses_sliding(cfg, sliding)
    sz = source.sizes(trace)
    units = list(source.units(trace, steps))
    base, alloc = _totals(sz, sz.valid), _totals(sz, sz.allocated)
    doc: dict[str, Any] = {
        "kvtrace_whatif": SCHEMA, "schema_minor": SCHEMA_MINOR, "kind": "proxy",
        "note": NOTE.replace(STEPS_NOTE["last"], STEPS_NOTE[steps]),
        "steps": steps, "needs": NEEDS, "ratios": ratios,
        "numerics": {"backend": calc.label, "note": calc.note},
        "baseline": {"layout": BASELINE, "bytes_peak": base[0], "bytes_mean": base[1], "valid_peak": base[0],
                     "kv_rows": len(sz),
                     "recorded": {"allocated_peak": alloc[0], "allocated_mean": alloc[1],
                                  "layout_peak": alloc[0] - base[0], "layout_mean": alloc[1] - base[1],
                                  "note": LAYOUT_NOTE}},
        "sliding": {"pressed": press_sliding, "mode": sliding, "reason": sliding_reason,
                    "layers": sorted({int(x) for x in sz.layer[sz.sliding]})},
        "sampled_units": len(units), "policies": [],
    }
    state = _state_steps(trace)  # hybrid models: conv/recurrent state no token policy can evict
    if state:
        doc["baseline"]["state"] = _state_baseline(sz, state)
    no_contents = "" if units else "the trace holds no sampled K/V (record with sampling={'every_n_steps': N})"
    jobs: list[_Job] = []
    for pol in policies:
        entry: dict[str, Any] = {"policy": pol.name, "label": pol.label(), "family": pol.family,
                                 "needs": pol.needs, "params": pol.params(), "results": []}
        if pol.note:
            entry["note"] = pol.note
        for ratio in (ratios if isinstance(pol, ScorerPolicy) and not _fixed(pol) else [None]):
            res = _result(pol, ratio, sz, base, no_contents, press_sliding)
            if state:
                peak, mean = _with_state(sz, _kept_bytes(pol, ratio, sz, press_sliding), state)
                res["bytes"]["kept_with_state_peak"], res["bytes"]["kept_with_state_mean"] = peak, mean
            entry["results"].append(res)
            if pol.family != "paging" and not no_contents:
                jobs.append((pol, ratio, res))
        doc["policies"].append(entry)
    with (progress or _no_progress)(len(units)) as step:
        _replay(jobs, units, calc, press_sliding, step)
    for _, _, res in jobs:
        res["overall"] = _overall(res["layers"])
        res["units"] = {k: sum(row.get("status") == k for row in res["layers"])
                        for k in ("measured", "unsupported", "not_pressed")}
    return plain(doc)


@contextmanager
def _no_progress(total: int) -> Iterator[Callable[[str], None]]:
    yield lambda _stage: None


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


STATE_NOTE = ("conv/recurrent state of a hybrid model's linear-attention / Mamba / conv layers (format 1.5 /state): "
              "constant per sequence and holding no token positions, so no token policy (eviction, paging, KV "
              "quantisation) removes any of it; kept_with_state_* = kept + this state")


def _state_steps(trace: Trace) -> dict[tuple[int, int], int]:
    """(request, step) -> state bytes the cache held beside its KV (empty: attention-only trace)."""
    return {k: u for k, (u, _) in trace.state_steps.items()}


def _with_state(sz: source.Sizes, per_row: np.ndarray, state: dict[tuple[int, int], int]) -> tuple[float, float]:
    """(peak, mean) as :func:`_totals`, each recorded (request, step)'s state added to its KV bytes."""
    if not len(sz):
        return 0.0, 0.0
    keys = sz.request.astype(np.int64) << 32 | sz.step.astype(np.int64)
    uniq, inv = np.unique(keys, return_inverse=True)
    tot = np.bincount(inv, weights=per_row) + np.array(
        [state.get((int(k) >> 32, int(k) & 0xFFFFFFFF), 0) for k in uniq], dtype=np.float64)
    return float(tot.max()), float(tot.mean())


def _state_baseline(sz: source.Sizes, state: dict[tuple[int, int], int]) -> dict[str, Any]:
    """The baseline's state block: the state alone and the policy-free bytes with it."""
    with_peak, with_mean = _with_state(sz, sz.valid, state)
    values = list(state.values())
    return {"bytes_peak": float(max(values)), "bytes_mean": float(np.mean(values)),
            "with_state_peak": with_peak, "with_state_mean": with_mean, "evictable": False, "note": STATE_NOTE}


def _kept_tokens(pol: ScorerPolicy, ratio: float | None, tokens: np.ndarray) -> np.ndarray:
    """Tokens ``pol`` keeps of each row's ``tokens`` at ``ratio`` (what its keep-set holds)."""
    if isinstance(pol, StreamingLLM):
        n = np.minimum(tokens, pol.n_sink + pol.window) if pol.window else _n_kept(tokens, ratio)
        return np.minimum(tokens, np.maximum(n, pol.n_sink))  # the sinks are kept (StreamingLLM.kept)
    return _n_kept(tokens, ratio)


def _kept_bytes(pol: Policy, ratio: float | None, sz: source.Sizes, press_sliding: bool = True) -> np.ndarray:
    """Bytes of each /kv row under ``pol``: kept tokens at the row's own bytes per token (as
    ``valid * kept / tokens``: exactly ``valid`` where everything is kept)."""
    if isinstance(pol, Quantizer):
        out = np.zeros(len(sz))
        for i in range(len(sz)):
            t = int(sz.tokens[i])
            per_head = pol.stored_bytes(t, int(sz.k_dim[i]), int(sz.k_bytes[i]), "key") + \
                pol.stored_bytes(t, int(sz.v_dim[i]), int(sz.v_bytes[i]), "value")
            out[i] = per_head * sz.kv_heads[i] * sz.batch[i]
        return out
    if isinstance(pol, Paging):
        kept = pol.tokens_allocated(sz.tokens)
    else:
        assert isinstance(pol, ScorerPolicy)
        kept = _kept_tokens(pol, ratio, sz.tokens)
        if not press_sliding:
            kept = np.where(sz.sliding, sz.tokens, kept)
    return np.divide(sz.valid * kept, sz.tokens, out=np.zeros(len(sz)), where=sz.tokens > 0)


def _n_kept(tokens: np.ndarray, ratio: float | None) -> np.ndarray:
    """policies.n_kept per row: max(1, int(T * (1 - ratio))) for T > 0, as kvpress."""
    kept = (tokens * (1 - (ratio or 0.0))).astype(np.int64)
    return np.where(tokens > 0, np.maximum(kept, 1), 0)


def _result(pol: Policy, ratio: float | None, sz: source.Sizes, base: tuple[float, float],
            no_contents: str, press_sliding: bool = True) -> dict[str, Any]:
    """The result of ``pol`` at ``ratio`` with its bytes; the content measures are filled in by
    :func:`_replay` (none for paging, a skip when the trace has no contents)."""
    kept = _totals(sz, _kept_bytes(pol, ratio, sz, press_sliding))
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


class _PrefixSums:
    """H2O's column sums of one (request, layer) carried from one sampled step to the next: a
    later step's keys extend the earlier ones and its scoring queries extend the earlier ones,
    and an earlier query sees none of the new keys (causal) and the same old ones, so only the
    new queries are summed (8 steps of a long prefill's queries: one pass instead of eight).
    Used only where that holds exactly (a full-attention layer; keys and queries compared)."""

    def __init__(self) -> None:
        self.at: tuple[int, int] | None = None
        self.k: np.ndarray | None = None
        self.q: np.ndarray | None = None
        self.q_pos: np.ndarray | None = None
        self.total: np.ndarray | None = None
        self.count: np.ndarray | None = None

    def fill(self, u: source.Unit, obs: Observed) -> None:
        from kvtrace.whatif.policies import sums_fn

        fn = sums_fn()
        start = 0
        if self._extends(u):
            assert self.q_pos is not None and self.total is not None and self.count is not None
            start = len(self.q_pos)
        total, count = fn(u.obs_q[:, :, start:], u.k, u.obs_pos[start:], u.k_pos, u.window, u.scale)
        if start:
            assert self.total is not None and self.count is not None
            t0 = self.total.shape[-1]
            total[..., :t0] += self.total
            count[:t0] += self.count
        obs.set_column_sums(u.k, total, count)
        self.at, self.k, self.q, self.q_pos, self.total, self.count = \
            (u.request, u.layer), u.k, u.obs_q, u.obs_pos, total, count

    def _extends(self, u: source.Unit) -> bool:
        if self.at != (u.request, u.layer) or u.window is not None or self.k is None or u.obs_q is None:
            return False
        assert self.q is not None and self.q_pos is not None
        t0, n0 = self.k.shape[2], len(self.q_pos)
        return (u.k.shape[2] >= t0 and u.k.shape[:2] == self.k.shape[:2] and len(u.obs_pos) >= n0
                and int(u.k_pos[0]) == 0 and bool((self.q_pos < t0).all())
                and np.array_equal(u.k[:, :, :t0], self.k) and np.array_equal(u.obs_pos[:n0], self.q_pos)
                and np.array_equal(u.obs_q[:, :, :n0], self.q))


def _replay(jobs: list[_Job], units: list[source.Unit], calc: Exact | Accelerated, press_sliding: bool = True,
            step: Callable[[str], None] | None = None) -> None:
    """Content measures of every job on every unit, into the jobs' results: per unit, the keep-sets
    of all eviction jobs in one :func:`_measure_keeps`, then each quantiser."""
    scorers = [j for j in jobs if isinstance(j[0], ScorerPolicy)]
    quantizers = [j for j in jobs if not isinstance(j[0], ScorerPolicy)]
    sums = _PrefixSums() if any(isinstance(j[0], ObservedAttention) for j in scorers) else None
    for u in units:
        if step is not None:
            step(f"request {u.request} layer {u.layer} step {u.step}")
        _scorer_unit(scorers, u, calc, press_sliding, sums)
        for pol, _, res in quantizers:
            try:
                res["layers"].append(_quantizer_unit(pol, u, res["skipped"], calc))
            except PolicyError as exc:
                _skip(res["skipped"], "all content measures", u, str(exc))


def _skip(skipped: list[dict[str, Any]], measure: str, u: source.Unit, reason: str) -> None:
    skipped.append({"measure": measure, "request": u.request, "layer": u.layer, "reason": reason})


def _row(u: source.Unit, status: str = "measured") -> dict[str, Any]:
    row: dict[str, Any] = {"request": u.request, "layer": u.layer, "step": u.step, "layer_type": u.layer_type,
                           "tokens": int(u.k.shape[2]), "kv_heads": u.kv_heads, "status": status}
    if u.latent:
        row["tensors"] = ["latent", "rope_key"]  # what key_* / value_* measure on an MLA cache
    if u.notes:
        row["notes"] = list(u.notes)
    return row


def _attn(u: source.Unit) -> tuple[Any, ...]:
    return (u.eval_q, u.k, u.v, u.eval_pos, u.k_pos, u.window, u.scale)


def _observed(u: source.Unit) -> Observed | None:
    """The unit's scoring queries: one object for every policy, so their softmax is shared."""
    return Observed(u.obs_q, u.obs_pos, u.k_pos, u.window, u.scale) if u.obs_q is not None else None


def _no_queries(pol: ScorerPolicy, u: source.Unit) -> str:
    reason = u.no_queries or f"no query sampled before step {u.step} to score with"
    return f"{pol.name} needs observed queries: {reason}"


def _scorer_unit(jobs: list[_Job], u: source.Unit, calc: Exact | Accelerated, press_sliding: bool = True,
                 sums: _PrefixSums | None = None) -> None:
    """Every eviction job on ``u``: each policy scores the unit once (its scores serve every
    ratio), each ratio's keep-set is its top-n; the keep-sets are measured all at once, one row
    each. A unit the policy cannot support gets a row that says why (status ``unsupported``); a
    sliding-window layer the replay does not press, a row ``not_pressed``."""
    obs = _observed(u)
    if obs is not None and sums is not None and (u.window is None or press_sliding):
        sums.fill(u, obs)
    T = int(u.k.shape[2])
    where = {"k_pos": u.k_pos, "window": u.window}
    planned: list[tuple[dict[str, Any], np.ndarray, dict[str, Any]]] = []
    scored: dict[int, Any] = {}  # id(policy) -> (scores, order) | exception
    for pol, ratio, res in jobs:
        assert isinstance(pol, ScorerPolicy)
        if u.window is not None and not press_sliding:
            row = _row(u, "not_pressed")
            row["reason"] = "sliding-window layer: left unpressed (see the document's 'sliding')"
            row["kept_tokens_per_head"] = [T * u.k.shape[0]] * u.k.shape[1]
            res["layers"].append(row)
            continue
        if pol.needs.startswith("Q") and obs is None:
            _skip(res["skipped"], "all content measures", u, _no_queries(pol, u))
            continue
        try:
            if ratio == 0 or (ratio is None and not _fixed(pol)):
                keep, info = np.ones(u.k.shape[:3], dtype=bool), {}
            elif isinstance(pol, StreamingLLM):
                keep, info = pol.select(u.k, pol.budget(T, ratio or 0.0), None, u.v, **where)
            else:
                if id(pol) not in scored:
                    try:
                        sc = pol.score(u.k, obs, u.v)
                        scored[id(pol)] = (sc, descending(sc))
                    except PolicyError as exc:
                        scored[id(pol)] = exc
                got = scored[id(pol)]
                if isinstance(got, Exception):
                    raise got
                keep, info = pol.choose(got[0], pol.budget(T, ratio or 0.0), obs, got[1])
        except Unsupported as exc:
            row = _row(u, "unsupported")
            row["reason"] = str(exc)
            res["layers"].append(row)
            continue
        except PolicyError as exc:
            _skip(res["skipped"], "all content measures", u, str(exc))
            continue
        planned.append((res, keep, info))
    if not planned:
        return
    measurable = u.eval_q is not None and not u.latent
    measures = _measure_keeps(calc, _attn(u), [keep for _, keep, _ in planned]) if measurable else []
    hk = u.k.shape[1]
    for i, (res, keep, info) in enumerate(planned):
        row = _row(u)
        row["kept_tokens_per_head"] = keep.sum(axis=(0, 2)).tolist()
        note = info.pop("note", None)
        row.update(info)
        if note:
            row.setdefault("notes", []).append(note)
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


