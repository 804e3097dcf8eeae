"""kvtrace/whatif/accelerated.py: the accelerated bridge answers as numerics.py does.

On the CPU the bridge runs the kernels' float64 torch reference (backend torch) and, under
TRITON_INTERPRET=1, the Triton kernels themselves (fp32; tolerances of
tests/kernels/test_whatif_kernels.py); with a CUDA device, the compiled kernels on it too. Inputs are the sampled units of the committed GQA and
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
    import torch

    from kvtrace.kernels.compute import open_compute

    out = [("torch", A.Accelerated(open_compute("cpu", "torch")), F64)]
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.importorskip("triton")
        out.append(("triton-cuda", A.Accelerated(open_compute("cuda", "triton")), FP32))
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
    u.eval_q = rng.standard_normal((1, 4, 8, 16)).astype(np.float32)  # 2 x 8 rows per KV head: shared-scores kernel
    u.eval_pos = np.array([30, 40, 50, 55, 56, 57, 10, 20])
    return u


def _bf16_values(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to bf16 (truncating the low 16 bits: still a bf16 value), kept as fp32."""
    return (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def _close(a, b, tol):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), equal_nan=True, **tol)


@pytest.mark.slow
def test_bridge_matches_numerics_on_recorded_and_hand_built_units():
    exact = A.Exact()
    grid = _hand_unit()  # a bf16 model's recording: fp32 arrays holding bf16 values (the bf16 kernel path)
    grid.k, grid.v, grid.eval_q = (_bf16_values(x) for x in (grid.k, grid.v, grid.eval_q))
    units = [u for u in _units() if u.eval_q is not None] + [_hand_unit(), grid]
    assert len(units) >= 5
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


def _measures(doc: dict) -> dict[tuple, float]:
    out = {}
    for p in doc["policies"]:
        for res in p["results"]:
            for row in res["layers"]:
                for m in ("attention_mass_recall", "attention_output_error", "key_mse", "key_cosine",
                          "value_mse", "value_cosine"):
                    for h, x in enumerate(row.get(m, [])):
                        out[(p["label"], res["ratio"], row["request"], row["layer"], m, h)] = x
    return out


def test_run_whatif_through_the_bridge_matches_the_exact_replay(monkeypatch):
    from kvtrace.whatif import parse_policy, run

    policies = [parse_policy(p) for p in ("knorm", "streaming_llm:n_sink=2", "kivi:nbits=2,residual_length=4", "fp8")]
    paths = [DATA / f"{name}.kvt.h5" for name in ("llama", "gemma3_text")]
    exact = [run.run_whatif(path, policies, [0.5]) for path in paths]
    for path, ex in zip(paths, exact, strict=True):
        assert ex["numerics"] == {"backend": "numpy-float64/cpu", "note": ""}
        want = _measures(ex)
        assert any(k[4] == "attention_output_error" for k in want) and any(k[4] == "key_mse" for k in want)
        for label, bridge, tol in _bridges():
            monkeypatch.setattr(run, "open_numerics", lambda device, b=bridge, **kw: b)
            doc = run.run_whatif(path, policies, [0.5], device="cuda")
            assert doc["numerics"]["backend"] == bridge.label
            got = _measures(doc)
            assert got.keys() == want.keys(), label
            for key, w in want.items():
                t = tol["mse"] if key[4].endswith("mse") else tol["cos"] if key[4].endswith("cosine") else tol["error"]
                _close(got[key], w, t)


def test_run_whatif_on_cuda_without_a_gpu_runs_exactly_and_says_so():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    from kvtrace.whatif import parse_policy
    from kvtrace.whatif.run import run_whatif

    doc = run_whatif(DATA / "llama.kvt.h5", [parse_policy("knorm")], [0.5], device="cuda")
    assert doc["numerics"]["backend"] == "numpy-float64/cpu"
    assert doc["numerics"]["note"].startswith("GPU asked for but no CUDA device") and "exact numpy" in doc["numerics"]["note"]
