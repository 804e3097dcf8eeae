"""Small numeric helpers shared by detectors (numpy only)."""

from __future__ import annotations

import numpy as np

# Scale that makes the MAD a consistent estimator of the standard deviation for normal data.
MAD_TO_SIGMA = 1.4826


def ramp(x: float, lo: float, hi: float) -> float:
    """0 at or below `lo`, 1 at or above `hi`, linear in between: how scores grow with evidence."""
    if not np.isfinite(x):
        return 1.0 if x > 0 else 0.0
    if x <= lo:
        return 0.0
    if x >= hi:
        return 1.0
    return float((x - lo) / (hi - lo))


def cv(values: np.ndarray) -> float:
    """Coefficient of variation (population std / mean); 0 for an empty or all-zero set."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return 0.0
    mean = float(v.mean())
    if mean == 0:
        return 0.0
    return float(v.std() / mean)


def median_mad(values: np.ndarray) -> tuple[float, float]:
    v = np.asarray(values, dtype=np.float64)
    med = float(np.median(v))
    return med, float(np.median(np.abs(v - med)))


def robust_z(values: np.ndarray, center: float, mad: float) -> np.ndarray:
    """(x - center) / (1.4826 MAD); where the MAD is 0 (identical layers are the norm) any
    deviation is infinitely far, so callers must also look at the relative deviation."""
    v = np.asarray(values, dtype=np.float64)
    dev = v - center
    if mad > 0:
        return dev / (MAD_TO_SIGMA * mad)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(dev == 0, 0.0, np.sign(dev) * np.inf)


def linear_fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Least-squares line y = a + b x: returns (slope b, intercept a, r^2). r^2 is 1 for a
    perfect fit and 0 where y does not vary."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.size < 2 or np.ptp(x) == 0:
        return 0.0, float(y.mean()) if y.size else 0.0, 0.0
    b, a = np.polyfit(x, y, 1)
    resid = y - (a + b * x)
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum(resid**2)) / ss_tot if ss_tot > 0 else 0.0
    return float(b), float(a), r2


def safe_ratio(num: float, den: float) -> float:
    """num / den, inf for a positive number over 0, 0 for 0 / 0."""
    if den == 0:
        return 0.0 if num == 0 else float("inf") * (1 if num > 0 else -1)
    return float(num) / float(den)
