"""Device-side staging of one sample: byte-shuffle into whole chunks on the GPU, then one D2H copy.

The payload codec stores each chunk as zstd(HDF5-shuffle(zero-padded chunk)). Doing the padding
and the shuffle on the GPU (on the sampler's side stream) leaves the background workers nothing
but compression, which python-zstandard runs with the GIL released: the generating thread, which
is CPU-bound Python during HF decode, no longer waits behind long GIL-holding copies.

``shuffled_chunks`` is plain torch and device-agnostic, so its bytes can be checked on the CPU
against ``kvtrace.format.codec.shuffle_chunks``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtrace.format.schema import payload_chunk_elements

_CARRIERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def carrier_bits(tensor: torch.Tensor) -> torch.Tensor:
    """Same bits, integer element type of the same size: no float conversion can touch them."""
    return tensor.view(_CARRIERS[tensor.element_size()])


def shuffled_chunks(carrier: torch.Tensor, chunk_elements: int) -> tuple[torch.Tensor, int]:
    """Zero-pad ``carrier`` (any strides) to whole chunks and byte-shuffle each chunk.

    Returns (chunks, own_bytes): chunks is a new contiguous uint8 tensor
    [n_chunks, itemsize, chunk_elements] on carrier's device, byte for byte what
    ``codec.shuffle_chunks`` returns for the same elements; own_bytes is the peak memory this
    function allocated (a gather of a non-contiguous input, alive together with the result).
    The result never aliases ``carrier``.
    """
    itemsize = carrier.element_size()
    n = carrier.numel()
    full, rest = divmod(n, chunk_elements)
    n_chunks = max(1, full + (rest > 0))
    own = 0
    if carrier.is_contiguous():
        flat = carrier.view(-1)
    else:  # one gather; the shuffle then reads plain rows
        flat = carrier.contiguous().view(-1)
        own = n * itemsize
    src = flat.view(torch.uint8)
    chunks = torch.empty((n_chunks, itemsize, chunk_elements), dtype=torch.uint8, device=carrier.device)
    split = full * chunk_elements * itemsize
    if full:
        chunks[:full].copy_(src[:split].view(full, chunk_elements, itemsize).transpose(1, 2))
    if n_chunks > full:  # only the last chunk is padded
        chunks[full, :, rest:].zero_()
        chunks[full, :, :rest].copy_(src[split:].view(rest, itemsize).t())
    return chunks, own + chunks.numel()


@dataclass
class Staged:
    host: torch.Tensor  # pinned uint8 [n_chunks, itemsize, chunk_elements], valid once `ready` fired
    ready: torch.cuda.Event
    device_bytes: int  # peak device bytes of the sampler's own temporaries for this sample


def stage_on_stream(view: torch.Tensor, stream: torch.cuda.Stream, *, in_place: bool) -> Staged:
    """Enqueue shuffle + D2H copy of ``view`` (carrier dtype) on ``stream``; the CPU never blocks.

    ``in_place``: the cache memory is written in place later, so the main stream waits (on the
    GPU) until the side stream has read it, which is before the D2H copy since the shuffled
    chunks never alias the view. Otherwise record_stream keeps the allocator from handing the
    memory to new work before the side stream has read it. Temporaries are allocated and freed
    in side-stream order, so the next sample reuses them only after this copy.
    """
    main = torch.cuda.current_stream(view.device)
    stream.wait_stream(main)
    with torch.cuda.stream(stream):
        chunks, own = shuffled_chunks(view, payload_chunk_elements(view.element_size()))
        if in_place:
            read = torch.cuda.Event()
            read.record(stream)
        host = torch.empty(chunks.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(chunks, non_blocking=True)
        del chunks
        ready = torch.cuda.Event()
        ready.record(stream)
    if in_place:
        main.wait_event(read)
    else:
        view.record_stream(stream)
    return Staged(host, ready, own)
