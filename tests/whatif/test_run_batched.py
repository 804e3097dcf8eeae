"""run_whatif measures all keep-sets of a unit in one keep_measures_many call (one launch, not one
per keep-set): the document is the one of evaluating each policy and ratio alone, one call per
(unit, query chunk) carries every (eviction policy, ratio) that applies to the unit, and the
accelerated bridge (torch backend on the CPU) gives the exact numbers. Fixtures: the committed
sampled GPU traces (llama GQA, gemma3_text sliding-window hybrid)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtrace.format.reader import Trace
from kvtrace.whatif import parse_policy, run, source
from kvtrace.whatif.accelerated import Exact
from kvtrace.whatif.policies import PolicyError, ScorerPolicy
from tests.whatif.test_whatif_accelerated import F64, _close, _measures

DATA = Path(__file__).parents[1] / "data" / "gpu_contents"
LLAMA, GEMMA = DATA / "llama.kvt.h5", DATA / "gemma3_text.kvt.h5"
RATIOS = [0.0, 0.25, 0.5]
# key-only, random, observed queries (snapkv, tova), fixed-window and ratio streaming_llm, a plan
# that fails on gemma's 7-token sliding layers (expected_attention n_sink=8), paging, quantisers
MIXED = ["knorm", "paging:page_size=16", "random", "snapkv:window_size=4", "kivi:nbits=2,residual_length=4",
         "streaming_llm:n_sink=2,window=4", "tova", "streaming_llm:n_sink=2", "expected_attention:n_sink=8", "fp8"]


def _alone(path: Path, names: list[str], ratios: list[float], steps: str) -> dict[str, Any]:
    """The document merged from run_whatif on one policy at one ratio at a time (one keep-set
    per call: the order before batching)."""
    merged: dict[str, Any] | None = None
    for name in names:
        first = run.run_whatif(path, [parse_policy(name)], [ratios[0]], steps=steps)
        entry = first["policies"][0]
        if entry["results"][0]["ratio"] is not None:  # one result per ratio
            entry["results"] += [run.run_whatif(path, [parse_policy(name)], [r], steps=steps)["policies"][0]["results"][0]
                                 for r in ratios[1:]]
        if merged is None:
            merged = {**first, "ratios": ratios, "policies": []}
        merged["policies"].append(entry)
    assert merged is not None
    return merged


@pytest.mark.slow
@pytest.mark.parametrize("steps", ["last", "all"])
@pytest.mark.parametrize("path", [LLAMA, GEMMA], ids=["llama", "gemma3_text"])
def test_the_document_is_the_one_of_each_policy_and_ratio_alone(path, steps):
    doc = run.run_whatif(path, [parse_policy(n) for n in MIXED], RATIOS, steps=steps)
    _same(doc, _alone(path, MIXED, RATIOS, steps))
    reasons = [s["reason"] for p in doc["policies"] for r in p["results"] for s in r["skipped"]]
    if steps == "all":  # the prefill has no earlier queries to score with
        assert any("snapkv needs observed queries" in x for x in reasons)
    if path == GEMMA:
        assert any("needs more than n_sink=8 keys" in x for x in reasons)
    assert sum(len(r["layers"]) for p in doc["policies"] if p["family"] == "eviction" for r in p["results"]) > 10


def _same(a: Any, b: Any, where: str = "") -> None:
    """The same document: equal structure and values, floats to 1e-12 (a pass over many keep-sets
    multiplies them by the softmax in one matmul, whose float64 summation order may differ from
    one set's in the last bit)."""
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=1e-12, abs=1e-15, nan_ok=True), where
    else:
        assert a == b, where


class _Spy:
    """Exact numerics that record each keep_measures_many call; no keep_measures at all (the
    replay must not ask for one set at a time)."""

    def __init__(self) -> None:
        self.exact = Exact()
        self.label, self.note = self.exact.label, self.exact.note
        self.calls: list[tuple[tuple[int, ...], int, int]] = []  # (K shape, queries, sets)

    def keep_measures_many(self, q, k, v, q_pos, k_pos, window, scale, keeps):
        self.calls.append((k.shape, q.shape[2], len(keeps)))
        return self.exact.keep_measures_many(q, k, v, q_pos, k_pos, window, scale, keeps)

    def reconstruction(self, *a):
        return self.exact.reconstruction(*a)

    def output_error(self, *a):
        return self.exact.output_error(*a)


COUNTED = ["knorm", "streaming_llm:n_sink=2,window=4", "snapkv:window_size=4", "kivi:nbits=2,residual_length=4",
           "random", "paging:page_size=16"]


def _expected_calls(path: Path, steps: str, one_query: bool) -> list[tuple[tuple[int, ...], int, int]]:
    """Per measured unit in order, per query chunk: (K shape, queries, sets), the sets being
    every (eviction policy, ratio) pair whose needs the unit meets."""
    pols = [parse_policy(n) for n in COUNTED]
    pairs = [(p, r) for p in pols if isinstance(p, ScorerPolicy) for r in ([None] if run._fixed(p) else RATIOS)]
    assert len(pairs) == 3 * len(RATIOS) + 1
    out = []
    with Trace(path) as t:
        for u in source.units(t, steps):
            if u.eval_q is None or u.latent:
                continue
            sets = sum(1 for p, r in pairs if _plannable(p, r, u))
            n = u.eval_q.shape[2]
            out += [(u.k.shape, 1, sets)] * n if one_query else [(u.k.shape, n, sets)]
    return out


def _plannable(pol: ScorerPolicy, ratio: float | None, u: source.Unit) -> bool:
    """The unit gets a keep-set of ``pol`` at ``ratio`` (not skipped, not unsupported)."""
    if pol.needs.startswith("Q") and u.obs_q is None:
        return False
    try:
        pol.plan(u.k, ratio or 0.0, run._observed(u), u.v, k_pos=u.k_pos, window=u.window)
    except PolicyError:
        return False
    return True


@pytest.mark.parametrize("one_query", [False, True], ids=["whole", "one-query-chunks"])
@pytest.mark.parametrize("path", [LLAMA, GEMMA], ids=["llama", "gemma3_text"])
def test_one_call_per_unit_and_chunk_carries_every_policy_and_ratio(monkeypatch, path, one_query):
    spy = _Spy()
    monkeypatch.setattr(run, "open_numerics", lambda device, **kw: spy)
    if one_query:
        monkeypatch.setattr(run, "CHUNK_ELEMENTS", 1)
    doc = run.run_whatif(path, [parse_policy(n) for n in COUNTED], RATIOS, steps="all")
    want = _expected_calls(path, "all", one_query)
    assert spy.calls == want
    # the prefill (no earlier queries: snapkv out), later steps (snapkv's 4-position window holds no sampled
    # query but ratio 0's control); sets > 7 on the full layer only (sinks of the window streaming_llm)
    assert {s for _, _, s in want} == {7, 8}
    if one_query:
        assert any(q > 1 for _, q, _ in _expected_calls(path, "all", False))  # chunking really split a unit
    rows = sum(x["status"] == "measured" for p in doc["policies"] if p["family"] == "eviction" for r in p["results"]
               for x in r["layers"])
    assert rows == sum(s for _, _, s in _expected_calls(path, "all", False))  # one row per set measured


def test_the_torch_bridge_gives_the_exact_numbers_with_one_pass_per_unit(monkeypatch):
    pytest.importorskip("torch")
    from kvtrace.kernels.compute import open_compute
    from kvtrace.whatif.accelerated import Accelerated

    policies = [parse_policy(n) for n in MIXED]
    for path in (LLAMA, GEMMA):
        exact = run.run_whatif(path, policies, RATIOS, steps="all")
        bridge, passes = _counting_bridge(Accelerated(open_compute("cpu", "torch")))
        monkeypatch.setattr(run, "open_numerics", lambda device, b=bridge, **kw: b)
        doc = run.run_whatif(path, policies, RATIOS, device="cuda", steps="all")
        assert doc["numerics"]["backend"] == bridge.label
        want, got = _measures(exact), _measures(doc)
        assert got.keys() == want.keys() and any(k[4] == "attention_mass_recall" for k in want)
        for key, w in want.items():
            tol = F64["mse"] if key[4].endswith("mse") else F64["cos"] if key[4].endswith("cosine") else F64["error"]
            _close(got[key], w, tol)
        measured = sum(1 for _ in _units_with_queries(path))
        assert len(passes) == measured and max(passes) > 10  # one pass per unit, many sets in it


def _counting_bridge(bridge: Any) -> tuple[Any, list[int]]:
    """``bridge`` whose kernel calls record how many keep-sets each pass measured."""
    passes: list[int] = []
    inner = bridge.compute.keep_measures

    def counted(q, k, v, keep, **kw):
        passes.append(int(keep.shape[0]))
        return inner(q, k, v, keep, **kw)

    bridge.compute.keep_measures = counted
    return bridge, passes


def _units_with_queries(path: Path):
    with Trace(path) as t:
        yield from (u for u in source.units(t, "all") if u.eval_q is not None and not u.latent)
