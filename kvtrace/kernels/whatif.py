"""What-if replay measures on torch tensors: keep-set attention (mass recall, output error) and
quantise-dequantise error, each as a Triton kernel and a plain-torch reference of the same
semantics (kvtrace.whatif.numerics is the float64 numpy definition both are tested against).

Shapes: queries ``[B, Hq, Tq, D]``, keys ``[B, Hk, T, D]``, values ``[B, Hk, T, Dv]``; query head
``h`` reads KV head ``h // (Hq // Hk)``. Key ``j`` sits at position ``k_start + j``; query ``i`` at
``q_positions[i]``. Key ``j`` is visible to a query at ``pos`` iff ``k_start + j <= pos`` (when
``causal``) and ``k_start + j > pos - window`` (when ``window`` is set).

Keep-sets: ``keep`` ``[S, B, Hk, T]`` (bool or int8; nonzero = kept), S candidate sets evaluated in
one pass. Per set, query head and query (``[S, B, Hq, Tq]`` each):
* ``recall`` = the full attention's mass on the kept keys (0 where nothing is visible);
* ``error`` = ``||o' - o|| / ||o||``, ``o'`` the attention output renormalised over the kept
  visible keys (0 where none is kept), ``o`` over all visible keys (NaN where ``||o|| = 0``).

Backends: ``triton`` (one pass over the keys for all sets, memory O(rows * sets), never a
rows x keys matrix; with 16+ query rows per KV head, where it pays, the signature-pieces path of
whatif_pieces.py: one attention pass whatever the number of sets, memory O(rows * pieces)), ``torch`` (materialises the ``[B, Hq, Tq, T]`` scores once and a softmax per
set; float64 by default, the exact reference). ``auto``: triton for CUDA tensors, else torch.

The Triton path's choices (exact decode kernel, signature pieces, direct launches) come from the
caller's ``KernelConfig`` (kvtrace/kernels/whatif_config.py; the defaults are the measured
winners); a kernel a compiler rejects is recorded in the caller's ``KernelFallbacks`` (one per
run: ``kernels.compute.Compute`` holds one).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvtrace.kernels._env import resolve_backend
from kvtrace.kernels.whatif_config import DEFAULT_CONFIG, KernelConfig, KernelFallbacks

if TYPE_CHECKING:
    from kvtrace.kernels._triton_whatif_launch import Launcher

__all__ = [
    "KernelConfig", "KernelFallbacks", "QuantSpec", "as_bf16_if_exact", "keep_measures", "keep_measures_reference",
    "keep_measures_triton", "output_error", "quant_error", "quant_error_reference", "quant_error_triton",
    "quant_roundtrip",
]

_LIMIT = 2**29  # the kernels add positions and windows in int32


@dataclass(frozen=True)
class _Attn:
    B: int
    Hq: int
    Hk: int
    Tq: int
    T: int
    group: int
    scale: float
    positions: torch.Tensor  # int64 [Tq]
    k_start: int
    window: int | None
    causal: bool


def _geometry(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions, k_start: int,
              window: int | None, scale: float | None, causal: bool) -> _Attn:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [B, H, T, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, Hq, Tq, D = q.shape
    Bk, Hk, T, Dk = k.shape
    if Bk != B or Dk != D or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree")
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"{Hq} query heads do not divide into {Hk} KV heads")
    if window is not None and int(window) < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    if q_positions is None:
        pos = torch.arange(k_start + T - Tq, k_start + T, device=q.device)
    else:
        pos = torch.as_tensor(q_positions, device=q.device).to(torch.int64).reshape(-1)
        if pos.numel() != Tq:
            raise ValueError(f"{pos.numel()} query positions for {Tq} queries")
    return _Attn(B, Hq, Hk, Tq, T, Hq // Hk, float(D ** -0.5 if scale is None else scale), pos,
                 int(k_start), None if window is None else int(window), bool(causal))


def _visible(g: _Attn, device: torch.device) -> torch.Tensor:
    """[Tq, T] bool visibility (numerics.visible_mask)."""
    kp = (g.k_start + torch.arange(g.T, device=device))[None, :]
    qp = g.positions.to(device)[:, None]
    vis = kp <= qp if g.causal else torch.ones(g.Tq, g.T, dtype=torch.bool, device=device)
    if g.window:
        vis = vis & (kp > qp - g.window)
    return vis


def _keep_sets(keep: torch.Tensor, g: _Attn) -> torch.Tensor:
    if keep.dim() != 4 or tuple(keep.shape[1:]) != (g.B, g.Hk, g.T):
        raise ValueError(f"keep must be [S, {g.B}, {g.Hk}, {g.T}], got {tuple(keep.shape)}")
    return keep


def _masked_softmax(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim where ``mask``; all-zero rows where nothing is masked in."""
    x = logits.masked_fill(~mask, float("-inf"))
    top = x.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.where(mask, torch.exp(x - top), torch.zeros_like(x))
    s = e.sum(dim=-1, keepdim=True)
    return torch.where(s > 0, e / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(e))


def _rel_error(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    num = torch.linalg.vector_norm(approx - exact, dim=-1)
    den = torch.linalg.vector_norm(exact, dim=-1)
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.full_like(num, float("nan")))


def keep_measures_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, *,
    q_positions: torch.Tensor | Sequence[int] | None = None, k_start: int = 0, window: int | None = None,
    scale: float | None = None, causal: bool = True, dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(recall, error) ``[S, B, Hq, Tq]`` by materialising the scores ``[B, Hq, Tq, T]`` once and a
    softmax per keep-set, in ``dtype`` (float64: the exact reference; float32: eager torch)."""
    g = _geometry(q, k, v, q_positions, k_start, window, scale, causal)
    keep = _keep_sets(keep, g)
    kk = k.to(dtype).repeat_interleave(g.group, dim=1)
    vv = v.to(dtype).repeat_interleave(g.group, dim=1)
    logits = torch.matmul(q.to(dtype), kk.transpose(-1, -2)) * g.scale
    vis = _visible(g, q.device)[None, None].expand_as(logits)
    p = _masked_softmax(logits, vis)
    o = torch.matmul(p, vv)
    recall, error = [], []
    for s in range(keep.shape[0]):
        kept = (keep[s] != 0).repeat_interleave(g.group, dim=1)[:, :, None, :]
        recall.append((p * kept).sum(dim=-1))
        error.append(_rel_error(torch.matmul(_masked_softmax(logits, vis & kept), vv), o))
    if not recall:
        empty = torch.zeros(0, g.B, g.Hq, g.Tq, dtype=dtype, device=q.device)
        return empty, empty.clone()
    return torch.stack(recall), torch.stack(error)


# ------------------------------------------------------------------------------ Triton path


_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _kernel_dtype(*xs: torch.Tensor) -> torch.dtype:
    dt = xs[0].dtype
    for x in xs[1:]:
        dt = torch.promote_types(dt, x.dtype)
    return dt if dt in (torch.float16, torch.bfloat16, torch.float32) else torch.float32


def _last_contig(x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    x = x.to(dt)
    return x if x.stride(-1) == 1 else x.contiguous()


def _low_bits(x: torch.Tensor) -> torch.Tensor:
    """The low 16 bits of each fp32 of ``x`` as an int16 view (no temporary tensor)."""
    halves = x.contiguous().view(torch.int16)
    return halves[..., 0::2] if sys.byteorder == "little" else halves[..., 1::2]


def _bf16_exact(x: torch.Tensor) -> bool:
    """Whether every value of ``x`` is a bf16 value (K/V/Q recorded in bf16 and upcast): an fp32
    holds a bf16 value iff its low 16 bits are 0."""
    if x.dtype == torch.bfloat16:
        return True
    if x.dtype != torch.float32 or x.numel() == 0:
        return False
    return not bool(_low_bits(x).any())


def as_bf16_if_exact(x: torch.Tensor) -> torch.Tensor:
    """``x`` as bf16 when that changes no value (half the memory; the kernels then skip their
    check and conversion), else ``x``."""
    return x.to(torch.bfloat16) if x.dtype == torch.float32 and _bf16_exact(x) else x


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (4 elsewhere: the interpreter's launches)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@dataclass(frozen=True)
class SplitPlan:
    """How a keep-set call cuts the keys: ``n_splits`` splits of ``keys_per_split`` keys."""

    n_splits: int
    keys_per_split: int


def _split_plan(g: _Attn, n_sets: int, device: torch.device, num_splits: int | None) -> SplitPlan:
    """Enough programs for ~4 per SM (a decode step's few rows would otherwise leave most SMs
    idle), at least 256 keys a split."""
    from kvtrace.kernels._triton_whatif import packed, split_unit

    unit = split_unit()
    if num_splits is None:
        sms = _sms(device)
        nvq = g.group * g.Tq
        per_kv = -(-n_sets * nvq // 32) if packed(g.group, g.Tq) else -(-nvq // 32) * -(-n_sets // 4)
        want = -(-4 * sms // max(g.B * g.Hk * per_kv, 1))  # programs without splits: ~32 rows, 4 sets each
        num_splits = max(1, min(want, g.T // 256))
    per = -(-g.T // max(1, num_splits))
    per = max(unit, -(-per // unit) * unit)
    return SplitPlan(-(-g.T // per), per)


def _keep_arg(keep: torch.Tensor) -> torch.Tensor:
    """Keep-sets as int8 (nonzero = kept), last dim contiguous; bool is reinterpreted, not copied."""
    if keep.dtype == torch.bool:
        keep = keep.view(torch.int8)
    elif keep.dtype not in (torch.int8, torch.uint8):
        keep = (keep != 0).view(torch.int8)
    elif keep.dtype == torch.uint8:
        keep = keep.view(torch.int8)
    return keep if keep.stride(-1) == 1 else keep.contiguous()


def _launcher(config: KernelConfig, fallbacks: KernelFallbacks | None) -> Launcher:
    from kvtrace.kernels._triton_whatif_launch import Launcher

    return Launcher(config.direct_launch, fallbacks)


@dataclass
class KeepPlan:
    """One keep-set call made ready by ``_keep_plan``: inputs checked and converted, the partial
    states allocated -- (pm, pl) ``[S + 1, rows, n_splits]`` and pacc ``x dv`` fp32 for set 0
    (every key) and each keep-set -- and what is left as callables."""

    key_pass: Callable[[], None]  # the keep kernel's launch (sets finish_args["check"]: which one ran)
    pm: torch.Tensor
    pl: torch.Tensor
    pacc: torch.Tensor
    n_splits: int
    rows: int  # B * Hq * Tq
    dv: int
    finish_args: dict[str, Any]  # what run_keep_finish needs besides the buffers
    verify: Callable[[], None]  # after the launches: raises what a check left on the device found
    launch: Launcher

    def measures_into(self, recall: torch.Tensor, err: torch.Tensor) -> None:
        """The key pass, the split merge into recall and err ``[S, ...]`` fp32, then the checks."""
        from kvtrace.kernels._triton_whatif_finish import run_keep_finish

        self.key_pass()
        run_keep_finish(self.pm, self.pl, self.pacc, recall, err, rows=self.rows, dv=self.dv, n_splits=self.n_splits,
                        launch=self.launch, **self.finish_args)
        self.verify()


def _partials_triton(q, k, v, keep, g: _Attn, num_splits: int | None, config: KernelConfig,
                     launch: Launcher) -> KeepPlan | None:
    """Per key split, the softmax states (m, l, acc) of set 0 (every key) and of each set in
    ``keep`` [S, B, Hk, T] (over the keys it keeps), in the returned plan's buffers after its key
    pass; None when there are no rows or keys."""
    plan = _keep_plan(q, k, v, keep, g, num_splits, config, launch)
    if plan is None:
        return None
    plan.key_pass()
    plan.verify()
    return plan


def _keep_plan(q, k, v, keep, g: _Attn, num_splits: int | None, config: KernelConfig,
               launch: Launcher) -> KeepPlan | None:
    """Checks, conversions and output buffers of a keep-set call, and its launch: a
    :class:`KeepPlan`, or None when there are no rows or keys."""
    from kvtrace.kernels import _triton_whatif as tw
    from kvtrace.kernels._triton_whatif_check import run_grid_check
    from kvtrace.kernels._triton_whatif_keep import run_keep

    window = None if g.window is None else min(g.window, _LIMIT)
    if abs(g.k_start) >= _LIMIT or g.T >= _LIMIT:
        raise ValueError("positions and lengths must be below 2**29 for the Triton path")
    q, k, v = (x if x.is_contiguous() else x.contiguous() for x in (q, k, v))
    positions = g.positions.contiguous()
    verify = _verified
    fp32 = [x if x.dtype == torch.float32 else None for x in (q, k, v)]
    # fp32 K or V of a decode step: the exact kernel (16-bit K and V: the packed kernel's tensor
    # cores, exact on them; on the H200 the exact kernel took 4-7 ms reading bf16 tensors).
    exact = config.exact_decode and tw.packed(g.group, g.Tq) and (fp32[1] is not None or fp32[2] is not None)
    if exact:  # no grid to check, and the kernel clamps positions itself: no check at all
        off = [True, True, True]
    elif fp32 == [None, None, None]:
        # The position bound checked on the device and read after the launches: no host sync
        # before them (16-bit tensors have no grid to check).
        verify = _bound_verifier(run_grid_check(None, None, None, positions, _LIMIT, _sms(q.device), launch,
                                                sync=False))
        off = [True, True, True]
    else:
        # One launch and one host sync for every check the launch depends on: the position bound
        # and, for fp32 tensors, whether they hold bf16 values (each a read of the whole tensor).
        big, *off = run_grid_check(*fp32, positions, _LIMIT, _sms(q.device), launch)
        if big:
            raise ValueError("positions and lengths must be below 2**29 for the Triton path")
    if g.B * g.Hq * g.Tq == 0 or g.T == 0:
        verify()
        return None
    if exact:  # the kernel reads any of fp16 / bf16 / fp32 as it is stored
        dt = _kernel_dtype(q, k)
        q, k, v = (x if x.dtype in _KERNEL_DTYPES else x.to(dt) for x in (q, k, v))
        cast_q = cast_k = cast_v = False
    else:
        q, k, v, cast_q, cast_k, cast_v = _operands(q, k, v, off)
    if not tw.packed(g.group, g.Tq) and (cast_k or cast_v):
        # The shared-scores kernel reads each key block once per block of rows and sets (~20-40
        # times at 64 queries): there a bf16 copy (one pass, half the inputs' size in memory)
        # halves that traffic and lets the loads go straight to shared memory.
        k, v = (k.to(torch.bfloat16) if cast_k else k), (v.to(torch.bfloat16) if cast_v else v)
        cast_k = cast_v = False
    S1, Dv = keep.shape[0] + 1, v.shape[3]
    rows = g.B * g.Hq * g.Tq
    split = _split_plan(g, S1, q.device, num_splits)
    pm, pl, pacc = _partial_buffers(S1 * rows * split.n_splits, Dv, q.device)
    keep8, qpos = _keep_arg(keep), positions  # int64, read as int32 (bounded above)
    finish_args: dict[str, Any] = dict(q=q, k=k, v=v, keep=keep8, qpos=qpos, group=g.group, scale=g.scale,
                                       k_start=g.k_start, window=window, causal=g.causal)

    def key_pass() -> None:
        finish_args["check"] = run_keep(q, k, v, keep8, qpos, pm, pl, pacc, group=g.group, scale=g.scale,
                                        k_start=g.k_start, window=window, causal=g.causal,
                                        keys_per_split=split.keys_per_split, n_splits=split.n_splits, n_sets=S1,
                                        launch=launch, cast_q=cast_q, cast_k=cast_k, cast_v=cast_v, exact=exact)

    return KeepPlan(key_pass, pm, pl, pacc, split.n_splits, rows, Dv, finish_args, verify, launch)


def _operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, off: Sequence[bool]):
    """(q, k, v, cast_q, cast_k, cast_v) for the tensor-core kernels, ``off`` saying which of q, k,
    v (if fp32) hold values off the bf16 grid. Recorded bf16 upcast to fp32 runs as bf16 (exact
    scores on the tensor cores; p @ V as three bf16 dots against the exact V), cast in registers:
    a converted copy would cost a pass over the tensor and its size again in memory."""
    bf16 = [x.dtype == torch.bfloat16 or (x.dtype == torch.float32 and not bad) for x, bad in zip((q, k, v), off,
                                                                                                  strict=True)]
    dt = _kernel_dtype(q, k)
    as_bf16 = dt == torch.float32 and bf16[0] and bf16[1]
    cast_q, cast_k = as_bf16 and q.dtype == torch.float32, as_bf16 and k.dtype == torch.float32
    if not as_bf16:
        q, k = q.to(dt), k.to(dt)
    cast_v = v.dtype == torch.float32 and bf16[2]
    v = v.to(v.dtype if v.dtype in _KERNEL_DTYPES else torch.float32)
    return q, k, v, cast_q, cast_k, cast_v


def _partial_buffers(n: int, dv: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pm, pl [n], pacc [n * dv]) fp32: views of one allocation (a decode step's call is bound by
    host work before its launch: each allocation is one more torch call), each 128-byte aligned."""
    step = -(-n // 32) * 32
    buf = torch.empty(2 * step + n * dv, dtype=torch.float32, device=device)
    return buf[:n], buf[step:step + n], buf[2 * step:]


def _verified() -> None:
    """Nothing left to check after the launches (the checks ran before them)."""


def _bound_verifier(flags: torch.Tensor):
    """``verify`` for a position bound checked on the device (``run_grid_check(sync=False)``'s
    flags), read after the launches: the call's one host sync."""

    def verify() -> None:
        if int(flags[0]) & 1:
            raise ValueError("positions and lengths must be below 2**29 for the Triton path")

    return verify


def _merged_states(plan: KeepPlan | None, g: _Attn, S1: int, Dv: int, device: torch.device):
    """Merged per-set states (m, l, o) ``[S1, B, Hq, Tq]`` (o: ``x Dv``) from ``_partials_triton``."""
    if plan is None:
        z = torch.zeros(S1, g.B, g.Hq, g.Tq, dtype=torch.float32, device=device)
        return z - float("inf"), z, torch.zeros(*z.shape, Dv, dtype=torch.float32, device=device)
    n_splits = plan.n_splits
    pm = plan.pm.view(S1, g.B, g.Hq, g.Tq, n_splits)
    pl = plan.pl.view_as(pm)
    pacc = plan.pacc.view(S1, g.B, g.Hq, g.Tq, n_splits, Dv)
    m = pm.amax(dim=-1)
    m_use = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp(pm - m_use[..., None])  # 0 for splits that used no key (pm = -inf)
    lsum = (w * pl).sum(dim=-1)
    acc = (w[..., None] * pacc).sum(dim=-2)
    o = torch.where(lsum[..., None] > 0, acc / torch.where(lsum > 0, lsum, torch.ones_like(lsum))[..., None],
                    torch.zeros_like(acc))
    return m, lsum, o


def _pieces_runner(q, k, v, keep, g: _Attn, num_splits: int | None, config: KernelConfig, launch: Launcher):
    """The signature-pieces path (kernels/whatif_pieces.py) for a KV head of 16+ query rows, as a
    callable; None where the config or its cost model leaves the call to the shared-max kernel,
    or its kernels failed in this run before."""
    from kvtrace.kernels import _triton_whatif as tw
    from kvtrace.kernels import whatif_pieces

    fb = launch.fallbacks
    if not config.pieces or not keep.shape[0] or tw.packed(g.group, g.Tq) or fb.off(fb.PIECES):
        return None
    return whatif_pieces.runner(q, k, v, keep, g, num_splits, pieces=config.pieces, launch=launch)


def _pieces_measures(q, k, v, keep, g: _Attn, num_splits: int | None, config: KernelConfig, launch: Launcher):
    """(recall, error) from the signature-pieces path, or None where it does not apply; a compiler
    that rejects its kernels turns it off for the run (the fallbacks record says so) and the
    shared-max kernel, which computes the same, answers instead."""
    try:
        run = _pieces_runner(q, k, v, keep, g, num_splits, config, launch)
        return None if run is None else run()
    except ValueError:
        raise
    except Exception as exc:
        if "out of memory" in str(exc).lower():
            raise
        fb = launch.fallbacks
        fb.turn_off(fb.PIECES, f"signature-pieces kernels unavailable ({type(exc).__name__}: {str(exc)[:200]}); "
                               "the shared-max kernel")
        return None


def keep_measures_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, *,
    q_positions: torch.Tensor | Sequence[int] | None = None, k_start: int = 0, window: int | None = None,
    scale: float | None = None, causal: bool = True, num_splits: int | None = None,
    config: KernelConfig = DEFAULT_CONFIG, fallbacks: KernelFallbacks | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(recall, error) ``[S, B, Hq, Tq]`` fp32 from one Triton pass over the keys for all sets and
    one launch merging the key splits into the measures. ``config``: which kernels
    (whatif_config.py); ``fallbacks``: the run's record of kernels replaced (None: this call's own)."""
    g = _geometry(q, k, v, q_positions, k_start, window, scale, causal)
    keep = _keep_sets(keep, g)
    launch = _launcher(config, fallbacks)
    shape = (keep.shape[0], g.B, g.Hq, g.Tq)
    measured = _pieces_measures(q, k, v, keep, g, num_splits, config, launch)
    if measured is not None:
        return measured
    plan = _keep_plan(q, k, v, keep, g, num_splits, config, launch) if keep.shape[0] else None
    if plan is None:  # no sets, queries or keys: recall 0, error NaN (||o|| = 0)
        recall = torch.zeros(shape, dtype=torch.float32, device=q.device)
        return recall, torch.full_like(recall, float("nan"))
    recall = torch.empty(shape, dtype=torch.float32, device=q.device)
    err = torch.empty_like(recall)
    plan.measures_into(recall, err)
    return recall, err


def keep_kernels_only(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, **kw):
    """For benchmarks: a callable running only the two launches of ``keep_measures_triton`` (key
    pass, split merge) on inputs checked, converted and buffers allocated once, here."""
    num_splits = kw.pop("num_splits", None)
    config = kw.pop("config", DEFAULT_CONFIG)
    launch = _launcher(config, kw.pop("fallbacks", None))
    g = _geometry(q, k, v, kw.pop("q_positions", None), kw.pop("k_start", 0), kw.pop("window", None),
                  kw.pop("scale", None), kw.pop("causal", True))
    keep = _keep_sets(keep, g)
    pieces = _pieces_runner(q, k, v, keep, g, num_splits, config, launch)
    if pieces is not None:
        return pieces
    plan = _keep_plan(q, k, v, keep, g, num_splits, config, launch)
    recall = torch.empty(keep.shape[0], g.B, g.Hq, g.Tq, dtype=torch.float32, device=q.device)
    err = torch.empty_like(recall)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        plan.measures_into(recall, err)
        return recall, err

    return run


def keep_measures(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, *,
    q_positions: torch.Tensor | Sequence[int] | None = None, k_start: int = 0, window: int | None = None,
    scale: float | None = None, causal: bool = True, backend: str = "auto",
    config: KernelConfig = DEFAULT_CONFIG, fallbacks: KernelFallbacks | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(recall, error) ``[S, B, Hq, Tq]`` for S keep-sets (module docstring); ``config`` and
    ``fallbacks`` as :func:`keep_measures_triton`'s (the torch path ignores them)."""
    kw = dict(q_positions=q_positions, k_start=k_start, window=window, scale=scale, causal=causal)
    if resolve_backend(backend, q) == "triton":
        return keep_measures_triton(q, k, v, keep, **kw, config=config, fallbacks=fallbacks)
    return keep_measures_reference(q, k, v, keep, **kw)


def output_error(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k2: torch.Tensor, v2: torch.Tensor, *,
    q_positions: torch.Tensor | Sequence[int] | None = None, k_start: int = 0, window: int | None = None,
    scale: float | None = None, causal: bool = True, backend: str = "auto",
    config: KernelConfig = DEFAULT_CONFIG, fallbacks: KernelFallbacks | None = None,
) -> torch.Tensor:
    """``||o' - o|| / ||o||`` ``[B, Hq, Tq]`` of attention over (k2, v2) (e.g. dequantised)
    against (k, v), every visible key kept; ``config`` and ``fallbacks`` as
    :func:`keep_measures_triton`'s."""
    g = _geometry(q, k, v, q_positions, k_start, window, scale, causal)
    if k2.shape != k.shape or v2.shape != v.shape:
        raise ValueError("k2, v2 must have the shapes of k, v")
    if resolve_backend(backend, q) == "triton":
        launch = _launcher(config, fallbacks)
        none = torch.zeros(0, g.B, g.Hk, g.T, dtype=torch.int8, device=q.device)  # set 0 (every key) only
        o = _merged_states(_partials_triton(q, k, v, none, g, None, config, launch), g, 1, v.shape[3], q.device)[2][0]
        o2 = _merged_states(_partials_triton(q, k2, v2, none, g, None, config, launch), g, 1, v2.shape[3],
                            q.device)[2][0]
        return _rel_error(o2, o)
    dt = torch.float64
    vis = _visible(g, q.device)

    def out(kx: torch.Tensor, vx: torch.Tensor) -> torch.Tensor:
        logits = torch.matmul(q.to(dt), kx.to(dt).repeat_interleave(g.group, dim=1).transpose(-1, -2)) * g.scale
        p = _masked_softmax(logits, vis[None, None].expand_as(logits))
        return torch.matmul(p, vx.to(dt).repeat_interleave(g.group, dim=1))

    return _rel_error(out(k2, v2), out(k, v))


# ------------------------------------------------------------------------------ quantisation


@dataclass(frozen=True)
class QuantSpec:
    """One quantise-dequantise round trip of K or V ``[B, H, T, D]``.

    ``kind`` "minmax": asymmetric round-to-nearest with a scale and zero per group of ``group``
    consecutive elements along ``axis`` ("channel": groups of channels within a token, the
    quanto/HQQ layout and KIVI values; "token": groups of tokens within a channel, KIVI keys), the
    last group possibly shorter. ``kind`` "fp8": nearest fp8 value with ``man`` mantissa bits,
    minimum normal exponent ``emin``, saturating at ``top``. The last ``residual`` tokens stay
    exact (full-precision window)."""

    kind: str = "minmax"
    bits: int = 8
    axis: str = "channel"
    group: int = 64
    residual: int = 0
    man: int = 3
    emin: int = -6
    top: float = 448.0

    def __post_init__(self) -> None:
        if self.kind not in ("minmax", "fp8"):
            raise ValueError(f"kind must be minmax or fp8, got {self.kind!r}")
        if self.axis not in ("channel", "token"):
            raise ValueError(f"axis must be channel or token, got {self.axis!r}")
        if self.kind == "minmax" and not (1 <= self.bits <= 8 and self.group >= 1):
            raise ValueError(f"minmax needs 1 <= bits <= 8 and group >= 1, got {self.bits}, {self.group}")
        if self.residual < 0:
            raise ValueError(f"residual must be >= 0, got {self.residual}")


def _minmax_last(g: torch.Tensor, levels: int) -> torch.Tensor:
    """Round trip with one scale and zero per row of the last dim."""
    lo = g.amin(dim=-1, keepdim=True)
    scale = (g.amax(dim=-1, keepdim=True) - lo) / levels
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.clamp(torch.round((g - lo) / safe), 0, levels) * scale + lo


def _minmax(x: torch.Tensor, bits: int, dim: int, group: int) -> torch.Tensor:
    """Groups of ``group`` along ``dim`` from its start (the last one possibly shorter)."""
    x = x.movedim(dim, -1)
    lead, n = x.shape[:-1], x.shape[-1]
    full = n // group * group
    levels = (1 << bits) - 1
    parts = []
    if full:
        parts.append(_minmax_last(x[..., :full].reshape(*lead, full // group, group), levels).reshape(*lead, full))
    if full < n:
        parts.append(_minmax_last(x[..., full:], levels))
    return torch.cat(parts, dim=-1).movedim(-1, dim)


def _fp8(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    x = torch.clamp(x, -spec.top, spec.top)
    ax = x.abs()
    e = torch.floor(torch.log2(torch.where(ax > 0, ax, torch.ones_like(ax))))
    quantum = torch.exp2(torch.clamp(e, min=spec.emin) - spec.man)
    return torch.clamp(torch.round(x / quantum) * quantum, -spec.top, spec.top)


def quant_roundtrip(x: torch.Tensor, spec: QuantSpec, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Dequantised ``x`` [B, H, T, D] in ``dtype`` (the plain-torch reference round trip)."""
    out = x.to(dtype).clone()
    T = x.shape[2]
    n = T - min(spec.residual, T)
    if n > 0:
        part = out[:, :, :n]
        if spec.kind == "fp8":
            out[:, :, :n] = _fp8(part, spec)
        else:
            out[:, :, :n] = _minmax(part, spec.bits, 2 if spec.axis == "token" else 3, spec.group)
    return out


def _per_head(x: torch.Tensor, xq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(MSE, mean cosine over tokens) per head, over the batch, tokens (and channels)."""
    a, b = x.to(torch.float64), xq.to(torch.float64)
    mse = ((a - b) ** 2).mean(dim=(0, 2, 3))
    na, nb = torch.linalg.vector_norm(a, dim=-1), torch.linalg.vector_norm(b, dim=-1)
    ok = (na > 0) & (nb > 0)
    cos = torch.where(ok, (a * b).sum(-1) / torch.where(ok, na * nb, torch.ones_like(na)), torch.zeros_like(na))
    n = ok.sum(dim=(0, 2)).to(torch.float64)
    return mse, torch.where(n > 0, cos.sum(dim=(0, 2)) / n.clamp(min=1), torch.full_like(n, float("nan")))


def quant_error_reference(x: torch.Tensor, spec: QuantSpec, dtype: torch.dtype = torch.float64
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(MSE, cosine) per head ``[H]`` float64, by materialising the round trip in ``dtype``."""
    return _per_head(x, quant_roundtrip(x, spec, dtype))


def quant_error_triton(x: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(MSE, cosine) per head ``[H]`` float64 from the fused kernel: the dequantised tensor stays
    in registers, quantisation and error sums in float64 as numerics.py (only the summation order
    differs)."""
    from kvtrace.kernels import _triton_whatif_quant as tq

    if x.dim() != 4:
        raise ValueError(f"x must be [B, H, T, D], got {tuple(x.shape)}")
    B, H, T, D = x.shape
    x = _last_contig(x, _kernel_dtype(x))
    n = T - min(spec.residual, T)
    # Few small ops after the launch: at 4k tokens they, not the kernel, were most of the time.
    if n > 0 and D > 0:
        mode = tq.MODE_FP8 if spec.kind == "fp8" else tq.MODE_TOKEN_GROUPS if spec.axis == "token" else tq.MODE_CHANNEL_GROUPS
        sms = _sms(x.device)
        n_prog, chunk = tq.quant_grid(n, mode, spec.group, lanes=B * H, sms=sms)
        parts = torch.empty(3, B * H * n_prog, dtype=torch.float64, device=x.device)
        tq.run_quant(x, parts[0], parts[1], parts[2], Tn=n, mode=mode, group=spec.group, chunk=chunk,
                     bits=spec.bits, fp8=(spec.man, spec.emin, spec.top))
        sums = parts.view(3, B, H, n_prog).sum(dim=(1, 3))  # (sse, cosine sum, count) per head
    else:
        sums = torch.zeros(3, H, dtype=torch.float64, device=x.device)
    if n < T:  # residual tokens are exact: error 0, cosine 1 wherever the token is not all zero
        sums[1:] += x[:, :, n:].ne(0).any(dim=-1).sum(dim=(0, 2))
    mse = sums[0] / (B * T * D) if B * T * D else torch.full_like(sums[0], float("nan"))
    return mse, sums[1] / sums[2]  # count 0 -> cosine sum 0: 0 / 0 = NaN, as the reference says


def quant_error(x: torch.Tensor, spec: QuantSpec, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(MSE, mean cosine) per head ``[H]`` of ``spec``'s round trip of ``x`` [B, H, T, D]."""
    if resolve_backend(backend, x) == "triton":
        return quant_error_triton(x, spec)
    return quant_error_reference(x, spec)
