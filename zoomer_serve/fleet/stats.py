"""Robust statistics for comparing replicas with their peers: median and MAD, never means.

The modified z-score of Iglewicz and Hoaglin: ``z = 0.6745 * (x - median) / MAD``, MAD = median absolute
deviation from the median. 0.6745 makes the MAD a consistent estimate of the standard deviation for normal
data, so ``|z| >= 3.5`` (their threshold) flags what lies far out whatever the other replicas' spread, and one
or two slow replicas cannot drag the reference with them as they drag a mean. When more than half of the peers
share one value (MAD = 0), the mean absolute deviation from the median stands in (scaled by 0.7979, its
normal-consistency constant); when that is 0 too, every peer has the same value and any different one is an
outlier (z = +-inf).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

Z_THRESHOLD = 3.5
MAD_SCALE = 0.6745
MEANAD_SCALE = 0.7979


@dataclass(frozen=True)
class Robust:
    """``median``, ``mad`` (median absolute deviation) and ``scale`` (the deviation a z of 1 means) of a
    sample; ``n`` values."""

    median: float
    mad: float
    scale: float
    n: int

    def z(self, x: float) -> float:
        """The modified z-score of ``x`` (+-inf when the peers do not vary and ``x`` differs; 0 when equal)."""
        d = x - self.median
        if self.scale > 0:
            return d / self.scale
        return 0.0 if d == 0 else math.copysign(math.inf, d)


def robust(values: np.ndarray | list[float]) -> Robust:
    """Median, MAD and the z-score scale of ``values`` (NaN left out). Raises ValueError: no value."""
    v = np.asarray(values, dtype=np.float64)
    v = v[~np.isnan(v)]
    if not len(v):
        raise ValueError("no values")
    med = float(np.median(v))
    dev = np.abs(v - med)
    mad = float(np.median(dev))
    if mad > 0:
        scale = mad / MAD_SCALE
    else:
        meanad = float(dev.mean())
        scale = meanad / MEANAD_SCALE if meanad > 0 else 0.0
    return Robust(med, mad, scale, int(len(v)))


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p): how likely ``k`` or more of ``n`` requests lie above a quantile that
    ``p`` of requests exceed, by chance. Exact (a sum of log-space terms) near the mean; 0.0 when ``k`` is more
    than 12 standard deviations above it (far below any threshold used here)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    mean, sd = n * p, math.sqrt(n * p * (1 - p))
    if k > mean + 12 * sd + 12:
        return 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    below = 0.0
    for i in range(k):  # P(X < k), k is at most a few standard deviations past the mean here
        below += math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p
                          + (n - i) * log_q)
    return max(0.0, 1.0 - below)
