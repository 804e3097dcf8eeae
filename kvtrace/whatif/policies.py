"""What-if policy registry: one small dataclass per KV policy, its parameters checked on
construction, one method that plans or scores. Names follow NVIDIA kvpress presses where the
meaning is the same (github.com/NVIDIA/kvpress, kvpress/presses/*_press.py, read at commit
8bb29b9); the code here is our own numpy.

Families:
* ``paging`` (sizes only): :class:`Paging` -- internal waste of fixed-size pages.
* ``eviction``: :class:`ScorerPolicy` subclasses return scores [B, Hk, T]; the top
  ``max(1, int(T * (1 - ratio)))`` per head are kept (kvpress ``ScorerPress.compress``). Keys a
  policy always keeps score ``inf`` (an observation window, keys no sampled query sees, sinks);
  when they outnumber the budget the keep-set would be decided by the tie-break, not by the
  scores, so :meth:`ScorerPolicy.select` raises :class:`Unsupported` with the reason instead
  (the replay's row says so). Ties among finite scores go to the older token (numpy's stable
  sort, where torch's topk order is unspecified).
* ``quantization``: :class:`Quantizer` subclasses return dequantised K or V and bytes per token.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np

from kvtrace.params import split_key_value, split_list
from kvtrace.whatif import cpu_fast
from kvtrace.whatif.numerics import (
    FP8_FORMATS,
    attention_probs,
    column_sums,
    quantize_minmax,
    round_fp8,
    visible_mask,
)

__all__ = ["Observed", "Policy", "PolicyError", "REGISTRY", "Unsupported", "descending", "parse_policy", "keep_top",
           "keep_first", "n_kept"]

# Always kept: scores of tokens a policy must not drop (the observation window, unscored keys).
KEEP = np.inf
# Parameter domains, checked where a policy is made (parse_policy, the constructors): token counts
# and windows up to 2^31 - 1 (more than any cache holds; positions stay int64-safe and fit the
# kernels' int32), a pooling kernel up to 4095 keys, seeds as numpy takes them.
TOKENS_MAX = (1 << 31) - 1
KERNEL_MAX = 4095
SEED_MAX = (1 << 63) - 1


@dataclass
class Observed:
    """Sampled post-RoPE queries that attend to the cached keys, for query-based scoring:
    ``q`` [B, Hq, Tq, D] at absolute positions ``q_pos``; keys at ``k_pos``; ``window`` of a
    sliding layer; softmax ``scale``.

    One softmax per unit, shared by every policy that scores with it: :meth:`column_sums` (the
    attention each key receives summed over all the queries, H2O) and :meth:`rows` (the
    attention of a few queries, TOVA and SnapKV) are computed once per key tensor and kept."""

    q: np.ndarray
    q_pos: np.ndarray
    k_pos: np.ndarray
    window: int | None
    scale: float
    _memo: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    def probs(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Softmax weights [B, Hq, Tq, T] of the queries over ``keys``, and the visibility [Tq, T]."""
        vis = visible_mask(self.q_pos, self.k_pos, self.window)
        return attention_probs(self.q, keys, vis, self.scale), vis

    def subset(self, idx: np.ndarray) -> Observed:
        return Observed(self.q[:, :, idx], self.q_pos[idx], self.k_pos, self.window, self.scale)

    def last(self) -> int:
        """Index of the newest query (the first of equals)."""
        return int(np.argmax(self.q_pos))

    def column_sums(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(attention each key receives summed over the queries [B, Hq, T], how many queries see
        it [T]), in chunks of queries (a long prefill's queries times a long cache)."""
        key = ("sums", id(keys))
        if key not in self._memo:
            self.set_column_sums(keys, *sums_fn()(self.q, keys, self.q_pos, self.k_pos, self.window, self.scale))
        return self._memo[key][1], self._memo[key][2]

    def set_column_sums(self, keys: np.ndarray, total: np.ndarray, count: np.ndarray) -> None:
        """:meth:`column_sums` over ``keys`` computed elsewhere (the replay's per-layer prefix)."""
        self._memo[("sums", id(keys))] = (keys, total, count)  # keys held: the id is not reused meanwhile

    def rows(self, idx: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Softmax weights [B, Hq, len(idx), T] of the queries ``idx`` and their visibility."""
        key = ("rows", id(keys), tuple(int(i) for i in idx))
        if key not in self._memo:
            sub = self.subset(np.asarray(idx, dtype=np.int64))
            got = cpu_fast.probs(sub.q, keys, sub.q_pos, self.k_pos, self.window, self.scale) if _fast() \
                else sub.probs(keys)
            self._memo[key] = (keys, *got)
        return self._memo[key][1], self._memo[key][2]


def sums_fn() -> Any:
    """The column-sums function in use: cpu_fast's (torch) or numerics' (numpy)."""
    return cpu_fast.column_sums if _fast() else column_sums


def _fast() -> bool:
    """The attention passes through whatif/cpu_fast.py (torch's CPU kernels, float64) unless torch
    is missing or KVTRACE_WHATIF_NUMPY=1."""
    return os.environ.get("KVTRACE_WHATIF_NUMPY", "") in ("", "0") and cpu_fast.available()


class PolicyError(ValueError):
    """A policy name or parameter that cannot be used (the CLI's usage error)."""


class Unsupported(PolicyError):
    """The trace cannot support the policy's definition on this unit (too few sampled queries in a
    window, more always-kept keys than the budget, ...): the row says why instead of a keep-set
    chosen by a tie-break."""


@dataclass
class Policy:
    name: ClassVar[str] = ""
    family: ClassVar[str] = ""  # paging | eviction | quantization
    needs: ClassVar[str] = ""  # sizes | K | Q and K | Q, K and V
    doc: ClassVar[str] = ""
    note: ClassVar[str] = ""  # where the offline version departs from the original (shown in the output)

    # parameter -> (lowest, highest) allowed, both included
    ranges: ClassVar[dict[str, tuple[float, float]]] = {}

    def __post_init__(self) -> None:
        for key, value in self.params().items():
            check_range(self.name, key, value, self.ranges)

    def params(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def label(self) -> str:
        p = ",".join(f"{k}={v}" for k, v in self.params().items())
        return f"{self.name}:{p}" if p else self.name


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise PolicyError(f"{name}: {msg}")


def check_range(name: str, key: str, value: Any, ranges: dict[str, tuple[float, float]]) -> None:
    """PolicyError naming the parameter and its range when ``value`` is outside it (NaN included)."""
    if key not in ranges or isinstance(value, bool):
        return
    lo, hi = ranges[key]
    if not lo <= value <= hi:
        raise PolicyError(f"{name}: {key} must be in [{lo:g}, {hi:g}], got {value:g}" if isinstance(value, float)
                          else f"{name}: {key} must be in [{lo}, {hi}], got {value}")


# ------------------------------------------------------------------------------------ paging


@dataclass
class Paging(Policy):
    """Fixed pages of ``page_size`` tokens per sequence: bytes = ceil(tokens / page) * page
    tokens (vLLM/transformers paged caches), from the recorded token counts only."""

    name: ClassVar[str] = "paging"
    family: ClassVar[str] = "paging"
    needs: ClassVar[str] = "sizes"
    page_size: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.page_size in (16, 32, 64, 128, 256), self.name, f"page_size must be 16/32/64/128/256, got {self.page_size}")

    def tokens_allocated(self, tokens: np.ndarray) -> np.ndarray:
        t = np.asarray(tokens, dtype=np.int64)
        return -(-t // self.page_size) * self.page_size


# ---------------------------------------------------------------------------------- eviction


def n_kept(tokens: int, ratio: float) -> int:
    """Tokens kept at compression ``ratio``: ``max(1, int(T * (1 - ratio)))`` for T > 0 (kvpress
    utils.compute_n_kept: never empties a layer)."""
    return max(1, int(tokens * (1 - ratio))) if tokens > 0 else 0


def keep_top(scores: np.ndarray, ratio: float) -> np.ndarray:
    """Keep mask [B, H, T]: the :func:`n_kept` highest scores per (B, H); on ties the older token
    wins (stable sort)."""
    return keep_first(scores, n_kept(scores.shape[-1], ratio))


def keep_first(scores: np.ndarray, n: int, order: np.ndarray | None = None) -> np.ndarray:
    """Keep mask [B, H, T] of the ``n`` highest scores per (B, H), older token first on ties
    (``order``: ``descending(scores)`` when already computed)."""
    top = (descending(scores) if order is None else order)[..., :n]
    keep = np.zeros(scores.shape, dtype=bool)
    np.put_along_axis(keep, top, True, axis=-1)
    return keep


def descending(scores: np.ndarray) -> np.ndarray:
    """Indices of ``scores`` by descending score along the last axis, older first on ties."""
    return np.argsort(-scores, axis=-1, kind="stable")


@dataclass
class ScorerPolicy(Policy):
    family: ClassVar[str] = "eviction"
    needs: ClassVar[str] = "K"
    # which keys score inf (always kept), for the reason when they outnumber the budget
    forced: ClassVar[str] = "always-kept keys"

    def score(self, keys: np.ndarray, obs: Observed | None, values: np.ndarray | None = None) -> np.ndarray:
        raise NotImplementedError

    def budget(self, tokens: int, ratio: float) -> int:
        """Tokens per head this policy keeps of ``tokens`` at ``ratio`` (kvpress compute_n_kept)."""
        return n_kept(tokens, ratio)

    def plan(self, keys: np.ndarray, ratio: float, obs: Observed | None = None,
             values: np.ndarray | None = None, **where: Any) -> np.ndarray:
        """Keep mask [B, Hk, T] at compression ``ratio`` (fraction of tokens dropped)."""
        return self.plan_info(keys, ratio, obs, values, **where)[0]

    def plan_info(self, keys: np.ndarray, ratio: float, obs: Observed | None = None,
                  values: np.ndarray | None = None, **where: Any) -> tuple[np.ndarray, dict[str, Any]]:
        """(keep mask, facts for the row) at ``ratio``; :class:`Unsupported` where the unit cannot
        support the policy's definition. ``where``: ``k_pos`` (absolute key positions) and
        ``window`` (a sliding layer's) when known."""
        _check(0 <= ratio < 1, self.name, f"ratio must be in [0, 1), got {ratio}")
        if ratio == 0:
            return np.ones(keys.shape[:3], dtype=bool), {}
        return self.select(keys, self.budget(keys.shape[2], ratio), obs, values, **where)

    def keep_n(self, keys: np.ndarray, n: int, obs: Observed | None = None,
               values: np.ndarray | None = None, **where: Any) -> np.ndarray:
        """Keep mask [B, Hk, T] of the ``n`` tokens per head this policy keeps (the rerun's
        per-step budget)."""
        return self.select(keys, n, obs, values, **where)[0]

    def select(self, keys: np.ndarray, n: int, obs: Observed | None = None, values: np.ndarray | None = None,
               **where: Any) -> tuple[np.ndarray, dict[str, Any]]:
        """(keep mask of the ``n`` best-scored keys per head, facts): ``forced_keep`` = keys scored
        inf (always kept) on the head with most. More of those than ``n``: :class:`Unsupported`."""
        return self.choose(self.score(keys, obs, values), n, obs)

    def choose(self, scores: np.ndarray, n: int, obs: Observed | None = None,
               order: np.ndarray | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        """:meth:`select` on scores already computed (``order``: their stable descending argsort,
        shared by several budgets)."""
        forced = int(np.isposinf(scores).sum(axis=-1).max()) if scores.size else 0
        if forced > n:
            raise Unsupported(f"{self.name}: {forced} {self.forced_facts(obs)} are always kept, more than the budget "
                              f"of {n}: the keep-set would be decided by a tie-break, not by the scores")
        info: dict[str, Any] = {"forced_keep": forced} if forced else {}
        info.update(self.facts(scores, obs))
        return keep_first(scores, n, order), info

    def forced_facts(self, obs: Observed | None) -> str:
        return self.forced

    def facts(self, scores: np.ndarray, obs: Observed | None) -> dict[str, Any]:
        """What the row should say about how the unit supported the definition."""
        return {}


@dataclass
class Knorm(ScorerPolicy):
    """knorm_press.py: score = -||k||: keys of small norm are kept."""

    name: ClassVar[str] = "knorm"

    def score(self, keys: np.ndarray, obs: Observed | None, values: np.ndarray | None = None) -> np.ndarray:
        return -np.linalg.norm(keys.astype(np.float64), axis=-1)


@dataclass
class KeyDiff(ScorerPolicy):
    """keydiff_press.py: score = -cos(k, mean of the unit keys): distinctive keys are kept."""

    name: ClassVar[str] = "keydiff"

    def score(self, keys: np.ndarray, obs: Observed | None, values: np.ndarray | None = None) -> np.ndarray:
        k = keys.astype(np.float64)
        # non-finite keys (an overflowed fp16 cache) give NaN scores, which selection ranks last;
        # numpy's divide warning would only repeat that to the user
        with np.errstate(invalid="ignore", over="ignore"):
            n = np.linalg.norm(k, axis=-1, keepdims=True)
            unit = k / np.maximum(n, 1e-12)  # F.normalize eps
            anchor = unit.mean(axis=2, keepdims=True)
            an = np.linalg.norm(anchor, axis=-1)
            cos = (k * anchor).sum(-1) / np.maximum(n[..., 0] * an, 1e-8)  # F.cosine_similarity eps
        return -cos


@dataclass
class Random(ScorerPolicy):
    """random_press.py: uniform random scores. numpy's generator, not torch's: the same seed
    gives a different (equally random) keep-set than kvpress."""

    name: ClassVar[str] = "random"
    ranges: ClassVar[dict[str, tuple[float, float]]] = {"seed": (0, SEED_MAX)}
    seed: int = 0

    def score(self, keys: np.ndarray, obs: Observed | None, values: np.ndarray | None = None) -> np.ndarray:
        return np.random.default_rng(self.seed).random(keys.shape[:3])


@dataclass
class StreamingLLM(ScorerPolicy):
    """streaming_llm_press.py: keep ``n_sink`` first tokens and the most recent ones; with
    ``window`` > 0 the cache is sinks + window tokens whatever the ratio (the paper's fixed cache).

    The budget is kvpress's ``compute_n_kept`` (its score prunes ``[n_sink, n_sink + T -
    int(T * (1 - ratio)))`` and the top ``max(1, int(T * (1 - ratio)))`` are kept). The sinks are the ``n_sink`` oldest positions
    the layer holds (on a full-attention layer positions 0..n_sink-1; a sample that does not start
    at position 0 cannot say which they are: :class:`Unsupported`) and are always kept: a budget
    below ``n_sink`` keeps the sinks alone, more than the budget (``over_budget`` says how many;
    kvpress would keep ``n`` of its sinks by topk's unspecified tie order)."""

    name: ClassVar[str] = "streaming_llm"
    ranges: ClassVar[dict[str, tuple[float, float]]] = {"n_sink": (0, TOKENS_MAX), "window": (0, TOKENS_MAX)}
    n_sink: int = 4
    window: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.n_sink >= 0 and self.window >= 0, self.name, "n_sink and window must be >= 0")

    def score(self, keys: np.ndarray, obs: Observed | None, values: np.ndarray | None = None) -> np.ndarray:
        raise AssertionError("select() is overridden")

    def budget(self, tokens: int, ratio: float) -> int:
        if self.window:
            return min(tokens, self.n_sink + self.window)
        return n_kept(tokens, ratio)  # kvpress: topk(compute_n_kept) of the scores below

    def kept(self, tokens: int, n: int) -> int:
        """Tokens kept of ``tokens`` at budget ``n``: the budget, or the sinks where they are more."""
        return min(tokens, max(n, self.n_sink))

    def plan_info(self, keys: np.ndarray, ratio: float, obs: Observed | None = None,
                  values: np.ndarray | None = None, **where: Any) -> tuple[np.ndarray, dict[str, Any]]:
        if not self.window:
            _check(0 <= ratio < 1, self.name, f"ratio must be in [0, 1), got {ratio}")
        return self.select(keys, self.budget(keys.shape[2], ratio), obs, values, **where)

    def select(self, keys: np.ndarray, n: int, obs: Observed | None = None, values: np.ndarray | None = None,
               **where: Any) -> tuple[np.ndarray, dict[str, Any]]:
        """The ``n_sink`` oldest tokens and the ``n - n_sink`` most recent ones."""
        T = keys.shape[2]
        k_pos = where.get("k_pos")
        if self.n_sink and k_pos is not None and len(k_pos) and where.get("window") is None and int(k_pos[0]) != 0 \
                and T > n:
            raise Unsupported(f"{self.name}: the sampled keys start at position {int(k_pos[0])}, not 0: the "
                              f"sinks (positions 0..{self.n_sink - 1}) are not in the sample")
        pos = np.arange(T)
        keep = (pos < self.n_sink) | (pos >= T - max(n - self.n_sink, 0))
        info: dict[str, Any] = {}
        if self.kept(T, n) > n:
            info["over_budget"] = self.kept(T, n) - n
            info["note"] = f"budget {n} below n_sink={self.n_sink}: the sinks are kept"
        return np.broadcast_to(keep, keys.shape[:3]).copy(), info


@dataclass
class QueryScorer(ScorerPolicy):
    needs: ClassVar[str] = "Q and K"


def _group_mean(x: np.ndarray, hk: int) -> np.ndarray:
    """[B, Hq, T] -> [B, Hk, T]: mean over the query heads of each KV head."""
    B, hq, T = x.shape
    return x.reshape(B, hk, hq // hk, T).mean(axis=2)


@dataclass
class ObservedAttention(QueryScorer):
    """observed_attention_press.py (H2O): the attention a key receives summed over the observed
    queries, divided by how many of them see it (kvpress divides by T - i for a causal prefill,
    where every position's query is there), averaged over each KV head's query heads. Keys no
    observed query sees (newer than the newest one) are kept; more of them than the budget:
    :class:`Unsupported`."""

    name: ClassVar[str] = "observed_attention"

    def score(self, keys: np.ndarray, obs: Observed | None, values: np.ndarray | None = None) -> np.ndarray:
        obs = _need(obs, self.name)
        total, count = obs.column_sums(keys)
        s = _group_mean(total / np.maximum(count, 1), keys.shape[1])
        return np.where(count > 0, s, KEEP)

    def forced_facts(self, obs: Observed | None) -> str:
        return "keys no sampled query sees (newer than the newest sampled query)"

    def facts(self, scores: np.ndarray, obs: Observed | None) -> dict[str, Any]:
        assert obs is not None
        return {"scoring_queries": int(obs.q.shape[2])}


@dataclass
class TOVA(QueryScorer):
    """tova_press.py: the attention of the last query averaged over all query heads, the same for
    every KV head; kvpress's last query is the newest position's, here the newest sampled one, and
    keys it does not see (its own and newer) are kept (kvpress keeps its own key too); more of
    them than the budget: :class:`Unsupported`."""

    name: ClassVar[str] = "tova"

    def score(self, keys: np.ndarray, obs: Observed | None, values: np.ndarray | None = None) -> np.ndarray:
        obs = _need(obs, self.name)
        last = obs.last()
        p, vis = obs.rows(np.array([last]), keys)
        s = p[:, :, 0].mean(axis=1, keepdims=True).repeat(keys.shape[1], axis=1)
        return np.where(vis[0] & (obs.k_pos < obs.q_pos[last]), s, KEEP)

    def forced_facts(self, obs: Observed | None) -> str:
        q = int(obs.q_pos[obs.last()]) if obs is not None and obs.q.shape[2] else None
        return f"keys at or after the last sampled query's position {q}"

    def facts(self, scores: np.ndarray, obs: Observed | None) -> dict[str, Any]:
        assert obs is not None
        return {"query_position": int(obs.q_pos[obs.last()])}


@dataclass
class SnapKV(QueryScorer):
    """snapkv_press.py: the mean attention of the queries of the observation window -- the last
    ``window_size`` positions of the cache, as kvpress's last ``window_size`` prefill queries --
    onto the keys before it, average-pooled over ``kernel_size`` keys (zero padding counted, as
    F.avg_pool1d), averaged over each KV head's query heads; the window's keys are kept.

    The window is in token positions: of its queries, those the trace sampled score
    (``window_queries`` of ``window_size`` in the row). No sampled query in the window, or more
    window keys than the budget (kvpress would then keep window keys by topk's tie order):
    :class:`Unsupported`."""

    name: ClassVar[str] = "snapkv"
    ranges: ClassVar[dict[str, tuple[float, float]]] = {"window_size": (1, TOKENS_MAX), "kernel_size": (1, KERNEL_MAX)}
    window_size: int = 64
    kernel_size: int = 5

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.window_size >= 1, self.name, "window_size must be >= 1")
        _check(self.kernel_size >= 1 and self.kernel_size % 2 == 1, self.name, "kernel_size must be odd and >= 1")

    def window(self, obs: Observed) -> tuple[int, np.ndarray]:
        """(first position of the window, indices of the sampled queries in it)."""
        end = int(obs.k_pos.max()) + 1 if len(obs.k_pos) else 0
        start = end - self.window_size
        return start, np.flatnonzero((obs.q_pos >= start) & (obs.q_pos < end))

    def score(self, keys: np.ndarray, obs: Observed | None, values: np.ndarray | None = None) -> np.ndarray:
        obs = _need(obs, self.name)
        start, idx = self.window(obs)
        if not len(idx):
            raise Unsupported(f"{self.name}: no sampled query in the observation window (positions "
                              f"{max(start, 0)}..{start + self.window_size - 1}); sample queries more often or "
                              "lower window_size")
        prefix = obs.k_pos < start
        out = np.full(keys.shape[:3], KEEP)
        if prefix.any():
            p, _ = obs.rows(idx, keys)
            s = p[..., prefix].mean(axis=2)  # [B, Hq, n_prefix]
            s = _avg_pool(s, self.kernel_size)
            out[..., prefix] = _group_mean(s, keys.shape[1])
        return out

    def forced_facts(self, obs: Observed | None) -> str:
        return f"keys in the observation window (the last {self.window_size} positions)"

    def facts(self, scores: np.ndarray, obs: Observed | None) -> dict[str, Any]:
        assert obs is not None
        start, idx = self.window(obs)
        return {"window_queries": int(len(idx)), "window_positions": [max(start, 0), start + self.window_size - 1]}


@dataclass
class ExpectedAttention(QueryScorer):
    """expected_attention_press.py (ExpectedAttentionPress.score): with the queries' mean ``mu``
    and covariance ``S`` per query head, a key's expected attention logit is
    ``k.mu / sqrt(d) + k^T S k / (2 d)``; softmax over the non-sink keys, mean over each KV head's
    query heads, times ``||v||`` (``use_vnorm``); the ``n_sink`` first keys are kept.

    Stand-in: kvpress takes ``mu`` and ``S`` of the *pre-RoPE* queries of the prefill and rotates
    them by the RoPE matrix averaged over the next ``n_future_positions`` positions. A trace holds
    *post-RoPE* queries sampled while decoding, so here the statistics of the sampled queries
    (positions >= n_sink) stand in for the future queries as they are: already rotated at the
    positions where they were sampled. Same scoring formula, different query statistics."""

    name: ClassVar[str] = "expected_attention"
    needs: ClassVar[str] = "Q, K and V"
    forced: ClassVar[str] = "sink keys (the n_sink first)"
    note: ClassVar[str] = ("stand-in: statistics of the sampled post-RoPE queries replace kvpress's pre-RoPE "
                           "prefill queries rotated by the RoPE averaged over future positions")
    ranges: ClassVar[dict[str, tuple[float, float]]] = {"n_sink": (0, TOKENS_MAX), "epsilon": (0.0, 1e6)}
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.n_sink >= 0 and self.epsilon >= 0, self.name, "n_sink and epsilon must be >= 0")

    def score(self, keys: np.ndarray, obs: Observed | None, values: np.ndarray | None = None) -> np.ndarray:
        obs = _need(obs, self.name)
        B, hk, T, d = keys.shape
        _check(T > self.n_sink, self.name, f"needs more than n_sink={self.n_sink} keys, got {T}")
        _check(values is not None or not self.use_vnorm, self.name, "use_vnorm needs the values")
        q = obs.q[:, :, obs.q_pos >= self.n_sink].astype(np.float64)  # kvpress drops the first n_sink
        _check(q.shape[2] > 0, self.name, f"needs queries at positions >= n_sink={self.n_sink}")
        hq = q.shape[1]
        mu = q.mean(axis=2)  # [B, Hq, d]
        k = np.repeat(keys[:, :, self.n_sink:].astype(np.float64), hq // hk, axis=1)  # [B, Hq, n, d]
        logits = np.einsum("bhnd,bhd->bhn", k, mu) / math.sqrt(d)
        if self.use_covariance:
            c = q - mu[:, :, None]
            cov = np.einsum("bhsi,bhsj->bhij", c, c) / q.shape[2]
            logits += ((k @ cov) * k).sum(axis=-1) / d / 2  # k^T S k per key, through BLAS
        logits -= logits.max(axis=-1, keepdims=True)
        p = np.exp(logits)
        s = _group_mean(p / p.sum(axis=-1, keepdims=True), hk)
        if self.use_vnorm:
            assert values is not None
            s = (s + self.epsilon) * np.linalg.norm(values[:, :, self.n_sink:].astype(np.float64), axis=-1)
        out = np.full(keys.shape[:3], KEEP)
        out[..., self.n_sink:] = s
        return out


def _avg_pool(x: np.ndarray, k: int) -> np.ndarray:
    pad = k // 2
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, pad)])
    c = np.cumsum(np.concatenate([np.zeros(x.shape[:-1] + (1,)), padded], axis=-1), axis=-1)
    return (c[..., k:] - c[..., :-k]) / k


def _need(obs: Observed | None, name: str) -> Observed:
    if obs is None or obs.q.shape[2] == 0:
        raise PolicyError(f"{name}: needs observed queries")
    return obs


# ------------------------------------------------------------------------------ quantisation


@dataclass
class Quantizer(Policy):
    family: ClassVar[str] = "quantization"
    needs: ClassVar[str] = "K"

    def residual(self) -> int:
        return 0

    def roundtrip(self, x: np.ndarray, which: str) -> np.ndarray:
        """Dequantised ``x`` [B, H, T, D] (``which``: "key" or "value"); the last
        :meth:`residual` tokens stay at full precision."""
        T = x.shape[2]
        r = min(self.residual(), T)
        out = x.astype(np.float64).copy()
        if T - r > 0:
            out[:, :, :T - r] = self._quantize(x[:, :, :T - r], which)
        return out

    def _quantize(self, x: np.ndarray, which: str) -> np.ndarray:
        raise NotImplementedError

    def stored_bytes(self, tokens: int, dim: int, elem_bytes: int, which: str) -> float:
        """Bytes of one head's ``tokens`` x ``dim`` K or V under this policy (residual tokens at
        the recorded ``elem_bytes``; scales and zeros as fp16)."""
        r = min(self.residual(), tokens)
        return self._quant_bytes(tokens - r, dim, which) + r * dim * elem_bytes

    def _quant_bytes(self, tokens: int, dim: int, which: str) -> float:
        raise NotImplementedError


@dataclass
class KIVI(Quantizer):
    """KIVI (Liu et al. 2024): keys quantised per channel over groups of ``group_size`` tokens,
    values per token over groups of ``group_size`` channels, the last ``residual_length`` tokens in
    full precision; scale and zero per group (fp16)."""

    name: ClassVar[str] = "kivi"
    ranges: ClassVar[dict[str, tuple[float, float]]] = {"group_size": (1, TOKENS_MAX), "residual_length": (0, TOKENS_MAX)}
    nbits: int = 2
    group_size: int = 32
    residual_length: int = 128

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.nbits in (2, 4, 8), self.name, f"nbits must be 2, 4 or 8, got {self.nbits}")
        _check(self.group_size >= 1 and self.residual_length >= 0, self.name, "group_size >= 1, residual_length >= 0")

    def residual(self) -> int:
        return self.residual_length

    def _quantize(self, x: np.ndarray, which: str) -> np.ndarray:
        return quantize_minmax(x, self.nbits, axis=2 if which == "key" else 3, group=self.group_size)

    def _quant_bytes(self, tokens: int, dim: int, which: str) -> float:
        along, across = (tokens, dim) if which == "key" else (dim, tokens)
        groups = math.ceil(along / self.group_size) * across
        return tokens * dim * self.nbits / 8 + groups * 4


@dataclass
class Quanto(Quantizer):
    """transformers QuantizedCache (quanto backend) layout: groups of ``q_group_size`` channels
    per token for K and V, scale and zero per group, ``residual_length`` recent tokens in full
    precision (defaults 4 bits, 64, 128)."""

    name: ClassVar[str] = "quanto"
    ranges: ClassVar[dict[str, tuple[float, float]]] = {"q_group_size": (1, TOKENS_MAX),
                                                       "residual_length": (0, TOKENS_MAX)}
    nbits: int = 4
    q_group_size: int = 64
    residual_length: int = 128
    allowed: ClassVar[tuple[int, ...]] = (2, 4)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.nbits in self.allowed, self.name, f"nbits must be one of {self.allowed}, got {self.nbits}")
        _check(self.q_group_size >= 1 and self.residual_length >= 0, self.name, "q_group_size >= 1, residual_length >= 0")

    def residual(self) -> int:
        return self.residual_length

    def _quantize(self, x: np.ndarray, which: str) -> np.ndarray:
        return quantize_minmax(x, self.nbits, axis=3, group=self.q_group_size)

    def _quant_bytes(self, tokens: int, dim: int, which: str) -> float:
        return tokens * dim * self.nbits / 8 + tokens * math.ceil(dim / self.q_group_size) * 4


@dataclass
class HQQ(Quanto):
    """HQQ backend of QuantizedCache, same group layout as quanto, 1-8 bits. HQQ's half-quadratic
    optimisation of zero points is not emulated: min-max round-to-nearest (an upper bound on error)."""

    name: ClassVar[str] = "hqq"
    allowed: ClassVar[tuple[int, ...]] = tuple(range(1, 9))


@dataclass
class FP8(Quantizer):
    """Cast of K and V to fp8 (``fmt`` e4m3 = float8_e4m3fn, e5m2), without a scale, 1 byte each."""

    name: ClassVar[str] = "fp8"
    fmt: str = "e4m3"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.fmt in FP8_FORMATS, self.name, f"fmt must be one of {sorted(FP8_FORMATS)}, got {self.fmt!r}")

    def _quantize(self, x: np.ndarray, which: str) -> np.ndarray:
        return round_fp8(x, self.fmt)

    def _quant_bytes(self, tokens: int, dim: int, which: str) -> float:
        return float(tokens * dim)


REGISTRY: dict[str, type[Policy]] = {
    c.name: c for c in (Paging, Knorm, KeyDiff, Random, StreamingLLM, ObservedAttention, TOVA, SnapKV,
                        ExpectedAttention, KIVI, Quanto, HQQ, FP8)
}


def parse_policy(text: str) -> Policy:
    """``NAME[:k=v,...]`` -> a policy; PolicyError with one line on an unknown name or parameter."""
    name, _, rest = text.partition(":")
    cls = REGISTRY.get(name.strip())
    if cls is None:
        raise PolicyError(f"unknown policy {name!r}; known: {', '.join(REGISTRY)}")
    types = {f.name: f.type for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for item in split_list(rest):
        kv = split_key_value(item)
        key, val = kv if kv is not None else (item, "")
        if kv is None or key not in types:
            raise PolicyError(f"{name}: unknown parameter {key!r}; parameters: {', '.join(types) or 'none'}")
        if types[key] in ("int", int):
            try:
                kwargs[key] = int(val)
            except ValueError:
                raise PolicyError(f"{name}: {key} must be an integer, got {val!r}") from None
        elif types[key] in ("float", float):
            try:
                kwargs[key] = float(val)
            except ValueError:
                raise PolicyError(f"{name}: {key} must be a number, got {val!r}") from None
        elif types[key] in ("bool", bool):
            if val.lower() not in ("true", "false", "1", "0"):
                raise PolicyError(f"{name}: {key} must be true or false, got {val!r}")
            kwargs[key] = val.lower() in ("true", "1")
        else:
            kwargs[key] = val
        check_range(name, key, kwargs[key], cls.ranges)  # its domain, where it is parsed
    return cls(**kwargs)
