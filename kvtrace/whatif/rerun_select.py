"""Which held tokens a rerun cache layer keeps, chosen by index (kvtrace.whatif.rerun).

Every (batch, KV head) row keeps exactly ``n`` tokens by construction: the cache is one tensor
[B, Hk, T, D], so a threshold or a boolean mask whose counts differ between heads (ties, NaN or
inf scores in half precision) cannot be stored. The order, per row, is one stable sort:

1. candidates before the rest (a sliding layer's keys still in its window);
2. then the higher score (+inf: always kept; -inf: last of the numbers);
3. NaN scores after every number (a NaN says nothing about the key: kept only where the budget
   cannot be met without it);
4. on ties the older token (lower index; a layer holds its tokens in position order), as
   kvtrace.whatif.policies.keep_first does offline.

Scores are compared in float64, so half-precision values tie exactly where they are equal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["NEAR_TIE_ULPS", "near_tie", "near_tie_tolerance", "rank_mask", "top_index"]

# Scores closer than this many units in the last place of the cache's dtype (relative) at a
# keep-set's boundary are a near tie: the model's rounding (one forward per token or one pass,
# CPU or GPU) can order them either way, so the policy did not decide which of them stays (e.g.
# knorm on a model whose keys are RMS-normed: every key norm is sqrt(head_dim) up to the norm's
# epsilon). 4 ulps: 4.8e-7 in float32, 3.9e-3 in float16, 3.1e-2 in bfloat16.
NEAR_TIE_ULPS = 4


def near_tie_tolerance(dtype: torch.dtype) -> float:
    """The relative gap below which two scores of keys held in ``dtype`` are a near tie."""
    import torch

    return NEAR_TIE_ULPS * float(torch.finfo(dtype).eps) if dtype.is_floating_point else 0.0


def top_index(scores: torch.Tensor, n: int, cand: torch.Tensor | None = None) -> torch.Tensor:
    """Indices [..., n] (ascending) of the ``n`` tokens each row of ``scores`` [..., T] keeps, in
    the order of the module docstring; ``cand`` [..., T] bool (None: every token a candidate)."""
    return _ranked(scores, n, cand)[0]


def near_tie(scores: torch.Tensor, n: int, cand: torch.Tensor | None = None,
             tol: float = 4.8e-7) -> tuple[torch.Tensor, bool]:
    """:func:`top_index` and whether some row's last kept and first dropped candidates score
    within ``tol`` (relative; :func:`near_tie_tolerance`) of each other (both finite)."""
    idx, order = _ranked(scores, n, cand)
    import torch

    if n == 0 or n >= order.shape[-1]:
        return idx, False
    s = scores.detach().to(torch.float64)
    a, b = s.gather(-1, order[..., n - 1:n]), s.gather(-1, order[..., n:n + 1])
    close = torch.isfinite(a) & torch.isfinite(b) & ((a - b).abs() <= tol * torch.maximum(a.abs(), b.abs()))
    if cand is not None:
        close &= cand.to(s.device).gather(-1, order[..., n:n + 1])
    return idx, bool(close.any())


def _ranked(scores: torch.Tensor, n: int, cand: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    s = scores.detach().to(torch.float64)
    if not 0 <= n <= s.shape[-1]:
        raise ValueError(f"top_index: cannot keep {n} of {s.shape[-1]} tokens")
    nan = torch.isnan(s)
    order = torch.sort(s.masked_fill(nan, float("-inf")), dim=-1, descending=True, stable=True).indices
    tier = nan.to(torch.int8)
    if cand is not None:
        tier = tier + 2 * (~cand.to(device=s.device, dtype=torch.bool)).to(torch.int8)
    order = order.gather(-1, torch.sort(tier.gather(-1, order), dim=-1, stable=True).indices)
    return torch.sort(order[..., :n], dim=-1).values, order


def rank_mask(keep: torch.Tensor, pos: torch.Tensor, cand: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """Scores that rank a policy's keep mask ``keep`` [..., T] first (the policy's tokens, +inf),
    then the other tokens newest first (``pos``, their positions); and the count every row keeps:
    the largest of the rows' keep counts, at most the fewest candidates a row holds (``cand``;
    a sliding layer never keeps a key that left its window). Rows whose masks count differently
    (streaming_llm's sinks, more than the budget, on heads holding different numbers of window
    keys) are so evened out: a short row is filled with its newest other candidates, a long one
    keeps its first tokens by position (sinks before recent ones)."""
    import torch

    m = int(keep.sum(dim=-1).max()) if keep.numel() else 0
    if cand is not None:
        m = min(m, int(cand.sum(dim=-1).min()))
    first = torch.full(pos.shape, float("inf"), dtype=torch.float64, device=pos.device)
    return torch.where(keep, first, pos.to(torch.float64)), m
