"""Small order statistics shared by the triggers and the session summary."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0 < q <= 100) of ascending ``sorted_values``; raises ValueError when
    empty."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def coefficient_of_variation(values: Sequence[float]) -> float:
    """Population standard deviation / mean of ``values`` (inf when the mean is 0); raises ValueError when
    empty."""
    if not values:
        raise ValueError("coefficient of variation of no values")
    mean = sum(values) / len(values)
    if mean == 0:
        return math.inf
    var = sum((v - mean) ** 2 for v in values) / len(values)
    return math.sqrt(var) / mean
