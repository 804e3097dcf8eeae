"""Built-in detectors, one module each; importing this package registers them."""

from kvtrace.analyzer.detectors import (  # noqa: F401 - imported for registration
    aliasing,
    block_waste,
    cache_density,
    capacity,
    concurrency_headroom,
    context_spike,
    fragmentation,
    growth_curve,
    layer_anomaly,
    layer_uniformity,
    oom,
    over_reservation,
    post_eos,
    preemption,
    prefill_spike,
    prefix_cache,
    queueing,
    serving_capacity,
)

# Report order: the reference's six first (its users know them), then the additions.
ORDER = (
    "growth_curve", "post_eos", "fragmentation", "layer_anomaly", "cache_density", "layer_uniformity",
    "aliasing", "prefill_spike", "capacity", "oom",
    # serving (continuous batching, format 1.4 tables)
    "serving_capacity", "concurrency_headroom", "block_waste", "preemption", "queueing", "prefix_cache",
    "over_reservation", "context_spike",
)
