"""Content analyses of sampled tensors (kvtrace.analyzer.contents, `kvtrace analyze --gpu`).

Real traces are recorded from tiny random-weight models on the CPU; the numbers the analysis
reports are checked against numpy computed here from the decoded payloads. A synthetic trace with
planted heads (one sink-only "streaming" KV head, one uniform head with ~zero values) checks the
classification where the answer is known.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvtrace import exitcodes
from kvtrace.format import schema
from kvtrace.format.assemble import ContentsAssembler
from kvtrace.format.reader import Trace
from kvtrace.format.writer import encode_payload

torch = pytest.importorskip("torch")

import kvtrace  # noqa: E402
from kvtrace.analyzer.contents import analyze_contents, select_device  # noqa: E402
from kvtrace.cli import main  # noqa: E402
from tests.helpers.models import tiny_model, tiny_prompt  # noqa: E402

SAMPLING = {"every_n_steps": 4, "queries": True}
PK = schema.PayloadKind


def _record(path, name, *, new=9, sampling=SAMPLING, hook=None):
    model = tiny_model(name)
    handles = hook(model) if hook else []
    with kvtrace.record(model, str(path), sampling=sampling):
        model.generate(tiny_prompt(12), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    for h in handles:
        h.remove()
    return path


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("contents")
    return {n: _record(d / f"{n}.kvt.h5", n) for n in ("llama", "gpt_oss", "deepseek_v3")}


def _payloads(path, kind, layer):
    with Trace(path) as t:
        idx = t.payload_index[:]
        rows = [i for i, r in enumerate(idx) if int(r["kind"]) == int(kind) and int(r["layer"]) == layer]
        return [t.payload(i) for i in rows]


def _at(path, kind, layer, step):
    """What the layer's cache held at ``step``: incremental samples joined (spec §6.1)."""
    with Trace(path) as t:
        return ContentsAssembler(t).at(0, layer, int(kind), step)


def _kv_row(path, step, layer):
    with Trace(path) as t:
        kv = t.kv[:]
    return kv[(kv["step"] == step) & (kv["layer"] == layer)][0]


# ------------------------------------------------------------------------------ real traces


def test_llama_structure_and_norms_match_numpy(traces):
    rep = analyze_contents(traces["llama"], heavy=3, recent=2, sinks=2, window=5)
    d = rep.to_dict()
    json.dumps(d)  # JSON-able as is
    assert d["status"] == "ran" and d["backend"] == "torch/cpu" and d["payloads"] == 18
    assert "no GPU" in d["device_note"]
    assert {x["layer"] for x in d["dead_heads"]} == {0, 1}
    for x in d["dead_heads"]:
        v = _at(traces["llama"], PK.VALUE, x["layer"], x["step"]).to_float32()
        k = _at(traces["llama"], PK.KEY, x["layer"], x["step"]).to_float32()
        assert x["step"] == 8 and x["tokens"] == v.shape[2] == 20
        np.testing.assert_allclose(x["value_mean_norm"], np.linalg.norm(v, axis=-1).mean(axis=(0, 2)), rtol=1e-5)
        np.testing.assert_allclose(x["key_mean_norm"], np.linalg.norm(k, axis=-1).mean(axis=(0, 2)), rtol=1e-5)
        means = np.linalg.norm(v, axis=-1).mean(axis=(0, 2))
        np.testing.assert_allclose(x["value_ratio"], means / np.median(means), rtol=1e-5)
        assert x["dead"] == []  # random weights: no head is near zero
        row = _kv_row(traces["llama"], x["step"], x["layer"])
        nb = schema.DTYPE_ITEMSIZE[schema.CacheDType(int(row["k_dtype"]))]
        assert x["bytes_per_head"] == 20 * (16 + 16) * nb
    assert {e["layer"] for e in d["entropy"]} == {0, 1}
    assert d["skipped"] == []


def _numpy_entropy(path, layer, scale):
    """Mean normalised entropy per query head over every sampled query with > 1 visible key."""
    sums, counts = np.zeros(4), 0
    for qp in _payloads(path, PK.QUERY, layer):
        q, kp = qp.to_float32()[0].astype(np.float64), _at(path, PK.KEY, layer, qp.step)
        k = kp.to_float32()[0].astype(np.float64)
        for i in range(q.shape[1]):
            pos = qp.token_start + i
            n = pos + 1 - kp.token_start
            if n <= 1:
                continue
            counts += 1
            for h in range(4):
                s = scale * k[h // 2, :n] @ q[h, i]
                p = np.exp(s - s.max())
                p /= p.sum()
                sums[h] += -(p * np.log(p)).sum() / math.log(n)
    return sums / counts, counts


def test_llama_entropy_matches_numpy_and_eviction_bytes(traces):
    d = analyze_contents(traces["llama"], heavy=3, recent=2, sinks=2, window=5).to_dict()
    for e in d["entropy"]:
        expect, n = _numpy_entropy(traces["llama"], e["layer"], 1 / math.sqrt(16))
        assert e["queries_sampled"] == e["queries_used"] == 14 and e["queries_multi_key"] == n == 13
        np.testing.assert_allclose(e["mean_norm_entropy"], expect, atol=1e-5)
        assert e["kv_head_of_query_head"] == [0, 0, 1, 1]
        # random weights attend almost uniformly: every head is high-entropy
        assert e["high"] == [0, 1, 2, 3] and e["low"] == []
    ev = {(x["layer"], x["policy"]): x for x in d["eviction"]}
    assert set(ev) == {(0, "h2o"), (0, "streaming"), (1, "h2o"), (1, "streaming")}
    for (layer, policy), x in ev.items():
        row = _kv_row(traces["llama"], 8, layer)
        nb = schema.DTYPE_ITEMSIZE[schema.CacheDType(int(row["k_dtype"]))]
        kept = 3 + 2 if policy == "h2o" else 2 + 5
        assert (x["tokens"], x["kept"], x["evicted"]) == (20, kept, 20 - kept)
        assert x["bytes_freed"] == (20 - kept) * 2 * 16 * nb * 2  # tokens x kv_heads x head_dim x bytes x (K, V)
        assert x["bytes_total"] == 20 * 2 * 16 * nb * 2
        assert 0 < x["mass_retained_min"] <= x["mass_retained_mean"] < 1


def test_gpt_oss_sliding_layer_gets_entropy_from_incremental_samples(traces):
    """Incremental samples keep the keys a sliding cache has dropped since: each query is scored
    against every key it attended to, while dead heads and eviction see only the kept tokens."""
    d = analyze_contents(traces["gpt_oss"]).to_dict()
    window = int(tiny_model("gpt_oss").config.sliding_window)
    ent = {e["layer"]: e for e in d["entropy"]}
    assert set(ent) == {0, 1} and ent[0]["window"] == window and ent[1]["window"] is None
    # 12 prefill queries + one per sampled decode step (4, 8); the prefill forward itself drops the
    # prompt's first 12 - (window - 1) keys, so only the decode steps' queries see all their keys.
    assert (ent[0]["queries_sampled"], ent[0]["queries_used"]) == (14, 2)
    dead = {x["layer"]: x for x in d["dead_heads"]}
    assert dead[0]["layer_type"] == "sliding" and dead[0]["tokens"] == window - 1 and dead[1]["tokens"] == 20
    h2o0 = [x for x in d["eviction"] if x["layer"] == 0 and x["policy"] == "h2o"][0]
    assert h2o0["tokens"] == window - 1 and h2o0["token_start"] == 20 - (window - 1)
    assert not [s for s in d["skipped"] if s["layer"] == 0]


def test_gpt_oss_sliding_snapshots_are_explained(tmp_path):
    """With whole samples a sliding layer's sampled queries miss the key the cache dropped."""
    path = _record(tmp_path / "all.kvt.h5", "gpt_oss", sampling={**SAMPLING, "tokens": "all"})
    d = analyze_contents(path).to_dict()
    by = {(s["analysis"], s["layer"]): s["reason"] for s in d["skipped"]}
    assert "window - 1" in by[("entropy", 0)]
    assert ("eviction_h2o", 0) in by
    assert [e["layer"] for e in d["entropy"]] == [1] and d["entropy"][0]["window"] is None
    dead = {x["layer"]: x for x in d["dead_heads"]}
    assert dead[0]["layer_type"] == "sliding" and dead[0]["tokens"] == 7 and dead[1]["tokens"] == 20
    stream0 = [x for x in d["eviction"] if x["layer"] == 0][0]
    assert stream0["policy"] == "streaming" and stream0["evicted"] == 0 and stream0["mass_retained_mean"] is None


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_incremental_and_whole_samples_give_the_same_analysis(tmp_path, traces, name):
    """The same generate() recorded with whole samples: identical analyses from fewer bytes."""
    whole = _record(tmp_path / "all.kvt.h5", name, sampling={**SAMPLING, "tokens": "all"})
    a = analyze_contents(traces[name], heavy=3, recent=2, sinks=2, window=5).to_dict()
    b = analyze_contents(whole, heavy=3, recent=2, sinks=2, window=5).to_dict()
    with Trace(traces[name]) as t_new, Trace(whole) as t_all:
        assert (t_new.meta.payload_tokens, t_all.meta.payload_tokens) == ("new", "all")
        new_elems = int(t_new.payload_index[:]["n_elements"].sum())
        all_elems = int(t_all.payload_index[:]["n_elements"].sum())
    assert new_elems < all_elems
    for key in ("dead_heads", "entropy", "eviction", "mla", "skipped"):
        assert a[key] == b[key], key
    assert any(a[k] for k in ("dead_heads", "mla"))


def test_deepseek_mla_spectrum(traces):
    d = analyze_contents(traces["deepseek_v3"]).to_dict()
    assert d["dead_heads"] == [] and d["entropy"] == [] and d["eviction"] == []
    assert {m["layer"] for m in d["mla"]} == {0, 1}
    for m in d["mla"]:
        lat = _at(traces["deepseek_v3"], PK.LATENT, m["layer"], m["step"])
        x = lat.to_float32().reshape(-1, 32).astype(np.float64)
        assert m["num_tokens"] == 20 and m["kv_lora_rank"] == 32 and m["rope_dim"] == 8
        assert m["trace"] == pytest.approx(float((x * x).sum()), rel=1e-5)  # trace of the Gram
        eig = np.linalg.eigvalsh(x.T @ x)[::-1]
        np.testing.assert_allclose(m["eigenvalues_top"], eig[:8], rtol=1e-4)
        assert 1 <= m["effective_rank"] <= 20  # 20 tokens: rank at most 20
        # 2 * heads * mean(K=16+8, V=16) / (r + rope)
        assert m["structural_ratio"] == pytest.approx(2 * 4 * 20 / (32 + 8))
    assert {s["analysis"] for s in d["skipped"]} == {"dead_heads", "entropy", "eviction"}


def test_planted_dead_head_in_a_recorded_trace(tmp_path):
    def zero_head1(model):
        def hook(_mod, _inp, out):
            out = out.clone()
            out[..., 16:32] = 0  # V of KV head 1 (head_dim 16)
            return out
        return [layer.self_attn.v_proj.register_forward_hook(hook) for layer in model.model.layers]

    path = _record(tmp_path / "dead.kvt.h5", "llama", hook=zero_head1)
    d = analyze_contents(path).to_dict()
    for x in d["dead_heads"]:
        assert x["dead"] == [1] and x["value_ratio"][1] == 0
        assert x["bytes_dead"] == x["bytes_per_head"] == 20 * 32 * 4  # fp32 K+V of one head, 20 tokens


# ----------------------------------------------------------------------- synthetic trace


def _synthetic(tmp_path, *, queries=True):
    """One layer, 4 query heads / 2 KV heads x 16, fp32. KV head 0: every query hits token 0
    (a sink: low entropy). KV head 1: zero keys (uniform attention, entropy exactly ln n) and
    values ~1e-4 of head 0's (dead)."""
    from tests.helpers.synth import Req, SynthTrace

    cfg = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "intermediate_size": 128}
    st = SynthTrace(tmp_path / "synth.kvt.h5", cfg, dtype=schema.CacheDType.FLOAT32)
    st.request(Req(30, 3))  # steps 0..2; 32 tokens at the last step
    T, rng = 32, np.random.default_rng(0)
    k = rng.standard_normal((1, 2, T, 16)).astype(np.float32)
    k[0, 0, :, 0] = 0.0
    k[0, 0, 0, 0] = 50.0  # the sink
    k[0, 1] = 0.0
    v = rng.standard_normal((1, 2, T, 16)).astype(np.float32)
    v[0, 1] *= 1e-4
    q = np.zeros((1, 4, T, 16), np.float32)
    q[0, :2, :, 0] = 10.0  # heads 0, 1 -> KV head 0: score 125 on the sink, ~0 elsewhere
    q[0, 2:] = rng.standard_normal((2, T, 16))
    items = [(PK.KEY, k), (PK.VALUE, v)] + ([(PK.QUERY, q)] if queries else [])
    for kind, arr in items:
        st.w.write_payload(encode_payload(0, 2, 0, kind, schema.CacheDType.FLOAT32, arr))
    return st.close()


def test_synthetic_streaming_high_and_dead_heads(tmp_path):
    path = _synthetic(tmp_path)
    d = analyze_contents(path, heavy=1, recent=1, sinks=1, window=1).to_dict()
    (e,) = d["entropy"]
    assert e["low"] == [0, 1] and e["high"] == [2, 3] and e["kv_low"] == [0]
    assert e["mean_norm_entropy"][2] == pytest.approx(1.0, abs=1e-6)  # uniform over zero keys
    assert e["mean_norm_entropy"][0] < 1e-6
    (dh,) = d["dead_heads"]
    assert dh["dead"] == [1] and dh["bytes_dead"] == 32 * 32 * 4
    h2o = [x for x in d["eviction"] if x["policy"] == "h2o"][0]
    assert (h2o["kept"], h2o["evicted"], h2o["bytes_freed"]) == (2, 30, 30 * 2 * 16 * 4 * 2)
    # Independent mass for KV head 1 (uniform): query at p gives 1/(p+1) to keys 0..p, x2 heads.
    # H2O keeps the newest token and the heaviest older one (token 0).
    T = 32
    m = np.array([sum(1 / (p + 1) for p in range(j, T)) for j in range(T)])
    assert h2o["mass_retained_min"] == pytest.approx((m[0] + m[-1]) / m.sum(), rel=1e-5)
    assert h2o["mass_retained_mean"] == pytest.approx(((m[0] + m[-1]) / m.sum() + 1.0) / 2, rel=1e-5)
    sl = [x for x in d["eviction"] if x["policy"] == "streaming"][0]
    assert (sl["kept"], sl["mass_retained_min"]) == (2, pytest.approx((m[0] + m[-1]) / m.sum(), rel=1e-5))


def test_synthetic_without_queries_says_why(tmp_path):
    d = analyze_contents(_synthetic(tmp_path, queries=False)).to_dict()
    reasons = {s["analysis"]: s["reason"] for s in d["skipped"]}
    assert "no sampled queries" in reasons["entropy"] and "eviction_h2o" in reasons
    assert d["dead_heads"][0]["dead"] == [1]


# -------------------------------------------------------------------------- device choice


def test_gpu_without_cuda_runs_on_cpu_and_says_so():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    dev, note = select_device("cuda")
    assert dev == "cpu" and "GPU asked for" in note
    assert select_device("cpu") == ("cpu", "")
    with pytest.raises(ValueError):
        select_device("tpu")


def test_trace_without_payloads_is_skipped_with_reason(tmp_path):
    from tests.helpers.synth import LLAMA_LIKE, Req, build

    path = build(tmp_path / "plain.kvt.h5", LLAMA_LIKE, [Req(16, 4)])
    d = analyze_contents(path).to_dict()
    assert d["status"] == "skipped" and "no sampled tensors" in d["reason"]


def test_committed_gpu_fixture(request):
    path = request.config.rootpath / "tests" / "data" / "gpu_gemma3_tiny.kvt.h5"
    d = analyze_contents(path).to_dict()
    assert d["status"] == "ran" and d["payloads"] == 36
    # 2 requests x 3 layers (sliding, sliding, full), bf16 K and V of 2 heads x 16
    assert len(d["dead_heads"]) == 6 and all(x["bytes_per_head"] == x["tokens"] * 32 * 2 for x in d["dead_heads"])
    assert {x["tokens"] for x in d["dead_heads"] if x["layer_type"] == "sliding"} == {7}
    assert d["entropy"] == []  # recorded without queries
    assert any("no sampled queries" in s["reason"] for s in d["skipped"] if s["analysis"] == "entropy")
    assert {x["policy"] for x in d["eviction"]} == {"streaming"}


# ------------------------------------------------------------------------------------- CLI


def _cli(capsys, *args):
    try:
        main(["analyze", *args])
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_contents_prints_section_and_json(traces, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")
    code, out, _ = _cli(capsys, "--contents", str(traces["llama"]))  # the GPU where there is one, else the CPU
    assert code == 0 and "Contents of 18 sampled tensor(s), backend" in out
    assert "Attention entropy" in out and "Eviction what-ifs" in out and "KV heads" in out
    if not torch.cuda.is_available():
        assert "backend torch/cpu" in out and "no GPU" in out
    code, out, _ = _cli(capsys, "--contents", str(traces["deepseek_v3"]), "--json", "-")
    doc = json.loads(out)
    assert code == 0 and doc["schema_version"] == "1.1"
    c = doc["reports"][0]["contents"]
    assert c["status"] == "ran" and len(c["mla"]) == 2
    code, out, _ = _cli(capsys, str(traces["llama"]), "--json", "-")
    assert "contents" not in json.loads(out)["reports"][0]  # not asked for


def test_cli_trace_without_payloads(tmp_path, capsys):
    from tests.helpers.synth import LLAMA_LIKE, Req, build

    path = build(tmp_path / "plain.kvt.h5", LLAMA_LIKE, [Req(16, 4)])
    code, out, _ = _cli(capsys, "--contents", str(path))
    assert code == 0 and "Contents: skipped: the trace holds no sampled tensors" in out


def test_cli_gpu_without_cuda_is_69_naming_contents(traces, capsys, tmp_path):
    """--gpu asks for the GPU: where torch sees none it is exit 69 before any work, one line naming
    --contents (which runs the same analyses on the CPU); it ran on the CPU with a note before."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out_json = tmp_path / "r.json"
    code, out, err = _cli(capsys, "--gpu", str(traces["llama"]), "--json-out", str(out_json))
    assert code == exitcodes.UNAVAILABLE and out == "", err
    assert err.count("\n") == 1 and err.startswith("kvtrace: --gpu: no CUDA device") and "--contents" in err, err
    assert not out_json.exists()


def test_without_torch_contents_are_skipped_with_reason(traces):
    code = textwrap.dedent(f"""
        import sys
        class _NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is blocked for this test")
                return None
        sys.meta_path.insert(0, _NoTorch())
        from kvtrace.analyzer.contents import analyze_contents
        d = analyze_contents({str(traces["llama"])!r}).to_dict()
        assert d["status"] == "skipped" and "torch is not importable" in d["reason"], d
        assert "torch" not in sys.modules
        print("OK")
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "OK" in p.stdout, p.stderr


# -------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_matches_cpu_on_a_recorded_trace(traces):
    from kvtrace.kernels import triton_available

    if not triton_available()[0]:
        pytest.skip("triton is not importable")
    gpu = analyze_contents(traces["llama"], device="cuda").to_dict()
    cpu = analyze_contents(traces["llama"], device="cpu").to_dict()
    assert gpu["backend"] == "triton/cuda" and cpu["backend"] == "torch/cpu"
    for a, b in zip(gpu["entropy"], cpu["entropy"], strict=True):
        np.testing.assert_allclose(a["mean_norm_entropy"], b["mean_norm_entropy"], atol=5e-4)
    for a, b in zip(gpu["dead_heads"], cpu["dead_heads"], strict=True):
        np.testing.assert_allclose(a["value_mean_norm"], b["value_mean_norm"], rtol=2e-5)
    for a, b in zip(gpu["eviction"], cpu["eviction"], strict=True):
        assert (a["kept"], a["bytes_freed"]) == (b["kept"], b["bytes_freed"])
