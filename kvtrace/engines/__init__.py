"""Engines that kvtrace records from outside their process (``kvtrace attach``): a running vLLM engine's
KV-cache event stream (ZMQ, msgpack) and Prometheus /metrics, written into a kvtrace trace (spec §10,
"Engine traces"). Nothing here imports vLLM: the wire schema is kvtrace's own
(:mod:`kvtrace.engines.vllm_events`), checked against vLLM's classes by tests/engines."""
