"""Device-side staging of one sample: one asynchronous D2H copy into pinned memory, on a side stream.

Measured on an H200 host (bench/profile_recorder.py, bench/scratch notes in docs/benchmarks.md):
the generating thread's cost per sample is what matters, because HF decode is CPU-bound Python.
A plain pinned copy costs it ~20 us; padding and byte-shuffling on the GPU first (about ten more
torch calls, allocations on the side stream) cost ~250 us, more than it saved the workers. So the
copy is plain, and the workers shuffle with the GIL released (``codec.shuffle_chunks``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_CARRIERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def carrier_bits(tensor: torch.Tensor) -> torch.Tensor:
    """Same bits, integer element type of the same size: no float conversion can touch them."""
    return tensor.view(_CARRIERS[tensor.element_size()])


@dataclass
class Staged:
    host: torch.Tensor  # pinned, the view's carrier elements (contiguous), valid once `ready` fired
    ready: torch.cuda.Event
    device_bytes: int  # device bytes of the sampler's own temporary (a gather), 0 if none


def stage_on_stream(view: torch.Tensor, stream: torch.cuda.Stream, *, in_place: bool) -> Staged:
    """Enqueue the D2H copy of ``view`` (carrier dtype) on ``stream``; the CPU never blocks.

    ``in_place``: the cache memory is written in place later, so the main stream waits (on the
    GPU) for the copy. Otherwise record_stream keeps the allocator from handing the memory to new
    work before the side stream has read it. A non-contiguous view is first gathered on the side
    stream (the sampler's own device memory, freed in side-stream order).
    """
    main = torch.cuda.current_stream(view.device)
    stream.wait_stream(main)
    own = 0
    with torch.cuda.stream(stream):
        host = torch.empty(view.shape, dtype=view.dtype, pin_memory=True)
        if view.is_contiguous():
            host.copy_(view, non_blocking=True)
        else:
            gathered = view.contiguous()
            own = gathered.numel() * gathered.element_size()
            host.copy_(gathered, non_blocking=True)
            del gathered
        ready = torch.cuda.Event()
        ready.record(stream)
    if in_place:
        main.wait_event(ready)
    else:
        view.record_stream(stream)
    return Staged(host, ready, own)
