"""kvtrace/whatif/accelerated.py: the accelerated bridge answers as numerics.py does.

On the CPU the bridge runs the kernels' float64 torch reference (backend torch) and, under
TRITON_INTERPRET=1, the Triton kernels themselves (fp32; tolerances of
tests/kernels/test_whatif_kernels.py). Inputs are the sampled units of the committed GQA and
sliding-window traces (one decode query per unit) and a hand-built unit with several queries.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvtrace.format.reader import Trace
from kvtrace.whatif import accelerated as A
from kvtrace.whatif import source
from kvtrace.whatif.policies import FP8, HQQ, KIVI, Knorm, Quanto, StreamingLLM

DATA = Path(__file__).parents[1] / "data" / "gpu_contents"
FP32 = dict(recall=dict(atol=1e-5, rtol=0), error=dict(atol=1e-5, rtol=1e-4), mse=dict(rtol=1e-9, atol=1e-9),
            cos=dict(atol=1e-9, rtol=0))
F64 = dict(recall=dict(atol=1e-12, rtol=0), error=dict(atol=1e-12, rtol=1e-10), mse=dict(rtol=1e-10, atol=0),
           cos=dict(atol=1e-12, rtol=0))


def test_open_numerics_cpu_and_fallbacks(monkeypatch):
    assert isinstance(A.open_numerics("cpu"), A.Exact)
    with pytest.raises(ValueError, match="auto, cpu or cuda"):
        A.open_numerics("tpu")
    from kvtrace.kernels import compute

    monkeypatch.setattr(compute, "torch_available", lambda: (False, "torch is not importable"))
    ex = A.open_numerics("cuda")
    assert isinstance(ex, A.Exact) and ex.note.startswith("GPU asked for but torch is not importable")
    assert A.Exact().note == ""  # the note is the instance's, not the class's


def _bridges() -> list[tuple[str, object, dict]]:
    pytest.importorskip("torch")
    from kvtrace.kernels.compute import open_compute

    out = [("torch", A.Accelerated(open_compute("cpu", "torch")), F64)]
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.importorskip("triton")
        out.append(("triton-interpreter", A.Accelerated(open_compute("cpu", "triton")), FP32))
    return out


def _units() -> list[source.Unit]:
    out = []
    for name in ("llama", "gemma3_text"):
        with Trace(DATA / f"{name}.kvt.h5") as t:
            out += list(source.units(t))
    return out


def _hand_unit() -> source.Unit:
    rng = np.random.default_rng(11)
    k = rng.standard_normal((1, 2, 48, 16)).astype(np.float32)
    v = rng.standard_normal((1, 2, 48, 16)).astype(np.float32)
    k[..., 3] += 20.0  # an outlier key channel
    u = source.Unit(0, 0, 5, "sliding", k, v, 10 + np.arange(48), [0, 1], 16, 0.25, False)
    u.eval_q = rng.standard_normal((1, 4, 6, 16)).astype(np.float32)
    u.eval_pos = np.array([30, 40, 50, 55, 56, 57])
    return u


def _close(a, b, tol):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), equal_nan=True, **tol)


def test_bridge_matches_numerics_on_recorded_and_hand_built_units():
    exact = A.Exact()
    units = [u for u in _units() if u.eval_q is not None] + [_hand_unit()]
    assert len(units) >= 4
    quants = [KIVI(nbits=2, group_size=8, residual_length=4), Quanto(nbits=4, q_group_size=8, residual_length=0),
              HQQ(nbits=3, q_group_size=16, residual_length=2), FP8(fmt="e4m3")]
    for label, bridge, tol in _bridges():
        for u in units:
            args = (u.eval_q, u.k, u.v, u.eval_pos, u.k_pos, u.window, u.scale)
            keeps = [Knorm().plan(u.k, r) for r in (0.25, 0.5, 0.75)] + [StreamingLLM(n_sink=2).plan(u.k, 0.5)]
            got = bridge.keep_measures_many(*args, keeps)
            want = exact.keep_measures_many(*args, keeps)
            for (gr, ge), (wr, we) in zip(got, want, strict=True):
                assert gr.shape == wr.shape == u.eval_q.shape[:3], label
                _close(gr, wr, tol["recall"])
                _close(ge, we, tol["error"])
            for pol in quants:
                for which, x in (("key", u.k), ("value", u.v)):
                    gm, gc = bridge.reconstruction(pol, x, which)
                    wm, wc = exact.reconstruction(pol, x, which)
                    _close(gm, wm, tol["mse"])
                    _close(gc, wc, tol["cos"])
                _close(bridge.output_error(pol, *args), exact.output_error(pol, *args), tol["error"])


def test_non_contiguous_key_positions_are_answered_exactly():
    pytest.importorskip("torch")
    from kvtrace.kernels.compute import open_compute

    u = _hand_unit()
    k_pos = np.arange(48) * 2  # not contiguous: the kernels' positions model does not apply
    keep = [Knorm().plan(u.k, 0.5)]
    args = (u.eval_q, u.k, u.v, u.eval_pos, k_pos, None, u.scale)
    got = A.Accelerated(open_compute("cpu", "torch")).keep_measures_many(*args, keep)
    want = A.Exact().keep_measures_many(*args, keep)
    assert np.array_equal(got[0][0], want[0][0]) and np.array_equal(got[0][1], want[0][1], equal_nan=True)
