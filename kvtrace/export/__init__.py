"""Exports of traces to the tools users already run: Perfetto (trace-event JSON), Prometheus
(live endpoint and textfile collector, used by the recorder) and Zenodo (dataset bundles)."""
