"""QuantizedCache with the quanto (optimum-quanto) and HQQ (hqq) backends: the recorder counts the
packed integer data, the per-group scales and shifts (zeros), and the full-precision residual,
byte for byte. Each backend's test skips, saying so, where its package is not installed.

The expectation is computed here from the config and the cache's documented rule, independently
of what the recorder read: the prompt is quantized whole; each decode step appends its token to
the residual, unless the residual would reach ``residual_length``, in which case everything seen
so far is re-quantized and the residual emptied. A quantized tensor of n elements at ``nbits``
takes n * nbits / 8 bytes of packed data plus one fp32 scale and one fp32 shift per group of
``q_group_size`` elements (both backends; HQQ's 3-bit packing, 10 values per int32, is not
covered).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from rec_helpers import model  # noqa: E402

import kvtrace  # noqa: E402
from kvtrace.format.reader import Trace  # noqa: E402
from kvtrace.format.schema import LayerType  # noqa: E402
from kvtrace.format.validate import validate  # noqa: E402
from tests.helpers.models import tiny_prompt  # noqa: E402

PROMPT, NEW = 6, 24
RESIDUAL, GROUP = 8, 16


def _expected_per_layer(step: int, kv_heads: int, head_dim: int, nbits: int, elem: int) -> tuple[int, int]:
    """(tokens seen, bytes of one layer's K + V) after ``step`` (0 = prefill)."""
    quantized, residual = PROMPT, 0
    for _ in range(step):
        if residual + 1 >= RESIDUAL:
            quantized, residual = quantized + residual + 1, 0
        else:
            residual += 1
    n = kv_heads * quantized * head_dim
    one_tensor = n * nbits // 8 + 2 * (n // GROUP) * 4 + kv_heads * residual * head_dim * elem
    return quantized + residual, 2 * one_tensor


_PACKAGES = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq.core.quantize", "hqq")}
_AXES = {"hqq": {"axis_key": 1, "axis_value": 1}}  # transformers' documented HQQ KV setting


@pytest.mark.parametrize(("backend", "nbits"), [("quanto", 2), ("quanto", 4), ("hqq", 2), ("hqq", 4), ("hqq", 8)])
def test_quantized_layers_counted_byte_for_byte(tmp_path, backend, nbits):
    module, package = _PACKAGES[backend]
    pytest.importorskip(module, reason=f"{package} is not installed")
    m = model("llama")
    cfg = m.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    path = tmp_path / f"{backend}{nbits}.kvt.h5"
    with kvtrace.record(m, path, structure_every=1) as rec:
        m.generate(tiny_prompt(PROMPT), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                   cache_implementation="quantized",
                   cache_config={"backend": backend, "nbits": nbits, "residual_length": RESIDUAL,
                                 "q_group_size": GROUP, **_AXES.get(backend, {})})
    assert rec.recorder_errors == 0, dict(rec.errors)
    assert validate(path).valid
    with Trace(path) as t:
        kv = t.kv[:]
    assert set(kv["layer_type"].tolist()) == {int(LayerType.QUANTIZED)}
    steps = sorted(set(kv["step"].tolist()))
    assert steps == list(range(NEW))
    expected = [_expected_per_layer(step, cfg.num_key_value_heads, head_dim, nbits, 4) for step in steps]
    for step, (seen, per_layer) in zip(steps, expected, strict=True):
        rows = kv[kv["step"] == step]
        assert len(rows) == cfg.num_hidden_layers
        assert rows["tokens_seen"].tolist() == [seen] * len(rows), step
        assert rows["bytes_allocated"].tolist() == [per_layer] * len(rows), step
        assert rows["bytes_unique"].tolist() == [per_layer] * len(rows), step
    # the residual was folded into the quantized data (bytes drop) more than once
    assert sum(b[1] < a[1] for a, b in zip(expected, expected[1:], strict=False)) >= 2
