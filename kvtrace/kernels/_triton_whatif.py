"""Triton kernels of the what-if replay (kvtrace/kernels/whatif.py dispatches). Imported lazily.

Keep-set attention: many candidate keep-sets in one pass over the keys. One program per (block
of rows, batch * KV head, key split): its rows are queries of all the query heads that read this
KV head (GQA: K and V are loaded once for the group), times keep-sets. Per row it keeps an
online-softmax state over the keys that are visible AND kept by the row's set: running max ``m``,
``l = sum exp(s - m)`` and ``acc = sum exp(s - m) v``; ``_keep_finish_kernel`` merges the key
splits' partial states. Set 0 is "keep every key" (the full attention), so mass recall
``exp(m_s - m_0) l_s / l_0`` and the output error follow from the merged states alone. Nothing of
size rows x keys x sets is formed: memory O(rows * sets * splits * Dv). The packed and shared kernels share
their prologue (``_program``) and loads.

* ``_keep_fma_kernel`` (fewer than 16 query rows per KV head: a decode step's samples; the
  default there, ``whatif.EXACT_DECODE``): fp32 arithmetic on the CUDA cores for any input dtype,
  so exact whatever grid the values sit on -- no bf16-grid check pass over K/V and no host sync
  before the launch. The KV head's queries score each key block once (broadcast products summed
  over head-dim chunks); the scores are broadcast to the rows, (set, query) pairs set-major, each
  with its own running max; ``p @ V`` is one fp32 FMA dot per block.
* ``_keep_packed_kernel`` (the same rows on the tensor cores, after the grid check: bf16 dots for
  bf16-grid values, 3xTF32 otherwise): rows are dense (set, query) pairs, each scoring the keys
  itself with its own running max (no padding rows). The exact kernel's fallback.
* ``_keep_shared_kernel`` (more queries, where the signature-pieces path of
  kvtrace/kernels/whatif_pieces.py -- one attention pass for all sets, keys grouped by which sets
  keep them -- does not pay for its plan): BLOCK_M query rows score a key block once and take ONE
  running max per row, the full attention's, which every set shares (a set is a subset of the
  keys): the exponentials and the bf16 split of p are computed once, then SETS keep-sets mask p
  into one [SETS * BLOCK_M, BLOCK_N] @ V dot per part. A set whose kept keys all sit >= ~27 nats
  below the row max would lose precision or underflow there: the finish kernel sees its small
  mass (``UNDERFLOW``) and recomputes that (row, set) exactly with its own max (``_exact_row``).

``_grid_check_kernel`` -- one pass over fp32 q, k, v (whether they hold bf16 values: then the
keep kernels read them as bf16) and the query positions (the int32 bound), one launch and one
host sync per call. Before the exact kernel it reads the positions only, and the bound is read
after the launches.

``_quant_kernel`` -- min-max (or fp8) quantise-dequantise of K or V in registers, returning per
(batch * head, program) the sum of squared errors and the sum and count of per-token cosines; the
dequantised tensor never reaches memory. Rounding and sums are float64 (numerics.py's formula):
the kernel is memory-bound, and fp32 would break the many rounding ties of bf16/fp16-grid data
differently from the reference.

Precision: the exact kernel computes in fp32 throughout (IEEE products and sums). Elsewhere
scores are fp32 dots (16-bit inputs: exact products, fp32 accumulation; fp32 inputs:
``tf32x3``, about fp32 accuracy, on the GPU); ``p @ V`` takes fp32 ``p`` and fp32 ``V`` with
``tf32x3`` on the GPU, so outputs carry ~1e-6 relative error, far below the errors being measured.
The interpreter computes in numpy fp32 throughout.
"""

from __future__ import annotations

from functools import cache

import triton
import triton.language as tl

from kvtrace.kernels._env import interpreting
from kvtrace.kernels._triton_attention import _scaled

# The interpreter runs small tiles (fast on CPU, and exercises the masking paths).
INTERP_ROWS = 16
INTERP_BLOCK_M = 16
INTERP_SETS = 2
INTERP_BLOCK_N = 16
INTERP_BLOCK_T = 16
# Key splits are a multiple of the largest BLOCK_N an autotuned config may use.
MAX_BLOCK_N = 128
# Query positions (relative to the keys) the int32 kernels take: |p| below this (whatif._LIMIT).
POSITION_LIMIT = 2**29


# ------------------------------------------------------------------------------ launching

# Launch compiled kernels directly after their first call (a switch for the benchmark's comparison).
DIRECT_LAUNCH = True
_COMPILED: dict = {}


def _spec(x) -> object:
    """What Triton specialises a runtime argument on (dtype and 16-byte alignment of a tensor; an
    int's ==1, %16 and 32/64-bit class), or a little more: a key that never maps two different
    compilations to one entry."""
    if isinstance(x, bool):
        return ("b", x)
    if isinstance(x, int):
        return (x == 1, x % 16 == 0, -2**31 <= x < 2**31)
    if isinstance(x, float):
        return "f"
    return (x.dtype, x.data_ptr() % 16 == 0)


def _launch(tag: str, fn, grid, args: tuple, consts: dict) -> None:
    """``fn[grid](*args, **consts)`` -- on CUDA, after the first call for this specialisation, through
    the compiled kernel's own launcher: Triton's call path (argument binding, cache key, autotuner
    lookup) cost ~50 us of Python per launch on the H200's host, several times a decode step's
    kernel. ``grid``: a tuple or a callable of the constexprs (the autotuner's choice included);
    ``args``: the kernel's runtime arguments in signature order, ``consts`` its constexprs."""
    global DIRECT_LAUNCH
    if interpreting() or not DIRECT_LAUNCH or not hasattr(triton, "knobs"):  # knobs: triton >= 3.4
        fn[grid](*args, **consts)
        return
    key = (tag, *map(_spec, args), *consts.items())
    hit = _COMPILED.get(key)
    if hit is None:
        compiled = fn[grid](*args, **consts)  # compiles (and autotunes) on the first call
        meta = dict(consts)
        if isinstance(fn, triton.runtime.Autotuner):
            meta.update(fn.best_config.kwargs)
        names = fn.arg_names[len(args):]  # the constexprs trail every kernel's runtime arguments
        if compiled is not None and hasattr(compiled, "packed_metadata"):
            _COMPILED[key] = (compiled, meta, tuple(meta[n] for n in names))
        return
    compiled, meta, tail = hit
    g = grid(meta) if callable(grid) else grid
    g = (*g, 1, 1)
    knobs = triton.knobs.runtime
    stream = triton.runtime.driver.active.get_current_stream(triton.runtime.driver.active.get_current_device())
    full = (*args, *tail)
    try:  # as JITFunction.run launches in triton 3.6 (every argument, constexprs included)
        compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata,
                     compiled.launch_metadata(g, stream, *full), knobs.launch_enter_hook, knobs.launch_exit_hook,
                     *full)
    except (TypeError, AttributeError) as exc:  # a Triton whose launcher differs: its own call path
        DIRECT_LAUNCH = False
        FALLBACKS.append(f"direct launches unavailable ({type(exc).__name__}: {str(exc)[:200]}); Triton's call path")
        fn[grid](*args, **consts)


@triton.jit
def _key_range(pid_split, keys_per_split, Tk, pos, valid, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Keys of this split, clipped to what some valid row (at ``pos``) can see."""
    lo = pid_split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, Tk)
    if CAUSAL:
        hi = tl.minimum(hi, tl.max(tl.where(valid, pos, -1), axis=0) + 1)
    if HAS_WINDOW:
        first = tl.min(tl.where(valid, pos, Tk + window), axis=0) - window + 1
        lo = tl.maximum(lo, (tl.maximum(first, 0) // BLOCK_N) * BLOCK_N)
    return lo, hi


@triton.jit
def _visible(offs_n, n_valid, pos, valid, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """[rows, keys] visibility of key offsets ``offs_n`` to rows at ``pos`` (relative positions)."""
    vis = valid[:, None] & n_valid[None, :]
    if CAUSAL:
        vis = vis & (offs_n[None, :] <= pos[:, None])
    if HAS_WINDOW:
        vis = vis & (offs_n[None, :] > pos[:, None] - window)
    return vis


@triton.jit
def _rows(vq, kvh, b, Hq, Tq, GROUP, QPOS, k_start, valid):
    """Virtual query ``vq`` of KV head ``kvh`` -> (query head, query index, relative position,
    row offset of its outputs in [B * Hq, Tq])."""
    h = kvh * GROUP + vq // Tq
    qi = vq % Tq
    pos = tl.load(QPOS + qi, mask=valid, other=0).to(tl.int32) - k_start  # int64 positions, < 2**29
    return h, qi, pos, (b * Hq + h).to(tl.int64) * Tq + qi


@triton.jit
def _load_q(Q, qrow, D, offs_d, valid, d_valid, CAST_Q: tl.constexpr, DOT_F32: tl.constexpr):
    """Query rows [rows, BLOCK_D] at row offsets ``qrow`` of the contiguous Q (a gather); ``CAST_Q``:
    fp32 holding bf16 values, cast to bf16 (exact)."""
    q = tl.load(Q + qrow[:, None] * D + offs_d[None, :], mask=valid[:, None] & d_valid[None, :], other=0.0)
    if CAST_Q:
        q = q.to(tl.bfloat16)
    if DOT_F32:
        q = q.to(tl.float32)
    return q


@triton.jit
def _load_kv(k_base, v_base, offs_n, n_valid, D, DV, offs_d, d_valid, offs_dv, dv_valid, DOT_F32: tl.constexpr,
             CAST_K: tl.constexpr, CAST_V: tl.constexpr):
    """A key block transposed [BLOCK_D, BLOCK_N] (dot operand dtype) and its values [BLOCK_N, BLOCK_DV]
    (as stored, or bf16) of contiguous K/V rows. ``CAST_K``/``CAST_V``: fp32 memory holding bf16
    values (recorded bf16 upcast), cast to bf16 in registers -- exact, and no converted copy of K/V
    in memory."""
    kt = tl.load(k_base + offs_n[None, :].to(tl.int64) * D + offs_d[:, None],
                 mask=n_valid[None, :] & d_valid[:, None], other=0.0)
    if CAST_K:
        kt = kt.to(tl.bfloat16)
    if DOT_F32:
        kt = kt.to(tl.float32)
    v = tl.load(v_base + offs_n[:, None].to(tl.int64) * DV + offs_dv[None, :],
                mask=n_valid[:, None] & dv_valid[None, :], other=0.0)
    if CAST_V:
        v = v.to(tl.bfloat16)
    return kt, v


@triton.jit
def _pv(acc, p, v, PV_SPLIT: tl.constexpr, DOT_F32: tl.constexpr, PREC_PV: tl.constexpr):
    """acc + p @ v to about fp32 accuracy. ``PV_SPLIT`` (bf16 V): p = hi + mid + lo, three bf16
    parts holding its 24 bits, each a bf16 tensor-core dot against the exact V (half the cost of
    3xTF32). Else V in fp32 and a ``PREC_PV`` dot."""
    if PV_SPLIT:
        hi = p.to(tl.bfloat16)
        r = p - hi.to(tl.float32)  # exact: hi is p's leading 8 bits
        mid = r.to(tl.bfloat16)
        lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
        if DOT_F32:  # the interpreter: same parts, fp32 products (it mis-computes bf16 dots)
            vf = v.to(tl.float32)
            acc = tl.dot(lo.to(tl.float32), vf, acc, input_precision="ieee")
            acc = tl.dot(mid.to(tl.float32), vf, acc, input_precision="ieee")
            acc = tl.dot(hi.to(tl.float32), vf, acc, input_precision="ieee")
        else:
            acc = tl.dot(lo, v, acc)
            acc = tl.dot(mid, v, acc)
            acc = tl.dot(hi, v, acc)
        return acc
    else:
        return tl.dot(p, v.to(tl.float32), acc, input_precision=PREC_PV)


@triton.jit
def _grid_free(x):
    """Whether every value of the fp32 tile ``x`` is a bf16 value (low 16 bits zero; masked-off
    elements load as 0)."""
    return tl.max(tl.max(x.to(tl.int32, bitcast=True) & 0xFFFF, axis=1), axis=0) == 0


@triton.jit
def _qk_auto(q, kt, q_on, DOT_F32: tl.constexpr, PREC_QK: tl.constexpr):
    """q @ kt of fp32 tiles, decided per key block: both on the bf16 grid -> one bf16 tensor-core
    dot (exact products, fp32 sums), else ``PREC_QK`` (3xTF32). Either is about fp32-exact."""
    if q_on & _grid_free(kt):
        if DOT_F32:  # the interpreter: same values, fp32 products
            s = tl.dot(q.to(tl.bfloat16).to(tl.float32), kt.to(tl.bfloat16).to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q.to(tl.bfloat16), kt.to(tl.bfloat16))
    else:
        s = tl.dot(q, kt, input_precision=PREC_QK)
    return s


@triton.jit
def _pv_auto(acc, p, v, DOT_F32: tl.constexpr, PREC_PV: tl.constexpr):
    """``_pv`` for an fp32 value block, decided per block: on the bf16 grid, the split bf16 dots
    against V read as bf16; else a ``PREC_PV`` dot."""
    if _grid_free(v):
        acc = _pv(acc, p, v.to(tl.bfloat16), True, DOT_F32, PREC_PV)
    else:
        acc = _pv(acc, p, v, False, DOT_F32, PREC_PV)
    return acc


@triton.jit
def _softmax_step(m_i, l_i, s):
    """One key block of a row-wise online softmax over scores ``s`` [rows, keys] (-inf where not
    used): (new max, new sum, the old state's rescale factor, p = exp(s - new max))."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # Rows that have used no key yet keep m = -inf; shift by 0 there so no inf - inf.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_use)
    p = tl.exp(s - m_use[:, None])  # 0 where not used (s = -inf)
    return m_new, alpha * l_i + tl.sum(p, axis=1), alpha, p


@triton.jit
def _program(Q, K, V, QPOS, vq, valid, Hq, Tq, Tk, GROUP, D, DV, k_start, window, keys_per_split,
             dv_off, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, CAST_Q: tl.constexpr, DOT_F32: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """The prologue both keep kernels share: this program's (batch, KV head), its rows' positions
    and output rows, their queries, the K/V bases and the key range of its split; value columns
    ``dv_off .. dv_off + BLOCK_DV``."""
    Hk = Hq // GROUP
    b = tl.program_id(1) // Hk
    kvh = tl.program_id(1) % Hk
    _, _, pos, out_row = _rows(vq, kvh, b, Hq, Tq, GROUP, QPOS, k_start, valid)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = dv_off + tl.arange(0, BLOCK_DV)
    d_valid = offs_d < D
    dv_valid = offs_dv < DV
    q = _load_q(Q, out_row, D, offs_d, valid, d_valid, CAST_Q, DOT_F32)
    head = b.to(tl.int64) * Hk + kvh  # K/V/keep are contiguous [B, Hk, Tk, ...]
    k_base = K + head * Tk * D
    v_base = V + head * Tk * DV
    lo, hi = _key_range(tl.program_id(2), keys_per_split, Tk, pos, valid, window, CAUSAL, HAS_WINDOW, BLOCK_N)
    return head, pos, out_row, q, k_base, v_base, lo, hi, offs_d, d_valid, offs_dv, dv_valid


@triton.jit(do_not_specialize=["Tq", "Tk", "S", "k_start", "window", "keys_per_split"])
def _keep_packed_kernel(
    Q, K, V, KEEP, QPOS, PM, PL, PACC,
    Hq, Tq, Tk, S, GROUP, D, DV, scale, k_start, window, keys_per_split, n_splits,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_F32: tl.constexpr, PREC_QK: tl.constexpr,
    PREC_PV: tl.constexpr, PV_SPLIT: tl.constexpr, CAST_Q: tl.constexpr, CAST_K: tl.constexpr,
    CAST_V: tl.constexpr, ROUNDED: tl.constexpr, GRID_AUTO: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Few queries (a decode step): rows are dense (set, query head of the group, query) triples,
    each with its own score row and its own running max (scores recomputed per set; this case is
    memory-bound, and no padding rows). ``GRID_AUTO`` (fp32 q, k, v): whether a tile holds bf16
    values is decided per key block from the bits already loaded (``_qk_auto``, ``_pv_auto``), so
    no pass over K/V and no host sync come before the launch."""
    nvq = GROUP * Tq
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    valid = i < S * nvq
    row_s = i // nvq
    head, pos, out_row, q, k_base, v_base, lo, hi, offs_d, d_valid, offs_dv, dv_valid = _program(
        Q, K, V, QPOS, i % nvq, valid, Hq, Tq, Tk, GROUP, D, DV, k_start, window, keys_per_split, 0, CAUSAL,
        HAS_WINDOW, CAST_Q, DOT_F32, BLOCK_N, BLOCK_D, BLOCK_DV)
    # Set 0 keeps every key and has no row in KEEP (set s > 0 reads KEEP[s - 1]).
    keep_row = KEEP + ((row_s - 1).to(tl.int64) * tl.num_programs(1) + head) * Tk
    has_keep = valid & (row_s > 0)
    q_on = False
    if GRID_AUTO:
        q_on = _grid_free(q)

    m_i = tl.zeros([ROWS], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_DV], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < Tk
        kt, v = _load_kv(k_base, v_base, offs_n, n_valid, D, DV, offs_d, d_valid, offs_dv, dv_valid, DOT_F32,
                         CAST_K, CAST_V)
        if GRID_AUTO:
            s = _scaled(_qk_auto(q, kt, q_on, DOT_F32, PREC_QK), scale, ROUNDED)
        else:
            s = _scaled(tl.dot(q, kt, input_precision=PREC_QK), scale, ROUNDED)
        kept = tl.load(keep_row[:, None] + offs_n[None, :], mask=has_keep[:, None] & n_valid[None, :], other=1)
        use = (kept != 0) & _visible(offs_n, n_valid, pos, valid, window, CAUSAL, HAS_WINDOW)
        m_i, l_i, alpha, p = _softmax_step(m_i, l_i, tl.where(use, s, float("-inf")))
        if GRID_AUTO:
            acc = _pv_auto(acc * alpha[:, None], p, v, DOT_F32, PREC_PV)
        else:
            acc = _pv(acc * alpha[:, None], p, v, PV_SPLIT, DOT_F32, PREC_PV)

    # Partial states, laid out [S, B * Hq, Tq, n_splits] (and x DV for acc).
    out = (row_s.to(tl.int64) * tl.num_programs(1) * GROUP * Tq + out_row) * n_splits + tl.program_id(2)
    tl.store(PM + out, m_i, mask=valid)
    tl.store(PL + out, l_i, mask=valid)
    tl.store(PACC + out[:, None] * DV + offs_dv[None, :], acc, mask=valid[:, None] & dv_valid[None, :])


POS_CLAMP = tl.constexpr(2**30)


@triton.jit
def _scores_fma(Q, q_row, q_ok, k_base, offs_n, n_valid, D, scale, ROUNDED: tl.constexpr, BLOCK_D: tl.constexpr,
                CHUNK_D: tl.constexpr):
    """[queries, BLOCK_N] scores of the queries at row offsets ``q_row`` against a key block, as
    broadcast products summed on the CUDA cores, CHUNK_D dimensions a step (fp32 products and
    sums: exact for any input grid). The query chunks are reloaded per block (a few hundred bytes,
    cached) so no [queries, keys, BLOCK_D] product is ever live."""
    for c in tl.static_range(0, BLOCK_D, CHUNK_D):
        offs_c = c + tl.arange(0, CHUNK_D)
        c_ok = offs_c < D
        k = tl.load(k_base + offs_n[:, None].to(tl.int64) * D + offs_c[None, :], mask=n_valid[:, None] & c_ok[None, :],
                    other=0.0).to(tl.float32)
        q = tl.load(Q + q_row[:, None] * D + offs_c[None, :], mask=q_ok[:, None] & c_ok[None, :],
                    other=0.0).to(tl.float32)
        part = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        if c == 0:
            s = part
        else:
            s += part
    return _scaled(s, scale, ROUNDED)


@triton.jit(do_not_specialize=["Tq", "Tk", "S", "k_start", "window", "keys_per_split"])
def _keep_fma_kernel(
    Q, K, V, KEEP, QPOS, PM, PL, PACC,
    Hq, Tq, Tk, S, GROUP, D, DV, scale, k_start, window, keys_per_split, n_splits,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, ROUNDED: tl.constexpr, PREC_PV: tl.constexpr, GP: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Few queries (a decode step), exact for any input dtype and grid: fp32 arithmetic on the
    CUDA cores (no tensor cores, so no bf16-grid check and no host sync before the launch). The
    KV head's ``GROUP * Tq`` queries (padded to GP) score each key block ONCE; the scores are
    broadcast to SETS = ROWS // GP keep-sets, rows (set, query) set-major, each row with its own
    running max (exact for sets far below the row max); ``p @ V`` is one fp32 FMA dot per block.
    Program: (block of SETS sets, batch * KV head, key split)."""
    SETS: tl.constexpr = ROWS // GP
    nvq = GROUP * Tq
    vq = tl.arange(0, GP)
    q_ok = vq < nvq
    Hk = Hq // GROUP
    b = tl.program_id(1) // Hk
    kvh = tl.program_id(1) % Hk
    _, qi, _, q_row = _rows(vq, kvh, b, Hq, Tq, GROUP, QPOS, k_start, q_ok)
    # Positions relative to the keys, clamped in int64 to +-2**30 before int32 arithmetic: every
    # visibility decision stays the same (Tk and the window are below 2**29), so any int64
    # position works and nothing is checked before or after the launch.
    pos = tl.load(QPOS + qi, mask=q_ok, other=0) - k_start
    pos = tl.minimum(tl.maximum(pos, -POS_CLAMP), POS_CLAMP).to(tl.int32)
    head = b.to(tl.int64) * Hk + kvh  # K/V/keep are contiguous [B, Hk, Tk, ...]
    k_base = K + head * Tk * D
    v_base = V + head * Tk * DV
    lo, hi = _key_range(tl.program_id(2), keys_per_split, Tk, pos, q_ok, window, CAUSAL, HAS_WINDOW, BLOCK_N)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV
    sets = tl.program_id(0) * SETS + tl.arange(0, SETS)
    s_ok = sets < S
    # Set 0 keeps every key and has no row in KEEP (set s > 0 reads KEEP[s - 1]).
    keep_base = KEEP + ((sets - 1).to(tl.int64) * tl.num_programs(1) + head) * Tk
    has_keep = s_ok & (sets > 0)

    m_i = tl.zeros([ROWS], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_DV], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):  # per block: scores once per query, then every set's row
        offs_n = start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < Tk
        sc = _scores_fma(Q, q_row, q_ok, k_base, offs_n, n_valid, D, scale, ROUNDED, BLOCK_D, CHUNK_D)
        sc = tl.where(_visible(offs_n, n_valid, pos, q_ok, window, CAUSAL, HAS_WINDOW), sc, float("-inf"))
        kept = tl.load(keep_base[:, None] + offs_n[None, :], mask=has_keep[:, None] & n_valid[None, :], other=1) != 0
        s = tl.reshape(tl.where(kept[:, None, :], sc[None, :, :], float("-inf")), (ROWS, BLOCK_N))
        m_i, l_i, alpha, p = _softmax_step(m_i, l_i, s)
        v = tl.load(v_base + offs_n[:, None].to(tl.int64) * DV + offs_dv[None, :],
                    mask=n_valid[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PREC_PV)

    # Partial states, laid out [S, B * Hq, Tq, n_splits] (and x DV for acc), as the packed kernel's.
    out = tl.reshape(sets[:, None].to(tl.int64) * tl.num_programs(1) * nvq + q_row[None, :], (ROWS,)) * n_splits \
        + tl.program_id(2)
    ok = tl.reshape(s_ok[:, None] & q_ok[None, :], (ROWS,))
    tl.store(PM + out, m_i, mask=ok)
    tl.store(PL + out, l_i, mask=ok)
    tl.store(PACC + out[:, None] * DV + offs_dv[None, :], acc, mask=ok[:, None] & dv_ok[None, :])


@triton.jit
def _masked_rows(x, kept, SETS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[SETS * BLOCK_M, BLOCK_N]: the rows of x [BLOCK_M, BLOCK_N] once per set, zero at the keys
    the set drops (exact for any dtype)."""
    x3 = tl.where(kept[:, None, :], x[None, :, :], tl.zeros_like(x)[None, :, :])
    return tl.reshape(x3, (SETS * BLOCK_M, BLOCK_N))


@triton.jit
def _pv_sets(acc, p, kept, v, SETS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             PV_SPLIT: tl.constexpr, DOT_F32: tl.constexpr, PREC_PV: tl.constexpr):
    """acc [SETS * BLOCK_M, DV] + every set's masked p @ v in one stacked dot per part. p is split
    (bf16 V: hi + mid + lo, see ``_pv``) once for all sets; masking a part is exact."""
    if PV_SPLIT:
        hi = p.to(tl.bfloat16)
        r = p - hi.to(tl.float32)
        mid = r.to(tl.bfloat16)
        lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
        if DOT_F32:  # the interpreter: same parts, fp32 products
            vf = v.to(tl.float32)
            acc = tl.dot(_masked_rows(lo.to(tl.float32), kept, SETS, BLOCK_M, BLOCK_N), vf, acc, input_precision="ieee")
            acc = tl.dot(_masked_rows(mid.to(tl.float32), kept, SETS, BLOCK_M, BLOCK_N), vf, acc,
                         input_precision="ieee")
            acc = tl.dot(_masked_rows(hi.to(tl.float32), kept, SETS, BLOCK_M, BLOCK_N), vf, acc, input_precision="ieee")
        else:
            acc = tl.dot(_masked_rows(lo, kept, SETS, BLOCK_M, BLOCK_N), v, acc)
            acc = tl.dot(_masked_rows(mid, kept, SETS, BLOCK_M, BLOCK_N), v, acc)
            acc = tl.dot(_masked_rows(hi, kept, SETS, BLOCK_M, BLOCK_N), v, acc)
        return acc
    else:
        return tl.dot(_masked_rows(p, kept, SETS, BLOCK_M, BLOCK_N), v.to(tl.float32), acc, input_precision=PREC_PV)


@triton.jit(do_not_specialize=["Tq", "Tk", "S", "k_start", "window", "keys_per_split"])
def _keep_shared_kernel(
    Q, K, V, KEEP, QPOS, PM, PL, PACC,
    Hq, Tq, Tk, S, GROUP, D, DV, scale, k_start, window, keys_per_split, n_splits,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_F32: tl.constexpr, PREC_QK: tl.constexpr,
    PREC_PV: tl.constexpr, PV_SPLIT: tl.constexpr, CAST_Q: tl.constexpr, CAST_K: tl.constexpr,
    CAST_V: tl.constexpr, ROUNDED: tl.constexpr, BLOCK_M: tl.constexpr, SETS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, DV_PARTS: tl.constexpr,
):
    """Many queries: BLOCK_M query rows (of the KV head's query heads) score a key block once and
    take one running max per row -- the full attention's, which every keep-set (a subset of the
    keys) shares -- so the exponentials and the split of p are computed once for all sets; SETS
    keep-sets then mask p ([SETS, BLOCK_M, BLOCK_N]) into one [SETS * BLOCK_M, BLOCK_N] @ V dot
    per part. A set whose kept keys all sit far below the row max underflows here; the finish
    kernel detects it (l below ``UNDERFLOW``) and recomputes that row exactly. ``DV_PARTS``: the
    value columns split over that many programs (each recomputes the scores): fewer accumulator
    registers per program."""
    nvq = GROUP * Tq
    n_mblocks = tl.cdiv(nvq, BLOCK_M)
    n_sblocks = tl.cdiv(S, SETS)
    pid0 = tl.program_id(0)
    vq = (pid0 % n_mblocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = vq < nvq
    head, pos, out_row, q, k_base, v_base, lo, hi, offs_d, d_valid, offs_dv, dv_valid = _program(
        Q, K, V, QPOS, vq, valid, Hq, Tq, Tk, GROUP, D, DV, k_start, window, keys_per_split,
        (pid0 // (n_mblocks * n_sblocks)) * (BLOCK_DV // DV_PARTS), CAUSAL, HAS_WINDOW, CAST_Q, DOT_F32, BLOCK_N,
        BLOCK_D, BLOCK_DV // DV_PARTS)
    sets = ((pid0 // n_mblocks) % n_sblocks) * SETS + tl.arange(0, SETS)
    s_valid = sets < S
    keep_base = KEEP + ((sets - 1).to(tl.int64) * tl.num_programs(1) + head) * Tk
    has_keep = s_valid & (sets > 0)  # set 0: every key

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([SETS, BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([SETS * BLOCK_M, BLOCK_DV // DV_PARTS], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < Tk
        kt, v = _load_kv(k_base, v_base, offs_n, n_valid, D, DV, offs_d, d_valid, offs_dv, dv_valid, DOT_F32,
                         CAST_K, CAST_V)
        s = _scaled(tl.dot(q, kt, input_precision=PREC_QK), scale, ROUNDED)
        s = tl.where(_visible(offs_n, n_valid, pos, valid, window, CAUSAL, HAS_WINDOW), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])  # [BLOCK_M, BLOCK_N], 0 where not visible
        kept = tl.load(keep_base[:, None] + offs_n[None, :], mask=has_keep[:, None] & n_valid[None, :], other=1) != 0
        l_i = alpha[None, :] * l_i + tl.sum(tl.where(kept[:, None, :], p[None, :, :], 0.0), axis=2)
        a_rows = tl.reshape(tl.broadcast_to(alpha[None, :], (SETS, BLOCK_M)), (SETS * BLOCK_M,))
        acc = _pv_sets(acc * a_rows[:, None], p, kept, v, SETS, BLOCK_M, BLOCK_N, PV_SPLIT, DOT_F32, PREC_PV)
        m_i = m_new

    out = (sets[:, None].to(tl.int64) * tl.num_programs(1) * GROUP * Tq + out_row[None, :]) * n_splits \
        + tl.program_id(2)
    ok = s_valid[:, None] & valid[None, :]
    tl.store(PM + out, tl.broadcast_to(m_i[None, :], (SETS, BLOCK_M)), mask=ok)
    tl.store(PL + out, l_i, mask=ok)
    out1 = tl.reshape(out, (SETS * BLOCK_M,))
    ok1 = tl.reshape(ok, (SETS * BLOCK_M,))
    tl.store(PACC + out1[:, None] * DV + offs_dv[None, :], acc, mask=ok1[:, None] & dv_valid[None, :])


def _packed_configs() -> list:
    """(ROWS, BLOCK_N, warps, stages) for the few-query kernel (the best on an H200 at 32k keys:
    bf16 64 x 32 with 3 stages, fp32 16 x 64 with 2)."""
    specs = [(64, 32, 4, 3), (64, 32, 4, 2), (16, 64, 4, 2), (64, 128, 4, 1), (16, 64, 4, 3), (32, 128, 4, 1)]
    return [triton.Config({"ROWS": r, "BLOCK_N": bn}, num_warps=w, num_stages=st) for r, bn, w, st in specs]


def _fma_configs() -> list:
    """(ROWS, BLOCK_N, CHUNK_D, warps, stages) for the exact few-query kernel (``_keep_fma_kernel``)."""
    specs = FMA_SPECS
    return [triton.Config({"ROWS": r, "BLOCK_N": bn, "CHUNK_D": cd}, num_warps=w, num_stages=st)
            for r, bn, cd, w, st in specs]


# The best of 76 tiles on an H200 (32k keys, one query, 4 queries per KV head, 10 sets, fp32;
# tiles of 64 rows: 0.296-0.32 ms a launch, 32 rows >= 0.41, 16 rows >= 0.43, 2 warps or 1
# stage 1.1-10 ms): a whole block of sets per program (the scores, K/V loads and reductions are
# per program) and small head-dim chunks. Smaller row counts stay for more queries per KV head
# (fewer sets a program). p @ V as 3xTF32 on the tensor cores (FMA_PREC_PV) took 0.39-0.56 ms.
FMA_PREC_PV = "ieee"
FMA_SPECS: list[tuple[int, int, int, int, int]] = [
    (64, 32, 16, 4, 2), (64, 64, 16, 8, 3), (64, 32, 16, 4, 3), (64, 32, 8, 4, 2), (64, 64, 8, 8, 3),
    (32, 32, 16, 4, 3), (16, 32, 16, 4, 3),
]


def _shared_configs() -> list:
    """(BLOCK_M, SETS, BLOCK_N, warps, stages) for the many-query kernel: 64-128 stacked rows of
    fp32 state against 64 keys a step (the best of 13 on an H200 at 32k keys, 64 queries). fp32 inputs (the replay's) take 3xTF32 dots, whose
    operand splits need up to ~200 KiB of shared memory at D = 128 (AOT-compiled for sm_90): small
    tiles and one stage are offered too, and the autotuner skips what does not fit."""
    specs = [(32, 2, 64, 4, 2), (128, 1, 64, 8, 2), (16, 4, 64, 4, 2), (32, 4, 64, 8, 2), (64, 2, 64, 8, 2),
             (16, 8, 64, 8, 2), (64, 2, 64, 4, 3), (128, 1, 64, 8, 3)]
    specs = [(*s, 1) for s in specs] + [(*s, 2) for s in SHARED_SPLIT_DV]
    return [triton.Config({"BLOCK_M": bm, "SETS": sets, "BLOCK_N": bn, "DV_PARTS": parts}, num_warps=w, num_stages=st)
            for bm, sets, bn, w, st, parts in specs]


# Tiles whose value columns are split over two programs (DV_PARTS = 2): none offered. On the H200
# (32k keys, 64 queries, bf16) the five tried took 4.47-6.38 ms against 3.29 ms for the best
# unsplit tile: the recomputed scores cost more than the registers saved. The interpreter still
# runs the split (tests), so the path stays correct for a GPU where it pays.
SHARED_SPLIT_DV: list[tuple[int, int, int, int, int]] = []


def packed(group: int, Tq: int) -> bool:
    """The few-query kernel when the KV head's queries (group x Tq) fill less than 16 rows."""
    return group * Tq < 16


# Tuned once per head dims and path (the tensors' dtypes, which the autotuner adds to the key, do
# not tell an fp32 tensor read as bf16 from one read as fp32): lengths hardly change the best tile.
_TUNE_KEY = ["BLOCK_D", "BLOCK_DV", "CAST_Q", "CAST_K", "CAST_V", "PV_SPLIT", "PREC_QK"]


@cache
def _tuned(kind: str):
    if kind == "packed":
        return triton.autotune(configs=_packed_configs(), key=[*_TUNE_KEY, "GRID_AUTO"])(_keep_packed_kernel)
    if kind == "fma":  # the tensors' dtypes join the key; GP (queries per KV head) sets the rows' shape
        return triton.autotune(configs=_fma_configs(), key=["BLOCK_D", "BLOCK_DV", "GP"])(_keep_fma_kernel)
    return triton.autotune(configs=_shared_configs(), key=_TUNE_KEY)(_keep_shared_kernel)


def split_unit() -> int:
    """Key splits must be a multiple of this (every BLOCK_N a launch may pick divides it)."""
    return INTERP_BLOCK_N if interpreting() else MAX_BLOCK_N


def run_keep(q, k, v, keep, qpos, pm, pl, pacc, *, group, scale, k_start, window, causal,
             keys_per_split, n_splits, n_sets, cast_q=False, cast_k=False, cast_v=False, grid_auto=False,
             exact=False) -> bool:
    """Launch a keep-set kernel for ``n_sets`` sets: set 0 keeps every key, set s > 0 the keys of
    keep[s - 1]. q [B, Hq, Tq, D], k [B, Hk, T, D], v [B, Hk, T, Dv], keep int8 [n_sets - 1, B,
    Hk, T] (all contiguous), qpos int64 [Tq] (|positions| < 2**29); pm/pl fp32 [n_sets * B * Hq * Tq * n_splits], pacc
    fp32 [... * Dv] outputs. ``cast_*``: fp32 tensors holding bf16 values, read as bf16. Returns
    whether the shared-max kernel ran (its partial states need the finish kernel's underflow check).
    ``grid_auto`` (fp32 q, k, v; the packed kernel only): the bf16 grid decided per key block.
    ``exact`` (fewer than 16 query rows per KV head): ``_keep_fma_kernel``, fp32 on the CUDA cores
    for any input dtype (casts ignored) and any int64 positions; a compiler that rejects it falls
    back to the packed kernel (3xTF32, as uncast fp32; positions checked against the int32 bound
    first, with a host sync) and says so in FALLBACKS."""
    import torch

    B, Hq, Tq, D = q.shape
    Hk, Tk, DV = k.shape[1], k.shape[2], v.shape[3]
    S = n_sets
    block_d = max(16, triton.next_power_of_2(D))
    block_dv = max(16, triton.next_power_of_2(DV))
    # The interpreter computes bf16 dots on raw bits: upcast there. On the GPU 16-bit inputs feed
    # the tensor cores (exact products, fp32 sums); fp32 inputs and p @ V use 3xTF32.
    v_bf16 = v.dtype == torch.bfloat16 or cast_v
    q_bf16 = q.dtype == torch.bfloat16 or cast_q
    dot_f32 = interpreting() and (q_bf16 or v_bf16 or grid_auto)
    prec_qk = "ieee" if interpreting() else ("tf32x3" if q.dtype == torch.float32 and not cast_q else "tf32")
    prec_pv = "ieee" if interpreting() else "tf32x3"
    args = (q, k, v, keep, qpos, pm, pl, pacc, Hq, Tq, Tk, S, group, D, DV, float(scale), int(k_start),
            int(window or 0), keys_per_split, n_splits)
    flags = dict(CAUSAL=bool(causal), HAS_WINDOW=window is not None, DOT_F32=dot_f32, PREC_QK=prec_qk,
                 PREC_PV=prec_pv, PV_SPLIT=v_bf16, CAST_Q=bool(cast_q), CAST_K=bool(cast_k), CAST_V=bool(cast_v),
                 ROUNDED=not interpreting(), BLOCK_D=block_d, BLOCK_DV=block_dv)
    nvq = group * Tq
    if exact and packed(group, Tq):
        if _run_fma(args, causal, window, nvq, block_d, block_dv, (B * Hk, n_splits)):
            return False
        if run_grid_check(None, None, None, qpos, POSITION_LIMIT, 1)[0]:  # its positions are int32
            raise ValueError("positions and lengths must be below 2**29 for the Triton path")
        dt = torch.promote_types(q.dtype, k.dtype)  # the packed kernel's score dot takes one dtype
        return run_keep(q.to(dt), k.to(dt), v, keep, qpos, pm, pl, pacc, group=group, scale=scale, k_start=k_start,
                        window=window, causal=causal, keys_per_split=keys_per_split, n_splits=n_splits,
                        n_sets=n_sets)
    if packed(group, Tq):
        flags["GRID_AUTO"] = bool(grid_auto)
        if interpreting():
            grid = (triton.cdiv(S * nvq, INTERP_ROWS), B * Hk, n_splits)
            _keep_packed_kernel[grid](*args, **flags, ROWS=INTERP_ROWS, BLOCK_N=INTERP_BLOCK_N)
            return False
        _launch("packed", _tuned("packed"), lambda meta: (triton.cdiv(S * nvq, meta["ROWS"]), B * Hk, n_splits),
                args, flags)
        return False
    assert not grid_auto, "grid_auto is the packed kernel's"
    if interpreting():
        # Two value-column parts when there are columns for both (exercises the offsets).
        parts = 2 if DV > block_dv // 2 else 1
        grid = (triton.cdiv(nvq, INTERP_BLOCK_M) * triton.cdiv(S, INTERP_SETS) * parts, B * Hk, n_splits)
        _keep_shared_kernel[grid](*args, **flags, BLOCK_M=INTERP_BLOCK_M, SETS=INTERP_SETS, BLOCK_N=INTERP_BLOCK_N,
                                  DV_PARTS=parts)
        return True
    if not FALLBACKS:
        try:
            _launch("shared", _tuned("shared"),
                    lambda meta: (triton.cdiv(nvq, meta["BLOCK_M"]) * triton.cdiv(S, meta["SETS"]) * meta["DV_PARTS"],
                                  B * Hk, n_splits),
                    args, flags)
            return True
        except Exception as exc:  # a compiler that rejects the 3-D tile: the packed kernel computes the same
            if "out of memory" in str(exc).lower():
                raise
            FALLBACKS.append(f"shared-scores kernel unavailable ({type(exc).__name__}: {str(exc)[:200]}); "
                             "using the packed kernel for every query count")
    _launch("packed", _tuned("packed"), lambda meta: (triton.cdiv(S * nvq, meta["ROWS"]), B * Hk, n_splits), args,
            {**flags, "GRID_AUTO": False})
    return False


def fma_tag(gp: int) -> str:
    """The FALLBACKS entry's prefix when the exact few-query kernel could not run."""
    return f"exact few-query kernel unavailable (GP {gp})"


def _run_fma(args: tuple, causal: bool, window, nvq: int, block_d: int, block_dv: int, grid_tail: tuple) -> bool:
    """Launch ``_keep_fma_kernel`` on ``run_keep``'s arguments; False (with the reason in
    FALLBACKS) when the compiler rejects it, so the caller runs the packed kernel instead."""
    gp = triton.next_power_of_2(nvq)
    consts = dict(CAUSAL=bool(causal), HAS_WINDOW=window is not None, ROUNDED=not interpreting(),
                  PREC_PV="ieee" if interpreting() else FMA_PREC_PV, GP=gp, BLOCK_D=block_d, BLOCK_DV=block_dv)
    S = args[11]
    if any(f.startswith(fma_tag(gp)) for f in FALLBACKS):
        return False
    if interpreting():
        # Small chunks of the head dim (the test sizes get several, the last one ragged).
        grid = (triton.cdiv(S, INTERP_ROWS // gp), *grid_tail)
        _keep_fma_kernel[grid](*args, **consts, ROWS=INTERP_ROWS, BLOCK_N=INTERP_BLOCK_N, CHUNK_D=8)
        return True
    try:
        _launch("fma", _tuned("fma"), lambda meta: (triton.cdiv(S, meta["ROWS"] // gp), *grid_tail), args, consts)
        return True
    except Exception as exc:
        if "out of memory" in str(exc).lower():
            raise
        FALLBACKS.append(f"{fma_tag(gp)} ({type(exc).__name__}: {str(exc)[:200]}); the packed kernel with 3xTF32")
        return False


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
                    k_start: int = 0, window: int | None = None, causal: bool = True) -> None:
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
    _launch("finish", _keep_finish_kernel, (rows, n_sets), (pm, pl, pacc, recall, err, rows, n_sets + 1, dv, n_splits,
                                                            *extra),
            dict(CHECK=bool(check), CAUSAL=bool(causal), HAS_WINDOW=window is not None, ROUNDED=not interpreting(),
                 UNDER=UNDERFLOW, BLOCK_S=block_s, BLOCK_N=INTERP_BLOCK_N if interpreting() else 32, BLOCK_D=block_d,
                 BLOCK_DV=block_dv, num_warps=4))


@triton.jit
def _grid_check_kernel(Q, K, V, POS, FLAGS, nq, nk, nv, n_pos, chunk, LIMIT: tl.constexpr, BLOCK: tl.constexpr):
    """One pass over q, k, v (fp32 viewed as int32; n 0 for a tensor not checked) and the query
    positions (int64): per program a bitmask -- 1: a position's magnitude >= LIMIT, 2/4/8: q/k/v
    has a value off the bf16 grid (low 16 bits not zero). One launch for every check the Triton
    path's choice depends on (they were ~8 torch ops)."""
    pid = tl.program_id(0)
    lo = pid.to(tl.int64) * chunk
    offs = tl.arange(0, BLOCK)
    bad_q = tl.zeros([BLOCK], dtype=tl.int32)
    bad_k = tl.zeros([BLOCK], dtype=tl.int32)
    bad_v = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, chunk, BLOCK):
        i = lo + start + offs
        bad_q = bad_q | (tl.load(Q + i, mask=i < nq, other=0) & 0xFFFF)
        bad_k = bad_k | (tl.load(K + i, mask=i < nk, other=0) & 0xFFFF)
        bad_v = bad_v | (tl.load(V + i, mask=i < nv, other=0) & 0xFFFF)
    flag = tl.where(tl.max(bad_q, axis=0) != 0, 2, 0) | tl.where(tl.max(bad_k, axis=0) != 0, 4, 0) \
        | tl.where(tl.max(bad_v, axis=0) != 0, 8, 0)
    if pid == 0:
        big = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, n_pos, BLOCK):
            i = start + offs
            p = tl.load(POS + i, mask=i < n_pos, other=0)
            big = big | ((p >= LIMIT) | (p <= -LIMIT)).to(tl.int32)
        flag = flag | tl.where(tl.max(big, axis=0) != 0, 1, 0)
    tl.store(FLAGS + pid, flag)


def run_grid_check(q, k, v, positions, limit: int, sms: int, sync: bool = True):
    """(a position's magnitude >= limit, q / k / v off the bf16 grid) from one launch and one
    device-to-host copy. q, k, v: contiguous, or None (not checked: not fp32); positions int64.
    ``sync`` False: the flags on the device instead (int32, OR them: bit 0 the position bound)."""
    import torch

    views = [None if x is None or x.numel() == 0 else x.view(torch.int32) for x in (q, k, v)]
    ns = [0 if x is None else x.numel() for x in views]
    block = 16 if interpreting() else 1024
    biggest = max(*ns, 1)
    # ~4 programs per SM over the largest tensor, whole blocks each.
    chunk = max(block, triton.cdiv(triton.cdiv(biggest, 4 * max(sms, 1)), block) * block)
    n_prog = triton.cdiv(biggest, chunk)
    flags = torch.empty(n_prog, dtype=torch.int32, device=positions.device)
    _launch("grid", _grid_check_kernel, (n_prog,),
            (*(flags if x is None else x for x in views), positions, flags, *ns, positions.numel(), chunk),
            dict(LIMIT=limit, BLOCK=block, num_warps=4))
    if not sync:
        return flags
    return grid_flags(flags.tolist())  # the one host sync of a keep-set call


def grid_flags(values) -> tuple[bool, bool, bool, bool]:
    """(a position's magnitude >= limit, q / k / v off the bf16 grid) from the per-program flags
    of ``run_grid_check`` read to the host (ints)."""
    bits = 0
    for f in values:
        bits |= int(f)
    return bool(bits & 1), bool(bits & 2), bool(bits & 4), bool(bits & 8)


# Why a kernel was replaced by another in this process (empty: none was); the benchmark reports it.
FALLBACKS: list[str] = []


# ------------------------------------------------------------------------------ quantisation

MODE_CHANNEL_GROUPS = 0  # groups of `group` channels per token (KIVI values, quanto/HQQ K and V)
MODE_TOKEN_GROUPS = 1  # groups of `group` tokens per channel (KIVI keys)
MODE_FP8 = 2


@triton.jit
def _rint(y):
    """Round half to even (numpy's np.round) from floor, exact in fp32 and in the interpreter."""
    f = tl.floor(y)
    d = y - f
    odd = f - 2.0 * tl.floor(f * 0.5)
    return f + tl.where(d > 0.5, 1.0, tl.where(d == 0.5, odd, 0.0))


@triton.jit
def _dequant(x, lo, hi, levels):
    """numerics.quantize_minmax's formula, in the precision of its inputs."""
    scale = (hi - lo) / levels
    safe = tl.where(scale > 0, scale, 1.0)
    qv = tl.minimum(tl.maximum(_rint((x - lo) / safe), 0.0), levels)
    return qv * scale + lo


@triton.jit
def _fp8(x, MAN: tl.constexpr, EMIN: tl.constexpr, TOP: tl.constexpr):
    """Nearest fp8 value (ties to even), saturating at +-TOP: exponent read from the fp32 bits, so
    no log2 approximation; scaling by powers of two is exact."""
    x = tl.minimum(tl.maximum(x, -TOP), TOP)
    bits = tl.abs(x).to(tl.int32, bitcast=True)
    e = tl.maximum((bits >> 23) - 127, EMIN)
    up = ((MAN - e + 127) << 23).to(tl.float32, bitcast=True)  # 2^(MAN - e)
    down = ((e - MAN + 127) << 23).to(tl.float32, bitcast=True)  # the quantum 2^(e - MAN)
    r = _rint(x * up) * down
    return tl.minimum(tl.maximum(r, -TOP), TOP)


@triton.jit(do_not_specialize=["Tn", "group", "chunk"])
def _quant_kernel(
    X, SSE, COS, CNT, Hn, Tn, D, group, chunk, sxb, sxh, sxt,
    LEVELS: tl.constexpr, MODE: tl.constexpr, MAN: tl.constexpr, EMIN: tl.constexpr, TOP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hn
    h = pid_bh % Hn
    base = X + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < D
    t0 = pid * chunk
    t1 = tl.minimum(t0 + chunk, Tn)

    # KIVI keys: per-channel min and max over this program's token group (first pass).
    c_lo = tl.zeros([BLOCK_D], dtype=tl.float32) + float("inf")
    c_hi = tl.zeros([BLOCK_D], dtype=tl.float32) - float("inf")
    if MODE == 1:
        for start in range(t0, t1, BLOCK_T):
            offs_t = start + tl.arange(0, BLOCK_T)
            ok = (offs_t < t1)[:, None] & d_valid[None, :]
            x = tl.load(base + offs_t[:, None].to(tl.int64) * sxt + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
            c_lo = tl.minimum(c_lo, tl.min(tl.where(ok, x, float("inf")), axis=0))
            c_hi = tl.maximum(c_hi, tl.max(tl.where(ok, x, float("-inf")), axis=0))

    # Errors are taken in float64, as numerics.py does: recorded K/V sit on a coarse (bf16/fp16)
    # grid where (x - lo) / scale often lands near a rounding tie, which fp32 and float64 break
    # differently (a whole quantum apart: first order in the cosine).
    sse = tl.zeros([BLOCK_T], dtype=tl.float64)
    cos = tl.zeros([BLOCK_T], dtype=tl.float64)
    cnt = tl.zeros([BLOCK_T], dtype=tl.float64)
    for start in range(t0, t1, BLOCK_T):
        offs_t = start + tl.arange(0, BLOCK_T)
        t_valid = offs_t < t1
        ok = t_valid[:, None] & d_valid[None, :]
        x = tl.load(base + offs_t[:, None].to(tl.int64) * sxt + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
        if MODE == 0:
            lo = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
            hi = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
            for g0 in range(0, D, group):
                in_g = (offs_d >= g0) & (offs_d < g0 + group) & d_valid
                g_lo = tl.min(tl.where(in_g[None, :], x, float("inf")), axis=1)
                g_hi = tl.max(tl.where(in_g[None, :], x, float("-inf")), axis=1)
                lo = tl.where(in_g[None, :], g_lo[:, None], lo)
                hi = tl.where(in_g[None, :], g_hi[:, None], hi)
            xq = _dequant(x.to(tl.float64), lo.to(tl.float64), hi.to(tl.float64), LEVELS)
        elif MODE == 1:
            xq = _dequant(x.to(tl.float64), c_lo.to(tl.float64)[None, :], c_hi.to(tl.float64)[None, :], LEVELS)
        else:
            xq = _fp8(x, MAN, EMIN, TOP).to(tl.float64)  # exact in fp32 (scaling by powers of two)
        x64 = x.to(tl.float64)
        xq = tl.where(ok, xq, 0.0)
        diff = x64 - xq
        sse += tl.sum(diff * diff, axis=1)
        na = tl.sum(x64 * x64, axis=1)
        nb = tl.sum(xq * xq, axis=1)
        good = t_valid & (na > 0) & (nb > 0)
        c = tl.sum(x64 * xq, axis=1) / (tl.sqrt(tl.where(good, na, 1.0)) * tl.sqrt(tl.where(good, nb, 1.0)))
        cos += tl.where(good, c, 0.0)
        cnt += tl.where(good, 1.0, 0.0)
    out = pid_bh.to(tl.int64) * tl.num_programs(0) + pid
    tl.store(SSE + out, tl.sum(sse, axis=0))
    tl.store(COS + out, tl.sum(cos, axis=0))
    tl.store(CNT + out, tl.sum(cnt, axis=0))


def quant_grid(Tn: int, mode: int, group: int, lanes: int = 1, sms: int = 1) -> tuple[int, int]:
    """(programs per head, tokens per program) for ``Tn`` quantised tokens of ``lanes`` heads
    (x batch): up to 256 tokens a program, fewer when that leaves under ~4 programs per SM (a
    4k-token layer of 8 heads at 256 gave 128 programs: one wave of long, latency-bound loops)."""
    if mode == MODE_TOKEN_GROUPS:
        return triton.cdiv(Tn, group), group
    if interpreting():
        chunk = INTERP_BLOCK_T
    else:
        chunk = max(32, min(256, triton.next_power_of_2(triton.cdiv(Tn * max(lanes, 1), 4 * max(sms, 1)))))
    return triton.cdiv(Tn, chunk), chunk


def run_quant(x, sse, cos, cnt, *, Tn, mode, group, chunk, bits, fp8=(3, -6, 448.0)) -> None:
    """Launch ``_quant_kernel`` over the first ``Tn`` tokens of x [B, H, T, D] (last dim
    contiguous); sse/cos/cnt float64 [B * H * programs] outputs."""
    B, H, _, D = x.shape
    n_prog = sse.numel() // (B * H)
    block_d = max(16, triton.next_power_of_2(D))
    # ~2k elements a tile: the float64 temporaries (x, its round trip, the difference) then take
    # ~16 registers each per thread instead of spilling.
    block_t = INTERP_BLOCK_T if interpreting() else max(1, min(64, 2048 // block_d))
    man, emin, top = fp8
    _quant_kernel[(n_prog, B * H)](
        x, sse, cos, cnt, H, Tn, D, max(1, int(group)), int(chunk),
        x.stride(0), x.stride(1), x.stride(2),
        LEVELS=float((1 << bits) - 1), MODE=mode, MAN=int(man), EMIN=int(emin), TOP=float(top), BLOCK_T=block_t, BLOCK_D=block_d,
        num_warps=4,
    )

