"""Attention statistics from sampled queries and cached keys: entropy, LSE, received mass (H2O).

Shapes: ``q`` ``[B, Hq, Tq, D]``, ``k`` ``[B, Hkv, Tk, D]`` with ``Hq = group * Hkv``; query head
``h`` reads KV head ``h // group`` (the order of transformers' ``repeat_kv``). 3-D inputs are read
as ``B = 1``.

Positions: key ``j`` sits at absolute position ``j``. Query ``i`` sits at ``q_positions[i]`` if
given, else at ``q_offset + i`` with ``q_offset`` defaulting to ``Tk - Tq`` (queries are the last
``Tq`` tokens). Key ``j`` is visible to a query at ``pos`` iff ``j <= pos`` (when ``causal``) and
``j > pos - window`` (when ``window`` is set): a window of ``W`` shows ``W`` keys, itself included.

Per (batch, query head, query), with ``s_j = scale * q.k_j`` (``scale`` default ``1/sqrt(D)``),
scores accumulated in fp32, and ``p = softmax(s)`` over the ``n`` visible keys:

* ``lse = log sum_j exp(s_j)`` (``-inf`` when ``n == 0``), also kept as ``row_max`` (max visible
  score) + ``log_z`` (``ln sum exp(s - row_max)``): the pair keeps full precision where an fp32
  LSE of huge scores (fp16 inputs near 6e4 give scores ~1e10) cannot hold ``ln Z``;
* ``entropy = -sum_j p_j ln p_j`` in nats (0 when ``n == 0``);
* ``norm_entropy = entropy / ln(n)`` in [0, 1], defined as 0 when ``n <= 1``;
* ``received[b, kv, j] = sum over query heads of group kv, sum over queries of p_j`` -- the H2O
  accumulated-attention score of key ``j`` (each query with ``n > 0`` contributes total mass 1).

Backends: ``triton`` (two passes, never forms a Tq x Tk matrix), ``torch`` (the reference below,
run over query chunks so memory stays bounded on CPU), and :func:`attention_stats_reference`
(materialises everything; the definition the others are tested against). Non-finite inputs give
unspecified non-finite outputs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtrace.kernels._env import resolve_backend

__all__ = [
    "AttentionStats",
    "attention_stats",
    "attention_stats_chunked",
    "attention_stats_reference",
    "attention_stats_triton",
    "received_attention",
    "visible_counts",
]

# Elements of one fp32 score chunk in the torch path (64 MiB); a few temporaries of this size live
# at once.
_CHUNK_ELEMS = 1 << 24


@dataclass
class AttentionStats:
    entropy: torch.Tensor  # [B, Hq, Tq] fp32, nats
    norm_entropy: torch.Tensor  # [B, Hq, Tq] fp32, entropy / ln(n_visible), 0 when n_visible <= 1
    lse: torch.Tensor  # [B, Hq, Tq] fp32 log-sum-exp = row_max + log_z; -inf where nothing is visible
    row_max: torch.Tensor  # [B, Hq, Tq] fp32 max visible score; -inf where nothing is visible
    log_z: torch.Tensor  # [B, Hq, Tq] fp32 ln sum exp(s - row_max), in [0, ln n]; -inf if n == 0
    n_visible: torch.Tensor  # [Tq] int64, keys visible to each query
    positions: torch.Tensor  # [Tq] int64, absolute query positions
    received: torch.Tensor | None  # [B, Hkv, Tk] fp32 received mass, or None if not asked


@dataclass(frozen=True)
class _Geom:
    B: int
    Hq: int
    Hkv: int
    Tq: int
    Tk: int
    D: int
    group: int
    scale: float
    causal: bool
    window: int | None
    positions: torch.Tensor  # int64 [Tq] on the inputs' device
    contig: bool  # positions == q_offset + arange(Tq)
    q_offset: int


def _as_4d(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() == 3:
        x = x.unsqueeze(0)
    if x.dim() != 4:
        raise ValueError(f"{name} must be [B, H, T, D] or [H, T, D], got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be floating point, got {x.dtype}")
    return x


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    q_offset: int | None,
    q_positions: torch.Tensor | Sequence[int] | None,
    causal: bool,
    window: int | None,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, _Geom]:
    q = _as_4d(q, "q")
    k = _as_4d(k, "k")
    B, Hq, Tq, D = q.shape
    Bk, Hkv, Tk, Dk = k.shape
    if Bk != B or Dk != D:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head_dim")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    if D == 0:
        raise ValueError("head_dim must be > 0")
    if window is not None and int(window) < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    if q_positions is not None and q_offset is not None:
        raise ValueError("give q_offset or q_positions, not both")
    if q_positions is None:
        off = Tk - Tq if q_offset is None else int(q_offset)
        positions = torch.arange(off, off + Tq, device=q.device, dtype=torch.int64)
        contig = True
    else:
        positions = torch.as_tensor(q_positions, dtype=torch.int64, device=q.device).reshape(-1)
        if positions.numel() != Tq:
            raise ValueError(f"q_positions has {positions.numel()} entries for {Tq} queries")
        off = int(positions[0]) if Tq else 0
        contig = bool(Tq == 0 or torch.equal(positions - off, torch.arange(Tq, device=q.device)))
    sc = 1.0 / math.sqrt(D) if scale is None else float(scale)
    geom = _Geom(B, Hq, Hkv, Tq, Tk, D, Hq // Hkv, sc, bool(causal),
                 None if window is None else int(window), positions, contig, off)
    return q, k, geom


def visible_counts(positions: torch.Tensor, num_keys: int, causal: bool = True,
                   window: int | None = None) -> torch.Tensor:
    """Number of keys (of ``0..num_keys-1``) each query position sees under the mask rules."""
    pos = positions.to(torch.int64)
    hi = torch.clamp(pos + 1, max=num_keys) if causal else torch.full_like(pos, num_keys)
    lo = torch.clamp(pos - window + 1, min=0) if window is not None else torch.zeros_like(pos)
    return torch.clamp(hi - lo, min=0)


def _visible_mask(pos: torch.Tensor, Tk: int, causal: bool, window: int | None) -> torch.Tensor:
    j = torch.arange(Tk, device=pos.device)
    vis = torch.ones(pos.numel(), Tk, dtype=torch.bool, device=pos.device)
    if causal:
        vis &= j[None, :] <= pos[:, None]
    if window is not None:
        vis &= j[None, :] > pos[:, None] - window
    return vis


def _finish(entropy: torch.Tensor, row_max: torch.Tensor, log_z: torch.Tensor,
            received: torch.Tensor | None, g: _Geom) -> AttentionStats:
    n = visible_counts(g.positions, g.Tk, g.causal, g.window)
    log_n = torch.log(n.clamp(min=1).to(torch.float32))
    norm = torch.where(n > 1, entropy / torch.where(n > 1, log_n, 1.0), torch.zeros_like(entropy))
    lse = torch.where(torch.isneginf(row_max), float("-inf"), row_max + log_z)
    return AttentionStats(entropy, norm, lse, row_max, log_z, n, g.positions, received)


def _dense_rows(qc: torch.Tensor, kf: torch.Tensor, pos: torch.Tensor, g: _Geom,
                norm_in: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Entropy, row max, log Z and per-KV-head received mass for a chunk of queries, materialised.

    qc [B, Hq, c, D]; kf [B, Hkv, Tk, D] fp32. With ``norm_in = (shift, log_z)`` the softmax
    normaliser is taken from there (p = exp((s - shift) - log_z)) instead of being computed.
    Scores are handled relative to the row max, so ln Z is not absorbed into a huge max.
    """
    B, _, c, D = qc.shape
    qf = qc.float().reshape(B, g.Hkv, g.group, c, D)
    s = torch.matmul(qf, kf.unsqueeze(2).transpose(-1, -2)) * g.scale  # [B, Hkv, G, c, Tk]
    vis = _visible_mask(pos, g.Tk, g.causal, g.window)
    s = s.masked_fill(~vis, float("-inf"))
    if norm_in is None:
        m = s.amax(dim=-1) if g.Tk else s.new_full(s.shape[:-1], float("-inf"))
        log_z = torch.logsumexp(s - torch.where(torch.isneginf(m), 0.0, m).unsqueeze(-1), dim=-1)
    else:
        m = norm_in[0].reshape(B, g.Hkv, g.group, c)
        log_z = norm_in[1].reshape(B, g.Hkv, g.group, c)
    d = (s - torch.where(torch.isneginf(m), 0.0, m).unsqueeze(-1)) - log_z.unsqueeze(-1)  # log p
    p = torch.where(vis, torch.exp(d), 0.0)  # NaN/inf on rows with nothing visible: masked here
    entropy = torch.where(vis, -p * d, 0.0).sum(-1)
    mass = p.sum(dim=(2, 3))
    return entropy.reshape(B, g.Hq, c), m.reshape(B, g.Hq, c), log_z.reshape(B, g.Hq, c), mass


def attention_stats_reference(
    q: torch.Tensor, k: torch.Tensor, *, q_offset: int | None = None,
    q_positions: torch.Tensor | Sequence[int] | None = None, causal: bool = True,
    window: int | None = None, scale: float | None = None, received: bool = True,
) -> AttentionStats:
    """Definition by materialising the full ``[B, Hq, Tq, Tk]`` fp32 softmax (small inputs only)."""
    q, k, g = _prepare(q, k, q_offset, q_positions, causal, window, scale)
    entropy, m, log_z, mass = _dense_rows(q, k.float(), g.positions, g)
    return _finish(entropy, m, log_z, mass if received else None, g)


def _chunk_rows(g: _Geom, chunk_size: int | None) -> int:
    if chunk_size is not None:
        return max(1, int(chunk_size))
    return max(1, _CHUNK_ELEMS // max(1, g.B * g.Hq * g.Tk))


def attention_stats_chunked(
    q: torch.Tensor, k: torch.Tensor, *, q_offset: int | None = None,
    q_positions: torch.Tensor | Sequence[int] | None = None, causal: bool = True,
    window: int | None = None, scale: float | None = None, received: bool = True,
    chunk_size: int | None = None,
) -> AttentionStats:
    """The reference computed over chunks of queries: memory O(B * Hq * chunk * Tk)."""
    q, k, g = _prepare(q, k, q_offset, q_positions, causal, window, scale)
    kf = k.float()
    step = _chunk_rows(g, chunk_size)
    parts: list[tuple[torch.Tensor, ...]] = []
    mass = torch.zeros(g.B, g.Hkv, g.Tk, dtype=torch.float32, device=q.device)
    for i in range(0, g.Tq, step):
        e, m, lz, ms = _dense_rows(q[:, :, i:i + step], kf, g.positions[i:i + step], g)
        parts.append((e, m, lz))
        mass += ms
    if g.Tq == 0:
        empty = torch.zeros(g.B, g.Hq, 0, dtype=torch.float32, device=q.device)
        parts = [(empty, empty, empty)]
    e, m, lz = (torch.cat(t, dim=2) for t in zip(*parts, strict=True))
    return _finish(e, m, lz, mass if received else None, g)


def _kernel_inputs(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # One dtype for both dot operands; fp64 and others go through fp32.
    dt = torch.promote_types(q.dtype, k.dtype)
    if dt not in (torch.float16, torch.bfloat16, torch.float32):
        dt = torch.float32
    q, k = q.to(dt), k.to(dt)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    return q, k


_LIMIT = 2**29  # the kernels add up to three of these in int32


def _int32_safe(g: _Geom) -> _Geom:
    """Check the kernels' int32 position arithmetic cannot overflow; clamp a huge window (any
    window >= 2**29 already shows every key at or before the query)."""
    if abs(g.q_offset) >= _LIMIT or g.Tk >= _LIMIT or (g.Tq and int(g.positions.abs().max()) >= _LIMIT):
        raise ValueError("positions and lengths must be below 2**29 for the Triton path")
    if g.window is not None and g.window > _LIMIT:
        g = dataclasses.replace(g, window=_LIMIT)
    return g


def _split_plan(g: _Geom, device: torch.device, num_splits: int | None) -> tuple[int, int]:
    from kvtrace.kernels._triton_attention import split_unit

    unit = split_unit()
    if num_splits is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        base = g.B * g.Hq * -(-g.Tq // 64)
        want = -(-2 * sms // max(base, 1))
        num_splits = max(1, min(want, -(-g.Tk // 512)))  # at least ~512 keys per split
    per = -(-g.Tk // max(1, num_splits))
    per = max(unit, -(-per // unit) * unit)
    return -(-g.Tk // per), per


def _merge_splits(pm: torch.Tensor, pz: torch.Tensor, ps: torch.Tensor):
    """Combine per-split (m, Z, S') along the last dim into (entropy, row max, log Z)."""
    m = pm.amax(dim=-1)
    m_use = torch.where(torch.isneginf(m), 0.0, m)
    w = torch.exp(pm - m_use.unsqueeze(-1))  # 0 for empty splits (pm = -inf)
    shift = torch.where(pz > 0, pm - m_use.unsqueeze(-1), 0.0)
    z = (w * pz).sum(-1)
    s = (w * (ps + shift * pz)).sum(-1)
    seen = z > 0
    safe_z = torch.where(seen, z, 1.0)
    log_z = torch.where(seen, torch.log(safe_z), float("-inf"))
    entropy = torch.where(seen, torch.log(safe_z) - s / safe_z, 0.0)
    return entropy, m, log_z


def attention_stats_triton(
    q: torch.Tensor, k: torch.Tensor, *, q_offset: int | None = None,
    q_positions: torch.Tensor | Sequence[int] | None = None, causal: bool = True,
    window: int | None = None, scale: float | None = None, received: bool = True,
    num_splits: int | None = None,
) -> AttentionStats:
    """Two Triton passes; extra memory O(B * Hq * Tq * num_splits + B * Hkv * Tk) floats.

    ``num_splits`` (key splits of pass 1) is chosen from the SM count when None.
    """
    from kvtrace.kernels import _triton_attention as tk

    q, k, g = _prepare(q, k, q_offset, q_positions, causal, window, scale)
    g = _int32_safe(g)
    q, k = _kernel_inputs(q, k)
    dev = q.device
    pos32 = g.positions.to(torch.int32).contiguous()
    rows = g.B * g.Hq * g.Tq
    if rows == 0 or g.Tk == 0:
        entropy = torch.zeros(g.B, g.Hq, g.Tq, dtype=torch.float32, device=dev)
        row_max = torch.full_like(entropy, float("-inf"))
        log_z = row_max.clone()
    else:
        n_splits, per = _split_plan(g, dev, num_splits)
        part = torch.empty(3, rows * n_splits, dtype=torch.float32, device=dev)
        tk.run_stats(q, k, pos32, part[0], part[1], part[2], group=g.group, scale=g.scale,
                     window=g.window, keys_per_split=per, n_splits=n_splits, causal=g.causal)
        part = part.view(3, g.B, g.Hq, g.Tq, n_splits)
        entropy, row_max, log_z = _merge_splits(part[0], part[1], part[2])
    mass = None
    if received:
        mass = _mass_triton(q, k, pos32, row_max, log_z, g)
    return _finish(entropy, row_max, log_z, mass, g)


def _mass_triton(q: torch.Tensor, k: torch.Tensor, pos32: torch.Tensor, shift: torch.Tensor,
                 log_z: torch.Tensor, g: _Geom) -> torch.Tensor:
    from kvtrace.kernels import _triton_attention as tk

    mass = torch.zeros(g.B * g.Hkv * g.Tk, dtype=torch.float32, device=q.device)
    if g.B * g.Hq * g.Tq and g.Tk:
        tk.run_mass(q, k, pos32, shift.float().contiguous().view(-1), log_z.float().contiguous().view(-1),
                    mass, group=g.group, scale=g.scale, window=g.window, q_offset=g.q_offset,
                    causal=g.causal, contig=g.contig)
    return mass.view(g.B, g.Hkv, g.Tk)


def received_attention(
    q: torch.Tensor, k: torch.Tensor, shift: torch.Tensor, log_z: torch.Tensor | None = None, *,
    q_offset: int | None = None, q_positions: torch.Tensor | Sequence[int] | None = None,
    causal: bool = True, window: int | None = None, scale: float | None = None, backend: str = "auto",
) -> torch.Tensor:
    """Pass 2 alone: received mass ``[B, Hkv, Tk]`` from a saved softmax normaliser.

    ``p = exp((s - shift) - log_z)``: pass a saved ``lse`` alone (``log_z`` None), or
    ``stats.row_max`` and ``stats.log_z`` to keep full precision when |scores| >> 1e3 (an fp32
    LSE of ~1e10 has lost ln Z entirely). ``shift``/``log_z``: ``[B, Hq, Tq]``.
    """
    q4, k4, g = _prepare(q, k, q_offset, q_positions, causal, window, scale)
    shift = shift.reshape(g.B, g.Hq, g.Tq).float()
    log_z = torch.zeros_like(shift) if log_z is None else log_z.reshape(g.B, g.Hq, g.Tq).float()
    if resolve_backend(backend, q4) == "triton":
        q4, k4 = _kernel_inputs(q4, k4)
        g = _int32_safe(g)
        return _mass_triton(q4, k4, g.positions.to(torch.int32).contiguous(), shift, log_z, g)
    kf = k4.float()
    mass = torch.zeros(g.B, g.Hkv, g.Tk, dtype=torch.float32, device=q4.device)
    step = _chunk_rows(g, None)
    for i in range(0, g.Tq, step):
        sl = slice(i, i + step)
        mass += _dense_rows(q4[:, :, sl], kf, g.positions[sl], g,
                            norm_in=(shift[:, :, sl], log_z[:, :, sl]))[3]
    return mass


def attention_stats(
    q: torch.Tensor, k: torch.Tensor, *, q_offset: int | None = None,
    q_positions: torch.Tensor | Sequence[int] | None = None, causal: bool = True,
    window: int | None = None, scale: float | None = None, received: bool = True,
    backend: str = "auto",
) -> AttentionStats:
    """Entropy / LSE per (batch, query head, query) and received mass per (batch, KV head, key).

    ``backend``: ``auto`` (triton for CUDA tensors, else torch), ``triton``, ``torch`` (chunked).
    """
    kw = dict(q_offset=q_offset, q_positions=q_positions, causal=causal, window=window,
              scale=scale, received=received)
    if resolve_backend(backend, q) == "triton":
        return attention_stats_triton(q, k, **kw)
    return attention_stats_chunked(q, k, **kw)
