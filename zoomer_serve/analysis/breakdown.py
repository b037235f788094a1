"""Where a GPU's time goes: the temporal breakdown (idle, computation, communication, memory, and how much
computation overlaps communication), and the time per exact combination of kernel types.

Types: **communication** (NCCL and other collective kernels), **memory** (memcpy / memset), **computation**
(every other kernel), and, under HTA's conventions, **other** for the CUPTI sync records it counts as GPU
work. With our conventions the types come from :func:`zoomer_serve.analysis.kernels.kernel_kind`; with
HTA's (``trace.conventions == "hta"``) from HTA's own name rules (:func:`hta_kernel_type`), so that the
figures can be compared with its ``get_temporal_breakdown`` and ``get_gpu_kernel_breakdown``.

All times are unions of intervals (two kernels running at once count once), in microseconds.
"""

from __future__ import annotations

import re

import numpy as np

from zoomer_serve.analysis.kernels import kernel_kinds
from zoomer_serve.analysis.kineto import KinetoTrace
from zoomer_serve.analysis.table import Table
from zoomer_serve.intervals import merge_intervals

TYPES = ("COMPUTATION", "COMMUNICATION", "MEMORY")
"""Kernel types in HTA's order (its labels for overlaps follow it: "COMPUTATION overlapping COMMUNICATION")."""

_HTA_COMMUNICATION = re.compile(r"(^nccl.*)|(^hip)|(^hccl)|(.*ncclKernel.*)")
_HTA_MEMORY = re.compile(r"(^(hip)?Memcpy)|(^(hip)?Memset)|(^dma)")
_HTA_NOT_COMPUTE = re.compile(
    r"(^nccl)|(.*Memcpy)|(.*Memset)|(.*dma)|(^.*Sync)|(^Stream Wait Event)|(cuda.*LaunchKernel)|(^runFunction)|"
    r"(^hip)|(^job_exe)|(^packet)|(^pe_exe)|(^cpum_exe_subgraph)|(^hccl)|(^collective_subgraph_execution)")


def hta_kernel_type(name: str) -> str:
    """HTA's type of a GPU event from its name (traceinsight 0.6 ``get_kernel_type``): COMMUNICATION, MEMORY,
    COMPUTATION or OTHER (sync records, launch calls)."""
    if _HTA_COMMUNICATION.match(name):
        return "COMMUNICATION"
    if _HTA_MEMORY.match(name):
        return "MEMORY"
    if not _HTA_NOT_COMPUTE.match(name):
        return "COMPUTATION"
    return "OTHER"


def op_types(trace: KinetoTrace) -> np.ndarray:
    """The type (see the module docstring) of each row of ``trace.gpu_ops()``."""
    ops = trace.gpu_ops()
    if not len(ops):
        return np.empty(0, dtype=object)
    if trace.conventions == "hta":
        uniq, inverse = np.unique(ops["name"].astype(str), return_inverse=True)
        return np.array([hta_kernel_type(str(n)) for n in uniq], dtype=object)[inverse.reshape(-1)]
    out = np.full(len(ops), "COMPUTATION", dtype=object)
    kinds = ops["kind"]
    out[(kinds == "memcpy") | (kinds == "memset")] = "MEMORY"
    out[kinds == "sync"] = "OTHER"
    is_kernel = kinds == "kernel"
    out[is_kernel & (kernel_kinds(ops["name"]) == "communication")] = "COMMUNICATION"
    return out


def overlap_times(start: np.ndarray, end: np.ndarray, groups: np.ndarray, n_groups: int) -> dict[int, float]:
    """Time per exact set of active groups: intervals ``[start, end)`` with a group index each (0 ..
    ``n_groups`` - 1); returns {bit mask of the groups active: time}, masks > 0 only."""
    edges_t: list[np.ndarray] = []
    edges_d: list[np.ndarray] = []
    for g in range(n_groups):
        sel = groups == g
        if not sel.any():
            continue
        s, e = merge_intervals(start[sel], end[sel])
        edges_t += [s, e]
        edges_d += [np.full(len(s), 1 << g, dtype=np.int64), np.full(len(e), -(1 << g), dtype=np.int64)]
    if not edges_t:
        return {}
    t = np.concatenate(edges_t)
    d = np.concatenate(edges_d)
    order = np.argsort(t, kind="stable")
    t, d = t[order], d[order]
    mask = np.cumsum(d)
    seg = np.diff(t)
    out: dict[int, float] = {}
    for m in np.unique(mask[:-1]):
        if m > 0:
            out[int(m)] = float(seg[mask[:-1] == m].sum())
    return out


def _label(mask: int) -> str:
    return " overlapping ".join(t for k, t in enumerate(TYPES) if mask & (1 << k))


def time_breakdown(trace: KinetoTrace) -> Table:
    """The temporal breakdown per device, as HTA's ``get_temporal_breakdown`` and more.

    Columns: ``device``, ``window_us`` (first GPU operation's start to the last one's end), ``busy_us``
    (union of all GPU operations), ``idle_us`` (window - busy), ``computation_us``, ``communication_us``,
    ``memory_us`` (union of each type), ``non_computation_us`` (window - computation - idle: HTA's
    "non-compute time"), ``computation_communication_overlap_us`` (both at once), ``communication_hidden``
    (that overlap / communication: the share of communication hidden behind computation, 0..1; NaN without
    communication), ``idle_share``, ``computation_share`` (of the window).
    """
    ops = trace.gpu_ops()
    types = op_types(trace)
    rows = []
    for dev in np.unique(ops["device"]):
        sel = ops["device"] == dev
        ts, end = ops["ts"][sel], ops["ts"][sel] + ops["dur"][sel]
        s, e = merge_intervals(ts, end)
        window = float(e.max() - s.min())
        busy = float((e - s).sum())
        group = np.array([TYPES.index(t) if t in TYPES else -1 for t in types[sel]], dtype=np.int64)
        masks = overlap_times(ts, end, group, len(TYPES))
        per_type = [sum(v for m, v in masks.items() if m & (1 << k)) for k in range(len(TYPES))]
        overlap = sum(v for m, v in masks.items() if m & 1 and m & 2)
        comp, comm, mem = per_type
        rows.append((int(dev), window, busy, window - busy, comp, comm, mem, window - comp - (window - busy),
                     overlap, overlap / comm if comm > 0 else float("nan"),
                     (window - busy) / window if window > 0 else 0.0, comp / window if window > 0 else 0.0))
    us = "us"
    return Table.from_rows(
        "time_breakdown",
        ("device", "window_us", "busy_us", "idle_us", "computation_us", "communication_us", "memory_us",
         "non_computation_us", "computation_communication_overlap_us", "communication_hidden", "idle_share",
         "computation_share"), rows,
        units={"window_us": us, "busy_us": us, "idle_us": us, "computation_us": us, "communication_us": us,
               "memory_us": us, "non_computation_us": us, "computation_communication_overlap_us": us,
               "communication_hidden": "ratio", "idle_share": "ratio", "computation_share": "ratio"},
        description="where each GPU's time goes (unions of intervals; HTA's temporal breakdown and more)",
        dtypes={"device": np.int64})


def kernel_type_breakdown(trace: KinetoTrace) -> Table:
    """GPU time per exact combination of kernel types and device, as HTA's kernel type breakdown (with memory
    kernels): "COMPUTATION", "COMMUNICATION", "MEMORY", "COMPUTATION overlapping COMMUNICATION", ...

    Columns: ``device``, ``types`` (the label), ``time_us``, ``share`` (of the device's busy time, 0..1).
    Largest first within each device.
    """
    ops = trace.gpu_ops()
    types = op_types(trace)
    rows = []
    for dev in np.unique(ops["device"]):
        sel = ops["device"] == dev
        group = np.array([TYPES.index(t) if t in TYPES else -1 for t in types[sel]], dtype=np.int64)
        masks = overlap_times(ops["ts"][sel], ops["ts"][sel] + ops["dur"][sel], group, len(TYPES))
        total = sum(masks.values())
        for m, v in sorted(masks.items(), key=lambda kv: -kv[1]):
            rows.append((int(dev), _label(m), v, v / total if total > 0 else 0.0))
    return Table.from_rows(
        "kernel_type_breakdown", ("device", "types", "time_us", "share"), rows,
        units={"time_us": "us", "share": "ratio"},
        description="GPU time per exact combination of kernel types running at once",
        dtypes={"device": np.int64, "types": object, "time_us": np.float64, "share": np.float64})
