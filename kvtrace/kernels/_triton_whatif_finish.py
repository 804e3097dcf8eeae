"""The split merge of the keep-set kernels' partial states into recall and output error (the
overview is kvtrace/kernels/_triton_whatif.py). Imported lazily.

``_keep_finish_kernel``: one program per (output row, keep-set), merging the key splits of set 0
(every key) and of the set, then recall ``exp(m_s - m_0) l_s / l_0`` and error
``||o_s - o_0|| / ||o_0||``. After the shared-max kernel (``check``) a set whose mass underflowed
against the shared max is recomputed exactly for that row with its own max (``_exact_row``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvtrace.kernels._env import interpreting
from kvtrace.kernels._triton_attention import _scaled
from kvtrace.kernels._triton_whatif import INTERP_BLOCK_N
from kvtrace.kernels._triton_whatif_launch import Launcher


@triton.jit
def _merge_chunk(m, lsum, acc, PM, PL, PACC, base, j0, n_splits, offs_s, offs_dv, dv_ok, DV):
    """Fold key splits ``j0 .. j0 + BLOCK_S`` of one row's partial states (at ``base``) into the
    running (m, lsum, acc) -- scalars and a [BLOCK_DV] vector."""
    js = j0 + offs_s
    ok = js < n_splits
    mj = tl.load(PM + base + js, mask=ok, other=float("-inf"))
    lj = tl.load(PL + base + js, mask=ok, other=0.0)
    aj = tl.load(PACC + (base + js)[:, None] * DV + offs_dv[None, :], mask=ok[:, None] & dv_ok[None, :], other=0.0)
    m_new = tl.maximum(m, tl.max(mj, axis=0))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no inf - inf where nothing was used yet
    a = tl.exp(m - m_use)
    w = tl.exp(mj - m_use)  # 0 for splits that used no key
    return m_new, a * lsum + tl.sum(w * lj, axis=0), acc * a + tl.sum(w[:, None] * aj, axis=0)


@triton.jit
def _exact_row(Q, K, V, KEEP, row, s, R, Hq, Tq, Tk, GROUP, D, DV, scale, k_start, window, QPOS, m, lsum, acc,
               CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, ROUNDED: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """(m, l, acc) of output row ``row`` over the visible keys keep-set ``s`` keeps, with the set's
    own running max, in fp32 on the CUDA cores: the rare row whose set underflowed against the
    shared max. Folded into the given (empty) state."""
    qi = row % Tq
    h = (row // Tq) % Hq
    head = (row // (Tq * Hq)) * (Hq // GROUP) + h // GROUP  # b * Hk + KV head
    pos = tl.load(QPOS + qi).to(tl.int32) - k_start
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + row.to(tl.int64) * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    lo = 0
    hi = Tk
    if CAUSAL:
        hi = tl.minimum(hi, pos + 1)
    if HAS_WINDOW:
        lo = tl.maximum(lo, pos - window + 1)
    keep_row = KEEP + ((tl.cast(s, tl.int64) - 1) * (R // (Tq * Hq)) * (Hq // GROUP) + head) * Tk
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        k = tl.load(K + (head * Tk + offs_n[:, None]).to(tl.int64) * D + offs_d[None, :],
                    mask=n_ok[:, None] & (offs_d < D)[None, :], other=0.0).to(tl.float32)
        sc = _scaled(tl.sum(k * q[None, :], axis=1), scale, ROUNDED)
        kept = tl.load(keep_row + offs_n, mask=n_ok, other=0) != 0
        sc = tl.where(kept & n_ok, sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp(m - m_use)
        p = tl.exp(sc - m_use)
        v = tl.load(V + (head * Tk + offs_n[:, None]).to(tl.int64) * DV + offs_dv[None, :],
                    mask=n_ok[:, None] & (offs_dv < DV)[None, :], other=0.0).to(tl.float32)
        lsum = a * lsum + tl.sum(p, axis=0)
        acc = acc * a + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    return m, lsum, acc


# A keep-set's mass below this, against the shared max (where the full attention's mass is >= 1),
# is recomputed with the set's own max: its terms sit >= 27 nats below the max, where the shared
# max would cost them relative precision (~|s - max| * 6e-8 each) or flush them to zero.
UNDERFLOW = 2.0 ** -40


@triton.jit
def _keep_finish_kernel(PM, PL, PACC, RECALL, ERR, R, S1, DV, n_splits,
                        Q, K, V, KEEP, QPOS, Hq, Tq, Tk, GROUP, D, scale, k_start, window,
                        CHECK: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, ROUNDED: tl.constexpr,
                        UNDER: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_DV: tl.constexpr):
    """One program per (output row, keep-set s >= 1): merge the key splits of set 0 (all keys) and
    of set s, BLOCK_S splits a step, then recall = exp(m_s - m_0) l_s / l_0 and error =
    ||o_s - o_0|| / ||o_0||. (A program per row looping over the sets left a decode step's 32 rows
    with 10 x 32 dependent merges each: 26 us on the H200, most of it latency.) ``CHECK`` (partial
    states of the shared-max kernel): a set whose mass underflowed (l_s < UNDER) is recomputed
    exactly for this row (``_exact_row``)."""
    row = tl.program_id(0)
    s = tl.program_id(1) + 1
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV
    neg = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), axis=0)  # fp32 scalars for the loops
    zero = tl.sum(tl.zeros([BLOCK_S], dtype=tl.float32), axis=0)
    m0, l0, a0 = neg, zero, tl.zeros([BLOCK_DV], dtype=tl.float32)
    base0 = row.to(tl.int64) * n_splits  # partials laid out [S1, R, n_splits] (x DV)
    for j0 in range(0, n_splits, BLOCK_S):
        m0, l0, a0 = _merge_chunk(m0, l0, a0, PM, PL, PACC, base0, j0, n_splits, offs_s, offs_dv, dv_ok, DV)
    o0 = a0 / tl.where(l0 > 0, l0, 1.0)  # 0 where no key was visible (acc 0)
    den = tl.sqrt(tl.sum(o0 * o0, axis=0))
    ms, ls, acc_s = neg, zero, tl.zeros([BLOCK_DV], dtype=tl.float32)
    bases = (tl.cast(s, tl.int64) * R + row) * n_splits
    for j0 in range(0, n_splits, BLOCK_S):
        ms, ls, acc_s = _merge_chunk(ms, ls, acc_s, PM, PL, PACC, bases, j0, n_splits, offs_s, offs_dv, dv_ok, DV)
    if CHECK:
        if (l0 > 0) & (ls * tl.exp(tl.where(l0 > 0, ms - m0, 0.0)) < UNDER):
            ms, ls, acc_s = _exact_row(Q, K, V, KEEP, row, s, R, Hq, Tq, Tk, GROUP, D, DV, scale, k_start,
                                       window, QPOS, neg, zero, tl.zeros([BLOCK_DV], dtype=tl.float32), CAUSAL,
                                       HAS_WINDOW, ROUNDED, BLOCK_N, BLOCK_D, BLOCK_DV)
    o_s = acc_s / tl.where(ls > 0, ls, 1.0)
    both = (ls > 0) & (l0 > 0)
    recall = tl.where(both, tl.exp(tl.where(both, ms - m0, 0.0)) * ls / tl.where(l0 > 0, l0, 1.0), 0.0)
    d = o_s - o0
    err = tl.where(den > 0, tl.sqrt(tl.sum(d * d, axis=0)) / tl.where(den > 0, den, 1.0), float("nan"))
    out = (tl.cast(s, tl.int64) - 1) * R + row
    tl.store(RECALL + out, recall)
    tl.store(ERR + out, err)


def run_keep_finish(pm, pl, pacc, recall, err, *, rows: int, dv: int, n_splits: int, check: bool = False,
                    q=None, k=None, v=None, keep=None, qpos=None, group: int = 1, scale: float = 1.0,
                    k_start: int = 0, window: int | None = None, causal: bool = True,
                    launch: Launcher | None = None) -> None:
    """Merge the partial states of ``run_keep`` ([S1, rows, n_splits], acc x dv) into recall and
    error [S1 - 1, rows] fp32. ``check``: the states came from the shared-max kernel; rows whose
    set underflowed are recomputed from q, k, v, keep, qpos (``run_keep``'s inputs)."""
    n_sets = recall.shape[0]
    if n_sets == 0 or rows == 0:
        return
    block_dv = max(16, triton.next_power_of_2(dv))
    # The interpreter takes 2 splits a step (exercises the loop and its masking).
    block_s = 2 if interpreting() else max(2, min(32, triton.next_power_of_2(n_splits)))
    if check:
        _, Hq, Tq, D = q.shape
        extra = (q, k, v, keep, qpos, Hq, Tq, k.shape[2], group, D, float(scale), int(k_start), int(window or 0))
        block_d = max(16, triton.next_power_of_2(D))
    else:  # never read (CHECK off)
        extra = (pm, pm, pm, pm, pm, 1, 1, 1, 1, 1, 1.0, 0, 0)
        block_d = 16
    (launch or Launcher())("finish", _keep_finish_kernel, (rows, n_sets),
                           (pm, pl, pacc, recall, err, rows, n_sets + 1, dv, n_splits, *extra),
                           dict(CHECK=bool(check), CAUSAL=bool(causal), HAS_WINDOW=window is not None, ROUNDED=not interpreting(),
                 UNDER=UNDERFLOW, BLOCK_S=block_s, BLOCK_N=INTERP_BLOCK_N if interpreting() else 32, BLOCK_D=block_d,
                 BLOCK_DV=block_dv, num_warps=4))
