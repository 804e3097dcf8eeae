"""The Grafana dashboard only queries metrics the exporter really serves, and shows all of them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvtrace.export.prometheus import METRICS

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
    used = {m for e in exprs for m in re.findall(r"\bkvtrace_[a-z_]+", e)}
    assert used <= set(METRICS), f"dashboard queries metrics the exporter lacks: {used - set(METRICS)}"
    assert set(METRICS) <= used, f"exporter metrics missing from the dashboard: {set(METRICS) - used}"
    # label names in selectors exist on the metric they select
    for e in exprs:
        for name, labels in re.findall(r"(kvtrace_[a-z_]+)\{([^}]*)\}", e):
            for label in re.findall(r"([a-z_]+)=~?\"", labels):
                assert label == "instance" or label in METRICS[name].labels, (name, label)
        for labels in re.findall(r"by \(([a-z_, ]+)\)", e):
            for label in labels.split(","):
                assert any(label.strip() in METRICS[m].labels for m in re.findall(r"kvtrace_[a-z_]+", e)), (e, label)
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
