"""Serving diagnosis: ``kvtrace serve`` runs transformers' own OpenAI-compatible server
in-process with the recorder attached (:mod:`kvtrace.serving.runner`, :mod:`kvtrace.serving.routes`);
``kvtrace loadtest`` drives any OpenAI-compatible endpoint through the four-phase protocol
(:mod:`phases`, :mod:`client`), writes a per-request latency table (:mod:`latency`) and judges each
phase against the alert thresholds (:mod:`verdict`, with trace numbers from :mod:`tracefacts`).

The load-test side needs httpx only; the server side needs ``kvtrace[serve]`` (transformers[serving]).
Neither is imported by the analyser."""
