"""Built-in detectors, one module each; importing this package registers them."""

from kvtrace.analyzer.detectors import (  # noqa: F401 - imported for registration
    aliasing,
    cache_density,
    capacity,
    fragmentation,
    growth_curve,
    layer_anomaly,
    layer_uniformity,
    oom,
    post_eos,
    prefill_spike,
)

# Report order: the reference's six first (its users know them), then the additions.
ORDER = (
    "growth_curve", "post_eos", "fragmentation", "layer_anomaly", "cache_density", "layer_uniformity",
    "aliasing", "prefill_spike", "capacity", "oom",
)
