"""Analysis helpers (dead heads, entropy classes, eviction what-ifs) and the import contract."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvtrace.kernels import analyses as an

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_package_imports_without_torch_or_triton():
    # Block torch and triton outright: the analyser-facing modules must still import and work.
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'triton'):
            raise ImportError('blocked ' + name)
sys.meta_path.insert(0, Block())
import numpy as np
import kvtrace.kernels as K
from kvtrace.kernels import analyses, spectrum, numpy_ref
ok, why = K.available()
assert ok is False and 'torch' in why, why
assert K.torch_available()[0] is False and K.triton_available()[0] is False
assert K.cuda_available()[0] is False
k = np.random.default_rng(0).standard_normal((1, 4, 16, 8)).astype(np.float16)
v = k.copy(); v[:, 1] *= 1e-3
rep = analyses.kv_head_report(k, v)
assert rep.dead == (1,), rep
att = analyses.attention_report(k[:, :, -3:].astype(np.float32), k, heavy=2, recent=2, stream_recent=4)
assert att['h2o'].kept == 4
sp = spectrum.spectrum_from_gram(spectrum.gram_numpy(k[0, 0]), num_tokens=16, num_heads=4, head_dim=8, rope_dim=0)
assert sp.kv_lora_rank == 8
assert 'torch' not in sys.modules and 'triton' not in sys.modules
print('ok')
"""
    res = _run(code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def test_plain_import_loads_neither_torch_nor_triton():
    res = _run("import sys, kvtrace.kernels, kvtrace.kernels.analyses, kvtrace.kernels.spectrum, "
               "kvtrace.kernels.numpy_ref; print('torch' in sys.modules, 'triton' in sys.modules)")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "False"]


def test_available_helpers_return_reasons():
    from kvtrace.kernels import available, cuda_available, torch_available, triton_available

    for fn in (available, cuda_available, torch_available, triton_available):
        ok, why = fn()
        assert isinstance(ok, bool) and isinstance(why, str) and why


def test_lazy_attributes():
    import kvtrace.kernels as K

    assert callable(K.head_norms) and callable(K.attention_stats) and callable(K.mla_spectrum)
    with pytest.raises(AttributeError):
        K.nope  # noqa: B018


# ----------------------------------------------------------------------------- dead heads


def test_dead_heads_basis_and_bytes():
    k_means = np.array([1.0, 1.1, 0.05, 0.9])
    v_means = np.array([[2.0, 0.1, 2.2, 1.9], [2.0, 0.1, 2.2, 2.1]])  # [B, H]: batch averaged
    r = an.dead_heads_from_means(k_means, v_means, tokens=100, head_dim=64, dtype_bytes=2, batch=2)
    assert r.dead == (1,)  # V basis: 0.1 / median(1.95..2.0) ~ 0.05
    assert r.bytes_per_head == 2 * 100 * (64 + 64) * 2
    assert r.bytes_dead == r.bytes_per_head
    assert an.dead_heads_from_means(k_means, v_means, tokens=100, head_dim=64, dtype_bytes=2,
                                    basis="k").dead == (2,)
    assert an.dead_heads_from_means(k_means, v_means, tokens=100, head_dim=64, dtype_bytes=2,
                                    basis="either").dead == (1, 2)
    assert an.dead_heads_from_means(k_means, v_means, tokens=100, head_dim=64, dtype_bytes=2,
                                    basis="both").dead == ()
    json.dumps(r.to_dict())  # plain numbers only
    with pytest.raises(ValueError):
        an.dead_heads_from_means(k_means, None, tokens=1, head_dim=1, dtype_bytes=2)  # v basis needs v


def test_dead_heads_threshold_is_strict_and_median_zero():
    r = an.dead_heads_from_means(None, [1.0, 1.0, 0.1], tokens=1, head_dim=1, dtype_bytes=2)
    assert r.dead == ()  # exactly at the threshold is not dead
    z = an.dead_heads_from_means(None, [0.0, 0.0, 0.0, 3.0], tokens=4, head_dim=2, dtype_bytes=2)
    assert z.dead == (0, 1, 2)


def test_kv_head_report_torch_matches_numpy():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 6, 20, 64, generator=g)
    v = torch.randn(2, 6, 20, 64, generator=g)
    v[:, 4] *= 0.02
    a = an.kv_head_report(k.half(), v.half(), layer=3)
    b = an.kv_head_report(k.half().numpy(), v.half().numpy(), layer=3)
    assert a.dead == b.dead == (4,)
    assert a.dtype_bytes == 2 and a.bytes_dead == 2 * 20 * 128 * 2 and a.layer == 3
    np.testing.assert_allclose(a.value_ratio, b.value_ratio, rtol=1e-5)


# ------------------------------------------------------------------------------ entropy


def test_classify_entropy_groups_and_masking():
    # Hq = 4 (2 KV heads x group 2); query 0 sees one key: excluded from the means.
    e = np.array([[0.0, 0.1, 0.2], [0.0, 0.2, 0.1], [0.0, 0.8, 0.9], [0.0, 0.5, 0.5]])
    r = an.classify_entropy(e, n_visible=[1, 5, 9], kv_heads=2)
    np.testing.assert_allclose(r.mean_norm_entropy, [0.15, 0.15, 0.85, 0.5])
    assert r.low == (0, 1) and r.high == (2,) and r.mixed == (3,) and r.kv_low == (0,)
    assert r.queries_used == 2
    json.dumps(r.to_dict())
    with pytest.raises(ValueError):
        an.classify_entropy(e, kv_heads=3)


# ----------------------------------------------------------------------------- eviction


def test_h2o_keeps_recent_plus_heaviest():
    mass = np.zeros((1, 2, 10))
    mass[0, 0] = [5, 0, 0, 9, 0, 0, 1, 0, 0, 0]
    mass[0, 1] = [0, 0, 0, 0, 0, 0, 0, 3, 1, 1]
    p = an.h2o_eviction(mass, heavy=2, recent=2, head_dim=64, dtype_bytes=2)
    assert (p.kept, p.evicted, p.tokens) == (4, 6, 10)
    assert p.bytes_freed == 6 * 2 * 64 * 2 * 2 and p.bytes_total == 10 * 2 * 64 * 2 * 2
    # head 0 keeps tokens 0 and 3 (heavy) + 8, 9 (recent): 14 of 15; head 1 keeps all its mass.
    assert p.mass_retained_min == pytest.approx(14 / 15)
    assert p.mass_retained_mean == pytest.approx((14 / 15 + 1) / 2)
    frac = an.h2o_eviction(mass[0], head_dim=64, dtype_bytes=2)  # 10% + 10% of 10 tokens
    assert frac.kept == 2 and frac.params == {"heavy": 1, "recent": 1}
    with pytest.raises(ValueError):
        an.h2o_eviction(mass, heavy=1.5, recent=1, head_dim=1, dtype_bytes=1)


def test_h2o_budget_larger_than_sequence():
    p = an.h2o_eviction(np.ones((2, 3)), heavy=5, recent=5, head_dim=8, dtype_bytes=2)
    assert p.kept == 3 and p.evicted == 0 and p.bytes_freed == 0 and p.mass_retained_min == 1.0


def test_streaming_bytes_and_mass():
    p = an.streaming_eviction(4096, kv_heads=8, head_dim=128, dtype_bytes=2, sinks=4, recent=1020)
    assert p.kept == 1024 and p.evicted == 3072
    assert p.bytes_freed == 3072 * 8 * 128 * 2 * 2
    assert p.mass_retained_mean is None
    mass = np.zeros((1, 1, 10))
    mass[0, 0, 0] = 6.0  # sink
    mass[0, 0, 5] = 2.0  # middle: evicted
    mass[0, 0, 9] = 2.0  # recent
    q = an.streaming_eviction(received=mass, head_dim=4, dtype_bytes=2, sinks=1, recent=2)
    assert (q.tokens, q.kept, q.evicted) == (10, 3, 7)
    assert q.mass_retained_mean == pytest.approx(0.8)
    short = an.streaming_eviction(100, kv_heads=1, head_dim=4, dtype_bytes=2)
    assert short.evicted == 0 and short.bytes_freed == 0
    with pytest.raises(ValueError):
        an.streaming_eviction(head_dim=4, dtype_bytes=2)


def test_attention_report_end_to_end():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 64, 32, generator=g)
    q = torch.randn(1, 4, 8, 32, generator=g)
    q[:, :2] = 0.0  # KV head 0's query heads attend uniformly: normalised entropy 1 -> high
    k[:, 1, 0] = 50.0  # a sink for KV head 1
    q[:, 2:] = 0.5  # all positive, so every query of KV head 1 locks onto the sink
    rep = an.attention_report(q, k.to(torch.bfloat16), heavy=4, recent=4, stream_recent=8, sinks=1)
    assert rep["entropy"].high == (0, 1)
    assert rep["entropy"].low == (2, 3) and rep["entropy"].kv_low == (1,)
    assert rep["h2o"].dtype_bytes == 2 and rep["h2o"].kv_heads == 2
    assert rep["streaming"].kept == 9
    # KV head 1: the sink holds nearly all the mass and both policies keep it (retained ~1);
    # KV head 0 attends uniformly, so keeping 8 or 9 of 57..64 visible keys retains little.
    for name in ("h2o", "streaming"):
        assert rep[name].mass_retained_mean > 0.5 and rep[name].mass_retained_min < 0.25, name
    npr = an.attention_report(q.numpy(), k.numpy(), heavy=4, recent=4, stream_recent=8, sinks=1)
    assert npr["entropy"].low == rep["entropy"].low
    json.dumps({name: r.to_dict() for name, r in rep.items()})
