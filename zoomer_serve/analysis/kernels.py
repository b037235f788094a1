"""Kernel kinds (GEMM, convolution, attention, ...) from kernel names, and the kernel breakdown analyzer.

The kind comes from the kernel's (demangled) name, the only thing a Kineto trace says about what a kernel
does. The rules are ordered; the first that matches wins (an implicit-GEMM convolution is a convolution):

==============  ===========================================================================================
kind            names matched (case-insensitive)
==============  ===========================================================================================
communication   NCCL kernels (``ncclKernel_*``, ``ncclDevKernel_*``) and custom all-reduce kernels
attention       flash / memory-efficient / fused multi-head attention (``flash_fwd``, ``fmha``, ``attention``)
convolution     cuDNN and CUTLASS convolutions (``conv``, ``fprop``, ``dgrad``, ``wgrad``, ``winograd``,
                ``scudnn``, ``implicit_gemm``, FFT convolution kernels)
gemm            matrix multiplies (``gemm``, ``gemv``, ``cutlass``, ``cublas``, ``splitKreduce``, Triton
                ``triton_tem_``)
reduction       reductions and normalisations (``reduce``, ``softmax``, ``norm``, ``bn_``, ``max_pool``,
                sort / scan / top-k, Triton ``triton_red_`` / ``triton_per_``)
elementwise     pointwise kernels (``elementwise``, ``vectorized``, functors, copies, fills, ``cat``,
                index / gather / scatter, optimizer ``multi_tensor_apply``, Triton ``triton_poi_``)
other           everything else (e.g. embedding lookups)
memcpy, memset  memory operations (from the ``memops`` table, not from kernel names)
==============  ===========================================================================================
"""

from __future__ import annotations

import re

import numpy as np

from zoomer_serve.analysis.kineto import KinetoTrace
from zoomer_serve.analysis.table import Table

KERNEL_KINDS = ("gemm", "convolution", "attention", "elementwise", "reduction", "communication", "other",
                "memcpy", "memset")

_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("communication", re.compile(r"nccl|cross_device_reduce|custom_?all_?reduce|one_?shot_?all_?reduce")),
    ("attention", re.compile(r"flash|fmha|attention|attn|_sdpa|sdp_|xformers")),
    ("convolution", re.compile(r"conv|fprop|dgrad|wgrad|winograd|scudnn|implicit_gemm|implicit_precomp|"
                               r"fft2d|fft_|cask_cudnn|im2col|col2im")),
    ("gemm", re.compile(r"gemm|gemv|cutlass|cublas|splitkreduce|matmul|triton_tem_|_bmm_|dot_kernel")),
    ("reduction", re.compile(r"reduce|reduction|softmax|norm|gammabeta|\bbn_|max_pool|avg_pool|average_pool|"
                             r"pooling|sort|scan|topk|argmax|argmin|cumsum|cumprod|welford|triton_red_|"
                             r"triton_per_|histogram")),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise|functor|triton_poi_|fill|copy|"
                               r"catarray|cat_|index|gather|scatter|where|clamp|relu|gelu|silu|sigmoid|tanh|"
                               r"dropout|transpose|permute|nchwtonhwc|nhwctonchw|multi_tensor_apply|"
                               r"distribution|arange|masked")),
)


def kernel_kind(name: str) -> str:
    """The kind of a kernel from its name (see the module docstring): one of :data:`KERNEL_KINDS` except
    memcpy / memset."""
    low = name.lower()
    for kind, pattern in _RULES:
        if pattern.search(low):
            return kind
    return "other"


def kernel_kinds(names: np.ndarray) -> np.ndarray:
    """:func:`kernel_kind` of each name (an ``object`` array), classifying each distinct name once."""
    uniq, inverse = np.unique(names.astype(object), return_inverse=True) if len(names) else (names, names)
    if not len(names):
        return np.empty(0, dtype=object)
    kinds = np.array([kernel_kind(str(n)) for n in uniq], dtype=object)
    return kinds[inverse.reshape(-1)]


def _grouped(names: np.ndarray, dur: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct names, the group index of each row, and the row order sorted by group."""
    uniq, inverse = np.unique(names, return_inverse=True)
    return uniq, inverse.reshape(-1), np.argsort(inverse, kind="stable")


def kernel_breakdown(trace: KinetoTrace, include_memops: bool = True) -> Table:
    """GPU time per kernel name (one row per distinct name and device), largest total first.

    Columns: ``device``, ``name``, ``kind`` (see :data:`KERNEL_KINDS`), ``count``, ``total_us``,
    ``mean_us``, ``min_us``, ``max_us``, ``std_us`` (sample standard deviation, 0 for one kernel),
    ``share`` (of the device's summed kernel + memory operation time, 0..1). Durations are summed as
    they are (concurrent kernels on different streams both count), as in HTA's kernel breakdown.
    ``include_memops`` adds memcpy / memset operations as rows of kind memcpy / memset. Under HTA's
    conventions the rows are what its kernel breakdown lists (by its name rules; memory operations as
    kernels of their own kind).
    """
    k = trace.kernels
    kinds = [kernel_kinds(k["name"])]
    if trace.conventions == "hta":
        k = _hta_kernels(trace, include_memops)
        kinds = [np.where(k["kind"] == "kernel", kernel_kinds(k["name"]), k["kind"])]
        include_memops = False
    names = [k["name"]]
    durs = [k["dur"]]
    devices = [k["device"]]
    if include_memops and len(trace.memops):
        m = trace.memops
        names.append(m["name"])
        kinds.append(m["op"])
        durs.append(m["dur"])
        devices.append(m["device"])
    name = np.concatenate(names)
    kind = np.concatenate(kinds)
    dur = np.concatenate(durs).astype(np.float64)
    device = np.concatenate(devices)
    rows = []
    for dev in np.unique(device):
        sel = device == dev
        dev_total = float(dur[sel].sum())
        n_, k_, d_ = name[sel], kind[sel], dur[sel]
        if not len(n_):
            continue
        uniq, inverse, _ = _grouped(n_, d_)
        count = np.bincount(inverse, minlength=len(uniq))
        total = np.bincount(inverse, weights=d_, minlength=len(uniq))
        sq = np.bincount(inverse, weights=d_ * d_, minlength=len(uniq))
        mins = np.full(len(uniq), np.inf)
        maxs = np.full(len(uniq), -np.inf)
        np.minimum.at(mins, inverse, d_)
        np.maximum.at(maxs, inverse, d_)
        first = np.zeros(len(uniq), dtype=np.int64)
        first[inverse[::-1]] = np.arange(len(inverse))[::-1]
        mean = total / count
        with np.errstate(invalid="ignore", divide="ignore"):
            var = np.where(count > 1, (sq - count * mean * mean) / np.maximum(count - 1, 1), 0.0)
        std = np.sqrt(np.clip(var, 0.0, None))
        for i in range(len(uniq)):
            rows.append((int(dev), uniq[i], k_[first[i]], int(count[i]), float(total[i]), float(mean[i]),
                         float(mins[i]), float(maxs[i]), float(std[i]),
                         float(total[i] / dev_total) if dev_total > 0 else 0.0))
    rows.sort(key=lambda r: (r[0], -r[4], r[1]))
    return Table.from_rows(
        "kernel_breakdown",
        ("device", "name", "kind", "count", "total_us", "mean_us", "min_us", "max_us", "std_us", "share"),
        rows, units={"total_us": "us", "mean_us": "us", "min_us": "us", "max_us": "us", "std_us": "us",
                     "share": "ratio"},
        description="GPU time per kernel name (kernels and memory operations), summed over launches",
        dtypes={"device": np.int64, "name": object, "kind": object, "count": np.int64, "total_us": np.float64,
                "mean_us": np.float64, "min_us": np.float64, "max_us": np.float64, "std_us": np.float64,
                "share": np.float64})


def _hta_kernels(trace: KinetoTrace, include_memops: bool) -> Table:
    """The GPU operations HTA's kernel breakdown lists: those of type COMPUTATION or COMMUNICATION (and
    MEMORY with ``include_memops``) by its name rules, sync records on a stream included."""
    from zoomer_serve.analysis.breakdown import op_types

    ops = trace.gpu_ops()
    types = op_types(trace)
    keep = (types == "COMPUTATION") | (types == "COMMUNICATION") | ((types == "MEMORY") & include_memops)
    return ops.take(keep)


def kind_breakdown(trace: KinetoTrace) -> Table:
    """GPU time per kernel kind and device (kernels by name rule, plus memcpy / memset).

    Columns: ``device``, ``kind``, ``count``, ``total_us`` (summed durations), ``share`` (of the device's
    summed GPU operation time, 0..1), ``distinct_names``. Largest first within each device.
    """
    by_name = kernel_breakdown(trace)
    rows = []
    for dev in np.unique(by_name["device"]):
        sel = by_name["device"] == dev
        kinds = by_name["kind"][sel]
        total = by_name["total_us"][sel]
        count = by_name["count"][sel]
        dev_total = float(total.sum())
        for kind in np.unique(kinds):
            ks = kinds == kind
            t = float(total[ks].sum())
            rows.append((int(dev), str(kind), int(count[ks].sum()), t, t / dev_total if dev_total > 0 else 0.0,
                         int(ks.sum())))
    rows.sort(key=lambda r: (r[0], -r[3]))
    return Table.from_rows(
        "kind_breakdown", ("device", "kind", "count", "total_us", "share", "distinct_names"), rows,
        units={"total_us": "us", "share": "ratio"},
        description="GPU time per kernel kind (name rules in zoomer_serve.analysis.kernels)",
        dtypes={"device": np.int64, "kind": object, "count": np.int64, "total_us": np.float64,
                "share": np.float64, "distinct_names": np.int64})
