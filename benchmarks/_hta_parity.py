"""The figures zoomer-serve and Holistic Trace Analysis (HTA, package ``traceinsight``; ``pip install -e
'.[hta]'``) both compute, from each side, and their differences. Used by ``benchmarks/analysis_speed.py``
(the largest shared trace) and ``tests/test_analysis_hta.py`` (the others).

Compared, on rank 0 / the trace's one device: the temporal breakdown (window, busy, idle, computation and
non-computation time), idle time per stream and category (host wait, kernel wait, other), GPU time per
exact combination of kernel types, and per kernel name its count-free statistics (sum, mean, min, max).
Ours run with ``Conventions("hta", steps)``, HTA with its defaults except ``include_last_profiler_step``
(True for ``steps == "all"``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

ABS_US = 0.01  # HTA rounds its idle table to 2 decimals


def ours(trace: Any, steps: str, conventions: str = "hta") -> dict[str, Any]:
    """Our figures for a loaded :class:`KinetoTrace` (under HTA's conventions unless told otherwise)."""
    from zoomer_serve.analysis.breakdown import kernel_type_breakdown, time_breakdown
    from zoomer_serve.analysis.conventions import Conventions, apply_conventions
    from zoomer_serve.analysis.kernels import kernel_breakdown
    from zoomer_serve.analysis.timeline import gpu_utilization

    t = apply_conventions(trace, Conventions(conventions, steps))
    tb = time_breakdown(t).rows()[0]
    util = gpu_utilization(t)
    kb = kernel_breakdown(t)
    idle = {}
    for r in util.rows():
        if r["stream"] >= 0:
            for cat, col in (("host_wait", "host_wait_us"), ("kernel_wait", "kernel_wait_us"), ("other", "other_idle_us")):
                idle[f"{r['stream']}/{cat}"] = r[col]
    return {
        "temporal": {"window": tb["window_us"], "busy": tb["busy_us"], "idle": tb["idle_us"],
                     "computation": tb["computation_us"], "non_computation": tb["non_computation_us"]},
        "idle_by_stream": idle,
        "kernel_type": {r["types"]: r["time_us"] for r in kernel_type_breakdown(t).rows()},
        "kernel_sum": dict(zip(kb["name"].tolist(), kb["total_us"].tolist())),
        "kernel_mean": dict(zip(kb["name"].tolist(), kb["mean_us"].tolist())),
        "kernel_min": dict(zip(kb["name"].tolist(), kb["min_us"].tolist())),
        "kernel_max": dict(zip(kb["name"].tolist(), kb["max_us"].tolist())),
    }


def hta(path: str | os.PathLike[str], steps: str) -> dict[str, Any]:
    """HTA's figures for the trace file (HTA's defaults but ``include_last_profiler_step``)."""
    logging.disable(logging.WARNING)
    from hta.trace_analysis import TraceAnalysis

    p = Path(path)
    ta = TraceAnalysis(trace_files={0: str(p)}, trace_dir=str(p.parent), include_last_profiler_step=steps == "all")
    return hta_figures(ta)


def hta_figures(ta: Any) -> dict[str, Any]:
    """HTA's figures from a ``TraceAnalysis`` (its temporal, idle time and kernel breakdowns)."""
    temporal = ta.get_temporal_breakdown(visualize=False).iloc[0]
    idle_df, _ = ta.get_idle_time_breakdown(visualize=False)
    types, kernels = ta.get_gpu_kernel_breakdown(visualize=False, num_kernels=10**9, duration_ratio=1.0,
                                                 include_memory_kernels=True)
    window, idle = float(temporal["kernel_time(us)"]), float(temporal["idle_time(us)"])
    names = kernels["name"].tolist()
    return {
        "temporal": {"window": window, "busy": window - idle, "idle": idle,
                     "computation": float(temporal["compute_time(us)"]),
                     "non_computation": float(temporal["non_compute_time(us)"])},
        "idle_by_stream": {f"{s}/{c}": float(v) for s, c, v in
                           zip(idle_df["stream"], idle_df["idle_category"], idle_df["idle_time"])},
        "kernel_type": dict(zip(types["kernel_type"].tolist(), types["sum"].astype(float).tolist())),
        "kernel_sum": dict(zip(names, kernels["sum (us)"].astype(float).tolist())),
        "kernel_mean": dict(zip(names, kernels["mean (us)"].astype(float).tolist())),
        "kernel_min": dict(zip(names, kernels["min (us)"].astype(float).tolist())),
        "kernel_max": dict(zip(names, kernels["max (us)"].astype(float).tolist())),
    }


def _rel(a: float, b: float) -> float:
    if abs(a - b) <= ABS_US:
        return 0.0
    return abs(a - b) / max(abs(b), 1e-9)


def compare(mine: dict[str, Any], theirs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per figure group: the largest relative difference (``max_rel``), the key where it is, how many keys
    were compared, and the keys only one side has (a missing key counts as 0 on that side)."""
    out = {}
    for group in ("temporal", "idle_by_stream", "kernel_type", "kernel_sum", "kernel_mean", "kernel_min",
                  "kernel_max"):
        a, b = mine[group], theirs[group]
        keys = sorted(set(a) | set(b))
        worst, where = 0.0, ""
        for k in keys:
            r = _rel(float(a.get(k, 0.0)), float(b.get(k, 0.0)))
            if r > worst:
                worst, where = r, k
        out[group] = {"max_rel": worst, "at": where, "compared": len(keys),
                      "only_ours": sorted(set(a) - set(b))[:5], "only_hta": sorted(set(b) - set(a))[:5]}
    return out


def worst(diff: dict[str, dict[str, Any]]) -> float:
    """The largest relative difference over every group."""
    return max(d["max_rel"] for d in diff.values())
