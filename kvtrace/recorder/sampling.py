"""Opt-in sampling of tensor contents (K, V, post-RoPE Q, MLA latents) into trace payloads.

The generating thread only selects a view and enqueues a copy: on CUDA an asynchronous
device->host copy into pinned memory on a side stream, closed by an event (``staging.py``); on CPU
a plain copy. A sampling step's samples reach the background threads as one work item per thread
(balanced by bytes); a thread waits for the step's event once, byte-shuffles each sample
(``codec.shuffle_chunks``, GIL-free numpy copies), compresses them all in one GIL-free zstd call
(``codec.compress_shuffled_many``) and writes them (``TraceWriter.write_payload``). Every time a
background thread takes the GIL back, the model's thread (CPU-bound in HF decode) may have to wait
for it, so these hand-overs are kept per step, not per chunk. At most ``queue_size`` samples are
in flight; when full, a sample is dropped and counted instead of stalling generation. Elements
travel as their raw bits (bf16 as int16, fp8 as uint8, ...), so every dtype round-trips
bit-exactly; the frames are the ones ``encode_payload`` writes.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import queue
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from kvtrace.format.codec import compress_shuffled_many, shuffle_chunks
from kvtrace.format.schema import (
    DTYPE_ITEMSIZE,
    PAYLOAD_MAX_NDIM,
    PAYLOAD_TOKEN_AXIS,
    PAYLOAD_TOKENS,
    TORCH_DTYPE_NAMES,
    CacheDType,
    EventKind,
    PayloadKind,
    payload_chunk_elements,
)
from kvtrace.format.writer import EncodedPayload, TraceWriter, monotonic_ns
from kvtrace.recorder.staging import StagingBatch, carrier_bits

if TYPE_CHECKING:  # pragma: no cover
    import torch

_SHARED_ACROSS_HEADS = (PayloadKind.LATENT, PayloadKind.ROPE_KEY)  # one latent serves every head


@dataclass
class SamplingSettings:
    every_n_steps: int = 0  # 0 = sampling off: tensor contents are stored only when asked for
    at_prefill_end: bool = True
    at_last_step: bool = True
    layers: list[int] | None = None  # None = all
    heads: list[int] | None = None  # KV heads to keep, evenly spaced; None = all
    max_tokens: int | None = None  # keep only the last N tokens of each sample
    queries: bool = False  # post-RoPE queries through the attention-interface wrapper
    latents: bool = True  # MLA latents (what the cache stores in transformers >= 5.x)
    queue_size: int = 64
    level: int = 1  # zstd level; 1 beats 3 on speed and ratio for shuffled bf16 (docs/benchmarks.md)
    # "new": a K/V/latent sample holds only the tokens no earlier sample of its (request, layer,
    # kind) holds; the contents at a step are the union of the samples up to it (spec §6.1).
    # Cached tokens never change in the append-only layouts, so this stores the same information
    # as "all" (every kept token at every sample) at a fraction of the bytes: 1,088 tokens of
    # Pythia-1.4B sampled every 32 steps are 117 MiB instead of 2 GiB. Layouts that rewrite
    # tokens (quantized layers, beam search, assisted decoding) are always sampled whole.
    tokens: str = "new"

    def __post_init__(self) -> None:
        if self.every_n_steps < 0:
            raise ValueError("every_n_steps must be >= 0 (0 turns sampling off)")
        if self.queue_size < 1:
            raise ValueError("queue_size must be >= 1")
        if not 1 <= self.level <= 22:
            raise ValueError("zstd level must be in 1..22")
        if self.tokens not in PAYLOAD_TOKENS:  # written as /meta payload_tokens
            raise ValueError(f"tokens must be one of {', '.join(PAYLOAD_TOKENS)}, got {self.tokens!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1 or None")
        if self.layers is not None:
            if any(int(x) < 0 for x in self.layers):
                raise ValueError("layer indices must be >= 0")
            self.layers = sorted({int(x) for x in self.layers})
        if self.heads is not None:
            heads = sorted({int(h) for h in self.heads})
            if not heads or heads[0] < 0:
                raise ValueError("heads must be a non-empty list of indices >= 0")
            steps = {b - a for a, b in itertools.pairwise(heads)}
            if len(steps) > 1:  # payload rows describe heads as head_start + i * head_stride
                raise ValueError(f"heads must be evenly spaced (e.g. 0,2,4), got {heads}")
            self.heads = heads

    @property
    def enabled(self) -> bool:
        return self.every_n_steps > 0

    def head_range(self) -> tuple[int, int, int] | None:
        """(start, stride, count) of the head selection, or None for all heads."""
        if self.heads is None:
            return None
        stride = self.heads[1] - self.heads[0] if len(self.heads) > 1 else 1
        return self.heads[0], stride, len(self.heads)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Job:
    request: int
    step: int
    layer: int
    kind: PayloadKind
    dtype: CacheDType
    shape: tuple[int, ...]
    host: Any  # torch.Tensor: the sample's carrier elements, contiguous (pinned on CUDA)
    event: Any  # torch.cuda.Event or None
    head_start: int
    head_stride: int
    token_start: int
    t_ns: int
    pinned_bytes: int


def cache_dtype(dtype: torch.dtype) -> CacheDType | None:
    return TORCH_DTYPE_NAMES.get(str(dtype).removeprefix("torch."))


def encode_samples(jobs: list[_Job], level: int) -> list[EncodedPayload]:
    """Shuffle each staged sample (GIL-free numpy copies) and compress them all in one zstd call."""
    shuffled = []
    for job in jobs:
        elements = job.host.numpy()
        shuffled.append(shuffle_chunks(elements, payload_chunk_elements(elements.dtype.itemsize)))
    frames = compress_shuffled_many(shuffled, level)
    return [
        EncodedPayload(
            job.request, job.step, job.layer, job.kind, job.dtype, job.shape, DTYPE_ITEMSIZE[job.dtype],
            math.prod(job.shape), job_frames, job.head_start, job.head_stride, job.token_start, job.t_ns,
        )
        for job, job_frames in zip(jobs, frames, strict=True)
    ]


def default_workers() -> int:
    """Payload worker threads: half the CPUs this process may run on, 2 to 8. Each one shuffles
    and compresses with the GIL released, so they run in parallel; the other half of the CPUs
    stays with the model's thread and everything else on the host."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 2
    return max(2, min(8, cpus // 2))


class _WriterStopped(Exception):
    """The writer stopped on a storage fault: the queued samples are discarded."""


class PayloadSampler:
    """Selects, copies and (in background threads) writes sampled tensors."""

    def __init__(self, writer: TraceWriter, settings: SamplingSettings, *, workers: int | None = None) -> None:
        self.writer = writer
        self.settings = settings
        self.written = 0
        self.dropped = 0
        self.failed = 0
        self.skipped = 0  # unsupported dtype/device or nothing left after selection
        self.last_error = ""
        self.last_skip = ""
        self.own_device_bytes = 0  # peak device bytes the sampler itself held (staging temporaries)
        self._own_by_device: dict[int, int] = {}
        self._pinned_in_flight = 0
        self.pinned_host_bytes_peak = 0
        self._streams: dict[int, Any] = {}
        self._batch: StagingBatch | None = None  # open while a sampling step stages its tensors
        self._batch_jobs: list[tuple[_Job, int]] = []
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        # Copy events of queued jobs that no worker has waited for yet: id -> [event, jobs]
        # (request end waits for these only, not for the encoding and writing).
        self._copies: dict[int, list] = {}
        self._slots = threading.Semaphore(settings.queue_size)
        # Work items are lists of jobs: a sampling step's samples travel as one item per worker, so
        # a worker waits on one event and compresses them all in one call.
        self._jobs: queue.SimpleQueue[list[_Job] | None] = queue.SimpleQueue()
        self._closed = False
        self._stats: dict[str, int] | None = None
        self._workers = [
            threading.Thread(target=self._work, name=f"kvtrace-payload-{i}", daemon=True)
            for i in range(max(1, default_workers() if workers is None else workers))
        ]
        for worker in self._workers:
            worker.start()

    def _writer_stopped(self) -> bool:
        """The writer stopped on a storage fault: nothing can be stored any more."""
        return bool(getattr(self.writer, "failed", False))

    # ---- what to sample --------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    def wants(self, step: int, *, is_prefill: bool, is_last: bool) -> bool:
        """Sample at this step? Prefill end, the last step and every N-th decode step."""
        s = self.settings
        if not s.enabled or self._closed or self._writer_stopped():  # nothing can be stored any more
            return False
        if is_prefill:
            return s.at_prefill_end
        return (is_last and s.at_last_step) or step % s.every_n_steps == 0

    def wants_layer(self, layer: int) -> bool:
        layers = self.settings.layers
        return layers is None or layer in layers

    def wants_kind(self, kind: PayloadKind) -> bool:
        if kind == PayloadKind.QUERY:
            return self.settings.queries
        if kind in _SHARED_ACROSS_HEADS:
            return self.settings.latents
        return True

    # ---- submitting (generating thread) ------------------------------------------------------

    def submit(
        self,
        request: int,
        step: int,
        layer: int,
        kind: PayloadKind,
        tensor: torch.Tensor,
        *,
        token_start: int = 0,
        group_size: int | None = None,
        mutable: bool | None = None,
    ) -> bool:
        """Enqueue one sample without blocking. False if not selected, unsupported or dropped.

        ``tensor`` is [B, H, T, D] (or [B, T, D]); heads and the last ``max_tokens`` tokens are
        selected here. For queries, ``group_size`` (query heads per KV head) maps the KV-head
        selection onto query heads; without it (or for strided selections with groups) all
        query heads are kept. No reference to ``tensor`` survives this call.

        ``mutable`` (CUDA only): may this memory be written in place after submit (static,
        sliding-static, offloaded caches)? Then the main stream waits for the copy on the GPU.
        Pass False for tensors nobody overwrites (DynamicLayer K/V, queries: the default for
        QUERY): the copy then overlaps the next kernels, and the allocator is told not to reuse
        the memory before the copy is done.
        """
        kind = PayloadKind(kind)
        if self._closed or self._writer_stopped() or not self.wants_layer(layer) or not self.wants_kind(kind):
            return False
        dtype = cache_dtype(tensor.dtype)
        if dtype is None or tensor.device.type == "meta" or tensor.dim() > PAYLOAD_MAX_NDIM:
            self._count_skip(f"cannot sample a {tensor.dim()}-d {tensor.dtype} on {tensor.device}")
            return False
        view, head_start, head_stride, token_start = self._select(tensor, kind, token_start, group_size)
        if view is None:
            self._count_skip(f"head selection leaves nothing of a {tuple(tensor.shape)} tensor")
            return False
        if not self._slots.acquire(blocking=False):
            with self._lock:
                self.dropped += 1
            return False
        shape = tuple(view.shape)
        index, event = -1, None
        try:
            view = carrier_bits(view)
            if view.device.type == "cuda":
                in_place = kind != PayloadKind.QUERY if mutable is None else mutable
                index = _device_index(view)
                if self._batch is not None:
                    host = self._stage_cuda(self._batch, view, index, in_place)
                else:  # a copy outside batch(): a batch of one, closed even if the copy failed
                    single = StagingBatch(self._streams)
                    try:
                        host = self._stage_cuda(single, view, index, in_place)
                    finally:
                        events = single.close()  # leaves the side stream's context
                    event = events[index]
            else:  # a plain copy: clone() always copies, so the cache's storage is not shared
                host = view.to("cpu").clone(memory_format=_contiguous())
        except Exception as exc:  # noqa: BLE001 - sampling must never break generation
            self._slots.release()
            with self._lock:
                self.failed += 1
                self.last_error = f"copy: {type(exc).__name__}: {exc}"
            return False
        del view  # the copy is enqueued: drop our reference to the cache memory now
        nbytes = host.numel() * host.element_size()
        job = _Job(request, step, layer, kind, dtype, shape, host, event, head_start,
                   head_stride, token_start, monotonic_ns(), nbytes if index >= 0 else 0)
        if index >= 0 and event is None:
            self._batch_jobs.append((job, index))  # queued when the batch closes, with its event
            return True
        self._enqueue([job])
        return True

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Stage every CUDA sample submitted inside on one side stream per device, closed by one
        event: what a sampling step does for all its layers. Jobs reach the workers at exit."""
        if self._batch is not None:  # nested: the outer batch closes
            yield
            return
        self._batch = StagingBatch(self._streams)
        try:
            yield
        finally:
            batch, self._batch = self._batch, None
            jobs, self._batch_jobs = self._batch_jobs, []
            try:
                events = batch.close()
            except Exception as exc:  # noqa: BLE001 - counted, never raised into generation
                for _ in jobs:
                    self._slots.release()
                with self._lock:
                    self.failed += len(jobs)
                    self.last_error = f"copy: {type(exc).__name__}: {exc}"
                jobs = []
            for job, index in jobs:
                job.event = events[index]
            self._enqueue([job for job, _index in jobs])

    def _enqueue(self, jobs: list[_Job]) -> None:
        """Queue jobs as at most one item per worker, balanced by bytes."""
        if not jobs:
            return
        with self._lock:
            self._pending += len(jobs)
            for job in jobs:
                if job.event is not None:
                    self._copies.setdefault(id(job.event), [job.event, 0])[1] += 1
            self._pinned_in_flight += sum(job.pinned_bytes for job in jobs)
            self.pinned_host_bytes_peak = max(self.pinned_host_bytes_peak, self._pinned_in_flight)
        items: list[list[_Job]] = [[] for _ in range(min(len(jobs), len(self._workers)))]
        loads = [0] * len(items)
        for job in sorted(jobs, key=lambda j: -j.host.numel() * j.host.element_size()):
            lightest = loads.index(min(loads))
            items[lightest].append(job)
            loads[lightest] += job.host.numel() * job.host.element_size()
        for item in items:
            self._jobs.put(sorted(item, key=lambda j: (j.layer, int(j.kind))))

    def _count_skip(self, why: str) -> None:
        with self._lock:
            self.skipped += 1
            self.last_skip = why

    def _select(
        self, tensor: torch.Tensor, kind: PayloadKind, token_start: int, group_size: int | None
    ) -> tuple[torch.Tensor | None, int, int, int]:
        """View of the selected heads and last tokens; (view, head_start, head_stride, token_start)."""
        view = tensor
        head_start, head_stride = 0, 1
        if view.dim() == 4:
            picked = self._head_pick(view.shape[1], kind, group_size)
            if picked is None:
                return None, 0, 1, token_start
            start, stride, count = picked
            if (start, stride, count) != (0, 1, view.shape[1]):
                view = view[:, start : start + stride * (count - 1) + 1 : stride]
            head_start, head_stride = start, stride
        token_dim = token_axis(view)
        limit = self.settings.max_tokens
        if token_dim is not None and limit is not None and view.shape[token_dim] > limit:
            cut = view.shape[token_dim] - limit
            view = view.narrow(token_dim, cut, limit)
            token_start += cut
        return view, head_start, head_stride, token_start

    def _head_pick(self, n_heads: int, kind: PayloadKind, group_size: int | None) -> tuple[int, int, int] | None:
        selection = self.settings.head_range()
        if selection is None or kind in _SHARED_ACROSS_HEADS:
            return 0, 1, n_heads
        start, stride, count = selection
        if kind == PayloadKind.QUERY:
            g = group_size or 0
            if g == 1:
                pass
            elif g > 1 and stride == 1:  # KV heads s..s+n-1 serve query heads s*g..(s+n)*g-1
                start, count = start * g, count * g
            else:
                return 0, 1, n_heads
        count = min(count, max(0, -(-(n_heads - start) // stride)))
        return (start, stride, count) if count > 0 else None

    def _stage_cuda(self, batch: StagingBatch, view: torch.Tensor, index: int, in_place: bool) -> torch.Tensor:
        """Enqueue the copy to pinned memory in ``batch``; counts the sampler's own device
        temporaries. Returns the pinned host tensor."""
        host, own = batch.copy(view, index, in_place=in_place)
        with self._lock:
            self._own_by_device[index] = max(self._own_by_device.get(index, 0), own)
            self.own_device_bytes = max(self.own_device_bytes, own)
        return host

    # ---- background writing ------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            jobs = self._jobs.get()
            if jobs is None:
                return
            written, error = 0, ""
            try:
                try:
                    for event in {id(j.event): j.event for j in jobs if j.event is not None}.values():
                        event.synchronize()  # this worker waits, the generating thread never does
                finally:
                    self._copies_done(jobs)
                if self._writer_stopped():  # stopped on a storage fault: skip the encoding too
                    raise _WriterStopped
                for payload in encode_samples(jobs, self.settings.level):
                    try:
                        if self.writer.write_payload(payload) is not False:  # False: writer stopped
                            written += 1
                    except Exception as exc:  # noqa: BLE001 - counted; the trace records it at close
                        error = f"write: {type(exc).__name__}: {exc}"
            except _WriterStopped:
                error = "write: the trace writer stopped on a storage failure"
            except Exception as exc:  # noqa: BLE001 - the copy or the encoding failed
                error = f"write: {type(exc).__name__}: {exc}"
            failed = len(jobs) - written
            pinned = sum(job.pinned_bytes for job in jobs)
            for job in jobs:
                job.host = job.event = None
            with self._lock:
                self.written += written
                self.failed += failed
                if error:
                    self.last_error = error
                self._pinned_in_flight -= pinned
                self._pending -= len(jobs)
                if self._pending == 0:
                    self._idle.notify_all()
            for _ in jobs:
                self._slots.release()

    def _copies_done(self, jobs: list[_Job]) -> None:
        with self._lock:
            for job in jobs:
                entry = self._copies.get(id(job.event)) if job.event is not None else None
                if entry is not None:
                    entry[1] -= 1
                    if entry[1] <= 0:
                        del self._copies[id(job.event)]

    def wait_copies(self) -> None:
        """Wait until every queued sample's device->host copy is done (its staging event fired),
        not for its encoding and writing: what request end needs, so that no staged copy still
        reads (or keeps a temporary in) device memory when the AFTER_RETURN reading is taken.
        The workers finish the rest in the background; :meth:`close` joins them. On CPU the copy
        was made in :meth:`submit`, so this returns at once."""
        with self._lock:
            events = [event for event, _n in self._copies.values()]
        for event in events:
            event.synchronize()  # a worker may wait on the same event: both return when it fires

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued sample is written (or failed). False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout=timeout)

    def own_device_bytes_on(self, device: int) -> int:
        """Peak device bytes the sampler itself held on ``device`` (0 if it never staged there)."""
        with self._lock:
            return self._own_by_device.get(device, 0)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "written": self.written,
                "dropped": self.dropped,
                "failed": self.failed,
                "skipped": self.skipped,
                "own_device_bytes": self.own_device_bytes,
                "pinned_host_bytes_peak": self.pinned_host_bytes_peak,
            }

    def close(self) -> dict[str, int]:
        """Drain, stop the workers, record drops (DROPPED_SAMPLES), failures (RECORDER_ERROR)
        and skipped samples (NOTE).
        Idempotent; returns the stats. The session writes the RECORDER_OWN readings (per
        request, from ``own_device_bytes_on``), so they are not written twice here."""
        if self._stats is not None:
            return self._stats
        self._closed = True
        self.drain()
        for _ in self._workers:
            self._jobs.put(None)
        for worker in self._workers:
            worker.join()
        self._stats = self.stats()
        if self._writer_stopped():
            return self._stats  # nothing more can be stored; the counts stay in the stats
        try:
            self._record_close()
        except RuntimeError:  # writer already closed: the counts stay in the returned stats
            pass
        return self._stats

    def _record_close(self) -> None:
        w, s, t = self.writer, self._stats or {}, monotonic_ns()
        if s.get("dropped"):
            off, n = w.add_text(
                f"{s['dropped']} sample(s) dropped: {self.settings.queue_size} already in flight"
            )
            w.append("events", (t, int(EventKind.DROPPED_SAMPLES), -1, -1, -1, -1, s["dropped"], off, n))
        if s.get("skipped"):
            off, n = w.add_text(f"sampling: {s['skipped']} sample(s) skipped, last: {self.last_skip}")
            w.append("events", (t, int(EventKind.NOTE), -1, -1, -1, -1, s["skipped"], off, n))
        if s.get("failed"):
            off, n = w.add_text(f"sampling: {s['failed']} sample(s) failed, last: {self.last_error}")
            w.append("events", (t, int(EventKind.RECORDER_ERROR), -1, -1, -1, -1, s["failed"], off, n))


def token_axis(tensor: torch.Tensor) -> int | None:
    """The token axis of a sampled tensor: [B, H, T, D] or [B, T, D] (latents); None otherwise."""
    return PAYLOAD_TOKEN_AXIS.get(tensor.dim())


def unsampled_tokens(tensor: torch.Tensor, start: int, until: int | None) -> tuple[torch.Tensor | None, int]:
    """The part of ``tensor`` (tokens ``start..``) at positions >= ``until`` (the end of what
    earlier samples hold; None: nothing sampled yet), and its first position. (None, until) when
    nothing is new. A view: no copy."""
    axis = token_axis(tensor)
    if until is None or axis is None or until <= start:
        return tensor, start
    count = tensor.shape[axis]
    cut = until - start
    if cut >= count:
        return None, until
    return tensor.narrow(axis, cut, count - cut), until


def _device_index(t: torch.Tensor) -> int:
    import torch

    index = t.device.index
    return index if index is not None else torch.cuda.current_device()


def _contiguous() -> Any:
    import torch

    return torch.contiguous_format
