"""Decode stored element bits to float32 without torch (numpy has no bf16 or fp8)."""

from __future__ import annotations

from functools import cache

import numpy as np

from kvtrace.format.schema import CacheDType


@cache
def _fp8_table(exp_bits: int, man_bits: int, bias: int, has_inf: bool) -> np.ndarray:
    codes = np.arange(256, dtype=np.uint32)
    sign = np.where(codes >> 7, -1.0, 1.0)
    exp = (codes >> man_bits) & ((1 << exp_bits) - 1)
    man = codes & ((1 << man_bits) - 1)
    frac = man / float(1 << man_bits)
    normal = (1.0 + frac) * np.exp2(exp.astype(np.float64) - bias)
    subnormal = frac * np.exp2(1.0 - bias)
    values = sign * np.where(exp == 0, subnormal, normal)
    top = (1 << exp_bits) - 1
    if has_inf:  # e5m2: IEEE-like top exponent
        values = np.where((exp == top) & (man == 0), sign * np.inf, values)
        values = np.where((exp == top) & (man != 0), np.nan, values)
    else:  # e4m3fn: only S.1111.111 is NaN, no infinities
        values = np.where((exp == top) & (man == (1 << man_bits) - 1), np.nan, values)
    return values.astype(np.float32)


def to_float32(raw: np.ndarray, dtype: CacheDType) -> np.ndarray:
    """Interpret raw carrier elements (uint8/uint16/...) as `dtype` and widen to float32."""
    dtype = CacheDType(dtype)
    if dtype == CacheDType.BFLOAT16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype == CacheDType.FLOAT16:
        return raw.view(np.float16).astype(np.float32)
    if dtype == CacheDType.FLOAT32:
        return raw.view(np.float32).copy()
    if dtype == CacheDType.FLOAT64:
        return raw.view(np.float64).astype(np.float32)
    if dtype == CacheDType.FLOAT8_E4M3FN:
        return _fp8_table(4, 3, 7, False)[raw.view(np.uint8)]
    if dtype == CacheDType.FLOAT8_E5M2:
        return _fp8_table(5, 2, 15, True)[raw.view(np.uint8)]
    if dtype == CacheDType.INT8:
        return raw.view(np.int8).astype(np.float32)
    if dtype == CacheDType.UINT8:
        return raw.view(np.uint8).astype(np.float32)
    if dtype == CacheDType.INT32:
        return raw.view(np.int32).astype(np.float32)
    if dtype == CacheDType.INT64:
        return raw.view(np.int64).astype(np.float32)
    raise ValueError(f"cannot widen {dtype.name} to float32")
