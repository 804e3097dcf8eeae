"""over_reservation: the paged KV pool allocated up front against the most of it this run ever
used (block-level, pool - free, at any scheduler step).

transformers sizes the pool from free device memory x max_memory_percent (vLLM does the same with
gpu_memory_utilization), so a pool far above the load is memory no other process on the GPU can
have. It costs something only against a device: on a trace whose pool device memory is unknown
(a CPU run) the numbers are info. With a GPU of known size and a pool of at least a tenth of
it (a smaller pool cannot crowd another process out), the score grows with the unused share of
the pool: 0.1 at half (the headroom the 80% alert asks for, and some), medium at 75% never used,
high at 90%. It never reaches critical: the unused room is the headroom a burst would need, and
this run's load may not be the host's peak. "Used" counts cached prefix blocks: they hold KV that
later prompts reuse, so a pool that fills with them is working.
"""

from __future__ import annotations

import numpy as np

from kvtrace.analyzer.base import Finding, ev, register
from kvtrace.analyzer.detectors._serving import ServingDetector, alert, known_pool
from kvtrace.analyzer.replay import ReplayContext
from kvtrace.units import format_bytes

UNUSED_ALERT = ((0.5, 0.75, 0.9), (0.1, 0.3, 0.5))
MIN_DEVICE_SHARE = 0.1


@register
class OverReservation(ServingDetector):
    name = "over_reservation"
    summary = "the paged pool reserved up front vs the most of it ever used"

    def per_manager(self, ctx: ReplayContext, manager: int, rows: np.ndarray) -> Finding | None:
        gpus = [d for d in ctx.gpu_devices if ctx.device_total(d)]
        device = gpus[0] if len(gpus) == 1 else None  # the pool's device is known only with one GPU
        total = ctx.device_total(device) if device is not None else None
        rows = known_pool(rows)
        if not rows.size:
            return None
        pool = int(rows["pool_bytes"].max())
        used = int((rows["pool_bytes"] - rows["free_bytes"]).max())
        unused = 1.0 - used / pool
        i = int(np.argmax(rows["pool_bytes"] - rows["free_bytes"]))
        on_device = pool / total if total else None
        if on_device is None or on_device < MIN_DEVICE_SHARE:
            score = min(alert(unused, *UNUSED_ALERT), 0.1)
        else:
            score = alert(unused, *UNUSED_ALERT)
        where = (f" ({on_device:.0%} of the {format_bytes(total)} device)" if on_device is not None and total else
                 " (device memory unknown: info)")
        msg = (f"Manager {manager}: the KV pool reserved {format_bytes(pool)} up front{where}; at most "
               f"{format_bytes(used)} ({used / pool:.0%}) was ever in blocks (step {int(rows['step'][i])}), "
               f"{format_bytes(pool - used)} never used by this load.")
        return self.finding(
            "over_reserved", score, msg, device=device,
            evidence={
                "pool_bytes": ev(pool, "bytes"),
                "max_used_bytes": ev(used, "bytes"),
                "never_used_share": ev(round(unused, 4), "ratio"),
                "pool_share_of_device": ev(round(on_device, 4) if on_device is not None else None, "ratio"),
                "steps": ev(int(rows.size), "count"),
            },
            steps=[int(rows["step"][i])],
        )
