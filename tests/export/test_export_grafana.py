"""The Grafana dashboard only queries metrics the exporter really serves, and shows all of them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvtrace.export.prometheus import METRICS
from kvtrace.export.prometheus_serving import MODEL_LABEL, SERVING_METRICS

# every exported family and its labels: the recorder's and the serving metrics (histograms add `le`)
LABELS: dict[str, tuple[str, ...]] = {
    **{name: m.labels for name, m in METRICS.items()},
    **{name: (MODEL_LABEL, *labels, "le") if kind == "histogram" else (MODEL_LABEL, *labels)
       for name, (kind, _, labels, _) in SERVING_METRICS.items()},
}
HISTOGRAMS = {name for name, (kind, *_) in SERVING_METRICS.items() if kind == "histogram"}


def _family(sample: str) -> str:
    """kvtrace_x_seconds_bucket -> kvtrace_x_seconds for the histograms; other names as they are."""
    for suffix in ("_bucket", "_sum", "_count"):
        if sample.endswith(suffix) and sample[: -len(suffix)] in HISTOGRAMS:
            return sample[: -len(suffix)]
    return sample

DASHBOARD = Path(__file__).resolve().parents[2] / "grafana" / "kvtrace-dashboard.json"


def _exprs(dash: dict) -> list[str]:
    out = []
    for p in dash["panels"]:
        out += [t["expr"] for t in p.get("targets", [])]
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            out.append(v["definition"])
    return out


def test_dashboard_matches_exporter():
    dash = json.loads(DASHBOARD.read_text())
    exprs = _exprs(dash)
    used = {_family(m) for e in exprs for m in re.findall(r"\bkvtrace_[a-z0-9_]+", e)}
    assert used <= set(LABELS), f"dashboard queries metrics the exporter lacks: {used - set(LABELS)}"
    assert set(LABELS) <= used, f"exporter metrics missing from the dashboard: {set(LABELS) - used}"
    # label names in selectors exist on the metric they select
    for e in exprs:
        for name, labels in re.findall(r"(kvtrace_[a-z0-9_]+)\{([^}]*)\}", e):
            for label in re.findall(r"([a-z_]+)=~?\"", labels):
                assert label == "instance" or label in LABELS[_family(name)], (name, label)
        for labels in re.findall(r"by \(([a-z_, ]+)\)", e):
            for label in labels.split(","):
                assert any(label.strip() in LABELS[_family(m)] for m in re.findall(r"kvtrace_[a-z0-9_]+", e)), (e, label)
        assert e.count("(") == e.count(")"), e


def test_dashboard_structure():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}"
            refs = [t["refId"] for t in p["targets"]]
            assert len(refs) == len(set(refs)) and refs
            unit = p["fieldConfig"]["defaults"]["unit"]
            if all("bytes" in t["expr"] and "/" not in t["expr"] for t in p["targets"]):
                assert unit == "bytes", p["title"]  # Grafana's "bytes" unit is binary (IEC)
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "instance", "device"}


def test_kv_panels_have_a_serving_query():
    """The KV-cache panels answer under continuous batching too (kvtrace serve): there the recorder's
    per-layer gauges of the request in flight have no samples, the paged pool's do."""
    dash = json.loads(DASHBOARD.read_text())
    kv = [p for p in dash["panels"] if any("kvtrace_kv_cache_" in t["expr"] for t in p.get("targets", []))]
    assert len(kv) == 4
    for p in kv:
        assert any("kvtrace_serving_kv_cache_" in t["expr"] for t in p["targets"]), p["title"]


def test_age_panel_outlives_the_recorder():
    """The "seconds since last update" stat reads the stamp over a range: an instant query of a
    target that went away returns nothing (Prometheus marks its series stale), which blanked the
    panel right when the age matters. tests/export/test_prometheus_server.py runs this expression
    on a real Prometheus after the recorder stopped."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])
             if "kvtrace_last_update_timestamp_seconds" in t["expr"]]
    assert len(exprs) == 1
    assert re.fullmatch(r"time\(\) - max\(last_over_time\(kvtrace_last_update_timestamp_seconds\{[^}]*\}\[\w+\]\)\)",
                        exprs[0]), exprs[0]


def test_serving_panels_use_rates_and_quantiles_of_the_right_kinds():
    """Serving panels: counters only inside rate(), histogram buckets only inside histogram_quantile,
    usage ratios on a 0-1 percent axis with the 80%/90% thresholds."""
    dash = json.loads(DASHBOARD.read_text())
    serving = [p for p in dash["panels"] if any("kvtrace_serving_" in t["expr"] for t in p.get("targets", []))]
    assert serving
    for p in serving:
        for t in p["targets"]:
            for name in re.findall(r"kvtrace_serving_[a-z0-9_]+", t["expr"]):
                if name.endswith("_total"):
                    assert f"rate({name}" in t["expr"], t["expr"]
                if name.endswith("_bucket"):
                    assert "histogram_quantile(" in t["expr"] and re.search(r"by \(le\b", t["expr"]), t["expr"]
    (usage,) = [p for p in serving if any("kv_cache_usage_ratio" in t["expr"] for t in p["targets"])]
    steps = usage["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert usage["fieldConfig"]["defaults"]["unit"] == "percentunit" and [s["value"] for s in steps] == [None, 0.8, 0.9]
