"""Device-side staging of one sample: one asynchronous D2H copy into pinned memory, on a side stream.

Measured on an H200 host (bench/profile_recorder.py; docs/benchmarks.md): the generating thread's
cost per sample is what matters, because HF decode is CPU-bound Python.
A plain pinned copy costs it ~20 us; padding and byte-shuffling on the GPU first (about ten more
torch calls, allocations on the side stream) cost ~250 us, more than it saved the workers. So the
copy is plain, and the workers shuffle with the GIL released (``codec.shuffle_chunks``).
"""

from __future__ import annotations

import contextlib

import torch

_CARRIERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def carrier_bits(tensor: torch.Tensor) -> torch.Tensor:
    """Same bits, integer element type of the same size: no float conversion can touch them."""
    return tensor.view(_CARRIERS[tensor.element_size()])


class StagingBatch:
    """Asynchronous D2H copies of several samples into pinned memory, enqueued on one side stream
    per device and closed by one event per device; the CPU never blocks.

    Per device, the first copy makes the side stream wait for the main stream's work so far and
    enters the side stream's context; :meth:`close` records one event per device, makes the main
    stream wait for it (on the GPU) when a copy was of memory that is written in place later, and
    leaves the contexts. A sampling step stages all its layers in one batch: the per-copy cost on
    the generating thread is then one pinned allocation and one ``copy_``.
    """

    def __init__(self, streams: dict[int, torch.cuda.Stream]) -> None:
        self._streams = streams  # the sampler's side stream per device index (created here if absent)
        self._open: dict[int, list] = {}  # index -> [side stream, main stream, any in-place copy]
        self._contexts = contextlib.ExitStack()

    def copy(self, view: torch.Tensor, index: int, *, in_place: bool) -> tuple[torch.Tensor, int]:
        """Enqueue the copy of ``view`` (carrier dtype, on device ``index``); returns the pinned
        host tensor (valid once this batch's event for the device fired) and the device bytes of
        the sampler's own temporary (a gather of a non-contiguous view, freed in side-stream
        order), 0 if none. ``in_place``: the memory is written in place later (static caches).
        Otherwise record_stream keeps the allocator from reusing it before the copy has read it."""
        state = self._open.get(index)
        if state is None:
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = torch.cuda.Stream(device=index)
            main = torch.cuda.current_stream(index)
            stream.wait_stream(main)
            self._contexts.enter_context(torch.cuda.stream(stream))
            state = self._open[index] = [stream, main, False]
        host = torch.empty(view.shape, dtype=view.dtype, pin_memory=True)
        own = 0
        if view.is_contiguous():
            host.copy_(view, non_blocking=True)
        else:
            gathered = view.contiguous()
            own = gathered.numel() * gathered.element_size()
            host.copy_(gathered, non_blocking=True)
            del gathered
        if in_place:
            state[2] = True
        else:
            view.record_stream(state[0])
        return host, own

    def close(self) -> dict[int, torch.cuda.Event]:
        """One event per device, recorded after every copy of the batch."""
        events: dict[int, torch.cuda.Event] = {}
        try:
            for index, (stream, main, in_place) in self._open.items():
                # blocking: the worker that waits on it sleeps instead of spinning a core in the
                # driver next to the model's thread
                event = torch.cuda.Event(blocking=True)
                event.record(stream)
                events[index] = event
                if in_place:
                    main.wait_event(event)
        finally:
            self._open.clear()
            self._contexts.close()
        return events
