"""Every what-if policy on traces recorded here with kvtrace.record + sampling (CPU, tiny random
models): a GQA model (llama, 4 query heads on 2 KV heads), a sliding-window hybrid (gemma3_text,
window 8) and an MLA model (deepseek_v3, cached latent). Every policy yields measures or says why
not, per sampled (request, layer); the document follows spec/whatif-json.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvtrace  # noqa: E402
from kvtrace.recorder.sampling import SamplingSettings  # noqa: E402
from kvtrace.whatif import REGISTRY, parse_policy  # noqa: E402
from kvtrace.whatif.run import NEEDS, run_whatif  # noqa: E402
from tests.helpers.models import TINY_WINDOW, tiny_model  # noqa: E402

MODELS = ("llama", "gemma3_text", "deepseek_v3")
POLICIES = ["paging:page_size=16", "knorm", "keydiff", "random", "streaming_llm:n_sink=2", "observed_attention", "tova",
            "snapkv:window_size=4", "expected_attention:n_sink=2", "kivi:nbits=2,residual_length=4",
            "quanto:residual_length=4", "hqq:nbits=3,residual_length=4", "fp8:fmt=e5m2"]
SPEC = Path(__file__).parents[2] / "spec" / "whatif-json.md"


def test_the_list_covers_the_registry():
    assert {p.split(":")[0] for p in POLICIES} == set(REGISTRY)


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    d = tmp_path_factory.mktemp("whatif")
    out = {}
    for name in MODELS:
        model = tiny_model(name)
        ids = torch.randint(3, 200, (1, 6), generator=torch.Generator().manual_seed(0))
        path = d / f"{name}.kvt.h5"
        # every 2 steps: snapkv's 4-position window holds one sampled query before the last step
        with kvtrace.record(model, path, sampling=SamplingSettings(every_n_steps=2, queries=True)):
            model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        out[name] = run_whatif(path, [parse_policy(p) for p in POLICIES], [0.0, 0.5])
    return out


@pytest.mark.parametrize("name", MODELS)
def test_every_policy_measures_or_says_why(docs, name):
    doc = docs[name]
    layers = {"llama": 2, "gemma3_text": 3, "deepseek_v3": 2}[name]
    assert doc["sampled_units"] == layers
    for p in doc["policies"]:
        for r in p["results"]:
            assert r["bytes"]["kept_peak"] > 0
            if p["family"] != "paging":  # pages of 16 round a 7-token sliding layer up past 2x
                assert r["bytes"]["kept_peak"] <= doc["baseline"]["bytes_peak"]
            if p["family"] == "paging":
                assert r["bytes"]["waste_peak"] >= 0
                continue
            skipped: dict[int, set[str]] = {}
            for x in r["layers"]:  # a row the policy cannot support says why and has no measures
                assert x["status"] in ("measured", "unsupported", "not_pressed")
                assert (x["status"] == "measured") == ("reason" not in x), x
                if x["status"] != "measured":
                    assert x["reason"].strip() and not {m for m in NEEDS if m in x}
            measured = {x["layer"]: {m for m in NEEDS if m in x} for x in r["layers"] if x["status"] == "measured"}
            for x in r["layers"]:
                if x["status"] != "measured":
                    skipped.setdefault(x["layer"], set()).add("all content measures")
            for s in r["skipped"]:
                assert s["reason"].strip(), s
                skipped.setdefault(s["layer"], set()).add(s["measure"])
            for layer in range(layers):  # each unit: a measure, or every missing measure skipped with a reason
                got = measured.get(layer, set())
                why = skipped.get(layer, set())
                want = {"attention_output_error"} | ({"attention_mass_recall"} if p["family"] == "eviction" else set())
                assert "all content measures" in why or want - got <= why, (p["label"], layer, got, why)
                assert got or "all content measures" in why or want <= why, (p["label"], layer)


def test_gqa_measures_per_kv_head(docs):
    doc = docs["llama"]
    for p in doc["policies"]:
        if p["family"] == "paging":
            continue
        for r in p["results"]:
            assert not r["skipped"], (p["label"], r["skipped"])
            for row in r["layers"]:
                assert len(row["attention_output_error"]) == 2  # 2 KV heads (4 query heads averaged per group)
                if p["family"] == "eviction":
                    assert all(0 <= x <= 1 + 1e-12 for x in row["attention_mass_recall"])
                    if r["ratio"] == 0.0:
                        assert row["attention_mass_recall"] == pytest.approx([1.0, 1.0])
                    else:
                        assert row["kept_tokens_per_head"] == [max(1, row["tokens"] // 2)] * 2
                else:
                    assert all(0.5 < c <= 1 + 1e-12 for c in row["key_cosine"])


def test_sliding_layers_are_measured_over_their_window(docs):
    doc = docs["gemma3_text"]
    by = {p["policy"]: p["results"][1] for p in doc["policies"] if p["family"] == "eviction"}
    r = by["snapkv"]
    types = {x["layer"]: x["layer_type"] for x in r["layers"]}
    assert types == {0: "sliding", 1: "sliding", 2: "full"}
    assert all(x["tokens"] == TINY_WINDOW - 1 for x in r["layers"] if x["layer_type"] == "sliding")
    # the 4-position window does not fit a budget of int(7 / 2) = 3: said, not a tie-break
    for x in r["layers"]:
        if x["layer_type"] == "sliding":
            assert x["status"] == "unsupported" and "4 keys in the observation window" in x["reason"]
        else:
            assert x["status"] == "measured" and x["window_queries"] >= 1 and "attention_mass_recall" in x
    assert r["units"] == {"measured": 1, "unsupported": 2, "not_pressed": 0}
    for name in ("knorm", "tova", "observed_attention"):
        assert all("attention_mass_recall" in x for x in by[name]["layers"]), name


def test_mla_plans_on_the_latent_and_skips_attention_with_the_reason(docs):
    doc = docs["deepseek_v3"]
    by = {p["policy"]: p["results"][-1] for p in doc["policies"]}
    for name in ("knorm", "keydiff", "random", "streaming_llm"):
        rows = by[name]["layers"]
        assert len(rows) == 2 and all(x["tensors"] == ["latent", "rope_key"] and x["kept_tokens_per_head"] for x in rows)
        assert all("MLA layer" in s["reason"] for s in by[name]["skipped"])
    for name in ("observed_attention", "tova", "snapkv", "expected_attention"):
        assert not by[name]["layers"] and all("MLA layer" in s["reason"] for s in by[name]["skipped"])
    for name in ("kivi", "quanto", "hqq", "fp8"):
        o = by[name]["overall"]
        assert {"key_mse", "key_cosine", "value_mse", "value_cosine"} <= set(o) and "attention_output_error" not in o


# ------------------------------------------------------------------------------ the JSON contract


def _spec_keys() -> set[str]:
    block = SPEC.read_text().split("```")[1]
    return set(re.findall(r'"([a-z_0-9]+)"', block))


def _walk(obj, keys: set[str], path: str = "") -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            if path.endswith(("params", "needs", "overall")) or k in NEEDS:
                _walk(v, keys, path + "." + k)  # names from the registry/measures, not schema keys
                continue
            keys.add(k)
            _walk(v, keys, path + "." + k)
    elif isinstance(obj, list):
        for v in obj:
            _walk(v, keys, path + "[]")


def test_every_key_of_the_documents_is_in_the_spec(docs):
    seen: set[str] = set()
    for doc in docs.values():
        _walk({"trace": "x", **doc}, seen)
    missing = seen - _spec_keys()
    assert not missing, f"keys written but not in spec/whatif-json.md: {sorted(missing)}"
    for doc in docs.values():
        assert doc["kind"] == "proxy" and doc["kvtrace_whatif"] == 1
        for p in doc["policies"]:
            assert {"policy", "label", "family", "needs", "params", "results"} <= set(p)
            assert p["family"] in ("paging", "eviction", "quantization")
            assert p["needs"] in ("sizes", "K", "Q and K", "Q, K and V")
            for r in p["results"]:
                assert {"ratio", "bytes", "overall", "layers", "skipped"} <= set(r)
                for m, v in r["overall"].items():
                    assert m in NEEDS and set(v) == {"mean", "worst", "heads", "needs"} and v["needs"] == NEEDS[m]
    expected = next(p for p in docs["llama"]["policies"] if p["policy"] == "expected_attention")
    assert "post-RoPE" in expected["note"]
