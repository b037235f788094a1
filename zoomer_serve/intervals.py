"""Unions of time intervals (numpy arrays of starts and ends, any one unit), shared by the trace summary of a
profiling session and the analysis."""

from __future__ import annotations

import numpy as np


def merge_intervals(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals ``[start, end)`` as sorted, disjoint ``(starts, ends)`` arrays."""
    if len(start) == 0:
        return np.empty(0), np.empty(0)
    order = np.argsort(start, kind="stable")
    s = np.asarray(start, dtype=np.float64)[order]
    e = np.asarray(end, dtype=np.float64)[order]
    reach = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    idx = np.flatnonzero(new)
    return s[idx], np.maximum.reduceat(e, idx)


def union_length(start: np.ndarray, end: np.ndarray) -> float:
    """Total length covered by intervals ``[start, end)`` (overlaps counted once)."""
    s, e = merge_intervals(start, end)
    return float((e - s).sum())
