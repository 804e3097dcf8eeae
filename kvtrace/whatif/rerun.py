"""Quality by rerun: a teacher-forced pass of a model over a text with a what-if policy applied to
its KV cache at every step, scored by perplexity and the KL divergence of the next-token
distributions against the same pass with the cache unchanged (``kvtrace whatif --rerun``).

These are *quality* measures (the model's own outputs change); the offline measures of
kvtrace.whatif.run are *proxies*. torch and transformers are imported inside the functions.

How the policy is applied (:class:`PolicyLayer`, a transformers ``DynamicLayer`` that replaces
each dynamic / sliding-window layer of a ``DynamicCache``):

* by definition the text is fed one token per forward (after an optional prefill of its first
  tokens in one forward, kvpress's setting: the policy acts once the prefill's attention is
  done); computed in one model pass (below);
* **eviction**: after a step's attention (a forward hook on each attention module), a
  full-attention layer that holds more than the policy's budget of the tokens it has seen
  (kvpress's ``compute_n_kept``) keeps that many per KV head by the policy's scores; evicted
  tokens are gone for every later step. Query-based policies score with the post-RoPE queries of
  every step so far, this one included (captured through transformers' attention interface,
  kvtrace.recorder.qcapture). Sliding-window layers are pressed or not as kvpress would for the
  model (kvtrace.whatif.kvpress.presses_sliding, the offline rule too): pressed, keys that left
  the window go first, then the budget of the window - 1 tokens the layer would hold is kept.
  streaming_llm's sinks are the first positions from the first token on (never evicted). An MLA
  latent is pressed by key-only policies (query-based ones need per-head keys and are refused);
* **quantisation**: K/V are kept at full precision and every step attends to the policy's
  round trip of the whole cache (the last ``residual`` tokens exact). A real quantised cache
  re-quantises values it already dequantised; that compounding is not modelled;
* the reference pass runs through the same layer with no policy, so a no-op policy gives
  exactly the reference logits (KL 0).

How a pass is computed (``teacher_forced_logprobs(mode=...)``): by default in **one model pass**
(kvtrace.whatif.rerun_pass): the model runs once over the whole text without a cache and each
attention layer's call is replaced by a loop over its query rows that drives the same
PolicyLayer exactly as the per-token loop does (update with the row's key, attend to what the
layer holds, evict); the next layer then sees what it would see step by step. Every policy is
expressible so; the per-token loop (below) remains the definition, the tests' reference, and
the fallback, with the reason in ``pass_note``, for a model the one pass cannot drive (a cache
holding other tensors than the attention reads -- an MLA latent --, non-tensor masks such as
flex attention's, attention outside the interface). The two agree to float32 rounding of
batched matmuls (logits within 1e-5, the same keep-sets) except where a policy's scores tie to
that rounding; ``steps_near_tie`` counts those steps (kvtrace.whatif.rerun_select.NEAR_TIE_ULPS).

Masks in the per-token loop: a layer's kept keys are presented to the mask builder as the most
recent contiguous positions (``get_mask_sizes``), so with one query per step every kept key is
visible (the prefill, before any eviction, gets the model's own causal / sliding mask) and RoPE
positions come from ``get_seq_length`` = tokens seen. Cost: query-based policies rescore every
step against all earlier queries (O(N^3) over N tokens), and quantisers round-trip the whole
cache every step: meant for hundreds to a few thousand tokens, not long contexts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtrace.errors import BadOption, Unavailable
from kvtrace.modelspec import preset_name, tiny_shrink
from kvtrace.whatif import policies as P
from kvtrace.whatif.policies import Observed, Policy, PolicyError
from kvtrace.whatif.rerun_select import near_tie, near_tie_tolerance, rank_mask, top_index

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["NOTE", "rerun_quality", "teacher_forced_logprobs"]

NOTE = ("quality: teacher-forced rerun of the model over the text (an optional prefill, then one token per step, "
        "computed in one model pass per policy: see 'pass'), "
        "the policy applied to the KV cache after every step; perplexity and KL(reference || policy) of the "
        "next-token distributions against the same pass with the cache unchanged")
RANDOM_NOTE = "the model has random weights: these numbers only prove the mechanics, not a policy's quality"


# A token of the tokenizers a rerun meets spans a few bytes of UTF-8 (about 4 in English prose; a
# run of spaces or code indentation more): --text is first read for this many bytes per token of
# --max-tokens, then in doubling chunks only while the tokens read fall short of the budget.
BYTES_PER_TOKEN = 8


class TextSource:
    """``--text FILE`` read only as far as ``max_tokens`` tokens need, however large the file: a
    file that is not UTF-8 text (undecodable bytes, or NUL bytes: a binary file) is refused with
    exit 64 (BadOption) from its first chunk, before any model loads."""

    def __init__(self, path: str | Path, max_tokens: int) -> None:
        import codecs

        self.path, self.max_tokens = Path(path), max_tokens
        self.text, self.bytes_read, self.eof = "", 0, False
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        try:
            self._fh = open(self.path, "rb")  # noqa: SIM115 - closed by close() / the with block
        except OSError as exc:
            raise BadOption(f"--text {path}: cannot read it ({exc.strerror or exc})", option="--text") from None
        try:
            self._read(max(1, max_tokens) * BYTES_PER_TOKEN)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> TextSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._fh.close()

    def _read(self, n: int) -> None:
        parts, got = [], 0
        try:
            while got < n:  # a pipe (--text <(...)) answers short reads before its end
                part = self._fh.read(n - got)
                if not part:
                    break
                parts.append(part)
                got += len(part)
        except OSError as exc:
            raise BadOption(f"--text {self.path}: cannot read it ({exc.strerror or exc})", option="--text") from None
        chunk = b"".join(parts)
        self.eof = got < n
        nul = chunk.find(b"\0")
        if nul >= 0:
            raise BadOption(f"--text {self.path}: not a text file (a NUL byte at offset {self.bytes_read + nul})",
                            option="--text")
        try:
            self.text += self._decoder.decode(chunk, final=self.eof)
        except UnicodeDecodeError as exc:
            raise BadOption(f"--text {self.path}: not UTF-8 text ({exc.reason} at byte "
                            f"{self.bytes_read + exc.start})", option="--text") from None
        self.bytes_read += len(chunk)

    def tokens(self, encode: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The first ``max_tokens`` tokens, ``[1, n]``. Reading stops once the text holds one token
        more than the budget (the last one may be cut where the read stopped) or at the file's end."""
        while True:
            ids = encode(self.text)
            if self.eof or ids.shape[1] > self.max_tokens:
                return ids[:, :self.max_tokens]
            self._read(max(self.bytes_read, BYTES_PER_TOKEN))


@dataclass
class _Applied:
    """A policy at one ratio as the cache layers apply it; ``press_sliding``: whether eviction
    also presses sliding-window layers (kvtrace.whatif.kvpress.presses_sliding)."""

    policy: Policy | None
    ratio: float | None
    press_sliding: bool = True

    @property
    def evicts(self) -> bool:
        return isinstance(self.policy, P.ScorerPolicy) and (self.ratio or 0) > 0 or \
            isinstance(self.policy, P.StreamingLLM) and self.policy.window > 0

    def budget(self, held: int) -> int:
        """Tokens a layer keeps of the ``held`` it would hold without the policy (all it has seen;
        a sliding layer's window - 1): the policy's own budget (streaming_llm: kvpress's
        ``int(T * (1 - ratio))``, or n_sink + window)."""
        pol = self.policy
        if isinstance(pol, P.ScorerPolicy):
            return pol.budget(held, self.ratio or 0.0)
        return held


def _layer_class() -> type:
    import torch
    from transformers.cache_utils import DynamicLayer

    class PolicyLayer(DynamicLayer):
        """A dynamic cache layer that applies a what-if policy (see the module docstring).
        ``keys``/``values`` hold what the cache keeps (full precision); ``pos`` [B, Hk, T] the
        absolute position of each kept token per head."""

        is_croppable = False

        def __init__(self, applied: _Applied, window: int | None, scale: float) -> None:
            super().__init__()
            self.applied = applied
            self.window = window
            self.is_sliding = window is not None
            self.pressed = applied.evicts and (window is None or applied.press_sliding)
            self.scale = scale
            self.seen = 0
            self.pos: torch.Tensor | None = None
            self.queries: torch.Tensor | None = None  # [B, Hq, seen, D] float64, for query-based policies
            self.kept_log: list[int] = []
            self.unscored: set[int] = set()  # steps (tokens seen) over budget the policy could not score
            self.over_budget: set[int] = set()  # steps that ended over budget (sinks, or unscored)
            self.near_ties: set[int] = set()  # steps whose keep-set boundary was a near tie (rerun_select)
            self.mode, self.mode_note = "per_token", ""  # how the pass was computed (teacher_forced_logprobs)
            self._done = -1  # seen at the last after_attention: a step's hooks may fire twice
            # observed_attention (H2O): attention each held key has received [B, Hq, T] and from how
            # many queries [B, Hk, T], accumulated step by step over the keys held then
            self.h2o: tuple[torch.Tensor, torch.Tensor] | None = None
            self._summed = 0  # queries already added to self.h2o

        def get_seq_length(self) -> int:
            return self.seen

        def get_mask_sizes(self, query: Any, *args: Any) -> tuple[int, int]:
            # transformers 5.23 passes the query length, older 5.x the cache_position tensor
            n = query if isinstance(query, int) else int(query.shape[0])
            held = 0 if self.keys is None or not self.is_initialized else int(self.keys.shape[-2])
            return held + n, self.seen - held

        def add_queries(self, q: torch.Tensor) -> None:
            q = q.detach().to(torch.float64)
            self.queries = q if self.queries is None else torch.cat([self.queries, q], dim=2)

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            n = key_states.shape[-2]
            if n != 1 and self.seen:
                raise RuntimeError("the what-if rerun feeds one token per step after the prefill")
            if not self.is_initialized:  # (not lazy_initialization: its signature varies across 5.x)
                self.dtype, self.device = key_states.dtype, key_states.device
                self.is_initialized = True
                self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
                self.pos = torch.zeros((*key_states.shape[:2], 0), dtype=torch.long, device=key_states.device)
            new_pos = torch.arange(self.seen, self.seen + n, device=key_states.device).expand(*key_states.shape[:2], -1)
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            self.pos = torch.cat([self.pos, new_pos], dim=-1)
            self.seen += n
            keys, values = self.keys, self.values
            if isinstance(self.applied.policy, P.Quantizer):
                keys, values = self._roundtrip(keys, "key"), self._roundtrip(values, "value")
            # What the next step will find: trimmed after this step's attention, as transformers' own
            # sliding layer does, so the mask built before the next forward (get_mask_sizes) matches.
            # A pressed sliding layer is trimmed by position with its eviction (after_attention).
            if self.window is not None and not self.pressed and self.keys.shape[-2] > self.window - 1:
                held = self.keys.shape[-2]
                self._select(torch.arange(held - self.window + 1, held, device=self.keys.device)
                             .expand(*self.keys.shape[:2], -1))
            return keys, values

        def after_attention(self) -> None:
            """Evict down to the budget once this step's attention (and its query) is done: a
            full layer's budget is of all it has seen, a pressed sliding layer's of the window - 1
            tokens it would hold (keys that left the window go first)."""
            if not self.is_initialized or self._done == self.seen:
                return
            self._done = self.seen
            if self.pressed and isinstance(self.applied.policy, P.ObservedAttention):
                _h2o_add(self)
            if self.pressed:
                held = self.seen if self.window is None else min(self.seen, self.window - 1)
                n = self.applied.budget(held)
                cand = None if self.window is None else self.pos > self.seen - self.window
                if cand is not None and bool(cand.all()):
                    cand = None
                counts = self.keys.shape[-2] if cand is None else int(cand.sum(dim=-1).min())
                if cand is not None or self.keys.shape[-2] > n:
                    self._evict(min(n, counts), cand)
                if self.keys.shape[-2] > n:
                    self.over_budget.add(self.seen)
            self.kept_log.append(int(self.keys.shape[-2]))  # what the cache holds between steps

        def _roundtrip(self, x: torch.Tensor, which: str) -> torch.Tensor:
            pol = self.applied.policy
            assert isinstance(pol, P.Quantizer)
            out = pol.roundtrip(x.detach().double().cpu().numpy(), which)
            return torch.from_numpy(out).to(device=x.device, dtype=x.dtype)

        def _select(self, idx: torch.Tensor) -> None:
            """Keep, per (batch, KV head), the tokens at ``idx`` [B, Hk, n] (ascending)."""
            g = idx.unsqueeze(-1).expand(-1, -1, -1, self.keys.shape[-1])
            self.keys = self.keys.gather(2, g)
            self.values = self.values.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, self.values.shape[-1]))
            self.pos = self.pos.gather(2, idx)
            if self.h2o is not None:
                acc, cnt = self.h2o
                B, hq, _ = acc.shape
                qi = idx.repeat_interleave(hq // idx.shape[1], dim=1)  # a query head reads its KV head's keys
                self.h2o = acc.gather(2, qi), cnt.gather(2, idx)

        def _select_mask(self, keep: np.ndarray, cand: torch.Tensor | None) -> None:
            """Keep the tokens of a policy's keep mask ``keep`` [B, Hk, T], by index
            (kvtrace.whatif.rerun_select.rank_mask): every head the same count."""
            keep_t = torch.from_numpy(np.ascontiguousarray(keep)).to(self.keys.device)
            if bool(keep_t.all()):
                return
            scores, m = rank_mask(keep_t, self.pos, cand)
            self._select(top_index(scores, m, cand))

        def _evict(self, n: int, cand: torch.Tensor | None = None) -> None:
            """Keep ``n`` tokens per head by the policy's scores, among the candidates ``cand``
            [B, Hk, T] (None: all; a sliding layer's: those still in its window). A step the policy
            cannot score keeps every candidate, or -- where heads hold different counts of them --
            the newest ``n`` of each (the window's own order), and counts as unscored."""
            pol = self.applied.policy
            assert isinstance(pol, P.ScorerPolicy)
            held = self.keys.shape[-2]
            try:
                if pol.needs.startswith("Q") and self.queries is None or \
                        isinstance(pol, P.StreamingLLM) and held <= pol.n_sink:  # kvpress: needs more than n_sink keys
                    raise PolicyError("nothing to score with yet")
                scores = _torch_scores(self, pol) if TORCH_SCORING or isinstance(pol, P.ObservedAttention) else None
                if scores is not None:
                    self._keep_top(scores, n, cand, pol)
                    return
                pos = self.pos.cpu().numpy()
                c = np.ones(pos.shape, dtype=bool) if cand is None else cand.cpu().numpy()
                k = self.keys.detach().double().cpu().numpy()
                v = self.values.detach().double().cpu().numpy()
                if c.all() and (pos == pos[:1, :1]).all():  # positions shared by all heads
                    keep = pol.keep_n(k, n, self._observed(pos[0, 0]), v, k_pos=pos[0, 0], window=self.window)
                else:  # heads hold different tokens: score each KV head with its own candidates
                    keep = np.zeros(k.shape[:3], dtype=bool)
                    hk = k.shape[1]
                    q = self._q()
                    g = q.shape[1] // hk if q is not None else 1
                    for b in range(k.shape[0]):
                        for h in range(hk):
                            i = np.flatnonzero(c[b, h])
                            obs = None if q is None else Observed(q[b:b + 1, h * g:(h + 1) * g], np.arange(q.shape[2]),
                                                                  pos[b, h, i], self.window, self.scale)
                            keep[b, h, i] = pol.keep_n(k[b:b + 1, h:h + 1, i], n, obs, v[b:b + 1, h:h + 1, i],
                                                       k_pos=pos[b, h, i], window=self.window)[0, 0]
            except PolicyError:  # too few keys or queries to score yet (e.g. T <= n_sink)
                self.unscored.add(self.seen)
                if cand is None:
                    return
                counts = cand.sum(dim=-1)  # keep every candidate, or the newest n where heads hold different counts
                m = n if bool((counts != counts.flatten()[0]).any()) else int(counts.flatten()[0])
                self._select(top_index(self.pos, m, cand))
                return
            self._select_mask(keep, cand)

        def _keep_top(self, scores: torch.Tensor, n: int, cand: torch.Tensor | None, pol: P.ScorerPolicy) -> None:
            """Keep the ``n`` best ``scores`` [B, Hk, T] of each head among ``cand``, by index
            (kvtrace.whatif.rerun_select.top_index: older first on ties, NaN last, as
            policies.keep_first); more always-kept (inf) candidates than ``n``: Unsupported, as offline."""
            inf = torch.isposinf(scores)
            forced = int((inf if cand is None else inf & cand).sum(dim=-1).max())
            if forced > n:
                raise P.Unsupported(f"{pol.name}: {forced} {pol.forced_facts(None)} are always kept, more than the "
                                    f"budget of {n}")
            idx, tied = near_tie(scores, n, cand, near_tie_tolerance(self.keys.dtype))
            if tied:
                self.near_ties.add(self.seen)
            self._select(idx)

        def _q(self) -> np.ndarray | None:
            return None if self.queries is None else self.queries.cpu().numpy()

        def _observed(self, k_pos: np.ndarray) -> Observed | None:
            q = self._q()
            if q is None:
                return None
            return Observed(q, np.arange(q.shape[2]), k_pos, self.window, self.scale)

    return PolicyLayer


# The rerun scores query policies in torch on the layer's own tensors (per-head key positions, no
# numpy round trip): knorm, snapkv, tova, expected_attention. False: policies.py's numpy scorers, head by
# head (tests compare both). observed_attention is always the step-by-step H2O sums (_h2o_add).
TORCH_SCORING = True


def _masked_probs(layer: Any, q: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """Softmax [B, Hk, G, m, T] of queries ``q`` [B, Hq, m, D] at ``q_pos`` [m] over the layer's
    held keys, each head's visibility from its own key positions (causal, and its window)."""
    import torch

    k = layer.keys.detach().to(torch.float64)
    B, hk, T, d = k.shape
    hq, m = q.shape[1], q.shape[2]
    g = hq // hk
    logits = (q.reshape(B, hk, g * m, d) @ k.transpose(-1, -2)).reshape(B, hk, g, m, T) * layer.scale
    pos = layer.pos[:, :, None, :]  # [B, Hk, 1, T]
    vis = pos <= q_pos[None, None, :, None]
    if layer.window is not None:
        vis &= pos > q_pos[None, None, :, None] - layer.window
    logits.masked_fill_(~vis[:, :, None], float("-inf"))
    return torch.nan_to_num_(torch.softmax(logits, dim=-1), nan=0.0)


def _h2o_add(layer: Any) -> None:
    """Add the queries not summed yet (this step's, or a prefill's) to the layer's H2O sums: the
    attention each held key receives from each of them, and how many of them see it."""
    import torch

    if layer.queries is None or layer._summed >= layer.queries.shape[2]:
        return
    B, hk, T, _ = layer.keys.shape
    hq = layer.queries.shape[1]
    if layer.h2o is None:
        dev = layer.keys.device
        layer.h2o = (torch.zeros((B, hq, 0), dtype=torch.float64, device=dev),
                     torch.zeros((B, hk, 0), dtype=torch.float64, device=dev))
    acc, cnt = layer.h2o
    if acc.shape[2] < T:  # the keys appended since: nothing received yet
        acc = torch.cat([acc, acc.new_zeros((B, hq, T - acc.shape[2]))], dim=2)
        cnt = torch.cat([cnt, cnt.new_zeros((B, hk, T - cnt.shape[2]))], dim=2)
    new = torch.arange(layer._summed, layer.queries.shape[2], device=layer.keys.device)
    p = _masked_probs(layer, layer.queries[:, :, layer._summed:], new)
    acc = acc + p.sum(dim=3).reshape(B, hq, T)
    seen = (layer.pos[:, :, None, :] <= new[None, None, :, None])
    if layer.window is not None:
        seen &= layer.pos[:, :, None, :] > new[None, None, :, None] - layer.window
    cnt = cnt + seen.sum(dim=2)
    layer.h2o, layer._summed = (acc, cnt), layer.queries.shape[2]


def _torch_scores(layer: Any, pol: P.ScorerPolicy) -> torch.Tensor | None:
    """``pol``'s scores [B, Hk, T] of the layer's held keys (inf: always kept), or None where the
    numpy scorers answer (policies without a torch version here)."""
    import torch

    q = layer.queries
    B, hk, T, _ = layer.keys.shape
    dev = layer.keys.device  # every tensor made here: the layer's device (a CUDA cache stays there)
    if type(pol) is P.Knorm:
        return -layer.keys.detach().to(torch.float64).norm(dim=-1)
    if isinstance(pol, P.ObservedAttention):
        _h2o_add(layer)
        acc, cnt = layer.h2o
        g = acc.shape[1] // hk
        s = (acc.reshape(B, hk, g, T) / cnt.clamp(min=1)[:, :, None]).mean(dim=2)
        return s.masked_fill(cnt == 0, float("inf"))
    if q is None:
        return None
    S = q.shape[2]
    if isinstance(pol, P.TOVA):
        p = _masked_probs(layer, q[:, :, S - 1:], torch.tensor([S - 1], device=dev))  # [B, Hk, G, 1, T]
        s = p[:, :, :, 0].mean(dim=(1, 2), keepdim=True).squeeze(2).expand(B, hk, T)  # all heads, index-wise
        return s.masked_fill(layer.pos >= S - 1, float("inf"))
    if isinstance(pol, P.SnapKV):
        start = S - pol.window_size
        prefix = layer.pos < start
        n_pre = prefix.sum(dim=-1)
        if bool((n_pre != n_pre.flatten()[0]).any()) or not bool(prefix[..., :int(n_pre.flatten()[0])].all()):
            return None  # heads differ in what precedes the window: the numpy scorers, head by head
        n_pre = int(n_pre.flatten()[0])
        out = torch.full((B, hk, T), float("inf"), dtype=torch.float64, device=dev)
        if n_pre:
            w = torch.arange(max(start, 0), S, device=dev)
            s = _masked_probs(layer, q[:, :, max(start, 0):], w)[..., :n_pre].mean(dim=3)  # [B, Hk, G, n_pre]
            k = pol.kernel_size
            pooled = torch.nn.functional.avg_pool1d(s.reshape(-1, 1, n_pre), k, stride=1, padding=k // 2)
            out[..., :n_pre] = pooled.reshape(B, hk, -1, n_pre).mean(dim=2)
        return out
    if isinstance(pol, P.ExpectedAttention):
        ns = pol.n_sink
        if T <= ns or S <= ns:
            raise PolicyError(f"{pol.name}: needs more than n_sink={ns} keys and queries")
        qs = q[:, :, ns:]
        hq, d = qs.shape[1], qs.shape[3]
        mu = qs.mean(dim=2)
        k = layer.keys.detach().to(torch.float64)[:, :, ns:].repeat_interleave(hq // hk, dim=1)
        logits = torch.einsum("bhnd,bhd->bhn", k, mu) / math.sqrt(d)
        if pol.use_covariance:
            c = qs - mu[:, :, None]
            cov = torch.einsum("bhsi,bhsj->bhij", c, c) / qs.shape[2]
            logits = logits + ((k @ cov) * k).sum(dim=-1) / d / 2
        s = torch.softmax(logits, dim=-1).reshape(B, hk, hq // hk, -1).mean(dim=2)
        if pol.use_vnorm:
            s = (s + pol.epsilon) * layer.values.detach().to(torch.float64)[:, :, ns:].norm(dim=-1)
        out = torch.full((B, hk, T), float("inf"), dtype=torch.float64, device=dev)
        out[..., ns:] = s
        return out
    return None


def _scales(model: Any) -> dict[int, float]:
    """Softmax scale of each attention layer (module.scaling; 1/sqrt(head_dim) otherwise)."""
    out: dict[int, float] = {}
    for m in model.modules():
        idx = getattr(m, "layer_idx", None)
        if isinstance(idx, int) and idx not in out and hasattr(m, "head_dim"):
            s = getattr(m, "scaling", None)
            out[idx] = float(s) if isinstance(s, (int, float)) else 1 / math.sqrt(int(m.head_dim))
    return out


def _policy_cache(model: Any, applied: _Applied) -> tuple[Any, list[Any]]:
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    cache = DynamicCache(config=model.config)
    if not cache.layers:
        raise Unavailable("what-if rerun: the model's config gives no cache layers to wrap")
    cls = _layer_class()
    scales = _scales(model)
    wrapped = []
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicSlidingWindowLayer:
            new = cls(applied, int(layer.sliding_window), scales.get(i, 1.0))
        elif type(layer) is DynamicLayer:
            new = cls(applied, None, scales.get(i, 1.0))
        else:
            raise Unavailable(f"what-if rerun: cache layer {i} is a {type(layer).__name__}; only dynamic and "
                              "sliding-window layers can be wrapped")
        cache.layers[i] = new
        wrapped.append(new)
    return cache, wrapped


# How a pass is computed: "one_pass" (kvtrace.whatif.rerun_pass: one forward, the layers driven
# row by row inside the attention function), "per_token" (one forward per token: the definition,
# kept as the tests' reference and for models the one pass cannot drive), "auto" (one_pass, else
# per_token with the reason).
MODES = ("auto", "one_pass", "per_token")


def teacher_forced_logprobs(model: Any, ids: torch.Tensor, policy: Policy | None = None,
                            ratio: float | None = None, prefill: int = 0,
                            press_sliding: bool | None = None, mode: str = "auto") -> tuple[np.ndarray, list[Any]]:
    """Next-token log-probabilities [N, V] (float64) of a pass over ``ids`` [1, N] with ``policy``
    applied to the cache: the first ``prefill`` tokens in one forward (the policy acts after it,
    as kvpress presses a prefill), then one token per step; and the wrapped cache layers (each
    with ``mode``: how the pass was computed, see MODES, and ``mode_note``: why per_token under
    auto). ``press_sliding``: whether eviction presses sliding-window layers (None: kvpress's
    choice for the model, kvtrace.whatif.kvpress.presses_sliding)."""
    from kvtrace.whatif.rerun_pass import NotRowDriven, one_pass_logprobs

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if getattr(model.config, "is_encoder_decoder", False):
        raise Unavailable("what-if rerun: encoder-decoder models are not supported (decoder-only causal LMs)")
    if press_sliding is None:
        press_sliding = sliding_rule(model)[0]
    applied = _Applied(policy, ratio, press_sliding)
    queries = isinstance(policy, P.ScorerPolicy) and policy.needs.startswith("Q") and applied.evicts
    if queries and getattr(model.config.get_text_config(), "kv_lora_rank", None):
        raise PolicyError(f"{policy.name}: the cache holds an MLA latent shared by all heads; scoring with "
                          "queries needs per-head keys (the up-projections)")
    note = ""
    if mode != "per_token":
        _, layers = _policy_cache(model, applied)
        try:
            got = one_pass_logprobs(model, ids, layers, prefill, queries)
        except NotRowDriven as exc:
            if mode == "one_pass":
                raise Unavailable(f"what-if rerun: one model pass cannot drive this model: {exc}") from None
            note = f"one token per forward: {exc}"
        else:
            for x in layers:
                x.mode, x.mode_note = "one_pass", ""
            return got, layers
    got, layers = _per_token_logprobs(model, ids, applied, prefill, queries)
    for x in layers:
        x.mode, x.mode_note = "per_token", note
    return got, layers


def _per_token_logprobs(model: Any, ids: torch.Tensor, applied: _Applied, prefill: int,
                        queries: bool) -> tuple[np.ndarray, list[Any]]:
    """The rerun by its definition: the prefill in one forward, then one forward per token through
    a DynamicCache of PolicyLayers (a forward hook on each attention module ends a layer's step)."""
    import torch

    cache, layers = _policy_cache(model, applied)
    modules = _attention_modules(model, len(layers))
    hooks: list[Any] = []
    capture = None
    rows = []
    first = max(prefill, 1)
    try:
        hooks = [m.register_forward_hook(lambda mod, args, out, i=m.layer_idx: layers[i].after_attention())
                 for m in modules]
        if queries:
            from kvtrace.recorder.qcapture import QueryCapture

            def keep_query(layer: int, q: torch.Tensor) -> None:
                layers[layer].add_queries(q)

            capture = QueryCapture(model, keep_query)
            capture.install()
        from kvtrace.recorder.hooks import cache_keyword

        cache_arg = cache_keyword(model.forward)
        with torch.no_grad():
            for start, stop in [(0, first)] + [(t, t + 1) for t in range(first, ids.shape[1])]:
                out = model(input_ids=ids[:, start:stop], use_cache=True, **{cache_arg: cache})
                rows.extend(torch.log_softmax(out.logits[0].double(), dim=-1).cpu().numpy())
    finally:
        for h in hooks:
            h.remove()
        if capture is not None:
            capture.restore()
    if capture is not None and capture.errors:
        raise RuntimeError(f"query capture failed {capture.errors}x: {capture.last_error}")
    return np.stack(rows), layers


def _attention_modules(model: Any, n_layers: int) -> list[Any]:
    """The modules whose forward hook ends a layer's step: each layer's attention module (one
    per layer index; decoder layers that also carry ``layer_idx`` are skipped)."""
    found: dict[int, Any] = {}
    for m in model.modules():
        idx = getattr(m, "layer_idx", None)
        if isinstance(idx, int) and 0 <= idx < n_layers and "Attention" in type(m).__name__:
            found.setdefault(idx, m)
    if len(found) != n_layers:
        raise Unavailable(f"what-if rerun: found attention modules for {len(found)} of {n_layers} cache layers")
    return list(found.values())


def _measures(ref: np.ndarray, got: np.ndarray, ids: np.ndarray, start: int = 0) -> dict[str, float]:
    """Perplexity and KL(ref || got) over the positions ``start``.. that predict a next token
    (before ``start`` the prefill ran on the full cache)."""
    pos = np.arange(start, len(ids) - 1)
    nxt = ids[pos + 1]
    nll = -got[pos, nxt]
    kl = (np.exp(ref[pos]) * (ref[pos] - got[pos])).sum(axis=-1)
    ppl_ref = float(np.exp(-ref[pos, nxt].mean()))
    ppl = float(np.exp(nll.mean()))
    return {"perplexity": ppl, "perplexity_change_pct": 100 * (ppl / ppl_ref - 1),
            "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top1_agreement": float((ref[pos].argmax(-1) == got[pos].argmax(-1)).mean())}


def _kept(layers: list[Any]) -> dict[str, Any]:
    """Tokens the pressed layers hold between steps, and the steps some of them ended over budget
    (counted once per step, however many layers)."""
    pressed = [x for x in layers if x.pressed]
    if not pressed:
        return {}
    out: dict[str, Any] = {"tokens_seen": pressed[0].seen,
                           "steps_unscored": len(set().union(*(x.unscored for x in pressed))),
                           "steps_over_budget": len(set().union(*(x.over_budget for x in pressed))),
                           "steps_near_tie": len(set().union(*(x.near_ties for x in pressed)))}
    for kind, group in (("full", [x for x in pressed if x.window is None]),
                        ("sliding", [x for x in pressed if x.window is not None])):
        if group:
            out[f"{kind}_layer_tokens_final"] = float(np.mean([x.kept_log[-1] for x in group]))
            out[f"{kind}_layer_tokens_mean"] = float(np.mean([np.mean(x.kept_log) for x in group]))
    return out


def _pass_facts(layers: list[Any]) -> dict[str, str]:
    """How a pass was computed: ``pass`` one_pass | per_token, and ``pass_note`` (why per_token)."""
    x = layers[0] if layers else None
    if x is None:
        return {}
    return {"pass": x.mode, **({"pass_note": x.mode_note} if x.mode_note else {})}


PROBE = "The quick brown fox jumps over the lazy dog. 0123456789"


def tokenizer_problem(tok: Any) -> str:
    """Why ``tok`` cannot tokenize a text ("" when it can): a tokenizer transformers builds empty
    (no vocabulary) encodes every text to no ids."""
    from kvtrace.loading import ByteTokenizer

    if isinstance(tok, ByteTokenizer):
        return ""
    try:
        size: int | None = len(tok)
    except TypeError:
        size = None
    ids = tok(PROBE, return_tensors=None)["input_ids"]
    if size == 0 or not ids:
        return f"its tokenizer has {size} tokens and encodes {PROBE!r} to {len(ids)} ids"
    return ""


def check_tokenizer(model_spec: str) -> None:
    """A local checkpoint whose tokenizer builds empty: BadOption (exit 64) naming --rerun, before
    any model loads (a checkpoint without a tokenizer is fine: UTF-8 bytes stand in)."""
    if preset_name(model_spec) is not None or not Path(model_spec).is_dir():
        return
    import transformers

    try:
        tok = transformers.AutoTokenizer.from_pretrained(model_spec, local_files_only=True)
    except Exception:  # noqa: BLE001 - load_model falls back to UTF-8 bytes without a tokenizer
        return
    why = tokenizer_problem(tok)
    if why:
        raise BadOption(f"--rerun {model_spec}: {why}: nothing could be scored; fix the checkpoint's tokenizer files "
                        "(or remove them: kvtrace then tokenizes as UTF-8 bytes)", option="--rerun")


def sliding_rule(model: Any, mode: str = "auto") -> tuple[bool, str]:
    """Whether eviction presses the model's sliding-window layers, and why (kvpress's choice for
    the model with ``mode`` auto)."""
    from kvtrace.whatif.kvpress import presses_sliding

    cfg = model.config.to_dict() if hasattr(model.config, "to_dict") else {}
    return presses_sliding(cfg, mode)


def rerun_quality(model_spec: str, text_path: str | Path, policies: list[Policy], ratios: list[float], *,
                  device: str = "cpu", max_tokens: int = 256, tiny: bool = False,
                  prefill: int = 0, sliding: str = "auto",
                  progress: Callable[[int], AbstractContextManager[Any]] | None = None) -> dict[str, Any]:
    """The ``rerun`` section of the what-if document (spec/whatif-json.md). ``prefill``: the first
    tokens go in one forward and the policy acts after it (kvpress's setting); the measures then
    cover the positions after the prefill. ``sliding``: auto | press | keep, as run_whatif's.
    ``progress(total)``: a context manager yielding a callable told each pass over the text as it
    starts (kvtrace.progress.progress_bar)."""
    from kvtrace.loading import encode, load_model

    source = TextSource(text_path, max_tokens)  # refused before the model loads when it is not text
    shrink: dict[str, Any] = {"layers": None, "width": None, "vocab": None}
    if tiny:
        name = preset_name(model_spec)
        if name is None:
            raise BadOption("--tiny only applies to --rerun preset:NAME", option="--tiny")
        try:
            shrink = dict(zip(("layers", "width", "vocab"), tiny_shrink(name), strict=True))
        except KeyError as exc:
            raise BadOption(str(exc).strip("'\""), option="--rerun") from None
    check_tokenizer(model_spec)
    loaded = load_model(model_spec, device=device, dtype="auto", **shrink)
    why = tokenizer_problem(loaded.tokenizer)
    if why:
        raise BadOption(f"--rerun {model_spec}: {why}: nothing could be scored", option="--rerun")
    with source:
        ids = source.tokens(lambda text: encode(loaded.tokenizer, text, str(loaded.model.device)))
    if ids.shape[1] < prefill + 2:  # at least one position predicted from the pressed cache
        what = f"after a prefill of {prefill}" if prefill else "(needs at least 2)"
        raise BadOption(f"--text {text_path}: {ids.shape[1]} tokens leave none to score {what}",
                        option="--rerun-prefill" if prefill else "--text")
    press_sliding, sliding_reason = sliding_rule(loaded.model, sliding)
    passes = [(pol, ratio) for pol in policies if not isinstance(pol, P.Paging)
              for ratio in ([None] if _fixed(pol) else ratios)]
    with (progress or _no_progress)(1 + len(passes)) as step:
        step("reference (the cache unchanged)")
        return _rerun_passes(loaded, model_spec, text_path, ids, policies, ratios, prefill, press_sliding,
                             sliding, sliding_reason, step)


def _fixed(pol: Policy) -> bool:
    """A policy with one result whatever the ratio (quantisers, streaming_llm with a window)."""
    return not isinstance(pol, P.ScorerPolicy) or isinstance(pol, P.StreamingLLM) and pol.window > 0


@contextmanager
def _no_progress(total: int) -> Iterator[Callable[[str], None]]:
    yield lambda _stage: None


def _rerun_passes(loaded: Any, model_spec: str, text_path: str | Path, ids: Any, policies: list[Policy],
                  ratios: list[float], prefill: int, press_sliding: bool, sliding: str, sliding_reason: str,
                  step: Callable[[str], None]) -> dict[str, Any]:
    ref, ref_layers = teacher_forced_logprobs(loaded.model, ids, prefill=prefill, press_sliding=press_sliding)
    flat = ids[0].cpu().numpy()
    n_sliding = sum(x.window is not None for x in ref_layers)
    doc: dict[str, Any] = {
        "kind": "quality", "note": NOTE, "model": loaded.model_id, "model_note": loaded.note,
        "text": str(text_path), "tokens": int(ids.shape[1]), "prefill_tokens": prefill,
        "scored_positions": int(ids.shape[1]) - 1 - prefill,
        "sliding_layers": n_sliding,
        "sliding": {"pressed": press_sliding, "mode": sliding, "reason": sliding_reason, "layers": n_sliding},
        "reference": {"perplexity": _measures(ref, ref, flat, prefill)["perplexity"], **_pass_facts(ref_layers)},
        "policies": [],
    }
    if preset_name(model_spec) is not None:
        doc["warning"] = RANDOM_NOTE
    for pol in policies:
        entry: dict[str, Any] = {"policy": pol.name, "label": pol.label(), "family": pol.family, "results": []}
        if isinstance(pol, P.Paging):
            entry["skipped"] = "paging changes where K/V live, not their values: quality is unchanged by construction"
        elif isinstance(pol, P.ScorerPolicy) and not press_sliding and not any(x.window is None for x in ref_layers):
            entry["skipped"] = ("every cache layer is sliding-window, and their windows are left unpressed (see "
                                "'sliding'): eviction has no layer to press")
        else:
            for ratio in ([None] if _fixed(pol) else ratios):
                step(f"{pol.label()}" + ("" if ratio is None else f" at {ratio:g}"))
                try:
                    got, layers = teacher_forced_logprobs(loaded.model, ids, pol, ratio, prefill, press_sliding)
                except PolicyError as exc:
                    entry["results"].append({"ratio": ratio, "skipped": str(exc)})
                    continue
                entry["results"].append({"ratio": ratio, **_measures(ref, got, flat, prefill), **_kept(layers),
                                         **_pass_facts(layers)})
        doc["policies"].append(entry)
    return doc
