"""The sampler's worker path (GIL-free shuffle of the staged elements, then compression) writes
exactly the frames encode_payload would write."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvtrace.format import CacheDType, PayloadKind, TraceWriter, encode_payload, schema  # noqa: E402
from kvtrace.recorder.sampling import PayloadSampler, SamplingSettings, _Job, encode_samples  # noqa: E402
from kvtrace.recorder.staging import carrier_bits  # noqa: E402

DTYPES = [
    (torch.bfloat16, CacheDType.BFLOAT16),
    (torch.float16, CacheDType.FLOAT16),
    (torch.float32, CacheDType.FLOAT32),
    (torch.float8_e4m3fn, CacheDType.FLOAT8_E4M3FN),
    (torch.int8, CacheDType.INT8),
]
IDS = [str(d[0]).removeprefix("torch.") for d in DTYPES]


def _random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, size), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def _numpy_bits(t: torch.Tensor) -> np.ndarray:
    return carrier_bits(t.contiguous()).numpy()


def _views(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the sampler stages: the whole cache, head/token selections, a transposed layout."""
    return {
        "whole": t,
        "heads": t[:, 1::2],
        "tokens": t.narrow(2, 1, t.shape[2] - 1),
        "transposed": t.transpose(2, 3),
    }


def _job(view: torch.Tensor, code: CacheDType) -> _Job:
    """A job as submit() builds it: the view's carrier elements, contiguous."""
    host = carrier_bits(view).contiguous().clone()
    return _Job(3, 5, 7, PayloadKind.VALUE, code, tuple(view.shape), host, None, 1, 2, 9, 123, 0)


@pytest.mark.parametrize(("dtype", "code"), DTYPES, ids=IDS)
@pytest.mark.parametrize("tokens", [5, 600])  # < 1 chunk for every dtype; > 1 chunk, ragged
def test_worker_frames_equal_encode_payload(dtype, code, tokens) -> None:
    view = _random_bits((1, 4, tokens, 64), dtype, seed=tokens)
    for name, v in _views(view).items():
        want = encode_payload(3, 5, 7, PayloadKind.VALUE, code, _numpy_bits(v), head_start=1,
                              head_stride=2, token_start=9, t_ns=123, level=1)
        assert encode_samples([_job(v, code)], level=1) == [want], name


def test_sampler_stores_the_frames_encode_payload_writes(tmp_path) -> None:
    """The CPU sampler end to end: the chunks in the file are encode_payload's frames, byte for byte."""
    k = _random_bits((2, 3, 40_000, 2), torch.bfloat16, seed=4)  # 240,000 elements: 2 chunks, ragged
    path = tmp_path / "frames.kvt.h5"
    with TraceWriter(path) as writer:
        sampler = PayloadSampler(writer, SamplingSettings(every_n_steps=1, level=1))
        assert sampler.submit(0, 0, 0, PayloadKind.KEY, k)
        assert sampler.close()["written"] == 1
    want = encode_payload(0, 0, 0, PayloadKind.KEY, CacheDType.BFLOAT16, _numpy_bits(k), level=1).frames
    import h5py

    with h5py.File(path, "r") as f:
        ds = f[schema.payload_dataset_name(2)]
        chunk = schema.payload_chunk_elements(2)
        stored = [ds.id.read_direct_chunk((i * chunk,)) for i in range(len(want))]
        assert ds.shape[0] == len(want) * chunk
    assert [mask for mask, _ in stored] == [0] * len(want)
    assert [bytes(frame) for _, frame in stored] == want
