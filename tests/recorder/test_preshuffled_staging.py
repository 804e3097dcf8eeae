"""The GPU staging's shuffle (plain torch, run here on CPU tensors) produces exactly the numpy
shuffle's bytes, and the sampler's worker path writes the frames encode_payload would write, for
preshuffled (CUDA) and unshuffled (CPU) jobs alike."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvtrace.format import CacheDType, PayloadKind, TraceWriter, encode_payload, schema  # noqa: E402
from kvtrace.format.codec import shuffle_chunks  # noqa: E402
from kvtrace.recorder.sampling import PayloadSampler, SamplingSettings, _Job, encode_sample  # noqa: E402
from kvtrace.recorder.staging import carrier_bits, shuffled_chunks  # noqa: E402

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


@pytest.mark.parametrize(("dtype", "code"), DTYPES, ids=IDS)
@pytest.mark.parametrize("shape", [(1, 2, 3, 4), (2, 4, 8, 8), (1, 4, 4, 4)], ids=["ragged", "multi", "exact"])
def test_torch_shuffle_equals_numpy_shuffle(dtype, code, shape) -> None:
    chunk = 16  # tiny chunks: 24 elements are ragged, 512 many chunks, 64 an exact multiple
    cache = _random_bits(shape, dtype, seed=sum(shape))
    for name, view in _views(cache).items():
        got, own = shuffled_chunks(carrier_bits(view), chunk)
        want = shuffle_chunks(_numpy_bits(view), chunk)
        assert got.dtype == torch.uint8 and got.is_contiguous(), name
        np.testing.assert_array_equal(got.numpy(), want, err_msg=name)
        gathered = 0 if view.is_contiguous() else view.numel() * view.element_size()
        assert own == got.numel() + gathered, name


@pytest.mark.parametrize(("dtype", "code"), DTYPES, ids=IDS)
def test_real_chunk_size(dtype, code) -> None:
    size = torch.empty((), dtype=dtype).element_size()
    chunk = schema.payload_chunk_elements(size)
    for n in (chunk // 5, 2 * chunk, 2 * chunk + 3):  # < 1 chunk, exact multiple, ragged
        t = _random_bits((1, 1, n, 1), dtype, seed=n)
        got, _ = shuffled_chunks(carrier_bits(t), chunk)
        np.testing.assert_array_equal(got.numpy(), shuffle_chunks(_numpy_bits(t), chunk))


def test_chunks_never_alias_the_cache() -> None:
    cache = _random_bits((1, 2, 8, 4), torch.int8, seed=1)  # 64 one-byte elements: 4 exact chunks
    got, own = shuffled_chunks(carrier_bits(cache), 16)
    before = got.clone()
    cache.view(torch.uint8).zero_()
    assert torch.equal(got, before) and own == got.numel()


def _job(view: torch.Tensor, code: CacheDType, *, on_gpu_path: bool) -> _Job:
    """A job as submit() builds it: shuffled chunks (CUDA path) or carrier elements (CPU path)."""
    bits = carrier_bits(view)
    if on_gpu_path:
        host, _ = shuffled_chunks(bits, schema.payload_chunk_elements(bits.element_size()))
    else:
        host = bits.contiguous().clone()
    return _Job(3, 5, 7, PayloadKind.VALUE, code, tuple(view.shape), host, on_gpu_path, None,
                1, 2, 9, 123, 0)


@pytest.mark.parametrize(("dtype", "code"), DTYPES, ids=IDS)
@pytest.mark.parametrize("tokens", [5, 600])  # < 1 chunk for every dtype; > 1 chunk, ragged
def test_worker_frames_equal_encode_payload(dtype, code, tokens) -> None:
    view = _random_bits((1, 4, tokens, 64), dtype, seed=tokens)[:, ::2]  # a head selection
    want = encode_payload(3, 5, 7, PayloadKind.VALUE, code, _numpy_bits(view), head_start=1,
                          head_stride=2, token_start=9, t_ns=123, level=1)
    for on_gpu_path in (True, False):
        got = encode_sample(_job(view, code, on_gpu_path=on_gpu_path), level=1)
        assert got == want, f"on_gpu_path={on_gpu_path}"


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
